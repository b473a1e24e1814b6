"""The roofline compute model against hand-computed cases, its place in strategies and the
step (optimizer update, recomputation, stage bounds), its config section, and the flat
model it leaves untouched on clusters of raw numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import ilp_planner
from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config, parse_config, section_mapping
from ilp_planner.inputs.importer import from_module
from ilp_planner.intra_op.problem import build_problem, gradient_merges, merge_seconds
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.device import ComputeFit, device_spec
from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.lowering.compute_model import (
    bound_by,
    least_seconds,
    master_weight_seconds,
    matmul_efficiency,
    op_seconds,
    op_times,
    op_work,
    state_shard_seconds,
    training_flops,
    update_bytes_per_param,
    update_seconds,
)
from ilp_planner.lowering.cost_model import MemorySpec, compute_time
from ilp_planner.lowering.strategies import (
    NORM_KINDS,
    grad_sync,
    is_summa,
    param_layouts,
    param_shapes,
)
from ilp_planner.reports.explain import explain
from ilp_planner.reports.roofline import bound_seconds
from ilp_planner.reports.summary import cluster_summary
from tests.helpers.shipped import CONFIGS

A100 = device_spec("a100-80gb")
FIT = A100.fit
PEAK = 312e12
HBM = 2039e9 * FIT.memory_efficiency  # achieved bytes/s
FLOOR = FIT.kernel_floor_s
LINK = Link(5e-6, 1e-11)


def _cluster(device=A100, nodes: int = 1, local: int = 8) -> Cluster:
    return Cluster(nodes, local, 80 * 2**30, PEAK, LINK, LINK, 0.5, "a100", device)


def _linear(m: int, k: int, n: int, dtype: str = "bfloat16") -> Op:
    return Op("fc", OpKind.LINEAR, ("x",), TensorSpec((m, n), dtype), TensorSpec((k, n), dtype),
              k * n, 2.0 * m * k * n)


def _eff(m: float, n: float, k: float) -> float:
    h = FIT.matmul_half_dim
    return FIT.matmul_efficiency * (m / (m + h)) * (n / (n + h)) * (k / (k + h))


def test_big_square_matmul_is_compute_bound_by_hand() -> None:
    """8192³ bf16 on an A100: forward 2·8192³ FLOPs at e_max·(8192/8320)³ of 312 TFLOP/s
    plus one floor; backward twice the FLOPs, two floors."""
    s = 8192
    op = _linear(s, s, s)
    fwd, bwd = op_work(op, 1.0, (s, s, s))
    flops = 2.0 * s**3
    assert (fwd.flops, bwd.flops) == (flops, 2 * flops)
    assert bound_by(fwd, A100, "bfloat16") == "compute"
    want_f = flops / (PEAK * _eff(s, s, s)) + FLOOR
    want_b = 2 * flops / (PEAK * _eff(s, s, s)) + 2 * FLOOR
    assert op_times(op, 1.0, _cluster(), (s, s, s)) == pytest.approx((want_f, want_b), rel=1e-12)
    # the curve passes through the published best shape's 85.9 % (device.py's citation)
    assert matmul_efficiency(A100, (6912, 16384, 2048)) == pytest.approx(267.9 / 312, rel=1e-12)


def test_layernorm_is_memory_bound_by_hand() -> None:
    """(8192, 4096) bf16: forward reads x, writes y (2 · 2 bytes · N), backward reads x and
    dy and writes dx (3 · 2 · N) with two kernels, at 90 % of 2,039 GB/s."""
    n = 8192 * 4096
    op = Op("ln", OpKind.LAYERNORM, ("x",), TensorSpec((8192, 4096), "bfloat16"), None,
            2 * 4096, 8.0 * n)
    fwd, bwd = op_work(op, 1.0)
    assert bound_by(fwd, A100, "bfloat16") == "memory" == bound_by(bwd, A100, "bfloat16")
    want = (4 * n / HBM + FLOOR, 6 * n / HBM + 2 * FLOOR)
    assert op_times(op, 1.0, _cluster()) == pytest.approx(want, rel=1e-12)


def test_kernel_floor_dominates_tiny_ops() -> None:
    """An 8 × 8 GELU moves 256 bytes: its time is its floors, within a part in a thousand."""
    op = Op("g", OpKind.GELU, ("x",), TensorSpec((8, 8), "bfloat16"), flops=64.0)
    fwd, bwd = op_work(op, 1.0)
    assert bound_by(fwd, A100, "bfloat16") == "floor"
    assert op_seconds(op, 1.0, _cluster()) == pytest.approx(2 * FLOOR, rel=1e-3)


def test_skinny_matmul_runs_at_a_fraction_of_the_square_one() -> None:
    """One dimension of 16 against d½ = 128 keeps 16/144 of that factor: a (16, 8192, 8192)
    matmul runs at ≈ 11 % of the square one's efficiency."""
    square, skinny = matmul_efficiency(A100, (8192,) * 3), matmul_efficiency(A100, (16, 8192, 8192))
    assert skinny / square == pytest.approx((16 / 144) / (8192 / 8320), rel=1e-12)
    assert skinny / square < 0.12


