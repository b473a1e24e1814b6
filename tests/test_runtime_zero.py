"""State sharding (ZeRO-1/2/3) and activation recomputation executed as planned.

In-process (fast): the ZeRO-3 gather keeps no gathered weight alive between forward and
backward and gathers again exactly once in the backward where the backward reads the
weights (a linear whose input needs a gradient); an op reading the data (linear, layer
norm, convolution) gathers nothing for its backward; inside a checkpointed block the
recomputation gathers once more (the plan's ``recompute`` phase) and the backward reads
that buffer — two gathers, not three; plans the runtime cannot execute as priced (a
sharded tied weight, a listing that is not what the buckets give) are refused before any
process group exists.

Multi-process (slow, gloo, real ``torchrun`` processes): each ZeRO level forced on every
shardable op of the tiny MLP (4 ranks, 2 micro-batches; ZeRO-2 and 3 also on two
pipeline stages under 1F1B), every block of a tiny
U-Transformer recomputed with and without ZeRO-3, the tiny GPT (8 ranks, ZeRO-3 + every
block recomputed, its tied pair left unsharded; in float32 and in bfloat16) and the
planner's own plan of
``configs/tiny-utf-zero-cpu.yaml`` (its budget makes it shard state, ZeRO-3 included, and
recompute), and its plan of the tiny GPT on two stages sharding state beside the tied
pair it leaves replicated, must give the single-process reference's losses and parameters
(``--check-reference``) with executed == planned collectives on every rank and step
(``--audit``, keyed by kind, purpose, phase and group size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import socket
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ilp_planner.api import solve
from ilp_planner.errors import PlanFormatError
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.intra_op.baselines import summa_filter
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import OpKind
from ilp_planner.plan.data import Plan
from ilp_planner.testing import pipelined_plan, sharded_plan, three_d_filter
from runtime import model
from runtime.errors import RuntimeSetupError
from runtime.executor import Executor, RunOptions
from runtime.recorder import Recorder, replaying
from runtime.reference import tolerance
from runtime.zero import ZeroBucket, gather, released
from tests.helpers.cases import GRID_WINS
from tests.helpers.procs import run

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
STEPS = 3
FOUR = {"cluster.nodes": 1, "cluster.devices_per_node": 4}


def _mlp4():
    return load_config(CONFIGS / "tiny-mlp-cpu.yaml").with_overrides(
        {**FOUR, "pipeline.microbatches": 2})


def _utf4():
    return load_config(CONFIGS / "tiny-utf-zero-cpu.yaml").with_overrides(
        {**FOUR, "pipeline.microbatches": 2})


def _not_tied(op, s) -> bool:
    """GPT's tied pair stays unsharded (the runtime refuses it, see below)."""
    return not s.zero or not (op.attrs.get("tied") or op.kind is OpKind.EMBEDDING)


# -- in-process: the ZeRO-3 gather and its release ------------------------------------------------


@pytest.fixture
def one_rank():
    """A one-process gloo group: every collective runs (over a group of one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _bucket(group) -> tuple[ZeroBucket, torch.Tensor]:
    """The planner's bucket of a data-parallel linear (weight 8×6), sharded at level 3."""
    from ilp_planner.inputs import models
    from ilp_planner.ir.cluster import Cluster, Link
    from ilp_planner.lowering.cost_model import MemorySpec
    from ilp_planner.lowering.strategies import StrategyContext, grad_sync, op_strategies

    g = models.mlp([8, 6], batch=4)
    ctx = StrategyContext(Cluster(1, 2, 2**30, 1e12, Link(1e-5, 1e-9), Link(1e-5, 1e-9), 0.5, "t"),
                          1, 2, MemorySpec.preset("adam"))
    dp = next(s for s in op_strategies(g["fc1"], [g["input"].output], ctx) if s.fact[0].size == 2)
    (sync,) = grad_sync(g["fc1"], dp.label, dp.inputs, dp.weight, dp.output, ctx)
    # the one process is the whole group
    sync = dataclasses.replace(sync, collective=dataclasses.replace(sync.collective, group_size=1))
    zb = ZeroBucket("fc1", 0, 3, sync, {"weight": (8, 6)}, {"weight": 48}, torch.float32)
    w = torch.randn(8, 6)
    zb.init({"weight": w}, group, torch.device("cpu"))
    return zb, w


def _zero3_linear(zb: ZeroBucket, x: torch.Tensor, rec: Recorder, alive: list) -> torch.Tensor:
    views, pair = gather(zb, rec)
    alive.append(weakref.ref(pair[0]))
    with released([pair]):
        return torch.tanh(x @ views["weight"])


