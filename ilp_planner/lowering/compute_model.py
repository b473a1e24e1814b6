"""Compute time by roofline: what one op costs on one device, forward and backward.

Each phase (forward, backward) of an op on its local shard is priced as::

    t = max(FLOPs / (peak · eff(m, n, k)),  bytes / (HBM bandwidth · memory efficiency))
        + kernels · kernel floor

or, where longer, ``kernels · dispatch`` — the host's time issuing the phase's kernels
(eager PyTorch: Python, the dispatcher and autograd per kernel; the device runs behind the
host and waits where its kernels are shorter). Taken per op and phase, this prices an
eager step as the sum of each op's longer side; the host's lead over a long matmul that
later short kernels use up is not credited (an upper bound where both sides alternate).
A forward that activation recomputation replays costs the host ``kernels · (dispatch +
replay)`` (``ComputeFit.replay_s``: ``torch.utils.checkpoint``'s bookkeeping a replayed
kernel; :func:`op_times_replayed`).

with the device's fitted parameters (:class:`~ilp_planner.ir.device.ComputeFit`). The
matmul efficiency falls for small and skinny local shapes::

    eff(m, n, k) = e_max · Π_{d ∈ (m, n, k)} d / (d + d½)

— three factors of one shape each, one parameter d½ for all: a tensor-core kernel tiles each
dimension, a dimension much smaller than a tile leaves most of it idle, and one much larger
runs at the asymptote. It is the simplest curve with that behaviour, symmetric (a matmul's
two backward products have the same three sizes, permuted), and two parameters a handful of
timings fit (``calibrate --measure``). Ops that are no matmul run their FLOPs at e_max (no
shape factor): their bytes bind long before.

What each kind moves, per phase, in elements of its local output N (its dtype's size),
with the reason for the backward:

========================  =====================  ==========================================
kind                      forward                backward
========================  =====================  ==========================================
linear, matmul            F; X, W, Y (a bias in  2F (dX = dY·Wᵀ, dW = Xᵀ·dY); 2 × (X, W, Y);
                          the matmul's epilogue) a bias: dY's rows summed, a kernel of its
                                                 own reading dY (a streaming term)
conv2d (implicit GEMM)    F; X, W, Y             2F; 2 × (X, W, Y)
embedding                 lookup: 2N (+N/table)  scatter-add of dY into the table rows: 3N
attention (fused flash)   F; Q, K, V, O = 4N     2.5F (S = QKᵀ recomputed: 5 matmuls for 2);
  (causal: F and 2.5F                            reads Q, K, V, O, dO, writes dQ, dK, dV: 8N
  × :func:`causal_fraction`)
attention (unfused)       F; 4N + 2E, then       2F; 8N + 4E, then 5E (E = s × s scores,
                          4E (softmax, dropout)  ``ComputeFit.attention``: Megatron 2021;
                                                 always for ``attrs.unfused``: an imported
                                                 hand-written attention runs as written,
                                                 an imported SDPA dropping its
                                                 probabilities takes the math kernel),
                                                 the dropout only where probabilities are
                                                 dropped (``attrs.probs_dropout``), else
                                                 2E and 3E; its mask drawn whole as a
                                                 dropout's (``attrs.whole_mask``)
+ its rotary (built-in)   3R FLOPs; 2R + 4sd     the same (dx = dy·cos + rot(dy·sin): one
                          elements, 2 kernels    pass over dy, dx and the tables)
+ folded steps, any op    torch's bytes, 1 FLOP  what autograd runs for them, counted on
  (imported: rotary, a    per element (none for  the export's fake tensors: its kernels,
  hand-written GELU or    a copy), 1 kernel      their bytes, 1 FLOP per element an
  norm, scores' scale     each                   arithmetic kernel writes (tanh's reads its
  and mask, casts,                               output, pow's is 3 kernels, a value read
  contiguous, cat, GQA's                         twice sums 2 gradients, a slice's gradient
  repeated heads)                                is written into a zero-filled tensor)
layernorm, rmsnorm        2N (read x, write y)   3N (read x, dy, write dx), 2 kernels (dx, dγ)
  (per head too: Qwen3's  on the local block,    the same; a head split divides N as a
  q / k norms)            split rows or heads    row split does
softmax                   2N                     3N (read y, dy, write dx)
gelu, silu, relu          2N                     3N (read x, dy, write dx)
dropout                   2N + N mask bytes      2N + N mask bytes (read dy, mask, write dx)
  (``attrs.identity``:    none                   none
  p = 0, imported)
  (``attrs.whole_mask``:  + the whole mask drawn the same
  imported, split)        and the block copied:
                          (d + 2)·N mask bytes,
                          2 kernels more
add                       3N                     none: the gradient passes to both inputs
mul                       3N                     5N (read dy, a, b, write da, db), 2 kernels
batchnorm                 3N (stats, normalise)  4N (reductions, then dx), 2 kernels
pool (max, stride k)      N·k² + N               N + N·k²
loss (cross-entropy)      float32 passes over    softmax scaled in place, cast back:
                          the logits: 28 B + it  12 B + it (:func:`_loss_work`: what the
                          a logit (+ the copy)   runtime's code moves, not a fused 2L)
opaque                    torch's FLOPs, bytes   imported: as autograd runs it, replayed at
                                                 import on fake tensors (``attrs.bwd``
                                                 kernels, ``bwd_bytes``, ``bwd_flops``:
                                                 FlopCounterMode's); a written graph's:
                                                 2 × both (no better knowledge)
flatten                   nothing (a view)       nothing
part (a fused output's    nothing (a view)       2N: its gradient read and written into the
  column block, chunk)                           fused one; one ``cat`` kernel for all the
                                                 parts, and a zero-filled gradient (N
                                                 written, read by the cat: 3N, a kernel)
                                                 for each part no code reads, counted on
                                                 the lowest part read (``attrs.cat``,
                                                 ``unread_parts``, marked at import; part 0
                                                 where unmarked)
========================  =====================  ==========================================

A frozen op (:attr:`~ilp_planner.ir.graph.Op.frozen`: its parameters ``requires_grad=False``)
computes no weight gradient: a linear's or convolution's backward is dX alone (F; X, W, Y,
one kernel), an embedding's none, its master weights no pass and no update; other kinds
keep their backward (a frozen norm still returns dx). The flat model counts 2 × FLOPs for it.
An op whose output takes no gradient (:attr:`~ilp_planner.ir.graph.Op.no_grad`, marked at
import: a frozen base, an image padded in code, a mask computed from the ids) runs no
backward at all: its forward alone (the flat model's F).

Rotary positions turn q and k before the attention kernel, in kernels of their own
(:func:`_rotary`, streaming beside the attention's roofline, as an unfused attention's
softmax is): R = the elements rotated on the device, ``N·(1 + kv_heads/heads)`` (q and k),
3 FLOPs each (``x·cos + rot(x)·sin``: two products and a sum; rotate-half's negation is a
sign), one fused kernel per tensor reading x and the ``(s, d)`` cos and sin rows and
writing y: ``(2R + 2·2·s·d) × itemsize`` bytes (d = the head dim); recomputation runs it
again with the forward. That is the fused kernel engines run (Megatron-Core's, Transformer
Engine's); the runtime's own executor turns q and k by five torch ops each
(:func:`runtime.model.rotary`), about five times these bytes, which this price does not
follow. An imported model's rotary is the element-wise steps its code
applies to q, k and v between their projections and the attention, folded into the
attention (``attrs.input_steps`` kernels, ``input_steps_bytes``, ``input_steps_flops``:
torch's bytes of each step's tensors, :mod:`ilp_planner.inputs.lift_layers`), priced alike.
The steps an import folds into any other op's inputs — a hand-written GELU before a
projection, a written-out RMSNorm's pow, mean and rsqrt before its gain (the norm's own
price is the fused kernel's, which the gain's product runs), a cast before a norm, an eager
attention's output made contiguous before its projection, a ``cat`` — are that op's
``input_steps`` too, priced on its local input (:func:`folded_work`; ``_bwd`` figures for
the backward, :func:`ilp_planner.inputs.lift_backward.replay_backward`); a hand-written
attention run as written (``attrs.unfused``) adds its scores' scale and mask.

The runtime's own passes over the master weights (:func:`master_weight_seconds`: under
mixed precision the compute copy cast once a step and each micro-batch's gradient cast back;
gradients accumulated in place across micro-batches; SUMMA's weight block instead cast at
its gathered size every micro-batch, in its strategy's compute) and, under float16, the loss
scale's unscaling of every gradient the optimizer reads (:func:`unscale_seconds`) are priced
once a step, beside the update. The optimizer's update (:func:`update_seconds`) is
memory-bound: per parameter of the local optimizer shard it reads the gradient and the
optimizer state and writes the state (Adam under mixed precision: 4 + 12 read, 12 written
= 28 bytes; the compute copy is the cast's). A cluster without a device (raw numbers, no
``cluster.compute``) keeps the flat model ``3 × FLOPs / (peak × efficiency)`` exactly
(:func:`op_seconds`), with no update.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ilp_planner.ir.cluster import Cluster
from ilp_planner.ir.device import DeviceSpec
from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.lowering.cost_model import MemorySpec, compute_time

GemmShape = tuple[float, float, float]
"""A matmul's local sizes (m, n, k): ``(m, k) × (k, n)`` on one device."""

