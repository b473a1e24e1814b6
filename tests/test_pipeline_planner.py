"""Pipelined solves end to end: layer units, sub-graphs, stage placement, resharding of every
crossing tensor, schedules, memory, and Zhuang et al.'s eager-1F1B claim on the shipped configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from formulations.schedules import make_schedule, validate
from formulations.simulator import simulate
from ilp_planner.api import solve
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.models import gpt, mlp, u_transformer
from ilp_planner.inter_op.assembly import stage_durations
from ilp_planner.inter_op.layer_units import RangeKeys, layer_units, subgraph
from ilp_planner.inter_op.pipeline import solve_pipelined
from ilp_planner.inter_op.stage_solver import StageSolver
from ilp_planner.ir.graph import OpKind
from ilp_planner.plan.data import Plan
from tests.helpers.oracles import brute_force_stages, crossing, signature
from tests.helpers.shipped import shipped_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "tiny-gpt-cpu.yaml"


def tiny(**overrides):
    base = {"pipeline.stages": 2, "pipeline.microbatches": 4, "pipeline.schedule": "eager-1f1b"}
    base.update(overrides)
    return load_config(TINY).with_overrides(base)


# -- units, sub-graphs, cuts -------------------------------------------------------------------


def test_gpt_units_are_blocks_with_embedding_first_and_head_last():
    g = gpt(64, 6, 4, 16, 128, 8)
    units = layer_units(g)
    assert len(units) == 6
    assert units[0][0] == "embed" and units[0][1] == "h.0.ln1"
    assert units[-1][-3:] == ["ln_f", "lm_head", "loss"]
    assert sorted(n for u in units for n in u) == sorted(
        op.name for op in g.ops if op.kind is not OpKind.INPUT)


def test_long_models_keep_one_unit_per_block_and_mlp_units_are_weighted_ops():
    g = gpt(64, 40, 4, 16, 128, 8)
    units = layer_units(g)
    assert len(units) == 40
    assert all(n.startswith(f"h.{i}.") for i, u in enumerate(units[1:-1], 1) for n in u)
    coarse = layer_units(g, max_units=16)  # pipeline.max_units: explicit, never silent
    assert len(coarse) == 16 and sum(coarse, []) == sum(units, [])
    assert [u[0] for u in layer_units(mlp([8, 8, 8, 8], 4))] == ["fc1", "fc2", "fc3"]


@pytest.mark.parametrize("graph", [gpt(64, 12, 4, 16, 128, 8), u_transformer(64, 8, 4, 16, 8),
                                   mlp([8, 16, 8, 16, 8], 4)], ids=["gpt", "u", "mlp"])
def test_range_keys_are_the_signature_classes(graph):
    """RangeKeys (built from per-unit parts) splits the ranges exactly as the full
    signatures with their stage boundaries do."""
    from ilp_planner.lowering.stage_boundary import stage_boundary

    units = layer_units(graph)
    keys = RangeKeys(graph, units)
    by_key: dict = {}
    by_sig: dict = {}
    for a in range(len(units)):
        for e in range(a + 1, len(units) + 1):
            names = [n for u in units[a:e] for n in u]
            by_key.setdefault(keys.key(a, e), set()).add((a, e))
            by_sig.setdefault(signature(graph, names, stage_boundary(graph, names)), set()).add((a, e))
    assert sorted(map(sorted, by_key.values())) == sorted(map(sorted, by_sig.values()))
    if graph.name.startswith("gpt"):  # (blocks, holds the first unit, holds the last)
        L = len(units)
        assert len(by_key) == 1 + 2 * (L - 1) + (L - 2)


def test_equal_block_ranges_share_a_signature_and_subgraphs_load_external_inputs():
    g = gpt(64, 6, 4, 16, 128, 8)
    u = layer_units(g)
    assert signature(g, u[1] + u[2]) == signature(g, u[3] + u[4])
    assert signature(g, u[0]) != signature(g, u[1])
    sub = subgraph(g, u[2])
    inputs = [op for op in sub.ops if op.kind is OpKind.INPUT]
    assert [op.name for op in inputs] == ["h.1.mlp.residual"]
    assert inputs[0].output == g["h.1.mlp.residual"].output


def test_skip_edges_cross_the_cut():
    g = u_transformer(64, 8, 4, 16, 8)
    edges = crossing(g, layer_units(g), 5)
    assert ("u.0.mlp.residual", "u.7.skip_add") in edges
    assert ("u.4.mlp.residual", "u.5.skip_add") in edges


# -- a pipelined tiny GPT ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    return solve(tiny())


def test_stages_cover_the_cluster_and_the_model(tiny_plan):
    plan = tiny_plan
    assert len(plan.stages) == 2
    devices = [d for st in plan.stages for d in st.devices]
    assert sorted(devices) == list(range(8))
    names = [n for st in plan.stages for n in st.layers]
    graph = load_config(TINY).microbatch_graph()
    assert names == [op.name for op in graph.ops if op.kind is not OpKind.INPUT]
    for st in plan.stages:
        for name in st.layers:
            layer = plan.layer(name)
            assert layer.stage == st.index
            size = int(np.prod([a.size for a in layer.output.fact]))
            assert size == len(st.devices)


def test_every_crossing_tensor_has_a_resharding_schedule(tiny_plan):
    plan = tiny_plan
    graph = load_config(TINY).microbatch_graph()
    stage_of = {layer.name: layer.stage for layer in plan.layers}
    crossing_edges = {(s, d) for s, d in graph.edges()
                      if graph[s].kind is not OpKind.INPUT and stage_of[s] != stage_of[d]}
    assert crossing_edges
    covered = {(r.tensor, r.consumer) for r in plan.resharding}
    for s, d in crossing_edges:
        assert any(t == s for t, _ in covered), (s, d)
    for r in plan.resharding:
        src_devices = set(plan.stages[r.src_stage].devices)
        dst_devices = set(plan.stages[r.dst_stage].devices)
        assert r.transfer is not None
        assert r.transfer.makespan_s >= r.transfer.lower_bound_s - 1e-12
        assert r.dst_layout == plan.layer(r.consumer).inputs[
            list(graph[r.consumer].inputs).index(r.tensor)]
        for task in r.tasks:
            assert task.sender in task.holders and set(task.holders) <= src_devices
            assert set(task.receivers) <= dst_devices


def test_schedule_is_valid_and_matches_its_simulation(tiny_plan):
    sc = tiny_plan.schedule
    rows = [list(row) for row in sc.actions]
    from formulations.schedules import Schedule

    validate(Schedule.from_strings(rows, num_microbatches=sc.num_microbatches))
    again = simulate(make_schedule(sc.name, len(tiny_plan.stages), sc.num_microbatches),
                     stage_durations([st.times for st in tiny_plan.stages], tiny_plan.resharding))
    assert again.makespan_s == pytest.approx(sc.simulated.makespan_s)
    assert tiny_plan.step_s >= sc.simulated.makespan_s


def test_pipelined_plan_round_trips(tiny_plan, tmp_path):
    path = tmp_path / "plan.json"
    tiny_plan.save(path)
    assert Plan.load(path).to_dict() == tiny_plan.to_dict()


def test_stage_memory_is_within_budget_and_an_impossible_budget_is_explained(tiny_plan):
    budget = load_config(TINY).cluster.memory_bytes
    assert all(st.dp.memory_bytes <= budget for st in tiny_plan.stages)
    with pytest.raises(InfeasibleError, match="least memory any assignment needs"):
        solve_pipelined(tiny(**{"cluster.memory_gib": 1e-5}), baselines=False)


UTF_PIPE = {"cluster.nodes": 1, "cluster.devices_per_node": 4, "pipeline.stages": 2,
            "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}
PLAIN = {"solver.state_sharding": [0], "solver.recompute": "never"}


def _utf_pipe(gib: float, **more):
    return load_config(CONFIGS / "tiny-utf-zero-cpu.yaml").with_overrides(
        {**UTF_PIPE, "cluster.memory_gib": gib, **more})


def _stage_peaks(plan, config) -> list[tuple[float, float]]:
    """Per stage: (the DP's memory, the exact peak of the stage's solve evaluated at the
    micro-batches its position holds), re-solving the stage as the planner did."""
    from dataclasses import replace

    from ilp_planner.intra_op.problem import peak_memory
    from ilp_planner.intra_op.request import MeshSolveRequest
    from ilp_planner.intra_op.solve_mesh import solve_mesh
    from ilp_planner.lowering.stage_boundary import stage_boundary

    graph = config.microbatch_graph()
    out = []
    for st in plan.stages:
        held = st.dp.memory_solved_for_inflight
        names = st.layers
        bound = stage_boundary(graph, names)
        gp, res = solve_mesh(MeshSolveRequest(
            config, *st.mesh, None if held is None else config.cluster.memory_bytes,
            subgraph(graph, names), config.pipeline.microbatches,
            bound if held is None else replace(bound, inflight=held)))
        at = replace(gp, boundary=replace(gp.boundary, inflight=st.dp.inflight_microbatches))
        out.append((st.dp.memory_bytes, peak_memory(at, res.choice)))
    return out


def test_memory_bound_stages_recompute_or_shard_state_to_fit_their_position():
    """A budget where no stage plan of the plain space fits holding its position's
    micro-batches: the stage solves under that memory row recompute activations; with a
    little more memory, sharded optimizer state beats the plain space's best. Each stage's
    memory is the exact peak of its plan at the micro-batches its position holds."""
    with pytest.raises(InfeasibleError, match="least memory any assignment needs"):
        solve_pipelined(_utf_pipe(0.0005, **PLAIN), baselines=False)
    tight = _utf_pipe(0.0005)
    plan = solve_pipelined(tight, baselines=False)
    assert any(lp.recompute for lp in plan.layers)
    assert [st.dp.inflight_microbatches for st in plan.stages] == [2, 1]
    for dp_memory, peak in _stage_peaks(plan, tight):
        assert dp_memory == pytest.approx(peak, rel=1e-12)
        assert peak <= tight.cluster.memory_bytes
    roomier = _utf_pipe(0.0006)
    joint = solve_pipelined(roomier, baselines=False)
    plain = solve_pipelined(_utf_pipe(0.0006, **PLAIN), baselines=False)
    assert any(lp.zero for lp in joint.layers) and not any(lp.zero for lp in plain.layers)
    assert (joint.schedule.simulated.dp_objective_s
            < plain.schedule.simulated.dp_objective_s * (1 - 1e-6))
    for dp_memory, peak in _stage_peaks(joint, roomier):
        assert dp_memory == pytest.approx(peak, rel=1e-12) and peak <= roomier.cluster.memory_bytes


@pytest.mark.parametrize("space,fits", [({}, 0.0005), (PLAIN, 0.0006)],
                         ids=["recompute-and-shard", "plain"])
def test_an_infeasible_pipeline_claims_only_a_memory_no_plan_can_go_below(space, fits):
    """Below every stage plan's reach (0.00045 GiB) the message's least memory is a lower
    bound over every plan the stage solves could make — recomputing and sharding state
    where the config allows (the floors of the solves that found none) — so a budget at
    which the planner does find a plan (0.0005 GiB with recomputation and state sharding,
    0.0006 without) is never below it. Before, it was the fastest stage plans' memory
    (0.000952 GiB), which either budget beats."""
    with pytest.raises(InfeasibleError, match="least memory any assignment needs is at "
                                              "least") as err:
        solve_pipelined(_utf_pipe(0.00045, **space), baselines=False)
    need = err.value.needed_bytes
    assert 0.00045 * 2**30 < need <= fits * 2**30
    plan = solve_pipelined(_utf_pipe(fits, **space), baselines=False)
    assert max(st.dp.memory_bytes for st in plan.stages) >= need


def test_lazy_gap_variants_reach_the_optimum_of_every_in_flight_count_solved():
    """Six blocks on 8 devices, 8 micro-batches under 1F1B and a budget that binds: the
    planner solves the in-flight counts between two solved ones only where the DP chooses
    their stand-in (:class:`~ilp_planner.inter_op.stage_variants.Gap`), and bounds the positions
    by its incumbent; the table of every count (bisected), without incumbent, has the same
    optimum and needs more solves."""
    from formulations.stage_dp import solve_stages
    from ilp_planner.inter_op.boundary_estimate import BoundaryCost
    from ilp_planner.inter_op.stage_solver import StageSolver
    from ilp_planner.ir.cluster import submesh_shapes

    config = tiny(**{"model.layers": 6, "cluster.memory_gib": 1.0 / 1024,
                     "pipeline.stages": "auto", "pipeline.microbatches": 8,
                     "pipeline.schedule": "1f1b"})
    plan = solve_pipelined(config, baselines=False)
    assert any(st.dp.memory_solved_for_inflight for st in plan.stages)
    graph = config.microbatch_graph()
    units = layer_units(graph)
    full = StageSolver(config, graph, units)
    full.lazy = False
    c = config.cluster
    dp = solve_stages(len(units), c.nodes, c.devices_per_node, 8, full.stage_cost,
                      boundary_cost=BoundaryCost(config, graph, units), schedule="1f1b",
                      memory_budget_bytes=c.memory_bytes,
                      submesh_shapes=submesh_shapes(c.nodes, c.devices_per_node))
    assert plan.schedule.simulated.dp_objective_s == pytest.approx(dp.objective_s, rel=1e-12)
    assert plan.solver.stages.stage_solves < full.stats.solves


def test_auto_stage_count_solves():
    plan = solve(tiny(**{"pipeline.stages": "auto"}), baselines=False)
    assert 1 <= len(plan.stages) <= 8
    assert sorted(d for st in plan.stages for d in st.devices) == list(range(8))


# -- Zhuang et al. §4: eager-1F1B never slower than 1F1B with communication overlapped ---------------


@pytest.mark.parametrize("name", ["gpt-2.6b-2x4", "u-transformer-2x4"])
def test_eager_1f1b_is_no_slower_than_1f1b_on_shipped_configs(name):
    plan = shipped_plan(name, baselines=False)
    assert len(plan.stages) >= 2 and plan.resharding
    durations = stage_durations([st.times for st in plan.stages], plan.resharding)
    assert sum(durations.activation_transfer) > 0
    m = plan.schedule.num_microbatches
    span = {s: simulate(make_schedule(s, len(plan.stages), m), durations, overlap=True).makespan_s
            for s in ("1f1b", "eager-1f1b")}
    assert span["eager-1f1b"] <= span["1f1b"] * (1 + 1e-12)


def test_simulate_verb_prints_every_schedule_and_draws_the_timeline(tiny_plan, tmp_path, capsys):
    from ilp_planner.cli import main

    path = tmp_path / "plan.json"
    tiny_plan.save(path)
    png = tmp_path / "timeline.png"
    assert main(["simulate", str(path), "--schedule", "1f1b", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for name in ("gpipe", "1f1b", "eager-1f1b"):
        assert name in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_verb_rejects_a_single_mesh_plan(tmp_path, capsys):
    from ilp_planner.cli import main

    path = tmp_path / "plan.json"
    solve(load_config(TINY), baselines=False).save(path)
    assert main(["simulate", str(path)]) == 2
    assert "no pipeline stages" in capsys.readouterr().err


# -- stage boundaries: priced by the stage ILP, listed on the layers, tasks both ways ----------


def test_stage_ilp_prices_its_boundary_programs_exactly():
    """A stage's own export (partial sums resolved before sending) and import (the
    consumer's gradient reduced before it goes back) programs, and the input backward an
    imported tensor now needs (autograd reaches it), are in its ILP costs: for every
    choice, objective(with boundary) − objective(without) is the seconds of exactly the
    collectives realise() lists on top, and those include every boundary program."""
    from collections import Counter

    from ilp_planner.intra_op.problem import build_problem
    from ilp_planner.intra_op.realise import realise
    from ilp_planner.lowering.cost_model import MemorySpec
    from ilp_planner.lowering.stage_boundary import export_program, import_program, stage_boundary
    from ilp_planner.lowering.strategies import input_grad_layouts

    config = load_config(TINY)
    g = mlp([64, 64, 64, 64, 64], 16)
    units = layer_units(g)
    names = [n for u in units[1:3] for n in u]
    sub = subgraph(g, names)
    boundary = stage_boundary(g, names)
    assert boundary.imported and boundary.exported
    args = (sub, config.cluster, 1, 4, MemorySpec.preset("adam"))
    plain = build_problem(*args, tie_layers=False)
    priced = build_problem(*args, tie_layers=False, boundary=boundary)
    rng = np.random.default_rng(0)
    extras = []
    for _ in range(20):
        choice = [int(rng.integers(len(c))) for c in priced.problem.cost]
        layers, _ = realise(priced, choice)
        programs = Counter()
        for ly in layers:
            op = sub[ly.name]
            grads = input_grad_layouts(op, ly.strategy, ly.inputs, ly.weight)
            for idx, src in enumerate(op.inputs):
                if src in boundary.imported:
                    red = import_program(ly.inputs[idx], grads[idx], sub[src].output, config.cluster)
                    programs.update(red.forward + red.backward)
            if ly.name in boundary.exported:
                red = export_program(ly.output, op.output, config.cluster)
                programs.update(red.forward + red.backward)
        added = Counter(c for ly in layers for c in ly.collectives)
        added.subtract(Counter(c for ly in realise(plain, choice)[0] for c in ly.collectives))
        assert all(n >= 0 for n in added.values())
        assert not programs - added
        extra = priced.problem.objective(choice) - plain.problem.objective(choice)
        assert extra == pytest.approx(sum(c.seconds * n for c, n in added.items()), rel=1e-9,
                                      abs=1e-15)
        extras.append(sum(c.seconds * n for c, n in programs.items()))
    assert max(extras) > 0  # some choices do pay at the boundary (e.g. a partial gradient)


def test_stage_costs_are_the_layers_own_and_gradients_have_their_own_tasks(tiny_plan):
    from ilp_planner.inter_op.assembly import stage_costs
    from ilp_planner.ir.regions import layout_blocks

    m = tiny_plan.schedule.num_microbatches
    for st, again in zip(tiny_plan.stages, stage_costs(tiny_plan.layers, tiny_plan.stages, m),
                         strict=True):
        assert st.times == again
    durations = stage_durations([st.times for st in tiny_plan.stages], tiny_plan.resharding)
    assert sum(durations.gradient_transfer) == pytest.approx(
        sum(r.transfer.backward_makespan_s for r in tiny_plan.resharding))
    for r in tiny_plan.resharding:
        src = dict(zip(tiny_plan.stages[r.src_stage].devices,
                       layout_blocks(r.src_layout, r.shape), strict=True))
        dst = dict(zip(tiny_plan.stages[r.dst_stage].devices,
                       layout_blocks(r.dst_layout, r.shape), strict=True))
        got = dict.fromkeys(src, 0)
        for t in r.backward_tasks:  # gradients: from devices holding the received block
            sl = t.region
            assert t.sender in t.holders and set(t.holders) <= set(dst)
            assert all(all(a >= lo and b <= hi for (a, b), (lo, hi) in zip(sl, dst[h], strict=True))
                       for h in t.holders)
            for d in t.receivers:
                got[d] += int(np.prod([b - a for a, b in sl]))
        assert got == {d: int(np.prod([b - a for a, b in reg])) for d, reg in src.items()}
        assert r.transfer.backward_makespan_s >= r.transfer.backward_lower_bound_s - 1e-12


def test_forty_blocks_are_forty_units_and_solves_are_the_distinct_signatures():
    """No unit ceiling, and one intra-op solve per (signature class, sub-mesh shape) that the
    DP asks for — not one per (range, shape): on 1 × 2 devices every partial range runs on
    (1, 1) and only the whole model on (1, 2)."""
    from ilp_planner.lowering.stage_boundary import stage_boundary

    config = tiny(**{"model.layers": 40, "cluster.nodes": 1, "cluster.devices_per_node": 2,
                     "pipeline.stages": "auto", "pipeline.stage_bound": False})
    plan = solve_pipelined(config, baselines=False)
    graph = config.microbatch_graph()
    units = layer_units(graph)
    L = len(units)
    assert plan.solver.stages.units == L == 40
    assert plan.solver.stages.stage_pairs == L * (L + 1) // 2  # every range, one admissible shape
    sigs = set()
    for a in range(L):
        for e in range(a + 1, L + 1):
            names = [n for u in units[a:e] for n in u]
            shape = (1, 2) if (a, e) == (0, L) else (1, 1)
            sigs.add((signature(graph, names, stage_boundary(graph, names)), shape))
    assert plan.solver.stages.stage_solves == len(sigs) == 3 * L - 3
    assert set(plan.solver.stages.timings) >= {"stage_solve_s", "dp_s", "resharding_s", "total_s"}


@pytest.mark.parametrize("overrides", [
    {"model.layers": 12, "cluster.nodes": 1, "cluster.devices_per_node": 4,
     "pipeline.microbatches": 8},
    {"model.layers": 8, "cluster.nodes": 2, "cluster.devices_per_node": 2,
     "pipeline.microbatches": 8, "pipeline.schedule": "1f1b"},
    {"model.layers": 6, "cluster.nodes": 2, "cluster.devices_per_node": 4,
     "pipeline.microbatches": 2, "pipeline.schedule": "gpipe", "pipeline.submesh_space": "all"},
], ids=["1x4", "2x2", "2x4-gpipe"])
def test_stage_bound_skips_solves_but_not_the_optimum(overrides):
    """The FLOP and relaxation lower bounds against an even incumbent pipeline never
    change the DP's optimum; they only save intra-op solves."""
    config = tiny(**{"pipeline.stages": "auto", **overrides})
    exact = solve_pipelined(config.with_overrides({"pipeline.stage_bound": False}),
                            baselines=False)
    bounded = solve_pipelined(config, baselines=False)
    assert bounded.solver.objective == pytest.approx(exact.solver.objective, rel=1e-12)
    assert bounded.solver.stages.incumbent_s >= exact.solver.objective * (1 - 1e-12)
    assert bounded.solver.stages.stage_solves <= exact.solver.stages.stage_solves
    assert bounded.solver.stages.stage_pairs == exact.solver.stages.stage_pairs
    assert bounded.solver.stages.stage_relaxed <= bounded.solver.stages.stage_bounded
    assert exact.solver.stages.stage_relaxed == 0