def test_split_32_ways_costs_more_than_a_32nd() -> None:
    """A 2,048-wide MLP matmul (8192 tokens, 2048 → 8192) split 32 ways over its columns
    (Megatron column-parallel) runs 256-wide local matmuls: each device takes well over
    1/32 of the unsplit time, the flat model exactly 1/32."""
    op = _linear(8192, 2048, 8192)
    whole = op_seconds(op, 1, _cluster(), (8192, 8192, 2048))
    split = op_seconds(op, 32, _cluster(), (8192, 8192 / 32, 2048))
    assert split > 1.3 * whole / 32
    flat = _cluster(device=None)
    assert op_seconds(op, 32, flat) == pytest.approx(op_seconds(op, 1, flat) / 32, rel=1e-12)


def test_attention_is_priced_as_a_flash_kernel() -> None:
    """Forward: its FLOPs at the curve of (seq, seq, head_dim), of which a causal kernel
    runs the diagonal tiles and below ((1 + 128/s)/2), bytes of Q, K, V, O; backward:
    2.5 × those FLOPs (S recomputed), 8 tensors' bytes."""
    t, h, heads, seq = 8 * 2048, 4096, 32, 2048
    op = Op("a", OpKind.ATTENTION, ("qkv",), TensorSpec((t, h), "bfloat16"),
            flops=4.0 * t * seq * h, attrs={"heads": heads, "seq_len": seq})
    fwd, bwd = op_work(op, 4.0)
    assert fwd.gemm == bwd.gemm == (seq, seq, h / heads)
    causal = (1 + 128 / seq) / 2
    assert (fwd.flops, bwd.flops) == (op.flops / 4 * causal, 2.5 * op.flops / 4 * causal)
    assert (fwd.bytes, bwd.bytes) == (4 * t * h * 2 / 4, 8 * t * h * 2 / 4)
    assert bound_by(fwd, A100, "bfloat16") == "compute"


def test_memory_bound_kinds_backward_bytes() -> None:
    """The table in compute_model's docstring, per kind, in local output bytes N."""
    shape = TensorSpec((1024, 1024), "bfloat16")
    n = 1024 * 1024 * 2
    cases = {OpKind.SOFTMAX: (2, 3), OpKind.GELU: (2, 3), OpKind.SILU: (2, 3),
             OpKind.RMSNORM: (2, 3), OpKind.ADD: (3, 0), OpKind.MUL: (3, 5),
             OpKind.DROPOUT: (2.5, 2.5)}  # + 1 mask byte per 2-byte element
    for kind, (f, b) in cases.items():
        fwd, bwd = op_work(Op("o", kind, ("x",), shape, flops=1.0), 1.0)
        assert (fwd.bytes, bwd.bytes) == (f * n, b * n), kind


def test_a_fused_outputs_part_is_a_view_whose_gradient_is_catted_by_hand() -> None:
    """Phi-3's ``gate, up = gate_up_proj(x).chunk(2, -1)``: each part is a view (no forward
    work); autograd's split backward writes both gradients into the fused one in one
    ``cat`` — each part's gradient read and written (2N bytes), the kernel's floor once,
    on part 0. Split 4 ways, a device moves a quarter."""
    n = 2048 * 4096 * 2
    parts = [Op(f"p{i}", OpKind.PART, ("fc",), TensorSpec((2048, 4096), "bfloat16"),
                attrs={"part": i, "parts": 2}) for i in (0, 1)]
    for op in parts:
        fwd, bwd = op_work(op, 1.0)
        assert (fwd.bytes, fwd.kernels) == (0.0, 0)
        assert (bwd.bytes, bwd.kernels) == (2 * n, 1 if op.attrs["part"] == 0 else 0)
    times = [op_times(op, 4.0, _cluster()) for op in parts]
    assert times[0] == pytest.approx((0.0, 2 * n / 4 / HBM + FLOOR), rel=1e-12)
    assert times[1] == pytest.approx((0.0, 2 * n / 4 / HBM), rel=1e-12)