MASK_BYTES = 1  # dropout keeps a boolean mask per element
LOSS_ITEMSIZE = 4  # the loss statistics are float32, whatever the logits' dtype
FLASH_BACKWARD_FLOPS = 2.5  # recomputes S = QKᵀ: five matmuls against the forward's two
# FlashAttention's block of query rows and of keys (FlashAttention-2 and cuDNN's fused
# attention run 128 × 128 tiles on Ampere and Hopper): a causal kernel skips the tiles
# above the diagonal and computes the diagonal ones whole
FLASH_TILE = 128


@dataclass(frozen=True)
class PhaseWork:
    """One phase of one op on one device: FLOPs, bytes to and from memory, kernel
    launches, and the local matmul shape its FLOPs run at (None: the asymptote).
    ``stream_bytes`` are moved by separate memory-bound kernels of the same phase (an
    unfused attention's softmax and dropout, rotary before attention): they run apart from
    the matmuls, not under them, so their time — the larger of ``stream_flops`` at e_max and
    their bytes — adds to the roofline's maximum."""

    flops: float
    bytes: float
    kernels: int
    gemm: GemmShape | None = None
    stream_bytes: float = 0.0
    stream_flops: float = 0.0  # of those kernels (rotary): at e_max, under their bytes


NO_WORK = PhaseWork(0.0, 0.0, 0)


