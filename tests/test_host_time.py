"""The kernels the runtime issues, priced: the host's time issuing them (``dispatch_s``) and
replaying them under recomputation (``replay_s``), the passes over the master weights,
gradient merges and a linear's bias gradient — each against a hand-computed case — and the
kernels one training step of the executor dispatches against the kernels its plan prices
(counted at dispatch, on one process)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ilp_planner.api import solve
from ilp_planner.commands.calibrate import dispatch_plan
from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.compute_calibration import (
    KernelTiming,
    compute_section,
    fit_compute,
    read_kernel_csv,
    write_kernel_csv,
)
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.inter_op.layer_units import subgraph
from ilp_planner.intra_op.problem import _structure, gradient_merges, merge_seconds
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.device import ComputeFit, DeviceSpec
from ilp_planner.ir.graph import OpKind
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering import strategies
from ilp_planner.lowering.compute_model import (
    UNSCALE_BYTES,
    UNSCALE_KERNELS,
    PhaseWork,
    bound_by,
    master_weight_seconds,
    op_times_replayed,
    op_work,
    phase_seconds,
    unscale_seconds,
)
from ilp_planner.lowering.cost_model import MemorySpec
from ilp_planner.lowering.stage_boundary import stage_boundary
from ilp_planner.lowering.strategies import (
    VOCAB_MASK_ID_BYTES,
    StrategyContext,
    is_summa,
    local_gemm,
    op_strategies,
    summa_cast_seconds,
)
from ilp_planner.reports.explain import step_seconds
from ilp_planner.reports.roofline import bound_seconds
from runtime import model as runtime_model
from runtime.executor import Executor, RunOptions
from runtime.measure_dispatch import count_dispatched
from tests.helpers.shipped import CONFIGS

HBM = 2e12
HOST = 30e-6


def _device(dispatch_s: float = HOST, replay_s: float = 0.0) -> DeviceSpec:
    return DeviceSpec("t", 80 * 2**30, {"bfloat16": 300e12, "float32": 20e12}, HBM, (),
                      ComputeFit(0.8, 128.0, 1.0, 5e-6, "flash", dispatch_s, replay_s))


def _cluster(device: DeviceSpec | None) -> Cluster:
    link = Link(1e-5, 1e-10)
    return Cluster(1, 1, 80 * 2**30, 300e12, link, link, 0.5, "t", device)


def test_a_phase_takes_the_longer_of_its_device_time_and_its_kernels_host_time() -> None:
    small = PhaseWork(0.0, 1e6, 3)  # 0.5 µs of bytes and 15 µs of floors, 90 µs to issue
    assert phase_seconds(small, _device(), "bfloat16") == pytest.approx(3 * HOST, rel=1e-12)
    assert bound_by(small, _device(), "bfloat16") == "host"
    big = PhaseWork(0.0, 1e9, 1)  # 500 µs of bytes
    assert phase_seconds(big, _device(), "bfloat16") == pytest.approx(1e9 / HBM + 5e-6, rel=1e-12)
    assert bound_by(big, _device(), "bfloat16") == "memory"
    # not modelled (every catalogue entry): the device's time alone
    assert phase_seconds(small, _device(0.0), "bfloat16") == pytest.approx(1e6 / HBM + 15e-6)


def test_a_replayed_forward_costs_the_host_its_checkpoint_bookkeeping_too() -> None:
    """A forward that recomputation replays: each kernel ``dispatch + replay`` of host time
    where that binds; a long kernel's device time hides it as it hides the dispatch."""
    small, big = PhaseWork(0.0, 1e6, 3), PhaseWork(0.0, 1e9, 1)
    dev = _device(HOST, 50e-6)
    assert phase_seconds(small, dev, "bfloat16", replayed=True) == \
        pytest.approx(3 * (HOST + 50e-6), rel=1e-12)
    assert phase_seconds(small, dev, "bfloat16") == pytest.approx(3 * HOST, rel=1e-12)
    assert phase_seconds(big, dev, "bfloat16", replayed=True) == \
        pytest.approx(1e9 / HBM + 5e-6, rel=1e-12)