def test_a_fused_output_read_in_part_pays_the_zeros_of_the_other_part() -> None:
    """``_, up = fc(x).chunk(2, -1)``: the import marks the one part read to carry the
    backward's cat (``attrs.cat``) and the block no code reads (``attrs.unread_parts``):
    autograd writes that block's gradient as zeros (N), which the cat reads (N) and writes
    (N) beside the part's own 2N — 5N bytes and two kernels (zeros, cat)."""
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 256, bias=False)
            self.out = nn.Linear(128, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _, up = self.fc(x).chunk(2, dim=-1)
            return self.out(up)

    g = from_module(Half(), (torch.zeros(8, 16, 64),))
    parts = [op for op in g.ops if op.kind is OpKind.PART]
    assert [(op.attrs["part"], op.attrs["cat"], op.attrs["unread_parts"]) for op in parts] == [
        (1, 1, 1)]
    n = 8 * 16 * 128 * 4
    fwd, bwd = op_work(parts[0], 1.0)
    assert (fwd.bytes, bwd.bytes, bwd.kernels) == (0.0, 5 * n, 2)


def test_optimizer_update_bytes_and_price() -> None:
    """Adam mixed moves 28 bytes per parameter (read grad 4 + state 12, write state 12: the
    half-precision copy is the next step's cast), fp32 Adam 28, SGD 12; no update is priced
    on a flat cluster."""
    assert update_bytes_per_param(MemorySpec.preset("adam_mixed"), mixed=True) == 28
    assert update_bytes_per_param(MemorySpec.preset("adam"), mixed=False) == 28
    assert update_bytes_per_param(MemorySpec.preset("sgd"), mixed=False) == 12
    op = _linear(1024, 4096, 4096)
    mem = MemorySpec.preset("adam_mixed")
    assert update_seconds(1e6, mem, op, _cluster()) == pytest.approx(28e6 / HBM, rel=1e-12)
    assert update_seconds(1e6, mem, op, _cluster(device=None)) == 0.0


def _gpt(device) -> dict:
    cluster = {"nodes": 1, "devices_per_node": 4, "memory_gib": 80, "peak_tflops": 312,
               "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 2400},
                         "inter": {"latency_us": 10, "bandwidth_gbps": 100}}}
    if device:
        cluster["compute"] = {"hbm_gbps": 2039}
    return {"model": {"kind": "gpt", "hidden": 256, "layers": 2, "heads": 4, "seq_len": 128,
                      "vocab": 512, "batch": 8, "dtype": "bfloat16"},
            "cluster": cluster, "solver": {"tie_layers": True}}