def test_zero3_frees_the_gathered_weight_and_gathers_again_once(one_rank) -> None:
    zb, w = _bucket(one_rank)
    rec = Recorder(4)
    x = torch.randn(4, 8, requires_grad=True)
    alive: list = []
    with rec:
        y = _zero3_linear(zb, x, rec, alive)
        assert alive[0]() is None  # nothing holds the gathered buffer until the backward
        y.sum().backward()
    phases = [(e.kind, e.purpose, e.phase) for e in rec.take()]
    assert phases == [("all_gather", "fsdp_gather", "forward"),
                      ("all_gather", "fsdp_gather", "backward"),
                      ("reduce_scatter", "shard_grad", "backward")]
    w0 = w.clone().requires_grad_(True)
    x0 = x.detach().clone().requires_grad_(True)
    torch.tanh(x0 @ w0).sum().backward()
    assert torch.allclose(zb.master.grad, w0.grad.reshape(-1))  # a group of one: the whole
    assert torch.allclose(x.grad, x0.grad)


def test_zero3_inside_a_checkpoint_gathers_forward_and_recompute_only(one_rank) -> None:
    """FSDP with checkpointing: recomputation replays the forward gather (recorded as
    ``recompute``) and the backward reads that buffer, through the checkpoint's own hooks
    — two gathers per micro-batch, as the plan lists for a recomputed ZeRO-3 op; no
    gathered buffer outlives the backward; values unchanged."""
    zb, w = _bucket(one_rank)
    zb.recomputed = True
    rec = Recorder(4)
    x = torch.randn(4, 8, requires_grad=True)
    alive: list = []
    with rec:
        y = checkpoint(lambda t: _zero3_linear(zb, t, rec, alive) * 2.0, x, use_reentrant=False,
                       early_stop=False, context_fn=lambda: (contextlib.nullcontext(), replaying()))
        assert alive[0]() is None  # the checkpoint dropped the forward's buffer
        y.sum().backward()
    phases = [(e.purpose, e.phase) for e in rec.take()]
    assert phases == [("fsdp_gather", "forward"), ("fsdp_gather", "recompute"),
                      ("shard_grad", "backward")]
    assert len(alive) == 2 and all(a() is None for a in alive)
    w0 = w.clone().requires_grad_(True)
    x0 = x.detach().clone().requires_grad_(True)
    (torch.tanh(x0 @ w0) * 2.0).sum().backward()
    assert torch.allclose(zb.master.grad, w0.grad.reshape(-1))
    assert torch.allclose(x.grad, x0.grad)


def _flat(group, shapes: dict[str, tuple[int, ...]]) -> tuple[ZeroBucket, dict[str, torch.Tensor]]:
    """A level-3 bucket of ``shapes`` (roles in order) over the one-process group, its
    backward not reading the weights (the op reads the data: no input gradient)."""
    zb0, _ = _bucket(group)
    numel = sum(math.prod(v) for v in shapes.values())
    sync = dataclasses.replace(zb0.sync, roles=tuple(shapes), numel=numel)
    zb = ZeroBucket("op", 0, 3, sync, dict(shapes), {r: math.prod(v) for r, v in shapes.items()},
                    torch.float32, backward_reads=False)
    blocks = {r: torch.randn(v) for r, v in shapes.items()}
    zb.init(blocks, group, torch.device("cpu"))
    return zb, blocks