def test_variants_cut_off_by_the_incumbent_leave_the_optimum():
    """A memory-bound variant whose solve proves it slower than the incumbent pipeline
    stops there (:meth:`StageSolver._cutoff`); the DP's optimum is the one found with no
    bound at all, and the cut-off is exactly the DP's own test: just below it a stage
    time can still be part of a better plan, at it none can."""

    config = tiny(**{"model.layers": 6, "cluster.memory_gib": 1.0 / 1024,
                     "pipeline.stages": "auto", "pipeline.microbatches": 8,
                     "pipeline.schedule": "1f1b"})
    exact = solve_pipelined(config.with_overrides({"pipeline.stage_bound": False}),
                            baselines=False)
    cut = solve_pipelined(config, baselines=False)
    assert cut.solver.stages.stage_cut_off > 0
    assert cut.solver.objective == pytest.approx(exact.solver.objective, rel=1e-12)
    graph = config.microbatch_graph()
    units = layer_units(graph)
    solver = StageSolver(config, graph, units)
    solver.state.incumbent_s = cut.solver.stages.incumbent_s
    M = config.pipeline.microbatches
    checked = 0
    for a, e, shape in [(0, 2, (1, 1)), (1, 4, (1, 2)), (2, 6, (1, 1)), (0, 6, (1, 2))]:
        per_step = solver._cutoff(a, e, shape)
        if solver.lower_bound(a, e, shape) > solver.state.incumbent_s:
            continue  # bounded by its FLOPs before any solve
        t_star = per_step / M / (1 + 1e-6)
        assert solver.lower_bound(a, e, shape, t_star * (1 - 1e-7)) <= solver.state.incumbent_s
        assert solver.lower_bound(a, e, shape, per_step / M) * (1 - 1e-9) > solver.state.incumbent_s
        checked += 1
    assert checked >= 2