def test_a_linear_with_a_bias_sums_its_output_gradient_in_a_kernel_of_its_own() -> None:
    g = models.mlp([64, 32], batch=16, bias=True)
    plain = models.mlp([64, 32], batch=16, bias=False)
    (fb, bb), (fp, bp) = op_work(g["fc1"], 1.0), op_work(plain["fc1"], 1.0)
    assert fb == fp  # the forward's bias rides in the matmul's epilogue
    assert bb.kernels == bp.kernels + 1 == 3
    assert bb.stream_bytes - bp.stream_bytes == 16 * 32 * 4  # dY read once more
    assert bb.bytes == bp.bytes and bb.flops == bp.flops


@pytest.mark.parametrize(("dtype", "microbatches", "synced", "casts", "adds"), [
    ("bfloat16", 1, False, 2, 0),   # the copy cast, one gradient cast back
    ("bfloat16", 4, True, 5, 4),    # four gradients cast back and added into the buffer
    ("bfloat16", 4, False, 5, 3),   # the first gradient becomes .grad
    ("float32", 1, False, 0, 0),
    ("float32", 3, True, 0, 3),
])
def test_master_weight_passes_by_hand(dtype: str, microbatches: int, synced: bool, casts: int,
                                      adds: int) -> None:
    g = models.mlp([64, 32], batch=16, bias=True, dtype=dtype)
    op, params, tensors = g["fc1"], 64 * 32 + 32, 2
    mem = MemorySpec.preset("adam_mixed" if dtype == "bfloat16" else "adam")
    item = 2 if dtype == "bfloat16" else 4
    want_bytes = params * (casts * (4 + item) + adds * 3 * 4)
    got = master_weight_seconds(op, params, tensors, mem, microbatches, synced,
                                _cluster(_device()))
    want = max(want_bytes / HBM + tensors * (casts + adds) * 5e-6,
               tensors * (casts + adds) * HOST)
    assert got == pytest.approx(want, rel=1e-12)
    assert master_weight_seconds(op, params, tensors, mem, microbatches, synced,
                                 _cluster(None)) == 0.0