def size_factor(gemm: GemmShape, half_dim: float) -> float:
    """``Π d / (d + d½)`` over the three sizes: 1 for huge matmuls, → 0 for tiny ones."""
    return math.prod(d / (d + half_dim) for d in gemm)


def matmul_efficiency(device: DeviceSpec, gemm: GemmShape | None) -> float:
    """Achieved / peak FLOP/s of a matmul of local sizes ``gemm`` on ``device``."""
    e = device.fit.matmul_efficiency
    return e if gemm is None else e * size_factor(gemm, device.fit.matmul_half_dim)


def phase_terms(work: PhaseWork, device: DeviceSpec, dtype: str
                ) -> tuple[float, float, float, float]:
    """Seconds of one phase's FLOPs, of its bytes, of its separate streaming kernels'
    bytes and of its kernel floors."""
    flops_s = work.flops / (device.peak(dtype) * matmul_efficiency(device, work.gemm)) \
        if work.flops else 0.0
    rate = device.hbm_bytes_per_s * device.fit.memory_efficiency
    stream_s = max(work.stream_flops / (device.peak(dtype) * device.fit.matmul_efficiency),
                   work.stream_bytes / rate)
    return (flops_s, work.bytes / rate, stream_s, work.kernels * device.fit.kernel_floor_s)


def phase_seconds(work: PhaseWork, device: DeviceSpec, dtype: str,
                  replayed: bool = False) -> float:
    """The roofline of one phase: the larger of its FLOPs and bytes times, plus its
    separate streaming kernels and its floors — or, where longer, the host's time issuing
    its kernels (``kernels × dispatch_s``: the device waits for the host; ``replayed``: the
    phase is a forward a recomputation runs again, each kernel also ``replay_s``)."""
    flops_s, bytes_s, stream_s, floor_s = phase_terms(work, device, dtype)
    host = device.fit.dispatch_s + (device.fit.replay_s if replayed else 0.0)
    return max(max(flops_s, bytes_s) + stream_s + floor_s, work.kernels * host)


def bound_by(work: PhaseWork, device: DeviceSpec, dtype: str) -> str:
    """Which term takes most of a phase: ``compute`` (FLOPs above bytes), ``memory``
    (bytes above FLOPs, with any streaming kernels), ``floor`` (the kernel floors) or
    ``host`` (issuing its kernels takes longer than the device runs them)."""
    flops_s, bytes_s, stream_s, floor_s = phase_terms(work, device, dtype)
    if work.kernels * device.fit.dispatch_s > max(flops_s, bytes_s) + stream_s + floor_s:
        return "host"
    compute = flops_s if flops_s >= bytes_s else 0.0
    memory = stream_s + (bytes_s if bytes_s > flops_s else 0.0)
    return max((("compute", compute), ("memory", memory), ("floor", floor_s)),
               key=lambda kv: kv[1])[0]


def _gemm_work(flops: float, gemm: GemmShape, itemsize: int) -> tuple[PhaseWork, PhaseWork]:
    m, n, k = gemm
    moved = (m * k + k * n + m * n) * itemsize
    return PhaseWork(flops, moved, 1, gemm), PhaseWork(2 * flops, 2 * moved, 2, gemm)


def _streaming(flops: float, fwd: float, bwd: float, kernels: tuple[int, int] = (1, 1)
               ) -> tuple[PhaseWork, PhaseWork]:
    """A memory-bound op moving ``fwd`` and ``bwd`` bytes (FLOPs at the asymptote)."""
    back = PhaseWork(2 * flops, bwd, kernels[1]) if bwd else NO_WORK
    return PhaseWork(flops, fwd, kernels[0]), back


# the runtime's loss kernels a micro-batch (:func:`runtime.ops.loss`), as aten dispatches
# them: forward, the targets' mask and local ids (6: ge, lt, and, sub, zeros_like, where)
# and the cross-entropy (13: the float32 copy, max, − max, the target's gather, its mask
# cast and product, exp, the row sum, stack, log, −, sum, / rows); backward, the step
# loop's scaling of the loss (4: / micro-batches, sum, the seed, its gradient), the
# cross-entropy's (8: the scale, / Σe, the softmax scaled, the rows' arange, − scale, the
# mask's cast and product, the targets' index_put; one more casting to half logits) and the
# reported loss read at the step's end (2: / micro-batches, sum)
LOSS_KERNELS = (6 + 13, 4 + 8 + 2)