def test_every_strategy_pays_the_update_once_per_step_and_respects_the_stage_bound() -> None:
    """Under the roofline every option's step cost holds its optimizer update once (spread
    1/m over the micro-batches' compute) and, with its weights held whole, the runtime's
    passes over its masters (:func:`master_weight_seconds`) once — sharded, its buckets'
    (:func:`state_shard_seconds`, level 1: no ZeRO-3 reads); plus, per micro-batch,
    the gradient additions of the tensors it reads after another op (:func:`merge_seconds`);
    ZeRO sharding shrinks the update, and every op's compute × devices is at least
    ``least_seconds`` (the exact stage bound's premise)."""
    cfg = parse_config(_gpt(device=True))
    for m in (1, 4):
        gp = build_problem(cfg.graph, cfg.cluster, 1, 4, cfg.memory, microbatches=m,
                           zero_levels=(0, 1))
        for node, opts in gp.options.items():
            op = cfg.graph[node]
            for o in opts:
                upd = update_seconds(o.base.update_params, cfg.memory, op, cfg.cluster)
                buckets = grad_sync(op, o.base.label, o.base.inputs, o.base.weight,
                                    o.base.output, gp.ctx)
                if o.base.zero:
                    upd += state_shard_seconds(
                        op, [(len(b.roles), b.numel, b.collective.group_size, True)
                             for b in buckets], o.base.zero, m, cfg.cluster)
                # role by role: in a bucket (no state sharding) every micro-batch's gradient
                # is added into the flat buffer, outside one the first comes as it is;
                # SUMMA's weight block has no compute copy (its casts are in its compute)
                bucketed = {r for b in buckets for r in b.roles}
                lays = param_layouts(op, o.base.label, o.base.inputs, o.base.weight,
                                     o.base.output)
                for synced in (False, True):
                    roles = [r for r in lays if (r in bucketed) == synced
                             and not (synced and o.base.zero)]
                    local = {r: math.prod(lays[r][0].padded_shape(param_shapes(op)[r]))
                             for r in roles}
                    block = local.get("weight", 0) if is_summa(o.base.label) else 0
                    upd += master_weight_seconds(op, sum(local.values()), len(roles),
                                                 cfg.memory, m, synced, cfg.cluster, block)
                merge = merge_seconds(cfg.graph, node, gradient_merges(cfg.graph, node), o.base.inputs,
                                      cfg.cluster)
                assert o.compute_s[0] == pytest.approx(o.base.compute_s + upd / m + merge,
                                                       rel=1e-12)
                assert o.base.compute_s * 4 >= least_seconds(op, cfg.cluster) * (1 - 1e-12)
                if op.params and o.base.zero:
                    assert o.base.update_params < op.params
                elif op.params:
                    assert o.base.update_params >= op.params / 4


def test_an_moe_op_pays_its_update_over_its_experts_local_parameters() -> None:
    """An MoE op's experts and router are parameters like any op's: every option's update
    runs over its local ones (the state its memory holds), and its step's compute holds
    that update, the master passes and the gradient additions, spread over the
    micro-batches (the tiny MoE on a device, bfloat16)."""
    cfg = load_config(CONFIGS / "tiny-moe-cpu.yaml").with_overrides(
        {"cluster.compute": {"hbm_gbps": 2039}, "model.dtype": "bfloat16",
         "pipeline.microbatches": 2})
    gp = build_problem(cfg.graph, cfg.cluster, 1, 4, cfg.memory, microbatches=2)
    moe = [n for n in gp.options if cfg.graph[n].kind is OpKind.MOE]
    assert moe
    for node in moe:
        op = cfg.graph[node]
        for o in gp.options[node]:
            assert o.base.update_params > 0
            assert o.base.update_params * cfg.memory.bytes_per_param == \
                pytest.approx(o.base.state_bytes, rel=1e-12)
            update = update_seconds(o.base.update_params, cfg.memory, op, cfg.cluster)
            assert o.compute_s[0] >= o.base.compute_s + update / 2 > o.base.compute_s


def test_recomputation_runs_the_forward_again_at_its_roofline_price() -> None:
    cfg = parse_config(_gpt(device=True))
    blocks = frozenset(cfg.graph.blocks())
    plain = build_problem(cfg.graph, cfg.cluster, 1, 4, cfg.memory)
    again = build_problem(cfg.graph, cfg.cluster, 1, 4, cfg.memory, recompute=blocks)
    checked = 0
    for node in again.recomputed:
        for p, r in zip(plain.options[node], again.options[node], strict=True):
            assert r.compute_s == pytest.approx([c + f for c, f in zip(p.compute_s, p.replay_s,
                                                                         strict=True)])
            assert all(0 < f <= c for f, c in zip(p.replay_s, p.compute_s, strict=True) if c)
            checked += 1
    assert checked


def test_flat_cluster_prices_every_strategy_exactly_as_before() -> None:
    """A shipped config of raw numbers (no compute section): every option of every op costs
    bit for bit ``compute_time(3 × FLOPs / split)``, with no optimizer update, and the
    solved plan's compute is those prices."""
    cfg = load_config("configs/tiny-gpt-cpu.yaml")
    assert cfg.cluster.device is None
    gp = build_problem(cfg.graph, cfg.cluster, 2, 4, cfg.memory)
    for node, opts in gp.options.items():
        for o in opts:
            for pos, member in enumerate(gp.members[node]):
                op = cfg.graph[member]
                if pos == 0 and op.kind in (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.MATMUL):
                    split = math.prod(a.size for a in o.base.fact)
                else:
                    lay = o.outputs[pos] if pos == 0 else o.inputs[pos][0]
                    tensor = op.output if pos == 0 else cfg.graph[op.inputs[0]].output
                    split = math.prod(lay.split_degree(d) for d in range(tensor.rank))
                want = 0.0 if op.kind is OpKind.FLATTEN else \
                    compute_time(3.0 * op.flops / split, cfg.cluster)
                assert o.compute_s[pos] == want, (member, o.base.label)
                assert o.replay_s[pos] == want / 3
    plan = ilp_planner.solve(cfg)
    assert plan.cost.compute_s == pytest.approx(sum(ly.compute_s for ly in plan.layers))


