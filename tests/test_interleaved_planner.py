"""Interleaving in the planner's space (:mod:`ilp_planner.inter_op.interleaved`): the chunk
cut, the memory of the extra chunk activations in flight, and ``virtual_stages: auto``
keeping an interleaved pipeline exactly where it simulates faster than the stage DP's."""

from __future__ import annotations

from pathlib import Path

import pytest

from formulations.schedules import inflight_interleaved
from ilp_planner.api import solve
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import load_config
from ilp_planner.inter_op.interleaved import chunk_ranges, interleaved_pipeline, mesh_shape
from ilp_planner.inter_op.layer_units import layer_units
from ilp_planner.inter_op.stage_solver import StageSolver

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-interleaved-cpu.yaml"
PIPE = {"stages": 2, "microbatches": 2, "schedule": "1f1b", "submeshes": [[1, 4], [1, 4]]}


def _solver(config):
    graph = config.microbatch_graph()
    return graph, StageSolver(config, graph, layer_units(graph, config.pipeline.max_units))


def test_chunk_cut_is_the_brute_force_min_max() -> None:
    """4 units into 2 chunks on a 1 × 4 mesh: the DP's cut has the least slowest chunk among
    the 3 possible cuts (then the least total)."""
    config = load_config(CONFIG)
    _, solver = _solver(config)

    def t(a: int, e: int) -> float:
        return solver.variant_cost(solver.solve(a, e, (1, 4))).time_s

    cuts = [[(0, i), (i, 4)] for i in range(1, 4)]
    best = min(cuts, key=lambda c: (max(t(a, e) for a, e in c), sum(t(a, e) for a, e in c)))
    assert chunk_ranges(solver, (1, 4), 2) == best
    assert chunk_ranges(solver, (1, 4), 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert chunk_ranges(solver, (1, 4), 5) is None


def test_mesh_shape_splits_evenly_or_says_why() -> None:
    config = load_config(CONFIG)
    assert mesh_shape(config, 2) == (1, 4) and mesh_shape(config, 4) == (1, 2)
    with pytest.raises(InfeasibleError, match="do not split into 3 equal stage meshes"):
        mesh_shape(config, 3)


def test_memory_counts_the_interleaved_activations() -> None:
    """Each mesh's memory is its chunks' fixed memory plus its peak chunk activations in
    flight (2·(p − 1 − r) + (v − 1)·p + 1, capped by M·v) times its largest chunk's."""
    config = load_config(CONFIG)
    graph, solver = _solver(config)
    pipe = interleaved_pipeline(config, graph, solver, 2, 2, {})
    costs = [solver.variant_cost(solver.solve(s.dp.layer_units[0], s.dp.layer_units[1], (1, 4)))
             for s in pipe.stages]
    for r in range(2):
        held = inflight_interleaved(2, r, 4, 2)
        want = sum(c.memory_bytes_fixed for c in costs[r::2]) + held * max(
            c.activation_bytes_per_microbatch for c in costs[r::2])
        assert pipe.stages[r].dp.memory_bytes == pytest.approx(want)
        assert pipe.stages[r].dp.inflight_microbatches == held
        assert pipe.stages[r].dp.memory_solved_for_inflight is None  # roomy: fastest plans
    assert (inflight_interleaved(2, 0, 4, 2), inflight_interleaved(2, 1, 4, 2)) == (5, 3)


def test_a_mesh_over_the_budget_is_resolved_within_a_share_of_it() -> None:
    """1 % below mesh 0's memory: its two chunks are re-solved, each within half the budget
    holding mesh 0's 5 chunk activations, and the mesh fits (slower); mesh 1 keeps its
    fastest plans. At a fifth of it no chunk plan fits and the error says so."""
    config = load_config(CONFIG)
    roomy = interleaved_pipeline(config, *_solver(config), 2, 2, {})
    need = roomy.stages[0].dp.memory_bytes
    tight = config.with_overrides({"cluster.memory_gib": need * 0.99 / 2**30})
    pipe = interleaved_pipeline(tight, *_solver(tight), 2, 2, {})
    assert [s.dp.memory_solved_for_inflight for s in pipe.stages] == [5, None, 5, None]
    assert all(s.dp.memory_bytes <= tight.cluster.memory_bytes for s in pipe.stages)
    assert pipe.step_s >= roomy.step_s
    tiny = config.with_overrides({"cluster.memory_gib": need * 0.2 / 2**30})
    with pytest.raises(InfeasibleError, match=r"chunk 0 .* has no plan within .* MiB per device "
                                              r"\(1/2 of the budget\) holding 5"):
        interleaved_pipeline(tiny, *_solver(tiny), 2, 2, {})


def test_auto_keeps_interleaving_where_it_is_faster() -> None:
    """Compute-bound (slow device, fast links): interleaving halves the bubble and wins;
    latency-bound (1 ms links): its extra transfers lose and the stage DP's 1F1B plan is
    kept, identical to the plan solved without ``auto``."""
    config = load_config(CONFIG)
    compute_bound = {"pipeline": PIPE, "cluster.peak_tflops": 0.0005}
    plain = solve(config.with_overrides(compute_bound), baselines=False)
    auto = solve(config.with_overrides({**compute_bound, "pipeline": {**PIPE, "virtual_stages": "auto"}}),
                 baselines=False)
    assert plain.schedule.name == "1f1b"
    assert auto.schedule.name == "interleaved-1f1b" and auto.schedule.virtual_stages == 2
    assert auto.step_s < plain.step_s
    assert "kept the interleaved one" in auto.solver.message
    slow_links = {"pipeline": PIPE, "cluster.links.inter.latency_us": 1000,
                  "cluster.links.intra.latency_us": 1000}
    plain = solve(config.with_overrides(slow_links), baselines=False)
    auto = solve(config.with_overrides({**slow_links, "pipeline": {**PIPE, "virtual_stages": "auto"}}),
                 baselines=False)
    assert auto.schedule.name == "1f1b" and auto.step_s == plain.step_s
    assert "interleaved 1F1B priced: the best, 2 stage meshes × 2 chunks" in auto.solver.message
    assert [s.layers for s in auto.stages] == [s.layers for s in plain.stages]


def test_forced_interleaving_with_auto_stages_finds_the_only_fit() -> None:
    """``stages: auto``: every even split of the 8 devices is tried; with 4 layer units only
    2 meshes × 2 chunks has a chunk per unit, so it is the plan ``stages: 2`` gives."""
    config = load_config(CONFIG)
    fixed = solve(config, baselines=False)
    auto = solve(config.with_overrides({"pipeline.stages": "auto"}), baselines=False)
    assert auto.schedule.virtual_stages == 2 and len(auto.stages) == 4
    assert [s.layers for s in auto.stages] == [s.layers for s in fixed.stages]
    assert auto.step_s == pytest.approx(fixed.step_s)


def test_an_interleaved_plan_s_cost_is_its_busiest_mesh_with_its_chunks_summed() -> None:
    """A mesh's devices run all its chunks: the plan's breakdown sums them (as a compared
    configuration's does, so the two rows of a report compare like with like), its peak the
    largest chunk's."""
    plan = solve(CONFIG, baselines=False)
    chunks = [s.times.cost for s in plan.stages]
    p = len(chunks) // plan.schedule.virtual_stages
    assert p == 2 and len(chunks) == 4
    meshes = [(sum(c.compute_s for c in chunks[r::p]), sum(c.grad_sync_s for c in chunks[r::p]),
               sum(c.total_s for c in chunks[r::p])) for r in range(p)]
    compute, sync, total = max(meshes, key=lambda m: m[2])
    assert plan.cost.compute_s == pytest.approx(compute, rel=1e-12)
    assert plan.cost.grad_sync_s == pytest.approx(sync, rel=1e-12)
    assert plan.cost.total_s == pytest.approx(total, rel=1e-12)
    assert plan.cost.peak_memory_bytes == max(c.peak_memory_bytes for c in chunks)
    assert plan.cost.compute_s > max(c.compute_s for c in chunks)  # not one chunk's
