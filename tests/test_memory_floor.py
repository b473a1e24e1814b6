"""``memory_floor`` — what an infeasible pipeline's message may claim — is a lower bound on
the exact peak of every plan in the space: every set of recomputed blocks the policy
allows, every state sharding, one block family or several (where the memory row's per-family
charge of re-materialised activations can exceed the peak's largest block)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.problem import BuildCache, peak_memory
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import _built, memory_floor
from ilp_planner.ir.graph import Graph

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _two_families(graph: Graph) -> Graph:
    """Blocks 2 and 3 relabelled as a second family (as an import marks a ResNet's stages)."""
    return Graph(graph.name, [dataclasses.replace(op, block="g") if op.block_index is not None
                              and op.block_index >= 2 else op for op in graph.ops])


@pytest.mark.parametrize("families", [1, 2])
@pytest.mark.parametrize("policy", ["never", "always", "auto"])
def test_the_floor_is_below_the_peak_of_every_plan(families, policy) -> None:
    config = load_config(CONFIGS / "tiny-gpt-cpu.yaml").with_overrides(
        {"model.layers": 4, "solver.recompute": policy, "solver.state_sharding": [0, 3]})
    graph = config.microbatch_graph()
    graph = _two_families(graph) if families == 2 else graph
    units = graph.blocks()
    assert len({u[0] for u in units}) == families
    request = MeshSolveRequest(config, 1, 4, 2**30, graph, config.pipeline.microbatches,
                               None, BuildCache())
    floor = memory_floor(request)
    allowed = ([frozenset()] if policy == "never" else [frozenset(units)] if policy == "always"
               else [frozenset(s) for k in range(len(units) + 1)
                     for s in itertools.combinations(units, k)])
    rng = random.Random(0)
    least = np.inf
    for blocks in allowed:
        gp = _built(dataclasses.replace(request, memory_budget=None, recompute=blocks))
        mem = gp.problem.memory
        choices = [tuple(int(np.argmin(m)) for m in mem)] + [
            tuple(rng.randrange(len(m)) for m in mem) for _ in range(20)]
        for choice in choices:
            peak = peak_memory(gp, choice)
            assert floor <= peak * (1 + 1e-12), (sorted(blocks), choice)
            least = min(least, peak)
    assert floor >= 0.5 * least  # a floor worth claiming