def test_refining_a_gap_at_a_cut_off_count_removes_the_gap_there():
    """A gap variant the DP chose, resolved at its position's count whose solve is cut
    off (useless): the rebuilt variants no longer offer that count a gap, so the DP's
    refine loop moves on (it repeated the same gap before)."""
    import types

    from formulations.stage_dp import StageCost
    from ilp_planner.inter_op.stage_solver import StageSolver, StageSolverState
    from ilp_planner.inter_op.stage_variants import Gap

    class Stub(StageSolver):
        """The table logic over canned solves: fastest fits no count ≥ 2, count 2 fits,
        counts ≥ 3 are cut off by the incumbent."""

        def __init__(self):
            self.state = StageSolverState(incumbent_s=100.0)
            self.lazy = True
            self.keys = types.SimpleNamespace(key=lambda a, e: ("sig", a, e))
            self.config = types.SimpleNamespace(
                cluster=types.SimpleNamespace(memory_bytes=100.0),
                pipeline=types.SimpleNamespace(microbatches=8))

        def _inflight_levels(self, a, e, shape):
            return [2, 3, 4, 5]

        def lower_bound(self, a, e, shape, t=None):
            return 0.0

        def variant_cost(self, solved):
            return solved

        def solve(self, a, e, shape, how=None, useful_only=False):
            key = (self.keys.key(a, e), shape, how)
            state = self.state
            if key in state.solved or (useful_only and key in state.cut_off):
                return state.solved.get(key)
            if how is None or how == 2:
                state.solved[key] = StageCost(1.0, 50.0 if how is None else 10.0,
                                              30.0 if how is None else 40.0)
                return state.solved[key]
            state.cut_off.add(key)
            return None

    s = Stub()
    pair = (s.keys.key(0, 1), (1, 1))
    s.state.variants[pair] = s._variants(0, 1, (1, 1))
    [gap] = [v for v, (how, _) in enumerate(s.state.variants[pair]) if isinstance(how, Gap)]
    stage = types.SimpleNamespace(start=0, end=1, submesh=(1, 1), inflight_microbatches=3,
                                  variant=gap)
    assert s.refine(stage)
    budget = s.config.cluster.memory_bytes
    assert not any(isinstance(how, Gap) and c.memory(3) <= budget for how, c in s.state.variants[pair])


