"""Mixture-of-experts: the ``kind: moe`` builder, the MoE op's strategies against closed
forms (AllToAll bytes at capacity, state per device, gradient layouts), the exact solve
against exhaustive search over EP × ETP × ZeRO choices, and the baselines beside it."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from formulations.sbp_ilp import SbpIlp
from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.intra_op.baselines import baseline_choices
from ilp_planner.intra_op.problem import build_problem, peak_memory
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_mesh
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import B, P, Split
from ilp_planner.lowering.cost_model import CollectiveKind, MemorySpec
from ilp_planner.lowering.moe_strategies import (
    COMBINE,
    COUNTS,
    DISPATCH,
    RECEIVED,
    capacity,
    expert_parallel,
    moe_param_shapes,
)
from ilp_planner.lowering.strategies import StrategyContext, grad_sync, op_strategies, param_layouts
from ilp_planner.plan.audit import AuditRow
from ilp_planner.reports.explain import explain
from ilp_planner.testing import restricted_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ADAM = MemorySpec.preset("adam")
TINY = dict(hidden=32, layers=2, heads=4, seq_len=8, vocab=64, batch=8, experts=4, top_k=2,
            expert_ffn=48, capacity_factor=2.0)


def cluster(nodes: int, local: int) -> Cluster:
    return Cluster(nodes, local, memory_bytes=16 * 2**30, peak_flops=1e13,
                   intra=Link.from_bandwidth(5, 800), inter=Link.from_bandwidth(10, 50))


def moe_params_closed_form(h: int, layers: int, vocab: int, seq: int, e: int, f: int,
                           m: int = 3, shared: int = 0, every: int = 1) -> int:
    """Embedding and positions, per block attention 4h² + 4h and two layernorms 4h, an MoE
    (router h·E, E experts of m·h·f, shared m·h·f_s) or a dense 4h MLP (8h² + 5h), final 2h."""
    moe_layers = layers // every
    dense = layers - moe_layers
    return (vocab * h + seq * h + layers * (4 * h * h + 8 * h) + 2 * h
            + moe_layers * (h * e + m * h * (e * f + shared)) + dense * (8 * h * h + 5 * h))


def test_builder_counts_parameters_in_closed_form():
    g = models.moe(**TINY)
    assert g.total_params == moe_params_closed_form(32, 2, 64, 8, 4, 48) == 48_192
    gelu = models.moe(**{**TINY, "activation": "gelu", "moe_every": 2, "shared_experts": 2,
                         "shared_ffn": 16})
    assert gelu.total_params == moe_params_closed_form(32, 2, 64, 8, 4, 48, m=2, shared=32,
                                                       every=2)
    assert [op.name for op in gelu.ops if op.kind is OpKind.MOE] == ["h.1.moe"]


@pytest.mark.parametrize("name, params", [("tiny-moe-cpu", 48_192)])  # Llama-block configs:
# tests/test_moe_blocks.py
def test_shipped_moe_configs_count_in_closed_form(name, params):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    m = cfg.model
    assert cfg.graph.total_params == params == moe_params_closed_form(
        m["hidden"], m["layers"], m["vocab"], m["seq_len"], m["experts"], m["expert_ffn"],
        shared=m.get("shared_experts", 0) * m.get("shared_ffn", 0))


@pytest.mark.parametrize("key, value, words", [("top_k", 5, "top_k 5 exceeds the 4 experts"),
                                               ("capacity_factor", 0, "model.capacity_factor"),
                                               ("activation", "relu", "model.activation")])
def test_bad_moe_keys_name_the_key(key, value, words):
    data = {"model": {"kind": "moe", **TINY, key: value},
            "cluster": {"nodes": 1, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 1,
                        "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 1},
                                  "inter": {"latency_us": 1, "bandwidth_gbps": 1}}}}
    with pytest.raises(ConfigError, match=words):
        parse_config(data, "moe.yaml")


def test_an_explicit_moe_op_needs_its_attrs_and_counts_its_params():
    op = {"name": "m", "kind": "moe", "inputs": ["x"], "shape": [8, 16]}
    spec = {"kind": "graph", "ops": [{"name": "x", "kind": "input", "shape": [8, 16]}, op,
                                     {"name": "loss", "kind": "loss", "inputs": ["m"], "shape": [1]}]}
    with pytest.raises(ConfigError, match=r"model.ops\[1\].attrs: a moe op needs attrs.experts"):
        models.graph_from_spec(spec, "g.yaml")
    op["attrs"] = {"experts": 4, "top_k": 2, "ffn": 8}
    g = models.graph_from_spec(spec, "g.yaml")
    assert g["m"].params == 16 * 4 + 3 * 16 * 4 * 8
    assert g["m"].flops == 2.0 * 8 * 16 * (4 + 3 * 2 * 8)  # as the builder counts
    assert models.graph_from_spec(models.graph_to_spec(g)).ops == g.ops


def _moe_op(tokens: int = 64, h: int = 32, e: int = 4, f: int = 48, cf: int = 200,
            **extra: int) -> Op:
    attrs = {"experts": e, "top_k": 2, "ffn": f, "capacity_pct": cf, "swiglu": 1,
             "norm_topk": 1, **extra}
    return Op("moe", OpKind.MOE, ("x",), TensorSpec((tokens, h)), TensorSpec((e, h, f)),
              models.moe_params(attrs, h), 1.0, attrs=attrs)


def _strategies(op: Op, nodes: int = 2, local: int = 4, levels=(0,)):
    ctx = StrategyContext(cluster(nodes, local), nodes, local, ADAM, zero_levels=levels)
    return ctx, op_strategies(op, [TensorSpec(op.output.shape)], ctx)


def _degrees(s) -> tuple[int, int, int]:
    return tuple(a.size for a in s.fact)


def test_expert_parallel_all_to_all_moves_the_capacity_buffer():
    """EP over p1: four AllToAlls (dispatch and combine, forward and backward), each of the
    whole local buffer E·C·h with C = ⌈cf · T/(p0·p1) · k / E⌉; none without EP."""
    op = _moe_op(cf=125)
    _, strats = _strategies(op)
    seen = 0
    for s in strats:
        p0, p1, p2 = _degrees(s)
        a2a = [c for c in s.collectives if c.kind is CollectiveKind.ALL_TO_ALL]
        if not expert_parallel(s.inputs[0]) or p1 == 1:
            assert not a2a
            continue
        seen += 1
        c = math.ceil(1.25 * (64 // (p0 * p1)) * 2 / 4)
        assert c == capacity(op, 64 // (p0 * p1))
        assert sorted((x.purpose, x.phase) for x in a2a) == sorted(
            (p, ph) for p in (DISPATCH, COMBINE) for ph in ("forward", "backward"))
        assert all(x.bytes == 4 * c * 32 * 4 and x.group_size == p1 for x in a2a)
    assert seen


def test_dropless_exchanges_price_a_balanced_router_and_its_counts():
    """Dropless (``attrs.dropless``): per expert-parallel strategy the counts AllToAll (E
    int64, forward), the dispatch and combine at a balanced router's rows — C = ⌈T_g · k /
    E⌉ whatever the capacity factor — with what the rank sends back (the combine's forward,
    the dispatch's backward) tagged ``moe_received``."""
    op = _moe_op(cf=200, dropless=1)
    _, strats = _strategies(op)
    seen = 0
    for s in strats:
        p0, p1, _ = _degrees(s)
        a2a = [c for c in s.collectives if c.kind is CollectiveKind.ALL_TO_ALL]
        if not expert_parallel(s.inputs[0]) or p1 == 1:
            assert not a2a
            continue
        seen += 1
        group = 64 // (p0 * p1)
        c = math.ceil(group * 2 / 4)
        assert c == capacity(op, group)
        rows = sorted((x.purpose, x.phase, x.bytes, x.group_size) for x in a2a)
        routed = 4 * c * 32 * 4
        assert rows == sorted([(COUNTS, "forward", 8 * 4, p1),
                               (DISPATCH, "forward", routed, p1),
                               (RECEIVED, "backward", routed, p1),
                               (RECEIVED, "forward", routed, p1),
                               (COMBINE, "backward", routed, p1)])
    assert seen


def test_the_audit_holds_received_rows_to_their_bound_and_the_rest_to_the_plan():
    """A dropless rank's received rows vary with the router: within the group's routed rows
    (group size × planned bytes) they pass; the other rows must match the plan."""
    assert AuditRow("all_to_all", RECEIVED, "forward", 4, 2, 100.0, 2, 390.0).ok
    assert not AuditRow("all_to_all", RECEIVED, "forward", 4, 2, 100.0, 2, 420.0).ok
    assert not AuditRow("all_to_all", RECEIVED, "forward", 4, 2, 100.0, 1, 50.0).ok
    assert not AuditRow("all_to_all", DISPATCH, "forward", 4, 2, 100.0, 2, 150.0).ok


def test_layouts_gradients_and_state_per_role():
    """Expert weights split over experts (p1) and hidden (p2), replicated over p0 where
    their gradient is AllReduced; the router's gradient is partial everywhere; the input's
    gradient is partial over the axes whose tokens are replicated (xp, etp)."""
    op = _moe_op()
    ctx, strats = _strategies(op)
    shapes = moe_param_shapes(op)
    for s in strats:
        p0, p1, p2 = _degrees(s)
        x = s.inputs[0]
        ep = expert_parallel(x)
        lays = param_layouts(op, s.label, s.inputs, None, s.output)
        w1, g1 = lays["w1"]
        assert w1.placements == (B, Split(0), Split(2))
        assert g1.placements[0] == (P if p0 > 1 else B)
        local = sum(math.prod(lays[r][0].padded_shape(shp)) for r, shp in shapes.items())
        assert local == 32 * 4 + 3 * 4 * 32 * 48 // (p1 * p2)
        assert s.state_bytes == local * ADAM.bytes_per_param
        want_out = (Split(0), Split(0) if ep else (P if p1 > 1 else B), P if p2 > 1 else B)
        assert s.output.placements == want_out and s.grads_of_inputs[0].placements == want_out
        syncs = {b.axes: set(b.roles) for b in grad_sync(op, s.label, s.inputs, None, s.output, ctx)}
        router_axes = tuple(a for a, n in enumerate((p0, p1, p2)) if n > 1)
        if router_axes:
            assert "router" in syncs[router_axes]
        if p0 > 1:
            assert {"w1", "w2", "w3"} <= syncs[(0,)] | syncs.get(router_axes, set())


def _small_graph(tokens: int = 32, h: int = 16) -> Graph:
    t = TensorSpec((tokens, h))
    moe = _moe_op(tokens, h, e=4, f=8, cf=200)
    return Graph("moe-small", [
        Op("x", OpKind.INPUT, (), t),
        Op("ln", OpKind.LAYERNORM, ("x",), t, params=2 * h, flops=8.0 * tokens * h),
        Op("moe", OpKind.MOE, ("ln",), t, moe.weight, moe.params, 2e6, attrs=moe.attrs),
        Op("fc", OpKind.LINEAR, ("moe",), TensorSpec((tokens, 8)), TensorSpec((h, 8)),
           h * 8, 2.0 * tokens * h * 8, attrs={"bias": 0}),
        Op("loss", OpKind.LOSS, ("fc",), TensorSpec((1,))),
    ])


def _small_config(levels: list[int]):
    return parse_config({
        "name": "moe-small", "model": _small_graph(),
        "cluster": {"nodes": 1, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 0.01,
                    "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 80},
                              "inter": {"latency_us": 10, "bandwidth_gbps": 10}}},
        "training": {"optimizer": "adam"},
        "solver": {"state_sharding": levels, "recompute": "never"}})