def _loss_work(flops: float, logits: TensorSpec, split: float) -> tuple[PhaseWork, PhaseWork]:
    """The runtime's cross-entropy (:class:`runtime.ops._CrossEntropy`, in float32) pass by
    pass, per local logit of ``it`` bytes. Forward: the float32 copy (read it, write 4), the
    row max (read 4), ``− max`` and ``exp`` in place (read 4, write 4 each), the row sum
    (read 4): 28 + it. Backward: the softmax scaled in place (read 4, write 4) and the cast to
    the logits' dtype (read 4, write it; none in fp32): 12 + it, or 8. The per-row steps
    (target mask, gather and scatter, log, the step loop's scaling) are small kernels of
    their own (:data:`LOSS_KERNELS`). On a large vocabulary this is a real share of the step
    (``benchmarks/gpu_check.py``: several milliseconds of a 124M GPT's step on an H200,
    where a fused kernel's 2 × the logits' bytes would be half a millisecond)."""
    it = logits.itemsize
    elements = logits.numel / split
    cast_back = 4 + it if it != LOSS_ITEMSIZE else 0
    fwd, bwd = LOSS_KERNELS
    return _streaming(flops, (28 + it) * elements, (8 + cast_back) * elements,
                      (fwd, bwd + (1 if cast_back else 0)))


def default_gemm(op: Op, split: float) -> GemmShape:
    """The local matmul of a matmul-like op when the strategy names none: the global
    (m, n, k) with the rows divided by ``split`` (a data-parallel split)."""
    m = op.output.shape[0] if op.output.rank == 2 else math.prod(
        op.output.shape[i] for i in (0, 2, 3))
    n = op.output.shape[-1] if op.output.rank == 2 else op.output.shape[1]
    k = op.flops / (2.0 * m * n) if op.flops else 1.0
    return (m / split, n, max(k, 1.0))


def _attention(op: Op, split: float, itemsize: int, flash: bool) -> tuple[PhaseWork, PhaseWork]:
    """A fused flash kernel, or the unfused sequence (batched QKᵀ, softmax, dropout, PV)
    that writes and reads the s × s scores: E = tokens · heads · seq elements in all; the
    dropout only where the probabilities are dropped (``attrs.probs_dropout``: a built-in
    model's ``dropout`` > 0, an imported module's p > 0 in training), else 2E and the mask
    less each phase and one kernel fewer.
    Unfused forward: the two matmuls move Q, K, V, O and write S / read P' (4N + 2E), the
    softmax reads S and writes P, the dropout reads P and writes P' and its mask
    (4E + E mask bytes); backward: four matmuls (dP', dV, dQ, dK: 8N + 4E, 2 × the
    FLOPs), the dropout's and softmax's backward (5E + E mask bytes)."""
    seq = op.attrs.get("seq_len", op.output.shape[0])
    heads = max(op.attrs.get("heads", 1), 1)
    gemm = (seq, seq, op.output.shape[-1] / heads)  # S = QKᵀ per head; O = PV permuted
    n = op.output.numel / split * itemsize
    flops = op.flops / split
    rf, rb, rk = _rotary(op, split, itemsize)  # the same in both phases
    if flash:
        work = flops * causal_fraction(op, seq)
        return (PhaseWork(work, 4 * n, 1 + rk, gemm, rb, rf),
                PhaseWork(FLASH_BACKWARD_FLOPS * work, 8 * n, 2 + rk, gemm, rb, rf))
    scores = op.output.shape[0] * heads * seq / split  # E, elements
    e = scores * itemsize
    drop = 1 if op.attrs.get("probs_dropout") else 0  # p > 0: the model's or the module's
    mask = drop * scores * MASK_BYTES
    drawn, kernels = whole_draw(op, mask, split) if drop else (0.0, 0)
    return (PhaseWork(flops, 4 * n + 2 * e, 3 + drop + kernels + rk, gemm,
                      (2 + 2 * drop) * e + mask + drawn + rb, rf),
            PhaseWork(2 * flops, 8 * n + 4 * e, 5 + drop + rk, gemm,
                      (3 + 2 * drop) * e + mask + rb, rf))


def whole_draw(op: Op, mask: float, split: float) -> tuple[float, int]:
    """(bytes, kernels) a dropout's mask costs beyond a fused dropout's where every rank
    draws the whole mask and keeps its block (``attrs.whole_mask``: an imported model's
    dropouts under ``parallelize``, :mod:`runtime.local_dropout`) and the op is split
    ``split`` ways: the whole draw (``split`` × this rank's ``mask`` bytes written) and the
    block's copy (read and written): 2 kernels. Nothing where nothing is split (the whole
    is the block) or the op draws only its block."""
    if not op.attrs.get("whole_mask") or split <= 1:
        return 0.0, 0
    return (split + 2) * mask, 2