@pytest.mark.parametrize("overrides", [
    {"model.layers": 4, "cluster.nodes": 2, "cluster.devices_per_node": 4},
    {"model.layers": 3, "cluster.nodes": 1, "cluster.devices_per_node": 4,
     "training.grad_bucket_mb": 0},
    {"model.layers": 3, "cluster.nodes": 2, "cluster.devices_per_node": 2,
     "solver.recompute": "always"},
], ids=["2x4", "1x4-no-buckets", "2x2-recompute"])
def test_the_relaxation_bounds_every_stage_solve_from_below(overrides):
    """What the planner drops pairs with: :func:`fastest_bound` of a range on a shape is
    at most the time the stage solve prices its fastest plan at (the plan's realised
    cost, every collective and boundary program included), for every range and shape."""
    from ilp_planner.inter_op.stage_solver import StageSolver
    from ilp_planner.intra_op.problem import BuildCache
    from ilp_planner.intra_op.request import MeshSolveRequest
    from ilp_planner.intra_op.solve_mesh import fastest_bound
    from ilp_planner.ir.cluster import submesh_shapes

    config = tiny(**{"pipeline.stages": "auto", **overrides})
    graph = config.microbatch_graph()
    units = layer_units(graph)
    solver = StageSolver(config, graph, units)
    M = config.pipeline.microbatches
    c = config.cluster
    checked = 0
    for shape in submesh_shapes(c.nodes, c.devices_per_node):
        for a in range(len(units)):
            for e in range(a + 1, len(units) + 1):
                solved = solver.solve(a, e, shape)
                if solved is None:
                    continue
                sub, boundary = solver._stage_graph(a, e)
                bound = fastest_bound(MeshSolveRequest(config, shape[0], shape[1], None, sub,
                                                       M, boundary, BuildCache()))
                assert bound <= solved[3].total_s * (1 + 1e-9), (a, e, shape)
                # a bound worth computing (the least: 0.43 of the first unit on 2 × 4)
                assert bound >= 0.4 * solved[3].total_s
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("space", ["all", "power_of_two"])
def test_stage_dp_over_one_unit_per_block_equals_brute_force(space):
    """The planner's real stage costs (shared by signature) and boundary costs, one unit
    per block: the DP's optimum is the brute-force enumeration's over every slicing and
    sub-mesh assignment."""
    from formulations.stage_dp import solve_stages
    from ilp_planner.inter_op.boundary_estimate import BoundaryCost
    from ilp_planner.inter_op.stage_solver import StageSolver
    from ilp_planner.ir.cluster import submesh_shapes

    config = tiny(**{"model.layers": 5, "cluster.nodes": 3, "cluster.devices_per_node": 2,
                     "pipeline.stages": "auto", "pipeline.microbatches": 8})
    graph = config.microbatch_graph()
    units = layer_units(graph)
    assert len(units) == 5
    solver = StageSolver(config, graph, units)
    kw = dict(boundary_cost=BoundaryCost(config, graph, units), schedule="1f1b",
              memory_budget_bytes=config.cluster.memory_bytes,
              submesh_shapes=submesh_shapes(3, 2, space))
    got = solve_stages(5, 3, 2, 8, solver.stage_cost, **kw)
    ref = brute_force_stages(5, 3, 2, 8, solver.stage_cost, **kw)
    assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-12)
    assert solver.stats.solves < solver.stats.calls