@pytest.mark.parametrize("kind", ["linear", "layernorm", "conv2d"])
@pytest.mark.parametrize("recomputed", [False, True])
def test_zero3_on_the_data_gathers_nothing_for_the_backward(one_rank, kind, recomputed) -> None:
    """An op reading the data computes no input gradient, so its backward does not read the
    weights: no backward gather (a recomputed one gathers in the recomputation only). A
    linear saves no weight then; a layer norm and a convolution save theirs all the same
    but read only the shape — they get NaN stand-ins, and the weight gradients still equal
    plain autograd's exactly (a value read would make them NaN)."""
    shapes = {"linear": {"weight": (8, 6), "bias": (6,)},
              "layernorm": {"weight": (6,), "bias": (6,)},
              "conv2d": {"weight": (4, 3, 3, 3), "bias": (4,)}}[kind]
    fn = {"linear": lambda x, p: x @ p["weight"] + p["bias"],
          "layernorm": lambda x, p: model.layer_norm(x, p["weight"], p["bias"]),
          "conv2d": lambda x, p: model.conv2d(x, p["weight"], p["bias"])}[kind]
    x = torch.randn(2, 3, 5, 5) if kind == "conv2d" else torch.randn(4, 8 if kind == "linear" else 6)
    zb, blocks = _flat(one_rank, shapes)
    zb.recomputed = recomputed
    rec = Recorder(4)
    alive: list = []

    def op(t: torch.Tensor) -> torch.Tensor:
        views, pair = gather(zb, rec)
        alive.append(weakref.ref(pair[0]))
        with released([pair]):
            return torch.tanh(fn(t, views))

    with rec:
        if recomputed:
            y = checkpoint(op, x, use_reentrant=False, early_stop=False,
                           context_fn=lambda: (contextlib.nullcontext(), replaying()))
        else:
            y = op(x)
        assert alive[0]() is None
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    phases = [(e.purpose, e.phase) for e in rec.take()]
    assert phases == [("fsdp_gather", "forward")] + [("fsdp_gather", "recompute")] * recomputed \
        + [("shard_grad", "backward")]
    ref = {r: b.clone().requires_grad_(True) for r, b in blocks.items()}
    y0 = torch.tanh(fn(x, ref))
    (y0 * torch.linspace(-1, 1, y0.numel()).reshape(y0.shape)).sum().backward()
    want = torch.cat([ref[r].grad.reshape(-1) for r in shapes])
    assert torch.isfinite(zb.master.grad).all()
    assert torch.allclose(zb.master.grad, want, atol=1e-6)


# -- in-process: what cannot run as priced is refused ---------------------------------------------


def test_tied_weights_are_never_offered_sharded_state() -> None:
    """The tied exchange needs both copies' whole gradients, so the planner offers no ZeRO
    level to a tied table or head (the executor refuses one as a guard); other weighted
    layers get them."""
    from ilp_planner.intra_op.problem import build_problem

    c = load_config(CONFIGS / "tiny-gpt-cpu.yaml").with_overrides(FOUR)
    gp = build_problem(c.graph, c.cluster, c.cluster.nodes, c.cluster.devices_per_node,
                       c.memory, zero_levels=(0, 1, 2, 3))
    for name in ("embed", "lm_head"):
        assert all(not o.base.zero for o in gp.options[name]), name
    assert any(o.base.zero for o in gp.options["h.0.mlp.fc1"])


def test_state_sharding_listing_must_match_the_buckets() -> None:
    plan = sharded_plan(_mlp4(), 3, keep=three_d_filter((2, 1, 2)))
    ex = Executor(plan, RunOptions(), rank=0, world=4)  # as solved: accepted
    assert [ex.compiled.layers[n].zero for n in ex.compiled.zero_syncs] == [3, 3, 3]
    fc2 = next(i for i, lp in enumerate(plan.layers) if lp.name == "fc2")
    colls = [dataclasses.replace(c, bytes=c.bytes / 2) if c.purpose == "shard_grad" else c
             for c in plan.layers[fc2].collectives]
    plan.layers[fc2] = dataclasses.replace(plan.layers[fc2], collectives=tuple(colls))
    with pytest.raises(PlanFormatError, match="'fc2' \\(zero3\\).*state-sharding collectives"):
        Executor(plan, RunOptions(), rank=0, world=4)


def test_recomputed_runs_are_the_blocks() -> None:
    plan = sharded_plan(_utf4(), 0, recompute=True)
    ex = Executor(plan, RunOptions(), rank=0, world=4)
    runs = [names for rc, names in ex.compiled.segments[0] if rc]
    assert [{(ex.compiled.graph[n].block, ex.compiled.graph[n].block_index) for n in r} for r in runs] == \
        [{("u", 0)}, {("u", 1)}]
    kept = {n for rc, names in ex.compiled.segments[0] if not rc for n in names}
    assert {"u.0.mlp.residual", "u.1.mlp.residual"} <= kept  # block outputs are held


# -- multi-process -------------------------------------------------------------------------------


