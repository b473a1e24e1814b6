"""A baseline member enumerates a matmul's, an embedding's or a convolution's strategies on
its own factorisations only (``StrategyContext.facts``; on 128 × 8 devices 2 of 360): the
list is exactly the whole one filtered, strategy for strategy, on every mesh and subset of
factorisations; a member built in a cache without the op's whole list (another micro-batch
count's graph) prices as one built where the plan's whole list is cached; and a member that
keeps no strategy still names how many layouts the op could take on the whole mesh."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ilp_planner.inputs import models
from ilp_planner.intra_op.baselines import megatron_filter
from ilp_planner.intra_op.problem import (
    BuildCache,
    _every_strategy,
    _kept_strategies,
    build_problem,
)
from ilp_planner.ir.cluster import MeshAxis, mesh_factorisations
from ilp_planner.ir.graph import OpKind
from ilp_planner.ir.layouts import drop_unit_axes
from ilp_planner.lowering.cost_model import MemorySpec
from ilp_planner.lowering.strategies import StrategyContext, op_strategies
from tests.test_baselines_at_scale import cluster

FACTORED = (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.MATMUL, OpKind.CONV2D)
GPT = models.gpt(hidden=64, layers=1, heads=4, seq_len=16, vocab=128, batch=8)
VGG = models.vgg13(batch=8, image=32, classes=10)


def _factored(graph):
    return [op for op in graph.ops if op.kind in FACTORED]


@settings(max_examples=25, deadline=None)
@given(mesh=st.sampled_from([(2, 4), (1, 8), (4, 4)]), graph=st.sampled_from([GPT, VGG]),
       levels=st.sampled_from([(0,), (0, 3)]), data=st.data())
def test_enumeration_on_some_factorisations_is_the_whole_list_filtered(mesh, graph, levels,
                                                                        data):
    nodes, local = mesh
    every = mesh_factorisations(nodes, local, 3)
    facts = frozenset(data.draw(st.lists(st.sampled_from(every), min_size=1, max_size=3)))
    ctx = StrategyContext(cluster(nodes, local), nodes, local, MemorySpec.preset("adam"),
                          zero_levels=levels)
    for op in _factored(graph):
        ins = [graph[i].output for i in op.inputs]
        whole = op_strategies(op, ins, ctx)
        assert op_strategies(op, ins, dataclasses.replace(ctx, facts=facts)) == [
            s for s in whole if s.fact in facts], op.name


def test_a_member_on_a_graph_the_plan_never_built_prices_as_in_the_plans_cache():
    """The member's build in a fresh cache (its matmuls enumerated on its factorisations
    alone) and in a cache holding every op's whole list: the same problem."""
    cl, mem = cluster(2, 4), MemorySpec.preset("adam")
    keep = megatron_filter(MeshAxis(2, 1), MeshAxis(1, 4), True)
    warm = BuildCache()
    build_problem(GPT, cl, 2, 4, mem, zero_levels=(0, 3), cache=warm)  # the plan's build
    fresh = BuildCache()
    a = build_problem(GPT, cl, 2, 4, mem, zero_levels=(0, 3), cache=fresh, keep=keep).problem
    b = build_problem(GPT, cl, 2, 4, mem, zero_levels=(0, 3), cache=warm, keep=keep).problem
    restricted = [k for k in fresh.strategies if k[2].facts is not None]
    assert restricted and len(restricted) < len(fresh.strategies)  # some lists were cut
    for x, y in zip(a.cost + a.memory, b.cost + b.memory, strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.edges.keys() == b.edges.keys()
    for k in a.edges:
        np.testing.assert_array_equal(a.edges[k], b.edges[k])


def test_a_member_without_a_strategy_counts_the_ops_whole_list():
    """A head dimension no TP degree of 8 divides: the refusal counts the layouts the op can
    take on the whole mesh, not only on the member's factorisations."""
    g = models.gpt(hidden=36, layers=1, heads=4, seq_len=16, vocab=100, batch=8)
    cl, mem = cluster(1, 8), MemorySpec.preset("adam")
    keep = megatron_filter(MeshAxis(1, 1), MeshAxis(1, 8))
    messages = []
    for cache in (None, BuildCache()):
        with pytest.raises(ValueError, match="no allowed strategy") as err:
            build_problem(g, cl, 1, 8, mem, cache=cache, keep=keep)
        messages.append(str(err.value))
    op = g[messages[0].split("no allowed strategy for ")[1].split(" ")[0]]
    assert op.kind in FACTORED
    ctx = StrategyContext(cl, 1, 8, mem)
    ins = [g[i].output for i in op.inputs]
    whole, own = ({str(drop_unit_axes(s.output)) for s in op_strategies(op, ins, c)}
                  for c in (ctx, dataclasses.replace(ctx, facts=keep.matmul_facts)))
    assert len(set(messages)) == 1
    assert f"among the {len(whole)} output layouts" in messages[0]
    assert len(own) < len(whole)  # the member's own list would have named fewer


def test_a_fused_linear_the_members_factorisations_cannot_split_is_refused_as_before():
    """A fused linear whose output is also read whole (``attrs.parts_read_whole``) keeps its
    columns whole: on Megatron's TP-8 factorisations it has no strategy, and the refusal is
    the baseline's own, naming the op's whole list — the same with no cache, a fresh one or
    one holding the plan's list (the fused linear's own refusal of those factorisations
    alone is not the member's answer)."""
    g = models.gpt(hidden=64, layers=1, heads=4, seq_len=16, vocab=128, batch=8)
    fc = next(op for op in g.ops if op.kind is OpKind.LINEAR and op.output.shape[1] == 256)
    op = dataclasses.replace(fc, attrs={**fc.attrs, "parts": 2, "parts_read_whole": 1})
    ctx = StrategyContext(cluster(1, 8), 1, 8, MemorySpec.preset("adam"))
    ins = [g[i].output for i in op.inputs]
    keep = megatron_filter(MeshAxis(1, 1), MeshAxis(1, 8))
    warm = BuildCache()
    _every_strategy(op, ins, ctx, warm)
    messages = set()
    for cache in (None, BuildCache(), warm):
        with pytest.raises(ValueError, match="no allowed strategy for h.0.mlp.fc1") as err:
            _kept_strategies(op, op.name, ins, ctx, keep, cache)
        messages.add(str(err.value))
    assert len(messages) == 1