def test_pruned_pipelined_grid_equals_the_best_degree_priced_alone(monkeypatch):
    """The pipelined torchtitan grid drops a PP degree once its latency with FLOP floors
    for the stages not yet priced reaches the best found; its answer equals the best of
    every degree priced alone (the config fixing the stage count: nothing to prune), and
    the floors did cut work here."""
    from ilp_planner.inter_op import pipelined_grid as grid_module
    from ilp_planner.inter_op.boundary_estimate import BoundaryCost
    from ilp_planner.inter_op.stage_solver import StageSolver
    from ilp_planner.ir.cluster import submesh_shapes

    config = tiny(**{"model.layers": 6, "cluster.memory_gib": 1.0 / 1024,
                     "pipeline.stages": "auto", "pipeline.microbatches": 8,
                     "pipeline.schedule": "1f1b"})
    graph = config.microbatch_graph()
    units = layer_units(graph)
    c = config.cluster
    shapes = submesh_shapes(c.nodes, c.devices_per_node)

    priced = []
    point = grid_module.torchtitan_choice
    monkeypatch.setattr(grid_module, "torchtitan_choice",
                        lambda *a, **k: priced.append(1) or point(*a, **k))

    def grid(num_stages=None, first=None):
        priced.clear()
        solver = StageSolver(config, graph, units)
        return grid_module.pipelined_grid(config, graph, solver, BoundaryCost(config, graph, units), shapes,
                              num_stages, first), len(priced)

    alone, work = {}, 0
    for S in (2, 4, 8):
        g, n = grid(S)
        work += n
        if not isinstance(g, str):
            alone[S] = g.latency_s
    assert len(alone) >= 2, alone
    best = min(alone, key=alone.get)
    for first in (None, best, max(alone, key=alone.get)):
        pruned, n = grid(first=first)
        assert pruned.latency_s == pytest.approx(alone[best], rel=1e-12)
        assert len(pruned.stages) == best
        if first == best:
            assert n < work, (n, work)