def _train(plans: dict[str, Plan], n: int, tmp: Path,
           optimizers: dict[str, tuple[str, float]] | None = None) -> dict:
    """Train every plan in one launch (Adam, lr 0.01 unless ``optimizers`` says otherwise)
    with ``--audit --check-reference``; each must match at its compute dtype's tolerance."""
    files, opts, lrs = [], [], []
    for name, plan in plans.items():
        plan.name = name
        files.append(str(tmp / f"{name}.json"))
        plan.save(files[-1])
        opt, lr = (optimizers or {}).get(name, ("adam", 0.01))
        opts.append(opt)
        lrs.append(str(lr))
    cmd = [sys.executable, "-m", "ilp_planner.cli", "run", *files, "--nproc-per-node", str(n),
           "--steps", str(STEPS), "--optimizer", ",".join(opts), "--lr", ",".join(lrs),
           "--results", str(tmp / "results.json"), "--quiet", "--audit", "--check-reference"]
    res = run(cmd, timeout=540)
    assert res.returncode == 0, f"launch failed:\n{res.stdout[-5000:]}\n{res.stderr[-3000:]}"
    assert "MISMATCH" not in res.stdout
    out = {Path(r["file"]).stem: r for r in json.loads((tmp / "results.json").read_text())}
    for name, r in out.items():
        rtol = tolerance(parse_config(plans[name].config).graph)
        assert r["audit_ok"] is True
        assert r["reference"]["loss_rel_err"] <= rtol and r["reference"]["param_rel_err"] <= rtol
        assert r["losses"][-1] < r["losses"][0]
    return out


def _gather_phases(plan: Plan) -> dict[str, list[str]]:
    """Per ZeRO-3 layer, the phases of the ``fsdp_gather`` collectives its plan lists."""
    return {lp.name: sorted(c.phase for c in lp.collectives if c.purpose == "fsdp_gather")
            for lp in plan.layers if lp.zero == 3}


SOLVED_FOUR = {**FOUR, "cluster.memory_gib": 0.0007}
"""The shipped config on one node of 4 (its own 2 × 4 solve takes over a minute here), the
budget scaled so that the planner still shards state (ZeRO-3 among it) and recomputes."""


PIPE_FOUR = {**FOUR, "pipeline.stages": 2, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}