def test_compute_section_builds_or_overrides_a_device() -> None:
    cfg = parse_config(_gpt(device=True))
    dev = cfg.cluster.device
    assert dev is not None and dev.hbm_bytes_per_s == 2039e9
    assert dict(dev.peak_flops) == {k: 312e12 for k in ("float32", "float16", "bfloat16")}
    assert dev.fit == ComputeFit()
    assert "compute   roofline (1x4): matmul e_max 0.8, d½ 128" in "\n".join(
        cluster_summary(cfg.cluster))
    # a catalogue device keeps its figures but for the keys given
    over = dataclasses.replace(cfg.cluster, device=A100)
    doc = _gpt(device=False)
    doc["cluster"] = section_mapping(over)
    # the catalogue device is written by name, its own figures standing
    assert doc["cluster"]["gpu"] == A100.name and "compute" not in doc["cluster"]
    assert parse_config(doc).cluster.device == A100
    doc["cluster"]["compute"] = {"kernel_floor_us": 2.0}
    back = parse_config(doc).cluster.device
    assert back.fit == dataclasses.replace(FIT, kernel_floor_s=2e-6)
    assert back.hbm_bytes_per_s == A100.hbm_bytes_per_s


@pytest.mark.parametrize(("compute", "match"), [
    ({"matmul_efficiency": 0.8}, "cluster.compute.hbm_gbps: missing required key"),
    ({"hbm_gbps": 2039, "matmul_efficiency": 1.5}, "cluster.compute.matmul_efficiency"),
    ({"hbm_gbps": 2039, "kernel_floor": 5}, "kernel_floor"),
])
def test_compute_section_errors_name_the_key(compute: dict, match: str) -> None:
    doc = _gpt(device=False)
    doc["cluster"]["compute"] = compute
    with pytest.raises(ConfigError, match=match):
        parse_config(doc)


def test_roofline_plan_solves_and_prices_norms_by_bytes() -> None:
    """A GPT on a roofline cluster solves; its norms cost their bytes, not FLOPs."""
    plan = ilp_planner.solve(parse_config(_gpt(device=True)))
    norms = [ly for ly in plan.layers if ly.kind in {k.value for k in NORM_KINDS}]
    assert norms and plan.cost.compute_s > 0
    assert all(ly.compute_s >= 3 * FLOOR for ly in norms)  # 1 + 2 kernels at least


def test_explain_names_what_bounds_each_kind() -> None:
    """A mid-size GPT on a roofline cluster: its linears are compute-bound, its norms and
    activations memory-bound, and explain prints the table; a flat plan has none."""
    doc = _gpt(device=True)
    doc["model"].update(hidden=2048, heads=16, seq_len=1024, batch=8)
    cfg = parse_config(doc)
    plan = ilp_planner.solve(cfg)
    table = bound_seconds(plan, cfg)
    mostly = {kind: max(row, key=row.get) for kind, row in table.items()}
    assert mostly["linear"] == "compute" and mostly["attention"] == "compute"
    assert mostly["layernorm"] == mostly["gelu"] == mostly["add"] == "memory"
    assert "roofline on 1x4" in explain(plan, collectives=False)
    flat = ilp_planner.solve(parse_config(_gpt(device=False)))
    assert "roofline on" not in explain(flat, collectives=False)


