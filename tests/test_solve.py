"""The solve pipeline end to end: closed forms (data-parallel gradient AllReduce, Megatron's
row-parallel output reduction), the planner never worse than a baseline, realise() pricing
exactly what the ILP minimised, the infeasible-memory explanation, the time-limit fallback,
the plan file's fields and round trip, and the ``solve`` verb."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from formulations.result import SolveStats
from formulations.sbp_ilp import SbpIlp
from ilp_planner import cli
from ilp_planner.api import solve
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import apply_overrides, load_config, parse_config
from ilp_planner.intra_op.baselines import baseline_choices, megatron_filter, restrict
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_mesh
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.cost_model import CollectiveKind, MemorySpec, collective_time
from ilp_planner.plan.data import PLAN_VERSION, Plan
from ilp_planner.reports.summary import memory_lower_bound
from tests.helpers.shipped import shipped_plan

K = CollectiveKind
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SINGLE_MESH = ["tiny-gpt-cpu", "vgg13-2x8", "mlp-autoddl-128"]


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """Each shipped single-mesh config solved once, baselines included."""
    return {name: shipped_plan(name, baselines=True) for name in SINGLE_MESH}


def cluster(nodes: int, local: int) -> Cluster:
    return Cluster(nodes, local, memory_bytes=16 * 2**30, peak_flops=1e13,
                   intra=Link.from_bandwidth(5, 800), inter=Link.from_bandwidth(10, 50))


# -- the planner against its baselines and against itself ----------------------------------


@pytest.mark.parametrize("name", SINGLE_MESH)
def test_planner_is_no_worse_than_any_baseline(plans, name):
    plan = plans[name]
    assert plan.solver.status == "optimal"
    priced = {k: b for k, b in plan.baselines.items() if "error" not in b}
    assert any(k.startswith("megatron") for k in priced) and "data_parallel" in priced
    for bname, b in priced.items():
        assert plan.cost.total_s <= b["total_s"] * (1 + 1e-9), bname


@pytest.mark.parametrize("name", SINGLE_MESH)
def test_realised_cost_equals_ilp_objective(plans, name):
    plan = plans[name]
    assert math.isclose(plan.cost.total_s, plan.solver.objective, rel_tol=1e-9)
    assert plan.cost.peak_memory_bytes <= load_config(CONFIGS / f"{name}.yaml").cluster.memory_bytes


def test_realised_cost_equals_ilp_objective_with_gradient_accumulation():
    """transformer-autoddl-64 accumulates 32 micro-batches: activation traffic and compute
    count 32 times, the gradient AllReduce once — in the ILP's costs and in realise() alike."""
    config = load_config(CONFIGS / "transformer-autoddl-64.yaml")
    assert config.pipeline.microbatches > 1 and not config.pipeline.pipelined
    gp, res = solve_mesh(MeshSolveRequest.whole_model(config, 64, 1, config.cluster.memory_bytes))
    _, cost = realise(gp, list(res.choice))
    assert math.isclose(cost.total_s, res.objective, rel_tol=1e-9)
    assert cost.peak_memory_bytes == pytest.approx(gp.problem.memory_of(res.choice))


def test_baselines_are_restrictions_of_the_planner_space():
    g = models.gpt(hidden=64, layers=2, heads=4, seq_len=16, vocab=128, batch=8)
    gp = build_problem(g, cluster(2, 4), 2, 4, MemorySpec.preset("adam"))
    opt = SbpIlp(gp.problem).solve().objective
    choices = baseline_choices(gp)
    assert len(choices) == 4
    for name, choice in choices.items():
        assert not isinstance(choice, str), (name, choice)
        total = realise(gp, choice)[1].total_s
        assert math.isclose(total, gp.problem.objective(choice), rel_tol=1e-9)
        assert opt <= total * (1 + 1e-9), name