def causal_fraction(op: Op, seq: float) -> float:
    """The share of an attention's score tiles a fused kernel computes: a causal one
    (every attention but those an import marks ``attrs.not_plain_causal``) skips the tiles
    above the diagonal, ``(1 + tile/s) / 2`` of them kept (tiles of :data:`FLASH_TILE`).
    The op's FLOPs stay the full ``4·tokens·s·h`` that MFU counts; an unfused attention
    computes every score and masks after. On an H200 a 124M GPT's (s = 1,024) fused causal
    attention took about half the time its full FLOPs priced (``benchmarks/gpu_check.py``'s
    profile, forward and backward kernels)."""
    if op.attrs.get("not_plain_causal") or seq <= FLASH_TILE:
        return 1.0
    return (1.0 + FLASH_TILE / seq) / 2.0


def _rotary(op: Op, split: float, itemsize: int) -> tuple[float, float, int]:
    """(FLOPs, bytes, kernels) of one phase of the built-in rotary positions ``op`` applies
    to its q and k on a device holding ``1/split`` of it (module docstring), where
    ``attrs.rope_theta`` is set and no folded steps of an import stand for them, else
    none."""
    if op.attrs.get("input_steps") or not op.attrs.get("rope_theta"):
        return 0.0, 0.0, 0
    heads = max(op.attrs.get("heads", 1), 1)
    kv = op.attrs.get("kv_heads", heads)
    rotated = op.output.numel / split * (1 + kv / heads)  # R: q's and k's elements
    tables = 2 * 2 * op.attrs.get("seq_len", 1) * op.output.shape[-1] / heads  # cos, sin × 2
    return 3.0 * rotated, (2 * rotated + tables) * itemsize, 2


def folded_work(op: Op, split: float) -> tuple[PhaseWork, PhaseWork]:
    """(forward, backward) of the kernels an import folded into the values ``op`` reads —
    element-wise steps (rotary on attention's q, k, v, a hand-written GELU or norm, a
    hand-written attention's score scale and mask) and copies (casts, ``contiguous``,
    ``cat``, repeated heads) — on a device holding ``1/split`` of its input: separate
    memory-bound kernels (``stream_bytes``, ``stream_flops``), each with its floor, as
    torch counted their bytes forward and as autograd runs them backward
    (:func:`ilp_planner.inputs.lift_graph.folded_steps`; a graph of an older import, with
    no backward figures, runs the forward's again)."""
    a = op.attrs
    if not a.get("input_steps"):
        return NO_WORK, NO_WORK
    fwd = PhaseWork(0.0, 0.0, a["input_steps"], None, a.get("input_steps_bytes", 0) / split,
                    a.get("input_steps_flops", 0) / split)
    if "input_steps_bwd" not in a:
        return fwd, fwd
    return fwd, PhaseWork(0.0, 0.0, a["input_steps_bwd"], None,
                          a.get("input_steps_bwd_bytes", 0) / split,
                          a.get("input_steps_bwd_flops", 0) / split)


def _input_split(op: Op, split: float, gemm: GemmShape | None) -> float:
    """How many devices share ``op``'s input: a matmul's local input is ``(m, k)`` of its
    local product (a column-parallel linear's input is whole on each of its ``n``
    devices); any other op's is split as its work."""
    if gemm is None or op.kind not in (OpKind.LINEAR, OpKind.MATMUL) or op.weight is None \
            or op.output.rank != 2:
        return split
    return op.output.shape[0] * op.weight.shape[0] / max(gemm[0] * gemm[2], 1e-12)


def _with_folded(work: tuple[PhaseWork, PhaseWork], op: Op, split: float
                 ) -> tuple[PhaseWork, PhaseWork]:
    """``work`` with :func:`folded_work`'s kernels added to each phase."""
    if not op.attrs.get("input_steps"):
        return work
    return tuple(PhaseWork(w.flops, w.bytes, w.kernels + f.kernels, w.gemm,
                           w.stream_bytes + f.stream_bytes, w.stream_flops + f.stream_flops)
                 for w, f in zip(work, folded_work(op, split), strict=True))


def op_work(op: Op, split: float, gemm: GemmShape | None = None,
            read: TensorSpec | None = None, flash: bool = True) -> tuple[PhaseWork, PhaseWork]:
    """(forward, backward) work of ``op`` on one device holding ``1/split`` of it (module
    docstring's table), with the kernels an import folded into its inputs
    (:func:`folded_work`, on its local input). ``gemm`` is the local matmul of a
    matmul-like op under its strategy; ``read`` the tensor the op reads where that is not
    its output's shape (a loss's logits, a pooling's input); ``flash``: attention runs
    fused (else unfused, :func:`_attention`)."""
    fwd, bwd = _with_folded(_kind_work(op, split, gemm, read, flash), op,
                            _input_split(op, split, gemm))
    return fwd, NO_WORK if op.no_grad else bwd