def test_unfused_attention_pays_for_its_scores_by_hand() -> None:
    """Megatron 2021's attention (dropping its probabilities at 0.1): the matmuls'
    roofline, plus the softmax and dropout streaming the s × s scores (E elements) after
    them; backward 2 × the FLOPs."""
    t, h, heads, seq = 4 * 2048, 2304, 24, 2048
    op = Op("a", OpKind.ATTENTION, ("qkv",), TensorSpec((t, h), "bfloat16"),
            flops=4.0 * t * seq * h, attrs={"heads": heads, "seq_len": seq,
                                            "probs_dropout": 1})
    e = t * heads * seq  # score elements
    n = t * h
    fwd, bwd = op_work(op, 1.0, flash=False)
    assert (fwd.bytes, fwd.stream_bytes) == ((4 * n + 2 * e) * 2, 4 * e * 2 + e)
    assert (bwd.flops, bwd.bytes, bwd.stream_bytes) == (2 * op.flops, (8 * n + 4 * e) * 2,
                                                        5 * e * 2 + e)
    unfused = dataclasses.replace(A100, fit=dataclasses.replace(FIT, attention="unfused"))
    mm = op.flops / (PEAK * _eff(seq, seq, h / heads))
    want = max(mm, (4 * n + 2 * e) * 2 / HBM) + (4 * e * 2 + e) / HBM + 4 * FLOOR
    assert op_times(op, 1.0, _cluster(unfused))[0] == pytest.approx(want, rel=1e-12)
    assert bound_by(fwd, unfused, "bfloat16") == "memory"  # its scores outweigh its matmuls
    assert op_seconds(op, 1.0, _cluster(unfused)) > 1.3 * op_seconds(op, 1.0, _cluster())
    for cluster in (_cluster(unfused), _cluster()):
        assert op_seconds(op, 1.0, cluster) >= least_seconds(op, cluster)


def test_rotary_positions_are_priced_by_hand() -> None:
    """A Llama block's attention turns q and k by rotary positions before its kernel:
    R = N·(1 + kv/heads) elements on the device, 3 FLOPs each, one kernel per tensor
    reading x and the (s, d) cos and sin rows and writing y — (2R + 4sd)·2 bytes in bf16,
    two floors, forward and backward, flash or unfused alike. The same attention without
    ``rope_theta`` costs exactly that less; it is memory-bound (its FLOPs hide under its
    bytes); recomputation pays it again with the forward; the built-in Llama carries it."""
    t, h, heads, kv, seq, split = 4 * 2048, 4096, 32, 8, 2048, 4
    rope = Op("a", OpKind.ATTENTION, ("qkv",), TensorSpec((t, h), "bfloat16"),
              flops=4.0 * t * seq * h,
              attrs={"heads": heads, "seq_len": seq, "kv_heads": kv, "rope_theta": 10_000})
    bare = dataclasses.replace(rope, attrs={k: v for k, v in rope.attrs.items()
                                            if k != "rope_theta"})
    d = h / heads
    r = t * h / split * (1 + kv / heads)
    rope_bytes, rope_flops = (2 * r + 4 * seq * d) * 2, 3 * r
    assert rope_flops / (PEAK * FIT.matmul_efficiency) < rope_bytes / HBM
    unfused = dataclasses.replace(A100, fit=dataclasses.replace(FIT, attention="unfused"))
    for cluster in (_cluster(), _cluster(unfused)):
        with_rope, without = op_times(rope, split, cluster), op_times(bare, split, cluster)
        for phase in (0, 1):
            assert with_rope[phase] - without[phase] == pytest.approx(
                rope_bytes / HBM + 2 * FLOOR, rel=1e-9)
    fwd, bwd = op_work(rope, split)
    assert (fwd.stream_flops, fwd.stream_bytes, bwd.stream_flops, bwd.stream_bytes) == \
        pytest.approx((rope_flops, rope_bytes, rope_flops, rope_bytes))
    assert training_flops(rope) - training_flops(bare) == pytest.approx(6 * r * split)
    graph = models.moe(hidden=64, layers=1, heads=4, seq_len=16, vocab=32, batch=2,
                       experts=2, top_k=1, expert_ffn=32, block="llama", kv_heads=2)
    attn = next(op for op in graph.ops if op.kind is OpKind.ATTENTION)
    assert attn.attrs["rope_theta"] and attn.attrs["kv_heads"] == 2
    fwd, _ = op_work(attn, 1.0)
    r = 2 * 16 * 64 * (1 + 2 / 4)
    assert (fwd.stream_flops, fwd.stream_bytes) == (3 * r, (2 * r + 4 * 16 * 16) * 4)