def test_megatron_sp_trades_allreduce_for_reducescatter_and_allgather():
    """Megatron-SP on dp × tp: norms and residual adds hold tokens split over both axes;
    each block's row-parallel outputs are reduce-scattered (not all-reduced) into them and
    gathered again before the column-parallel linears — the same ring bytes as Megatron's
    AllReduce, so the two price within latency terms of each other."""
    g = models.gpt(hidden=64, layers=2, heads=4, seq_len=16, vocab=128, batch=8)
    gp = build_problem(g, cluster(1, 8), 1, 8, MemorySpec.preset("adam"))
    choices = baseline_choices(gp)
    sp_name = next(n for n in choices if n.startswith("megatron_sp"))
    mg_name = next(n for n in choices if n.startswith("megatron("))
    assert sp_name[len("megatron_sp"):] == mg_name[len("megatron"):]  # same dp × tp
    sp_layers = {ly.name: ly for ly in realise(gp, choices[sp_name])[0]}
    mg_layers = {ly.name: ly for ly in realise(gp, choices[mg_name])[0]}
    for i in range(2):
        norm = sp_layers[f"h.{i}.ln2"]
        assert [x.split_degree(0) for x in (norm.output,)] == [8]  # tokens over dp and tp
        drop = sp_layers[f"h.{i}.mlp.residual"]  # reads fc2's partial sums
        assert drop.output.split_degree(0) == 8
        assert [(c.kind.value, c.group_size) for c in drop.collectives
                if c.phase == "forward"] == [("reduce_scatter", 4)]
        sp_fwd = [c for ly in sp_layers.values() if ly.name.startswith(f"h.{i}.mlp.")
                  for c in ly.collectives if c.phase == "forward"]
        assert not any(c.kind.value == "all_reduce" for c in sp_fwd)
        assert any(c.kind.value == "all_gather" and c.phase == "forward"
                   for c in sp_layers[f"h.{i}.mlp.fc1"].collectives)
        mg_drop = mg_layers[f"h.{i}.mlp.residual"]
        assert mg_drop.output.split_degree(0) == 2  # Megatron: tokens over dp only


# -- closed forms ----------------------------------------------------------------------------


@pytest.mark.parametrize("graph", [
    models.gpt(hidden=64, layers=2, heads=4, seq_len=16, vocab=128, batch=8),
    models.mlp([64, 32, 32, 16], batch=16),
], ids=["gpt", "mlp"])
def test_data_parallel_gradient_allreduce_closed_form(graph):
    """Every weight replicated on p = 8 devices (across nodes): one AllReduce of the whole
    gradient per layer, ring time 2(p−1)α + 2(p−1)/p·nβ with n = params · itemsize, i.e.
    every device sends 2(p−1)/p of the parameter bytes. A tied LM head holds its own copy of
    the table (the runtime trains both and exchanges their gradients), so it syncs too."""
    cl = cluster(2, 4)
    p = 8
    gp = build_problem(graph, cl, 2, 4, MemorySpec.preset("adam"), tie_layers=False)
    choice = baseline_choices(gp)["data_parallel"]
    layers, cost = realise(gp, choice)
    grads = [c for layer in layers for c in layer.collectives if c.purpose == "grad_sync"]
    with_params = [op for op in graph.ops if op.params > 0 or op.attrs.get("tied")]
    assert len(grads) == len(with_params)
    for c in grads:
        assert (c.kind, c.group_size, c.link, c.phase) == (K.ALL_REDUCE, p, "inter", "backward")
    sizes = {op.name: (op.weight.numel if op.attrs.get("tied") else op.params) for op in with_params}
    param_bytes = sum(sizes.values()) * 4
    tied = sum(op.weight.numel for op in graph.ops if op.attrs.get("tied"))
    assert param_bytes == (graph.total_params + tied) * 4  # float32
    assert cost.grad_sync_bytes == pytest.approx(param_bytes)
    # data parallel: both copies of a tied table share one layout, the exchange is local
    assert not [c for layer in layers for c in layer.collectives if c.purpose == "tied_weight"]
    alpha, beta = cl.inter.alpha, cl.inter.beta
    per_device_sent = 2 * (p - 1) / p * param_bytes
    expected = len(with_params) * 2 * (p - 1) * alpha + per_device_sent * beta
    assert cost.grad_sync_s == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(sum(collective_time(K.ALL_REDUCE, p, sizes[op.name] * 4, cl.inter)
                                         for op in with_params), rel=1e-12)
    # data parallel moves no activations; the loss mean is one fp32 scalar AllReduced
    # over the row-splitting devices
    assert cost.activation_comm_bytes == 4