def test_the_incumbent_prices_pipelines_before_the_whole_cluster():
    """The one-stage pipeline on the whole cluster (the mesh with the most factorisations:
    the dearest build at scale) is the incumbent's last resort: where even pipelines fit,
    no stage is solved on the whole cluster for it, and the DP's optimum is still the one
    found with no bound."""
    from ilp_planner.inter_op.boundary_estimate import BoundaryCost
    from ilp_planner.inter_op.stage_incumbent import set_incumbent
    from ilp_planner.ir.cluster import submesh_shapes

    config = tiny(**{"model.layers": 8, "cluster.nodes": 2, "cluster.devices_per_node": 2,
                     "pipeline.stages": "auto", "pipeline.microbatches": 8,
                     "pipeline.schedule": "1f1b"})
    graph = config.microbatch_graph()
    units = layer_units(graph)
    solver = StageSolver(config, graph, units)
    set_incumbent(solver, BoundaryCost(config, graph, units), submesh_shapes(2, 2), None,
                  config.pipeline.imbalance_tolerance)
    assert solver.state.incumbent_s is not None
    assert solver.state.solved and all(shape != (2, 2) for _, shape, _ in solver.state.solved)
    exact = solve_pipelined(config.with_overrides({"pipeline.stage_bound": False}),
                            baselines=False)
    bounded = solve_pipelined(config, baselines=False)
    assert bounded.solver.objective == pytest.approx(exact.solver.objective, rel=1e-12)
    assert solver.state.incumbent_s >= exact.solver.objective * (1 - 1e-12)