def test_rotary_positions_are_recomputed_and_named_by_explain() -> None:
    """A built-in Llama block's recomputation runs its attention's forward again, rotary
    included (the forward share holds it), and ``explain`` says where rotary is priced —
    and that the flat model (no device) does not price it."""
    llama = {"kind": "moe", "block": "llama", "hidden": 64, "layers": 2, "heads": 4,
             "kv_heads": 2, "seq_len": 32, "vocab": 128, "batch": 4, "experts": 2,
             "top_k": 1, "expert_ffn": 64, "dtype": "bfloat16"}
    cfg = parse_config({**_gpt(device=True), "model": llama})
    attn = next(op for op in cfg.graph.ops if op.kind is OpKind.ATTENTION)
    bare = dataclasses.replace(attn, attrs={k: v for k, v in attn.attrs.items()
                                            if k != "rope_theta"})
    rope_fwd = op_times(attn, 1.0, cfg.cluster)[0] - op_times(bare, 1.0, cfg.cluster)[0]
    assert rope_fwd > 0
    again = build_problem(cfg.graph, cfg.cluster, 1, 1, cfg.memory,
                          recompute=frozenset(cfg.graph.blocks()))
    plain = build_problem(cfg.graph, cfg.cluster, 1, 1, cfg.memory)
    assert attn.name in again.recomputed
    for p, r in zip(plain.options[attn.name], again.options[attn.name], strict=True):
        assert r.compute_s[0] - p.compute_s[0] == pytest.approx(p.replay_s[0])
        assert p.replay_s[0] >= rope_fwd
    text = explain(ilp_planner.solve(cfg, baselines=False), collectives=False)
    assert "rotary positions priced in 2 attention op(s)" in text and "NOT priced" not in text
    flat = explain(ilp_planner.solve({**_gpt(device=False), "model": llama}, baselines=False),
                   collectives=False)
    assert "rotary positions priced in 2 attention op(s)" in flat and "NOT priced" in flat


def test_imported_hand_written_attention_is_priced_unfused_on_a_flash_device() -> None:
    """A user's hand-written attention (``attrs.unfused``, set by the importer) runs as
    written under ``parallelize``: its scores go through memory even where the device's
    attention is fused flash, so it is priced as the unfused sequence there."""
    t, h, heads, seq = 4 * 2048, 2304, 24, 2048
    fused = Op("a", OpKind.ATTENTION, ("qkv",), TensorSpec((t, h), "bfloat16"),
               flops=4.0 * t * seq * h, attrs={"heads": heads, "seq_len": seq,
                                               "probs_dropout": 1})
    written = dataclasses.replace(fused, attrs={**fused.attrs, "unfused": 1})
    unfused = dataclasses.replace(A100, fit=dataclasses.replace(FIT, attention="unfused"))
    assert FIT.attention == "flash"
    assert op_times(written, 2.0, _cluster()) == op_times(fused, 2.0, _cluster(unfused))
    assert op_times(written, 2.0, _cluster()) != op_times(fused, 2.0, _cluster())


def test_imported_attention_dropping_nothing_is_priced_without_a_dropout() -> None:
    """The unfused sequence's dropout (read P, write P' and its mask; backward read dP',
    the mask, write dP) is priced for an imported hand-written attention only where its
    code drops probabilities (``attrs.probs_dropout``): without it, 2E bytes and E mask
    bytes less and one kernel fewer each phase (E = the local scores)."""
    t, h, heads, seq = 4 * 2048, 2304, 24, 2048
    base = {"heads": heads, "seq_len": seq, "unfused": 1}
    plain = Op("a", OpKind.ATTENTION, ("qkv",), TensorSpec((t, h), "bfloat16"),
               flops=4.0 * t * seq * h, attrs=base)
    dropping = dataclasses.replace(plain, attrs={**base, "probs_dropout": 1})
    e = t * heads * seq / 2  # scores on each of 2 devices
    for with_, without in zip(op_work(dropping, 2.0), op_work(plain, 2.0), strict=True):
        assert with_.stream_bytes - without.stream_bytes == 2 * e * 2 + e
        assert (with_.kernels - without.kernels, with_.bytes, with_.flops) == \
            (1, without.bytes, without.flops)
    assert op_seconds(plain, 2.0, _cluster()) < op_seconds(dropping, 2.0, _cluster())