def test_megatron_row_parallel_output_is_allreduced_over_tp():
    """Megatron on dp × tp = 2 × 4 (TP inside a node) with qkv/fc1 column- and proj/fc2
    row-parallel. A row-parallel output is a partial sum over tp of n = (tokens/dp) ·
    hidden · itemsize bytes; the plan reduce-scatters it (n) and all-gathers it (n), in the
    follower or before the next reader: together exactly the AllReduce closed form
    2(tp−1)α + 2(tp−1)/tp·nβ."""
    layers_n, hidden, seq, batch, vocab = 3, 64, 16, 4, 128
    # Megatron-LM's GPT drops (0.1): the follower of each row-parallel output is a dropout
    g = models.gpt(hidden=hidden, layers=layers_n, heads=4, seq_len=seq, vocab=vocab, batch=batch,
                   dropout=0.1)
    cl = cluster(2, 4)
    gp = build_problem(g, cl, 2, 4, MemorySpec.preset("adam"))
    dp, tp, one = MeshAxis(2, 1), MeshAxis(1, 4), MeshAxis(1, 1)
    megatron = megatron_filter(dp, tp)
    row = {"attn.proj", "mlp.fc2"}

    def canonical(op, s) -> bool:
        if not megatron(op, s):
            return False
        if op.kind is OpKind.LINEAR and op.block is not None:
            return s.fact == ((dp, one, tp) if op.name.split(".", 2)[2] in row else (dp, tp, one))
        return True

    restricted = restrict(gp, canonical)
    assert not isinstance(restricted, str), restricted
    sub, allowed = restricted
    res = SbpIlp(sub).solve()
    choice = [int(allowed[i][k]) for i, k in enumerate(res.choice)]
    layers, cost = realise(gp, choice)
    assert math.isclose(cost.total_s, res.objective, rel_tol=1e-9)
    by_name = {layer.name: layer for layer in layers}
    n = batch * seq // 2 * hidden * 4
    tp_size = 4
    reduce_scatters, all_gathers = [], []
    for layer in layers:
        for c in layer.collectives:
            if c.phase != "forward" or c.purpose != "activation" or layer.kind == "loss":
                continue
            assert c.link == "intra", (layer.name, c)  # tensor parallelism stays in a node
            (reduce_scatters if c.kind is K.REDUCE_SCATTER else all_gathers).append((layer.name, c))
    for i in range(layers_n):
        for lin in row:
            assert by_name[f"h.{i}.{lin}"].output.partial_axes  # partial sum over tp
    # one reduce-scatter per row-parallel output, in the follower that first reads it
    assert sorted(name for name, _ in reduce_scatters) == sorted(
        f"h.{i}.{d}" for i in range(layers_n) for d in ("attn.dropout", "mlp.dropout"))
    for _, c in reduce_scatters:
        assert (c.group_size, c.bytes) == (tp_size, n)
    # the all-gathers rebuild n bytes per device over tp (possibly as a product of smaller
    # rings): one per row-parallel output — in the follower itself when it reads the sums
    # all-reduced, or before the next reader when it reads them reduce-scattered (the ILP's
    # pick; equal cost) — plus the column-parallel embedding's
    gathered = {}
    for name, c in all_gathers:
        gathered.setdefault(name, []).append(c)
    assert len(gathered) >= 2 * layers_n + 1
    for cs in gathered.values():
        assert math.prod(c.group_size for c in cs) == tp_size and max(c.bytes for c in cs) == n
    rs = collective_time(K.REDUCE_SCATTER, tp_size, n, cl.intra)
    ag = collective_time(K.ALL_GATHER, tp_size, n, cl.intra)
    assert rs + ag == pytest.approx(collective_time(K.ALL_REDUCE, tp_size, n, cl.intra), rel=1e-12)
    assert rs + ag == pytest.approx(2 * (tp_size - 1) * cl.intra.alpha
                                    + 2 * (tp_size - 1) / tp_size * n * cl.intra.beta, rel=1e-12)


# -- infeasibility and time limits -----------------------------------------------------------


@pytest.mark.parametrize("name,gib", [("gpt-6.7b-2x8", 4), ("tiny-gpt-cpu", 1e-4)])
def test_infeasible_memory_is_explained(name, gib):
    config = load_config(CONFIGS / f"{name}.yaml").with_overrides({"cluster.memory_gib": gib})
    with pytest.raises(InfeasibleError) as info:
        solve(config)
    msg = str(info.value)
    m = re.search(r"the smallest per-device memory any plan needs is ([\d.e+-]+) GiB", msg)
    assert m, msg
    assert re.search(rf"the budget is {gib:g} GiB", msg), msg
    term = re.search(r"dominant term: (\S+)", msg)
    _, dominant = memory_lower_bound(config.microbatch_graph(), config.cluster, config.memory)
    assert term and term.group(1) == dominant.name, msg  # the term validate names
    gp = build_problem(config.microbatch_graph(), config.cluster, config.cluster.nodes,
                       config.cluster.devices_per_node, config.memory,
                       microbatches=config.pipeline.microbatches)
    need = gp.problem.min_memory()[0] / 2**30
    assert float(m.group(1)) == pytest.approx(need, rel=1e-3)
    assert need > gib