@pytest.mark.slow
def test_zero_levels_recomputation_and_a_solved_plan_on_four_ranks(tmp_path) -> None:
    mlp, utf = _mlp4(), _utf4()
    plans = {f"mlp4-zero{z}": sharded_plan(mlp, z, keep=three_d_filter((2, 1, 2)))
             for z in (1, 2, 3)}
    for z in (2, 3):  # per-micro-batch scatters and gathers interleaved by 1F1B, two stages
        plans[f"mlp4-pp-zero{z}"] = pipelined_plan(_mlp4(), stages=2, schedule="1f1b",
                                                   microbatches=4, zero=z)
    summa = summa_filter(MeshAxis(1, 2), MeshAxis(1, 2))  # the baseline's layouts, any state
    plans["mlp4-summa-zero3"] = sharded_plan(  # SUMMA gathers its weight; ZeRO-3 its bias
        _mlp4(), 3, keep=lambda op, s: summa(op, dataclasses.replace(s, zero=0)))
    bf16 = _mlp4().with_overrides({"model.dtype": "bfloat16"})
    for z in (1, 2):  # full blocks in bf16, gradients accumulated in fp32 (as priced)
        plans[f"mlp4-bf16-zero{z}"] = sharded_plan(bf16, z, keep=three_d_filter((2, 1, 2)))
    plans["mlp4-bf16-summa-zero1"] = sharded_plan(  # SUMMA's weight gathered from fp32
        bf16, 1, keep=lambda op, s: summa(op, dataclasses.replace(s, zero=0)))
    plans["utf4-recompute"] = sharded_plan(utf, 0, recompute=True)
    plans["utf4-zero3-recompute"] = sharded_plan(utf, 3, recompute=True)
    for name, plan in plans.items():
        levels = {lp.zero for lp in plan.layers if lp.kind == "linear"}
        if "summa" not in name:
            assert levels == {0 if "zero" not in name else int(name.split("zero")[1][0])}, name
        assert any(lp.recompute for lp in plan.layers) == ("recompute" in name)
    # the audit's equality then proves the runtime gathers as little: fc1 reads the data
    # (once per micro-batch), fc2 and fc3 read W for dX (twice); a recomputed op gathers
    # in the forward and the recomputation, whose buffer its backward reads (twice)
    assert _gather_phases(plans["mlp4-zero3"]) == {
        "fc1": ["forward"], "fc2": ["backward", "forward"], "fc3": ["backward", "forward"]}
    rc = _gather_phases(plans["utf4-zero3-recompute"])
    again = [lp.name for lp in plans["utf4-zero3-recompute"].layers if lp.recompute and lp.zero]
    assert again and all(rc[n] == ["forward", "recompute"] for n in again)
    solved = solve(load_config(CONFIGS / "tiny-utf-zero-cpu.yaml").with_overrides(SOLVED_FOUR),
                   baselines=False)
    assert 3 in {lp.zero for lp in solved.layers} and any(lp.recompute for lp in solved.layers)
    plans["utf4-solved"] = solved
    for gib, what in ((0.0005, "recompute"), (0.0006, "zero")):  # pipelined: stages solved
        # under their positions' memory rows (tests/test_pipeline_planner.py)
        plans[f"utf4-pp-{what}"] = solve(load_config(CONFIGS / "tiny-utf-zero-cpu.yaml")
                                         .with_overrides({**PIPE_FOUR, "cluster.memory_gib": gib}),
                                         baselines=False)
    assert any(lp.recompute for lp in plans["utf4-pp-recompute"].layers)
    assert any(lp.zero for lp in plans["utf4-pp-zero"].layers)
    # a plan that is the torchtitan grid's pipeline (it simulates faster than the DP's)
    plans["gpt4-pp-grid"] = solve(load_config(CONFIGS / "tiny-gpt-cpu.yaml").with_overrides(
        GRID_WINS))
    assert "kept the torchtitan grid" in plans["gpt4-pp-grid"].solver.message
    # the tied GPT pair split over two stages under a budget that shards other state: the
    # planner leaves the pair replicated (the runtime once refused its ZeRO-1 embedding)
    tied = solve(load_config(CONFIGS / "tiny-gpt-cpu.yaml").with_overrides(
        {**PIPE_FOUR, "solver.state_sharding": [0, 1, 2, 3], "cluster.memory_gib": 0.0007}),
        baselines=False)
    zero = {lp.name: lp.zero for lp in tied.layers}
    assert any(zero.values()) and zero["embed"] == zero["lm_head"] == 0
    plans["gpt4-pp-tied-zero"] = tied
    # bf16 with Adam's normalised update amplifies rounding (runtime/reference.py): SGD
    out = _train(plans, 4, tmp_path, {n: ("sgd", 0.1) for n in plans if "bf16" in n})
    assert set(out) == set(plans)
    # ZeRO-1/2 under bf16 hold their full blocks in bf16 (the planner's w = 2 bytes; the fp32
    # master is the shard), but SUMMA's weight, gathered from the fp32 master as priced
    for name in ("mlp4-bf16-zero1", "mlp4-bf16-zero2"):
        assert {d for d, _ in out[name]["held"].values()} == {"bfloat16"}, out[name]["held"]
    summa_held = out["mlp4-bf16-summa-zero1"]["held"]
    assert {k for k, (d, _) in summa_held.items() if d == "float32"} == {
        "fc1.weight", "fc2.weight", "fc3.weight"}, summa_held
    # ZeRO-1 reduce-scatters during the last backward, as soon as a layer's gradient is
    # final (overlapped, as priced), so fc3's comes before the backward reaches fc1
    order = out["mlp4-zero1"]["order"]
    rs = [i for i, x in enumerate(order) if x.startswith("backward/shard_grad_sync:")]
    assert len(rs) == 3 and order[rs[0]] == "backward/shard_grad_sync:fc3"
    into_fc1 = order.index("backward/activation:relu1", order.index("backward_end:0"))
    assert rs[0] < into_fc1 < rs[-1] < order.index("backward_end:1"), order
    # ZeRO-2 reduce-scatters after every micro-batch's backward
    order = out["mlp4-zero2"]["order"]
    assert sum(x.startswith("backward/shard_grad:") for x in order[:order.index("backward_end:0")]) == 3


@pytest.mark.slow
def test_gpt_with_zero3_and_recomputation_on_eight_ranks(tmp_path) -> None:
    """Two nodes of 4: the sharded groups span nodes where the data-parallel axis does;
    the tied embedding and head keep their state (refused sharded, see above)."""
    plans, opts = {}, {}
    for dtype, opt in (("", ("adam", 0.01)), ("-bf16", ("sgd", 0.1))):
        c = load_config(CONFIGS / f"tiny-gpt{dtype}-cpu.yaml").with_overrides(
            {"pipeline.microbatches": 2})
        gpt = sharded_plan(c, 3, recompute=True, keep=_not_tied)
        assert {lp.zero for lp in gpt.layers
                if lp.kind == "linear" and lp.name != "lm_head"} == {3}
        # both blocks recomputed, all but each block's output (the next one's checkpoint)
        blocks = [lp for lp in gpt.layers if lp.name.startswith("h.")]
        assert len(blocks) == 20 and all(lp.recompute != lp.name.endswith("mlp.residual")
                                         for lp in blocks)
        plans[f"gpt8{dtype}-zero3-recompute"] = gpt
        opts[f"gpt8{dtype}-zero3-recompute"] = opt
    # bfloat16: weights gathered in bfloat16, gradients scattered in float32 (as priced);
    # SGD, as tests/test_runtime.py's bfloat16 runs (runtime.reference.RTOL's note)
    _train(plans, 8, tmp_path, opts)