def _brute_force(gp, budget: float | None) -> float:
    """The least objective over every choice of the unpruned problem whose exact peak
    (:func:`peak_memory`) fits ``budget``."""
    best = math.inf
    for choice in itertools.product(*(range(len(c)) for c in gp.problem.cost)):
        if budget is None or peak_memory(gp, choice) <= budget:
            best = min(best, gp.problem.objective(choice))
    return best


@pytest.mark.parametrize("fraction", [None, 0.7, 0.5])
def test_exact_solve_equals_exhaustive_search_over_ep_etp_and_zero(fraction):
    """On a 4-device mesh every (EP or expert slicing, ETP, expert DP, ZeRO level) of the
    MoE op, with the layernorm before and the linear after it: the planner's solve (its
    dominance pruning, elimination and budget handling included) and an enumeration of the
    unpruned problem agree — free, and under budgets that force other experts' layouts."""
    config = _small_config([0, 1, 2, 3])
    gp = build_problem(config.graph, config.cluster, 1, 4, config.memory, zero_levels=(0, 1, 2, 3),
                       grad_bucket_bytes=config.grad_bucket_bytes)
    moe_opts = gp.options["moe"]
    assert {o.base.zero for o in moe_opts} == {0, 1, 2, 3}
    assert {_degrees(o.base) for o in moe_opts} >= {(1, 4, 1), (1, 2, 2), (4, 1, 1), (2, 2, 1)}
    free = solve_mesh(MeshSolveRequest.whole_model(config, 1, 4, None))
    peak = realise(free[0], list(free[1].choice))[1].peak_memory_bytes
    budget = None if fraction is None else fraction * peak
    res = free[1] if budget is None else solve_mesh(
        MeshSolveRequest.whole_model(config, 1, 4, budget))[1]
    assert res.status == "optimal"
    assert math.isclose(res.objective, _brute_force(gp, budget), rel_tol=1e-9)