def test_time_limit_returns_a_marked_feasible_plan():
    # the ILP alone: the elimination proves this model's optimum without one
    raw = apply_overrides(load_config(CONFIGS / "tiny-gpt-cpu.yaml").raw,
                          {"solver.time_limit_s": 1e-3, "solver.tie_layers": False,
                           "solver.elimination": False, "model.layers": 4})
    config = parse_config(raw, "tiny-gpt-cpu-4-untied")
    plan = solve(config, baselines=False)
    s = plan.solver
    assert s.status in ("feasible", "heuristic"), s
    assert s.message, s
    assert re.search(r"time limit|within", s.message)
    assert s.stats.variables > 0 and s.stats.search_s is not None  # the ILP's, always
    assert plan.cost.peak_memory_bytes <= config.cluster.memory_bytes
    assert math.isclose(plan.cost.total_s, s.objective, rel_tol=1e-9)
    optimum = solve(config.with_overrides({"solver.time_limit_s": 60}), baselines=False)
    assert optimum.solver.status == "optimal"
    assert s.objective >= optimum.solver.objective * (1 - 1e-9)
    if s.bound is not None:
        assert s.bound <= optimum.solver.objective * (1 + 1e-9)
        assert s.gap >= 0


def test_milp_option_picks_the_backend():
    """``solver.milp: cbc`` (PuLP's CBC, the reference) and the default in-process SCIP reach
    the same optimum through the planner; the stats say which engine ran."""
    # the ILP alone: the elimination proves this model's optimum without one
    config = load_config(CONFIGS / "tiny-gpt-cpu.yaml").with_overrides(
        {"solver.elimination": False})
    assert config.solver.milp == "scip"
    scip = solve(config, baselines=False).solver
    cbc = solve(config.with_overrides({"solver.milp": "cbc"}), baselines=False).solver
    assert scip.status == cbc.status == "optimal"
    assert math.isclose(scip.objective, cbc.objective, rel_tol=1e-9)
    assert scip.stats.note.startswith("SCIP") and cbc.stats.note.startswith("CBC")
    sizes = ("variables", "integer_variables", "constraints")
    assert [getattr(scip.stats, k) for k in sizes] == [getattr(cbc.stats, k) for k in sizes]


# -- the plan file ------------------------------------------------------------------------

COST_KEYS = {"total_s", "compute_s", "comm_s", "activation_comm_bytes", "grad_sync_bytes",
             "peak_memory_bytes"}


def test_plan_json_fields(plans):
    d = json.loads(json.dumps(plans["tiny-gpt-cpu"].to_dict()))
    assert d["version"] == PLAN_VERSION
    assert {"status", "objective", "bound", "gap", "build_s", "solve_s", "stats"} <= set(d["solver"])
    assert set(d["solver"]["stats"]) == {f.name for f in dataclasses.fields(SolveStats)}
    stats = d["solver"]["stats"]
    assert stats["variables"] > 0
    if d["solver"]["method"] != "elimination":  # the ILP's binaries and continuous variables
        assert stats["variables"] > stats["integer_variables"] > 0
    assert Plan.from_dict(d).solver.to_dict() == d["solver"]
    assert COST_KEYS <= set(d["cost"])
    assert math.isclose(d["cost"]["total_s"], d["cost"]["compute_s"] + d["cost"]["comm_s"])
    names = [layer["name"] for layer in d["layers"]]
    assert names == [op.name for op in load_config(CONFIGS / "tiny-gpt-cpu.yaml").graph.ops
                     if op.kind is not OpKind.INPUT]
    for layer in d["layers"]:
        st = layer["strategy"]
        assert st["mesh"] and st["output"]["placements"] and "inputs" in st
        for c in layer["collectives"]:
            assert {"kind", "group_size", "bytes", "seconds", "phase"} <= set(c)
            assert c["phase"] in ("forward", "backward") and c["group_size"] >= 1
    assert any(layer["collectives"] for layer in d["layers"])
    for name, b in d["baselines"].items():
        assert COST_KEYS <= set(b) or set(b) == {"error"}, name
    assert any(k.startswith("megatron") for k in d["baselines"])


def test_plan_save_load_round_trip(plans, tmp_path):
    for name, plan in plans.items():
        path = tmp_path / f"{name}.json"
        plan.save(path)
        loaded = Plan.load(path)
        assert loaded.to_dict() == plan.to_dict(), name
        assert loaded.layers == plan.layers and loaded.cost == plan.cost


def test_solve_verb_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["solve", str(CONFIGS / "tiny-gpt-cpu.yaml"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "status optimal" in printed and "data_parallel" in printed and "megatron" in printed
    plan = Plan.load(out)
    assert plan.solver.status == "optimal" and plan.baselines
    assert plan.to_dict() == json.loads(out.read_text())


def test_solve_verb_reports_infeasible_memory(tmp_path, capsys):
    raw = apply_overrides(load_config(CONFIGS / "tiny-gpt-cpu.yaml").raw, {"cluster.memory_gib": 1e-4})
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(raw))  # JSON is YAML
    assert cli.main(["solve", str(cfg), "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert "smallest per-device memory" in err and "the budget is" in err