def test_divisors_space_holds_the_even_split_power_of_two_cannot():
    """12 single-device nodes in 2 stages: the even split 6 + 6 (Megatron's ``nodes / pp``)
    is in ``submesh_space: divisors`` and the optimum over every shape (``all``);
    powers of two split 12 only as 8 + 4, a slower pipeline."""
    def plan(space):
        return solve_pipelined(tiny(**{
            "model.layers": 2, "model.batch": 48, "cluster.nodes": 12,
            "cluster.devices_per_node": 1, "pipeline.stages": 2, "pipeline.microbatches": 8,
            "pipeline.schedule": "1f1b", "pipeline.submesh_space": space}), baselines=False)

    divisors, pow2, every = plan("divisors"), plan("power_of_two"), plan("all")
    assert [s.mesh for s in divisors.stages] == [(6, 1), (6, 1)]
    assert sorted(s.mesh for s in pow2.stages) == [(4, 1), (8, 1)]
    assert divisors.solver.objective == pytest.approx(every.solver.objective, rel=1e-12)
    assert divisors.solver.objective < pow2.solver.objective * (1 - 1e-3)


def test_coarse_units_are_balanced_larger_first():
    """``max_units`` not dividing the units: exactly ``max_units`` groups of sizes differing
    by at most one, the larger first (40 blocks → 8 of 3 then 8 of 2; the ceiling split
    left 14 groups, the last of 1)."""
    g = gpt(64, 40, 4, 16, 128, 8)
    units = layer_units(g)
    for k in (1, 7, 16, 39, 40, 41):
        coarse = layer_units(g, max_units=k)
        sizes = [sum(1 for u in units if u[0] in c) for c in coarse]
        assert len(coarse) == min(k, 40) and sum(coarse, []) == sum(units, [])
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [len({n.split(".")[1] for n in c if n.startswith("h.")})
            for c in layer_units(g, 16)] == [3] * 8 + [2] * 8


def test_no_unit_of_the_530b_row_fits_one_node_when_coarsened_to_8():
    """Megatron 529.6B (h 20480) on one node of 8 × A100 80 GB, 105 blocks in 8 balanced
    units (one of 14 blocks, seven of 13): Adam's 16 bytes a parameter sharded 8 ways is
    ≈ 131 GB even for a 13-block unit, so no variant fits one node at any position —
    the short 7-block last unit a ceiling split made (the one that fitted, put on one node
    by the power-of-two space at 0.05× the published configuration) is gone."""
    config = load_config(CONFIGS / "published" / "megatron-529.6b-2520.yaml").with_overrides(
        {"pipeline.max_units": 8, "pipeline.submesh_space": "power_of_two"})
    graph = config.microbatch_graph()
    units = layer_units(graph, 8)
    solver = StageSolver(config, graph, units)
    budget = config.cluster.memory_bytes
    state = sum(graph[n].params for n in units[1]) * 16 / 8
    assert state == pytest.approx(13 * 12 * 20480**2 * 2, rel=0.01) and state > budget
    for a in (0, 1, 7):
        assert all(c.memory(1) > budget for c in solver.stage_cost(a, a + 1, (1, 8)))