def test_planner_beats_or_ties_every_baseline_including_the_moe_ones():
    g = models.moe(**TINY)
    gp = build_problem(g, cluster(2, 4), 2, 4, ADAM)
    opt = SbpIlp(gp.problem).solve().objective
    choices = baseline_choices(gp)
    assert "deepspeed_moe" in choices
    ds = realise(gp, choices["deepspeed_moe"])[0]
    moe_layers = [ly for ly in ds if ly.name.endswith(".moe")]
    assert moe_layers and all(ly.strategy.startswith("moe(dp=2,ep=4,etp=1)") for ly in moe_layers)
    for name, choice in choices.items():
        assert not isinstance(choice, str), (name, choice)
        assert opt <= realise(gp, choice)[1].total_s * (1 + 1e-9), name


@pytest.mark.parametrize("name", ["mixtral-8x7b-8x8", "deepseek-v2-lite-2x8"])
def test_large_moe_configs_solve_optimal_with_expert_parallelism(name):
    """Both solve to optimality (the benchmark times them: well under 30 s) and spread the
    experts: EP > 1 on every MoE layer."""
    config = load_config(CONFIGS / f"{name}.yaml")
    gp, res = solve_mesh(MeshSolveRequest.whole_cluster(config))
    assert res.status == "optimal"
    layers = realise(gp, list(res.choice))[0]
    moe = [ly for ly in layers if ly.name.endswith(".moe")]
    assert len(moe) == config.model["layers"] - config.model.get("first_dense", 0)
    assert all(",ep=" in ly.strategy and ",ep=1," not in ly.strategy for ly in moe)


def test_explain_lists_the_all_to_alls_with_their_bytes():
    """A plan lists every collective it will issue: an expert-parallel layer's dispatch and
    combine AllToAlls, forward and backward, each E·C·h·4 bytes over the EP group."""
    config = load_config(CONFIGS / "tiny-moe-cpu.yaml")
    plan = restricted_plan(config, lambda op, s: op.kind is not OpKind.MOE
                           or s.label == "moe(dp=2,ep=4,etp=1)")
    text = explain(plan)
    assert "h.0.moe [moe] moe(dp=2,ep=4,etp=1) on mesh (2, 4, 1)" in text
    for purpose in (DISPATCH, COMBINE):
        for phase in ("fwd", "bwd"):  # 64 tokens over 8 devices: C = 8 slots per expert
            assert f"all_to_all {phase} {purpose}: group 4 (intra, axes 1), 4.00 KiB" in text