def _kind_work(op: Op, split: float, gemm: GemmShape | None, read: TensorSpec | None,
               flash: bool) -> tuple[PhaseWork, PhaseWork]:
    """:func:`op_work` of ``op``'s kind alone."""
    kind, it = op.kind, op.output.itemsize
    flops = op.flops / split
    n = op.output.numel / split * it  # bytes of the local output
    if kind in (OpKind.LINEAR, OpKind.MATMUL, OpKind.CONV2D):
        gemm = gemm or default_gemm(op, split)
        fwd, bwd = _gemm_work(flops, gemm, it)
        if op.frozen:  # dX = dY·Wᵀ alone: one product as large as the forward's
            return fwd, fwd
        if kind is OpKind.LINEAR and op.attrs.get("bias"):  # dbias: dY's rows summed
            bwd = dataclasses.replace(bwd, kernels=bwd.kernels + 1,
                                      stream_bytes=bwd.stream_bytes + gemm[0] * gemm[1] * it)
        return fwd, bwd
    if kind is OpKind.ATTENTION:  # an imported hand-written one runs unfused (its code)
        return _attention(op, split, it, flash and not op.attrs.get("unfused"))
    if kind is OpKind.EMBEDDING:
        tables = 1 + sum(1 for k in op.attrs if k == "seq_len" or k.startswith("pos_"))
        out = (gemm[0] * gemm[1] * it) if gemm else n
        # the runtime's learned positions (``seq_len``, :func:`runtime.ops.embedding`): the
        # rows' positions computed (arange, remainder), looked up and added (index, add);
        # their gradient scattered back into the table (new_zeros, index_put)
        own = 1 if "seq_len" in op.attrs else 0
        if op.frozen:  # its ids take no gradient, nor does its table
            return _streaming(0.0, (tables + 1) * out, 0.0, (1 + 4 * own, 0))
        return _streaming(0.0, (tables + 1) * out, 3 * out, (1 + 4 * own, 1 + 2 * own))
    if kind in (OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.SOFTMAX, OpKind.GELU, OpKind.SILU,
                OpKind.RELU):
        norm = kind in (OpKind.LAYERNORM, OpKind.RMSNORM)
        return _streaming(flops, 2 * n, 3 * n, (1, 2 if norm else 1))
    if kind is OpKind.DROPOUT:
        if op.is_identity:  # p = 0 or evaluated: torch returns the input
            return NO_WORK, NO_WORK
        mask = op.output.numel / split * MASK_BYTES
        drawn, kernels = whole_draw(op, mask, split)
        return _streaming(flops, 2 * n + mask + drawn, 2 * n + mask, (1 + kernels, 1))
    if kind is OpKind.ADD:
        return _streaming(flops, 3 * n, 0.0)
    if kind is OpKind.MUL:
        return _streaming(flops, 3 * n, 5 * n, (1, 2))
    if kind is OpKind.BATCHNORM:
        return _streaming(flops, 3 * n, 4 * n, (1, 2))
    if kind is OpKind.POOL:
        window = op.attrs.get("kernel", 1) ** 2
        return _streaming(flops, n * (window + 1), n * (window + 1))
    if kind is OpKind.LOSS:
        return _loss_work(flops, read or op.output, split)
    if kind is OpKind.OPAQUE:
        moved = (op.attrs.get("bytes_read", 0) + op.attrs.get("bytes_written", 0)) / split
        if "bwd" in op.attrs:  # its backward as autograd runs it, counted at import
            return PhaseWork(flops, moved, 1), (PhaseWork(
                op.attrs["bwd_flops"] / split, op.attrs["bwd_bytes"] / split, op.attrs["bwd"])
                if op.attrs["bwd"] else NO_WORK)
        return _streaming(flops, moved, 2 * moved)  # a written graph's: the convention
    if kind is OpKind.PART:  # a view; autograd's split backward cats the parts' gradients
        cat = op.attrs.get("cat", int(op.attrs.get("part") == 0))
        unread = op.attrs.get("unread_parts", 0) if cat else 0
        return NO_WORK, PhaseWork(0.0, (2 + 3 * unread) * n, cat + unread)
    return NO_WORK, NO_WORK  # input, flatten


