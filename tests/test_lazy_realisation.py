"""The stage solver realises its solves lazily: the DP's table reads only each solve's
total (:func:`~ilp_planner.intra_op.realise.realised_total_s`), which must be the eager
realisation's figure bit for bit, and the layers realised on first use (through the edge
programs kept across solves) must be the eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.inter_op.layer_units import layer_units
from ilp_planner.inter_op.stage_solver import StageSolver
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.cluster import submesh_shapes

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize(("config", "overrides"), [
    ("tiny-gpt-cpu", {"model.layers": 3, "cluster.nodes": 2, "cluster.devices_per_node": 2}),
    ("tiny-gpt-cpu", {"model.layers": 3, "cluster.nodes": 1, "cluster.devices_per_node": 4,
                      "training.grad_bucket_mb": 0, "solver.recompute": "always"}),
    ("u-transformer-2x4", {"model.layers": 6, "model.hidden": 256, "model.seq_len": 128,
                           "pipeline.stages": 2}),
], ids=["gpt-2x2", "gpt-1x4-no-buckets-recompute", "u-transformer-2x4-small"])
def test_lazy_stage_realisation_equals_the_eager_one(config, overrides):
    """Every stage solve of every range on every sub-mesh shape, each at its fastest plan
    and at the in-flight counts its variants need: the DP's table is made without
    realising a layer, its times are the eager realisation's ``total_s`` exactly, and the
    layers and cost realised later equal the eager ones."""
    cfg = load_config(CONFIGS / f"{config}.yaml").with_overrides(
        {"pipeline.stages": "auto", "pipeline.microbatches": 4, **overrides})
    graph = cfg.microbatch_graph()
    units = layer_units(graph)
    solver = StageSolver(cfg, graph, units)
    c = cfg.cluster
    for shape in submesh_shapes(c.nodes, c.devices_per_node):
        for a in range(len(units)):
            for e in range(a + 1, len(units) + 1):
                solver.stage_cost(a, e, shape)
    solved = [s for s in solver.state.solved.values() if s is not None]
    assert len(solved) >= 10
    assert all(s._realised is None for s in solved)  # the table realised nothing
    for s in solved:
        layers, cost = realise(s.gp, list(s.res.choice))
        assert s.total_s == cost.total_s  # bit for bit: the DP's figure is unchanged
        assert s.layers == layers and s.cost == cost
        gp, res, lazy_layers, lazy_cost = s
        assert (gp, res, lazy_layers, lazy_cost) == (s.gp, s.res, layers, cost)
        assert s.total_s == cost.total_s and s[3] == cost