def test_a_summa_weight_accumulates_but_is_cast_at_its_gathered_size() -> None:
    """SUMMA's weight block (``gathered``) has no compute copy and no gradient cast back
    among the master passes — its casts run at its gathered size in the strategy's compute —
    but its gradient accumulates: outside every bucket (its gather's backward
    reduce-scatters it), autograd takes the first micro-batch's as it comes and adds the
    other three. By hand, bfloat16, four micro-batches; a bias in a bucket beside it is
    cast once a step, cast back and added every micro-batch."""
    g = models.mlp([64, 32], batch=16, bias=True, dtype="bfloat16")
    op, block, bias = g["fc1"], 64 * 32 // 4, 32 // 2
    mem = MemorySpec.preset("adam_mixed")
    host = _cluster(_device())
    weight = master_weight_seconds(op, block, 1, mem, 4, False, host, block)
    moved, kernels = block * 3 * 3 * 4, 3
    assert weight == pytest.approx(max(moved / HBM + kernels * 5e-6, kernels * HOST), rel=1e-12)
    synced = master_weight_seconds(op, bias, 1, mem, 4, True, host)
    moved, kernels = bias * (5 * (4 + 2) + 4 * 3 * 4), 5 + 4
    assert synced == pytest.approx(max(moved / HBM + kernels * 5e-6, kernels * HOST), rel=1e-12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_summa_prices_its_weight_casts_forward_backward_and_replayed(dtype: str) -> None:
    """Under a half compute dtype a SUMMA strategy's compute holds two casts of its gathered
    weight block (K × N/c elements: the forward's from the float32 master, the backward's
    gradient back), its replay the forward's again — by hand; in float32 nothing."""
    g = models.mlp([64, 32], batch=16, bias=False, dtype=dtype)
    op = g["fc1"]
    cluster = dataclasses.replace(_cluster(_device()), nodes=1, devices_per_node=4)
    ctx = StrategyContext(cluster, 1, 4, MemorySpec.preset("adam_mixed"))
    summa = [s for s in op_strategies(op, [g["input"].output], ctx) if is_summa(s.label)]
    assert summa
    for s in summa:
        r, c = (a.size for a in s.fact)
        split, gemm = local_gemm(op, op.weight, s.fact, True)
        fwd, bwd, replay = op_times_replayed(op, split, cluster, gemm)
        cast = 0.0 if dtype == "float32" else max(6 * 64 * 32 / c / HBM + 5e-6, HOST)
        assert summa_cast_seconds(op, c, cluster) == pytest.approx(cast, rel=1e-12)
        assert s.compute_s == pytest.approx(fwd + bwd + 2 * cast, rel=1e-12)
        assert s.replay_s == pytest.approx(replay + cast, rel=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_float16_loss_scale_unscales_each_gradient_by_hand(dtype: str) -> None:
    """Only float16 takes a loss scale: per gradient tensor 6 kernels, 34 bytes an element
    (:data:`UNSCALE_BYTES`); the kernel count is what :func:`runtime.model.unscale`
    dispatches."""
    g = models.mlp([64, 32], batch=16, bias=True, dtype=dtype)
    op, params, tensors = g["fc1"], 64 * 32 + 32, 2
    got = unscale_seconds(op, params, tensors, _cluster(_device()))
    kernels = tensors * UNSCALE_KERNELS
    want = max(params * UNSCALE_BYTES / HBM + kernels * 5e-6, kernels * HOST) \
        if dtype == "float16" else 0.0
    assert got == pytest.approx(want, rel=1e-12)
    assert unscale_seconds(op, params, tensors, _cluster(None)) == 0.0
    grads = {"weight": torch.randn(64, 32), "bias": torch.randn(32)}
    assert count_dispatched(lambda: runtime_model.unscale(grads, 1024.0)) == kernels


def test_a_vocabulary_split_lookup_prices_the_kernels_its_mask_dispatches() -> None:
    """An embedding whose table's rows are split looks up through a mask: 8 kernels more
    forward and 1 backward than a whole table's lookup, as the runtime dispatches them, and
    priced so by hand (a 1 × 4 mesh: the vocabulary over p2 = 4, the ids whole)."""
    ids, table = torch.randint(0, 100, (16,)), torch.randn(50, 8, requires_grad=True)
    fwd = count_dispatched(lambda: runtime_model.embedding(ids, table, 50, whole=False))
    y = runtime_model.embedding(ids, table, 50, whole=False)
    grad = torch.ones_like(y)
    assert (fwd, count_dispatched(lambda: y.backward(grad))) == (1 + 8, 1 + 1)
    g = models.gpt(hidden=64, layers=1, heads=4, seq_len=16, vocab=128, batch=2,
                   dtype="bfloat16")
    op = next(o for o in g.ops if o.kind is OpKind.EMBEDDING)
    cluster = dataclasses.replace(_cluster(_device()), nodes=1, devices_per_node=4)
    ctx = StrategyContext(cluster, 1, 4, MemorySpec.preset("adam_mixed"))
    (s,) = [s for s in op_strategies(op, [g[op.inputs[0]].output], ctx)
            if [a.size for a in s.fact] == [1, 1, 4]]
    plain = strategies._with_bias_share(strategies._gemm_priced(op, op.weight, s.fact, ctx),
                                        op, s.label, s.inputs, s.weight, s.output, ctx)
    tokens, rows = 32, 32 * 64 * 2
    mask_f = max((tokens * (VOCAB_MASK_ID_BYTES + 1 + 4) + 2 * rows) / HBM + 8 * 5e-6, 8 * HOST)
    mask_b = max((tokens * 2 + 2 * rows) / HBM + 5e-6, HOST)
    assert s.compute_s == pytest.approx(plain["compute_s"] + mask_f + mask_b, rel=1e-12)
    assert s.replay_s == pytest.approx(plain["replay_s"] + mask_f, rel=1e-12)


def test_a_tensor_read_twice_adds_its_gradients_once_in_the_later_reader() -> None:
    cfg = load_config(CONFIGS / "tiny-gpt-cpu.yaml")
    g = cfg.graph
    merged = {op.name: gradient_merges(g, op.name) for op in g.ops if gradient_merges(g, op.name)}
    # the residual stream: each block's two adds read it after a norm did
    assert merged == {op.name: (0,) for op in g.ops if op.kind is OpKind.ADD}
    add = g["h.0.attn.residual"]
    lay = Layout.replicated((MeshAxis(1, 1),))
    want = max(3 * g[add.inputs[0]].output.nbytes / HBM + 5e-6, HOST)
    dev = _cluster(_device())
    assert merge_seconds(g, add.name, (0,), (lay, lay), dev) == pytest.approx(want)
    assert merge_seconds(g, "h.0.ln1", (), (lay,), dev) == 0.0
    assert merge_seconds(g, add.name, (0,), (lay, lay), _cluster(None)) == 0.0


def test_merges_count_reads_and_the_stage_boundary() -> None:
    """``x + x`` adds its two gradients (the U-transformer's first skip add reads one tensor
    twice); in a pipeline stage the imported residual stream is read twice as in the whole
    model, and a tensor a later stage reads too gets its gradient back from there."""
    u = load_config(CONFIGS / "u-transformer-2x4.yaml").graph
    twice = next(op for op in u.ops if op.inputs and len(set(op.inputs)) < len(op.inputs))
    assert gradient_merges(u, twice.name) == (1,)
    g = load_config(CONFIGS / "tiny-gpt-cpu.yaml").graph
    names = [op.name for op in g.ops if op.name.startswith("h.1.")]
    boundary = stage_boundary(g, names)
    assert "h.0.mlp.residual" in boundary.imported
    assert gradient_merges(g, "h.1.attn.residual") == (0,)
    assert gradient_merges(g, "h.1.attn.residual", boundary) == (0,)
    assert gradient_merges(g, "h.1.ln1", boundary) == ()
    # the last block's output: read by the final norm here and by nothing else
    assert gradient_merges(g, "ln_f") == ()
    cut = stage_boundary(g, [op.name for op in g.ops if not op.name.startswith("h.1.")
                             and op.name not in ("ln_f", "lm_head", "loss")])
    assert "h.0.mlp.residual" in cut.exported
    assert gradient_merges(g, "h.0.mlp.residual", cut) == (0,)  # its own input, read twice
    # a stage's build prices the first block's merge as every other block's
    stage = stage_problem_merges(g, names, boundary)
    assert stage["h.1.attn.residual"] == stage["h.1.mlp.residual"] == (0,)


def stage_problem_merges(g, names, boundary) -> dict[str, tuple[int, ...]]:
    """Each op's merges as a stage's build derives them (its structure, on the stage's
    graph, with the boundary)."""
    st = _structure(subgraph(g, names), boundary, True, None)
    return {m: shape[i][2] for _, mem, _, shape, _ in st.nodes for i, m in enumerate(mem)}


def test_dispatch_rows_fit_the_host_time_and_round_trip(tmp_path) -> None:
    streams = [KernelTiming("stream", 0, 0, 0, b, b / 1e11 + 4e-6) for b in (1e4, 1e6, 1e8)]
    matmuls = [KernelTiming("matmul", s, s, s, 3 * s * s * 2.0,
                            2 * s**3 / (1e13 * (s / (s + 64)) ** 3) + 4e-6) for s in (256, 1024)]
    steps = [KernelTiming("dispatch", k, 0, 0, 0.0, k * 25e-6 * f)
             for k, f in ((100, 1.0), (180, 1.02), (140, 0.97))]
    cal = fit_compute(streams + matmuls + steps)
    assert cal.dispatch_s == pytest.approx(25e-6)  # the median step's ratio
    assert compute_section(cal)["dispatch_us"] == pytest.approx(25.0)
    assert "dispatch_us" not in compute_section(fit_compute(streams + matmuls))
    path = tmp_path / "k.csv"
    write_kernel_csv(steps, path)
    assert read_kernel_csv(path) == steps
    with pytest.raises(ValueError, match="kernels its step issued"):
        KernelTiming("dispatch", 0, 0, 0, 0.0, 1.0)


def test_replay_rows_fit_a_replayed_kernels_host_time_beyond_its_dispatch() -> None:
    """``replay`` rows: the recomputed step's ``m`` kernels at the dispatch rows' h, and its
    ``n`` replayed ones r more each — r the median of ``(t − m·h) / n``, at least 0."""
    streams = [KernelTiming("stream", 0, 0, 0, b, b / 1e11 + 4e-6) for b in (1e4, 1e6, 1e8)]
    matmuls = [KernelTiming("matmul", s, s, s, 3 * s * s * 2.0,
                            2 * s**3 / (1e13 * (s / (s + 64)) ** 3) + 4e-6) for s in (256, 1024)]
    steps = [KernelTiming("dispatch", 100, 0, 0, 0.0, 100 * 25e-6)]
    replays = [KernelTiming("replay", m, n, 0, 0.0, m * 25e-6 + n * r)
               for m, n, r in ((120, 20, 150e-6), (160, 60, 140e-6), (130, 30, 170e-6))]
    cal = fit_compute(streams + matmuls + steps + replays)
    assert cal.replay_s == pytest.approx(150e-6)
    assert compute_section(cal)["replay_us"] == pytest.approx(150.0)
    assert all(cal.predict(r) == pytest.approx(r.seconds) for r in replays[:1])
    # noise larger than the bookkeeping: 0, not a negative host time
    fast = [KernelTiming("replay", 120, 20, 0, 0.0, 120 * 24e-6)]
    assert fit_compute(streams + matmuls + steps + fast).replay_s == 0.0
    with pytest.raises(ConfigError, match="replay timings need dispatch timings"):
        fit_compute(streams + matmuls + replays)
    with pytest.raises(ValueError, match="kernels recomputation replayed"):
        KernelTiming("replay", 100, 101, 0, 0.0, 1.0)


@pytest.mark.parametrize("key", ["dispatch_us", "replay_us"])
def test_host_times_are_read_from_the_compute_section(key: str) -> None:
    doc = {"model": {"kind": "mlp", "dims": [8, 8], "batch": 4},
           "cluster": {"gpu": "h100-sxm", "nodes": 1, "devices_per_node": 1, "intra": "nvlink4",
                       "inter": "ib-ndr400",
                       "compute": {key: 30}}}
    fit = parse_config(doc).cluster.device.fit
    assert getattr(fit, key.replace("_us", "_s")) == pytest.approx(30e-6)
    doc["cluster"]["compute"][key] = -1
    with pytest.raises(ConfigError, match=f"cluster.compute.{key}"):
        parse_config(doc)


def _priced_and_dispatched(config: str, layers: int, microbatches: int,
                           recompute: str, replay_us: float = 0.0,
                           dtype: str | None = None) -> tuple[int, int]:
    """(kernels the plan prices, kernels the executor's step dispatches) of ``config`` on one
    device (``dtype``: its model's, where given): with a second of host time a kernel and a
    device too fast to matter, the predicted step's seconds are its kernels (``replay_us`` =
    1e6: a replayed kernel counts twice)."""
    cfg = load_config(CONFIGS / config).with_overrides({
        **({"model.dtype": dtype} if dtype else {}),
        "model.layers": layers, "cluster.nodes": 1, "cluster.devices_per_node": 1,
        "pipeline.microbatches": microbatches, "solver.recompute": recompute,
        "cluster.compute": {"hbm_gbps": 1e9, "peak_tflops": 1e6, "kernel_floor_us": 0,
                            "dispatch_us": 1e6, "replay_us": replay_us}})
    plan = solve(cfg, baselines=False)
    priced = step_seconds(plan)
    assert priced == pytest.approx(round(priced), abs=1e-6)
    ex = Executor(plan, RunOptions(record=False), rank=0, world=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ex.setup()
        ex.train_step(0)
        dispatched = count_dispatched(lambda: ex.train_step(1))
    finally:
        dist.destroy_process_group()
    return round(priced), dispatched


@pytest.mark.parametrize(("config", "dtype"), [("tiny-gpt-cpu.yaml", None),
                                               ("tiny-gpt-bf16-cpu.yaml", None),
                                               ("tiny-gpt-bf16-cpu.yaml", "float16")])
@pytest.mark.parametrize(("microbatches", "recompute"), [(1, "never"), (2, "never"),
                                                         (2, "always")])
def test_a_block_prices_the_kernels_the_executor_dispatches(config: str, dtype: str | None,
                                                            microbatches: int,
                                                            recompute: str) -> None:
    """A block's kernels, priced vs dispatched (one block more, the difference): equal but
    for the two layernorms' backwards, each one aten op the model counts as the two CUDA
    kernels it launches (dx; dγ and dβ) — recomputed blocks too, whose forward runs twice;
    under float16 the loss scale's unscaling of each of its parameters' gradients too. The
    whole step's count — the embedding and its positions, the loss and the step loop's
    scaling of it, the tied exchange, the master passes — is equal too but for every
    layernorm's backward (the final one's as well) and the optimizer's two fused calls a
    step (Adam's update and its step counts), which the model prices as bytes shared by
    every op, without a launch."""
    (p2, d2), (p3, d3) = (_priced_and_dispatched(config, n, microbatches, recompute,
                                                 dtype=dtype) for n in (2, 3))
    assert (p3 - p2) - (d3 - d2) == 2 * microbatches, (p2, d2, p3, d3)
    assert d3 - d2 > 25 * microbatches  # a block issues dozens (casts under bf16: 24 more)
    layernorms = 2 * 3 + 1
    assert p3 - d3 == layernorms * microbatches - 2, (p3, d3)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_replay_is_priced_on_the_kernels_recomputation_dispatches_again(
        microbatches: int) -> None:
    """With a second of host time a replayed kernel beyond its dispatch, a recomputed step
    is priced the kernels recomputation replays more — exactly the kernels the executor's
    recomputed step dispatches beyond its plain twin's (counted at dispatch)."""
    _, plain = _priced_and_dispatched("tiny-gpt-cpu.yaml", 2, microbatches, "never")
    priced, again = _priced_and_dispatched("tiny-gpt-cpu.yaml", 2, microbatches, "always")
    booked, same = _priced_and_dispatched("tiny-gpt-cpu.yaml", 2, microbatches, "always", 1e6)
    assert same == again > plain
    assert booked - priced == again - plain


def test_the_host_time_decides_between_plans_when_kernels_are_small() -> None:
    """Four micro-batches issue about four times the kernels: with a host that takes 30 µs a
    kernel the tiny GPT's step on an H100 costs several times as much, where the device alone
    prices it at little more (the same FLOPs)."""
    base = {"model": {"kind": "gpt", "hidden": 64, "layers": 2, "heads": 4, "seq_len": 16,
                      "vocab": 128, "batch": 8, "dtype": "bfloat16"},
            "cluster": {"gpu": "h100-sxm", "nodes": 1, "devices_per_node": 1,
                        "intra": "nvlink4", "inter": "ib-ndr400"}}
    steps = {}
    for host in (0, 30):
        for m in (1, 4):
            doc = {**base, "pipeline": {"microbatches": m},
                   "cluster": {**base["cluster"], "compute": {"dispatch_us": host}}}
            steps[host, m] = step_seconds(solve(doc, baselines=False))
    assert steps[30, 4] > 3 * steps[30, 1]
    # its kernels are all but their 5 µs floors (the catalogue's): issuing each takes 6× that
    assert 5 < steps[30, 1] / steps[0, 1] <= 6 + 1e-9


def test_measure_dispatch_runs_as_calibrate_runs_it(tmp_path) -> None:
    """``python -m runtime.measure_dispatch`` on the plan ``calibrate --measure`` times: one
    ``dispatch`` row, its kernels those the same step issues counted here."""
    plan = dispatch_plan("float32")
    path = tmp_path / "plan.json"
    plan.save(path)
    out = tmp_path / "dispatch.csv"
    subprocess.run([sys.executable, "-m", "runtime.measure_dispatch", str(path), "--output",
                    str(out), "--repeats", "1"], check=True, capture_output=True, timeout=300)
    (row,) = read_kernel_csv(out)
    ex = Executor(plan, RunOptions(record=False), rank=0, world=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ex.setup()
        ex.train_step(0)
        assert row.kernel == "dispatch" and row.m == count_dispatched(lambda: ex.train_step(1))
    finally:
        dist.destroy_process_group()
    assert row.m > 50 and row.seconds > 0


def test_explain_names_the_host_where_it_binds() -> None:
    """``explain``'s roofline table: a tiny GPT's norms on an H100 are floor-bound; with a
    host taking 30 µs a kernel they are host-bound, at exactly their kernels × 30 µs."""
    doc = {"model": {"kind": "gpt", "hidden": 64, "layers": 2, "heads": 4, "seq_len": 16,
                     "vocab": 128, "batch": 8, "dtype": "bfloat16"},
           "cluster": {"gpu": "h100-sxm", "nodes": 1, "devices_per_node": 1,
                       "intra": "nvlink4", "inter": "ib-ndr400"}}
    plain = parse_config(doc)
    assert bound_seconds(solve(plain, baselines=False), plain)["layernorm"]["host"] == 0.0
    doc["cluster"]["compute"] = {"dispatch_us": 30}
    hosted = parse_config(doc)
    row = bound_seconds(solve(hosted, baselines=False), hosted)["layernorm"]
    norms = 2 * 2 + 1  # two per block and the final one; 1 + 2 kernels each
    assert row["host"] == pytest.approx(norms * 3 * 30e-6) and row["floor"] == 0.0