def op_times(op: Op, split: float, cluster: Cluster, gemm: GemmShape | None = None,
             read: TensorSpec | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of ``op`` on one device holding ``1/split`` of it: the
    roofline where the cluster names a device, else the flat model's third and two
    thirds of ``3 × FLOPs / (peak × efficiency)``."""
    return op_times_replayed(op, split, cluster, gemm, read)[:2]


def op_times_replayed(op: Op, split: float, cluster: Cluster, gemm: GemmShape | None = None,
                      read: TensorSpec | None = None) -> tuple[float, float, float]:
    """:func:`op_times` and the seconds the forward takes again when activation
    recomputation replays it (its host time with ``ComputeFit.replay_s`` a kernel; the
    flat model's third)."""
    if cluster.device is None:
        total = compute_time(3.0 * op.flops / split, cluster)
        back = 0.0 if op.no_grad else total / 3 if op.frozen else total - total / 3
        return total / 3, back, total / 3
    dtype = (read or op.output).dtype
    fwd, bwd = op_work(op, split, gemm, read, cluster.device.fit.attention == "flash")
    return (phase_seconds(fwd, cluster.device, dtype), phase_seconds(bwd, cluster.device, dtype),
            phase_seconds(fwd, cluster.device, dtype, replayed=True))


def op_seconds(op: Op, split: float, cluster: Cluster, gemm: GemmShape | None = None,
               read: TensorSpec | None = None) -> float:
    """Forward + backward seconds (:func:`op_times`); on a flat cluster exactly
    ``compute_time(3 × FLOPs / split)``, as before the roofline."""
    if cluster.device is None and not (op.frozen or op.no_grad):
        return compute_time(3.0 * op.flops / split, cluster)
    return sum(op_times(op, split, cluster, gemm, read))


def training_flops(op: Op, flash: bool = True) -> float:
    """Forward + backward FLOPs of ``op`` as the roofline counts them (attention's flash
    backward recomputes, its rotary included; an add has no backward)."""
    fwd, bwd = op_work(op, 1.0, flash=flash)
    return fwd.flops + bwd.flops + fwd.stream_flops + bwd.stream_flops


def least_seconds(op: Op, cluster: Cluster) -> float:
    """A lower bound on ``op``'s forward + backward seconds summed over the devices that
    share it: its FLOPs at the device's best matmul throughput (flat: the flat price of
    the whole op). No strategy spreads it faster, so stage bounds built on it stay exact."""
    if cluster.device is None:
        return op_seconds(op, 1.0, cluster)
    best = max(cluster.device.peak_flops.values())  # whatever dtype the op runs in
    fit = cluster.device.fit
    return training_flops(op, fit.attention == "flash") / (best * fit.matmul_efficiency)


def update_bytes_per_param(memory: MemorySpec, mixed: bool) -> float:
    """Bytes one optimizer step moves per parameter of its shard: read the gradient and
    the optimizer state, write the state back, and read and write the weights where they
    are the master copy. Under mixed precision the float32 master sits in the state and the
    runtime's fused Adam updates it alone: the half-precision copy is written by the next
    step's cast (:func:`master_weight_seconds`; a sharded block's,
    :func:`state_shard_seconds`). Adam mixed: 4 + 12 + 12 = 28; Adam fp32: 4 + 8 + 8 + 4 + 4
    = 28; SGD: 12."""
    w, g, o = memory.weight_bytes, memory.grad_bytes, memory.optimizer_bytes
    return g + 2 * o + (0 if mixed else 2 * w)


MASTER_ITEMSIZE = 4  # the runtime's master weights and their gradients are float32


def master_weight_seconds(op: Op, params: float, tensors: int, memory: MemorySpec,
                          microbatches: int, synced: bool, cluster: Cluster,
                          gathered: float = 0.0) -> float:
    """Seconds a step spends on ``op``'s master weights besides the optimizer's update, as
    the runtime runs it (``params`` local parameters in ``tensors`` tensors, held whole —
    state sharding level 0): under mixed precision the compute copy cast once a step (read
    the float32 master, write the copy: :meth:`runtime.stage_forward.StageForward._compute_copy`)
    and each micro-batch's gradient cast back (read it, write float32); in any precision
    autograd's in-place accumulation into ``.grad`` (read it and the new gradient, write
    it) — every micro-batch where ``.grad`` is a slice of a synchronised flat buffer
    (:mod:`runtime.grad_sync`), every one after the first otherwise. One kernel per tensor
    each. 0 on a flat cluster (it never priced them) or without parameters. State-sharded
    blocks run their own passes (:func:`state_shard_seconds`). ``gathered``: the elements of
    ``params`` in a weight SUMMA gathers from its master and casts at its gathered size
    every micro-batch (priced in the strategy's compute,
    :func:`~ilp_planner.lowering.strategies.summa_cast_seconds`): no compute copy and no
    gradient cast back here, but its gradient accumulates like the others'."""
    if cluster.device is None or params <= 0:
        return 0.0
    spec = op.weight or op.output
    g = memory.grad_bytes
    adds = microbatches if synced else microbatches - 1
    casts = 1 + microbatches if op.mixed_precision else 0
    cast_tensors = tensors - (1 if gathered else 0)
    work = PhaseWork(0.0, (params - gathered) * casts * (MASTER_ITEMSIZE + spec.itemsize)
                     + params * adds * 3 * g, cast_tensors * casts + tensors * adds)
    return phase_seconds(work, cluster.device, "float32")


# an element of a float16 gradient unscaled (float32): divided in place (read 4, write 4);
# ``isfinite``, which aten composes of abs (4 + 4), ne inf (4 + 1), eq self (8 + 1) and
# their product (2 + 1); ``all`` over it (1)
UNSCALE_BYTES = 34
UNSCALE_KERNELS = 6  # a tensor: div_, abs, ne, eq, mul, all (the flag's read is no kernel)


def unscale_seconds(op: Op, params: float, tensors: int, cluster: Cluster) -> float:
    """Seconds of undoing the float16 loss scale on the ``params`` gradient elements the
    optimizer reads for ``op`` (``tensors`` tensors), as :func:`runtime.model.unscale` runs
    it once a step: per tensor a division in place and a finiteness test read back to the
    host (:data:`UNSCALE_KERNELS` kernels, :data:`UNSCALE_BYTES` an element). 0 unless the
    op computes in float16 (bfloat16 and float32 take no loss scale), without parameters,
    or on a flat cluster (it never priced them)."""
    spec = op.weight or op.output
    if cluster.device is None or params <= 0 or spec.dtype != "float16":
        return 0.0
    work = PhaseWork(0.0, params * UNSCALE_BYTES, UNSCALE_KERNELS * tensors)
    return phase_seconds(work, cluster.device, "float32")


def state_shard_seconds(op: Op, buckets: list[tuple[int, int, int, bool]], level: int,
                        microbatches: int, cluster: Cluster) -> float:
    """Seconds a step spends on the passes over ``op``'s state-sharded buckets besides their
    collectives and the shard's update, as the runtime runs them (:mod:`runtime.zero_state`,
    :mod:`runtime.zero`) — each bucket given as (roles R, elements N of its padded local
    blocks, group size p, its ZeRO-3 backward reads the weights); its flat buffer holds
    ``n = s·p`` elements, ``s = ⌈N/p⌉`` the shard; w the compute dtype's bytes; one cast
    (read fp32, write w) wherever the compute dtype is a half one, none in float32:

    * ZeRO-1/2: at the step's start the flat fp32 gradient and the shard's gradient are
      zeroed (2 kernels); every micro-batch each role's gradient is added into its slice
      of the flat buffer (R kernels, ``(8 + w)·N`` bytes); the shard's gradient adds the
      reduce-scattered one (ZeRO-1 once a step; ZeRO-2 every micro-batch, which also
      zeroes the flat buffer again); after the update the shard is cast and, gathered,
      copied into each role's full block (R kernels, ``2w·N``);
    * ZeRO-3, every micro-batch: each gather casts the shard (the forward's, and the
      backward's where it reads the weights); autograd writes each role's gradient into a
      zero-filled flat buffer (``slice_backward``: a fill and a copy, 2 kernels a role, as
      a CUDA device runs it) and adds the R of them (R − 1 kernels); the flat gradient is
      cast to float32 for the reduce-scatter; from the second micro-batch on the shard's
      gradient accumulates (an add).

    0 on a flat cluster (it never priced them)."""
    if cluster.device is None or not buckets:
        return 0.0
    spec = op.weight or op.output
    w, m = spec.itemsize, microbatches
    cast = 1 if op.mixed_precision else 0
    kernels, moved = 0, 0.0
    for roles, numel, p, reads in buckets:
        s = -(-numel // p)
        n = s * p
        cast_b = cast * (MASTER_ITEMSIZE + w) * s
        if level in (1, 2):
            per_mb = (roles, (8 + w) * numel)
            shard = (1, 12 * s) if level == 1 else (0, 0.0)
            again = (2, 12 * s + 4 * n) if level == 2 else (0, 0)
            kernels += 2 + m * (per_mb[0] + again[0]) + shard[0] + cast + roles
            moved += (4 * n + 4 * s + m * (per_mb[1] + again[1]) + shard[1] + cast_b
                      + 2 * w * numel)
        else:
            gathers = 2 if reads else 1
            kernels += m * (gathers * cast + 3 * roles - 1 + cast) + (m - 1)
            moved += (m * (gathers * cast_b + roles * w * n + 2 * w * numel
                           + (roles - 1) * 3 * w * n + cast * (w + MASTER_ITEMSIZE) * n)
                      + (m - 1) * 12 * s)
    return phase_seconds(PhaseWork(0.0, moved, kernels), cluster.device, "float32")


def shard_cast_seconds(op: Op, numel: int, group_size: int, cluster: Cluster,
                       replayed: bool = False) -> float:
    """One cast of a ZeRO-3 bucket's float32 shard (``⌈numel / group_size⌉`` elements) to
    the compute dtype, as each of its gathers does (:func:`state_shard_seconds`;
    ``replayed``: a recomputation's, its host time a replayed kernel's); 0 in float32 (no
    cast) or on a flat cluster."""
    spec = op.weight or op.output
    if cluster.device is None or not op.mixed_precision:
        return 0.0
    s = -(-numel // group_size)
    return phase_seconds(PhaseWork(0.0, (MASTER_ITEMSIZE + spec.itemsize) * s, 1),
                         cluster.device, "float32", replayed)


def update_seconds(params: float, memory: MemorySpec, op: Op, cluster: Cluster) -> float:
    """Seconds of the optimizer update over ``params`` local parameters of ``op``,
    memory-bound; 0 on a flat cluster (it had no price before) or for an op without
    parameters. No kernel floor: a multi-tensor (foreach / fused) optimizer updates every
    parameter in a few launches shared by all ops."""
    if cluster.device is None or params <= 0:
        return 0.0
    mixed = op.mixed_precision
    work = PhaseWork(0.0, params * update_bytes_per_param(memory, mixed), 0)
    return phase_seconds(work, cluster.device, "float32")