def test_parallelize_refuses_sharded_or_recomputed_layers() -> None:
    """ilp_planner.parallelize (a user's module under DTensor) does not shard state or recompute:
    it says so instead of running the layers as if they were plain."""
    import ilp_planner
    from runtime.modules import MLP

    mlp = MLP([8, 8])
    cluster = {"nodes": 1, "devices_per_node": 1, "memory_gib": 16, "peak_tflops": 1,
               "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                         "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}
    plan = ilp_planner.solve(ilp_planner.from_module(mlp, (torch.zeros(4, 8),)),
                             cluster=cluster, baselines=False)
    plan.layers[0] = dataclasses.replace(plan.layers[0], recompute=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeSetupError, match="state sharding or recomputation"):
            ilp_planner.parallelize(plan, mlp)
    finally:
        dist.destroy_process_group()


def _saved_bytes(plan: Plan) -> int:
    """Bytes autograd keeps from one forward of ``plan`` on one process (what the saved-
    tensor hooks outside the executor see: a checkpointed block's are its own)."""
    ex = Executor(plan, RunOptions(record=False), rank=0, world=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    kept = []
    try:
        ex.setup()
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.append(t.numel() * t.element_size()) or t, lambda t: t):
            _chunk(ex).loop.forward(0)
    finally:
        dist.destroy_process_group()
    return sum(kept)


def test_recomputed_blocks_keep_no_activations_between_forward_and_backward() -> None:
    one = load_config(CONFIGS / "tiny-utf-zero-cpu.yaml").with_overrides(
        {"cluster.nodes": 1, "cluster.devices_per_node": 1})
    plain, again = sharded_plan(one, 0), sharded_plan(one, 0, recompute=True)
    held, rc = _saved_bytes(plain), _saved_bytes(again)
    graph = one.graph
    recomputed = sum(graph[lp.name].output.nbytes for lp in again.layers if lp.recompute)
    assert 0 < rc < held
    # the recomputed layers' outputs (what the planner stops charging) are no longer held
    assert held - rc >= recomputed, (held, rc, recomputed)


def test_mixed_precision_casts_each_master_once_a_step() -> None:
    """Under bf16 every micro-batch's forward reads one compute copy of each weight, cast
    once a step: what two forwards (two micro-batches in flight) save for their backwards
    shares those copies — the planner charges w = 2 bytes a parameter once, not once per
    micro-batch in flight."""
    one = load_config(CONFIGS / "tiny-gpt-bf16-cpu.yaml").with_overrides(
        {"cluster.nodes": 1, "cluster.devices_per_node": 1, "pipeline.microbatches": 2})
    ex = Executor(sharded_plan(one, 0), RunOptions(record=False), rank=0, world=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    saved: list[set[int]] = [set(), set()]

    def keep(mb: int):
        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[mb].add(t.untyped_storage().data_ptr())
            return t
        return pack

    try:
        ex.setup()
        for mb in (0, 1):
            with torch.autograd.graph.saved_tensors_hooks(keep(mb), lambda t: t):
                _chunk(ex).loop.forward(mb)
    finally:
        dist.destroy_process_group()
    weights = {k: c.t for k, c in _chunk(ex).compute.copies.items()
               if ex.compiled.graph[k.rsplit(".", 1)[0]].kind is OpKind.LINEAR and k.endswith(".weight")}
    assert weights and all(t.dtype == torch.bfloat16 for t in weights.values())
    for k, t in weights.items():  # both micro-batches saved the one copy
        ptr = t.untyped_storage().data_ptr()
        assert ptr in saved[0] and ptr in saved[1], k
    masters = {ex.params[k].t.untyped_storage().data_ptr() for k in weights}
    assert not masters & (saved[0] | saved[1])  # no fp32 master saved in their place


def _chunk(ex):
    """The one model chunk this rank runs (a plan without interleaving)."""
    (chunk,) = ex.chunks.values()
    return chunk
