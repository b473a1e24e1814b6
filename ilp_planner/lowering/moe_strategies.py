"""Mixture-of-experts strategies: how one MoE op (router, dispatch, experts, combine —
:data:`~ilp_planner.ir.graph.OpKind.MOE`) runs on a mesh, what it moves and what it holds.

Every strategy views the devices as three ordered axes ``(p0, p1, p2)``, each with a role::

    axis   role                     tokens x   expert weights    output   gradients
    p0     expert data parallel     S(0)       replicated        S(0)     AllReduced over p0
    p1     expert parallel (ep)     S(0)       S(expert)         S(0)     complete
           or expert slicing (xp)   B          S(expert)         P        complete
    p2     expert tensor parallel   B          S(hidden)         P        complete

Expert parallel (GShard, DeepSpeed-MoE, torchtitan): each device routes its own tokens into
a dispatch buffer ``(E, C, h)`` — ``C`` slots per expert — and one AllToAll over p1 sends
expert ``e``'s slots to the device owning it, which then holds ``(E/p1, p1·C, h)``; the
combine is the reverse AllToAll. Bytes per rank and direction: ``E·C·h`` ≈ tokens × top_k ×
capacity factor × h, the tokens being this device's ``T/(p0·p1)``. Expert slicing (``xp``)
keeps every token on every device of p1 and lets each device run only its own experts:
no AllToAll, a partial-sum output instead (cheap for few tokens). Expert tensor parallelism
splits each expert's hidden dim over p2 (Megatron's column/row pair inside every expert),
again with a partial-sum output. The router's gate is replicated everywhere; its gradient
is a partial sum over every axis (each device's tokens, or its share of the experts' output).
Shared experts (Qwen-MoE, DeepSeek) are a dense MLP beside the routed ones: replicated over
the token-splitting axes, hidden dim split over the others.

Load imbalance enters as the capacity factor ``cf`` (``attrs.capacity_pct`` = 100·cf): each
expert takes ``C = ⌈cf · T_g · top_k / E⌉`` tokens of a group of ``T_g`` (capped at ``T_g``,
where nothing can drop), so the buffers, the AllToAll bytes and the expert compute are
priced at capacity — a router sending more than ``C`` tokens to one expert drops the rest,
one balanced to within ``cf`` drops none. ``cf = E / top_k`` gives ``C = T_g``: nothing
drops, at a buffer ``E / top_k`` times the routed tokens. A dropless op (:func:`dropless`:
imported blocks, ``kind: moe`` with ``dropless: true``) exchanges exactly the routed tokens
instead, priced at ``cf = 1`` — a balanced router's load; the audit holds the rows a rank
sends back to their bound (:mod:`ilp_planner.plan.audit`).

An imported block (``attrs.hf_experts``) keeps the module's own tensors as its parameters,
so ``parallelize`` places them without transposes. Two forms (:func:`hf_form`): Mixtral's,
Qwen2-MoE's and DeepSeek's (:data:`HF_FUSED`) — ``router`` ``(E, h)``, ``gate_up``
``(E, 2f, h)`` (gate rows, then up rows), ``down`` ``(E, h, f)`` —, and GPT-OSS's
(:data:`HF_INTERLEAVED`) — ``router`` ``(E, h)``, ``gate_up`` ``(E, h, 2f)`` (gate and up
columns alternating), ``down`` ``(E, f, h)``, each with its bias (``router_bias`` ``(E,)``,
``gate_up_bias`` ``(E, 2f)``, ``down_bias`` ``(E, h)``), and a clamped GLU
(:func:`clamped_glu`). Neither is offered expert tensor parallelism: a block of the fused
rows would hold gate rows of some columns and up rows of others (the interleaved form could
split, but its bias would then be added on every rank of a partial sum). A plan is a
program: the solver offers only what the runtime runs.

Pure and torch-free; :mod:`ilp_planner.lowering.strategies` wraps these pieces into its
:class:`~ilp_planner.lowering.strategies.Strategy` (gradient sync, ZeRO variants, pricing),
and the runtime's MoE kernel runs :func:`moe_programs` for its two AllToAlls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ilp_planner.ir.cluster import Cluster, Factorisation
from ilp_planner.ir.graph import Op, TensorSpec
from ilp_planner.ir.layouts import B, Layout, P, Placement, Split
from ilp_planner.lowering.cost_model import Collective, CollectiveKind, make_collective
from ilp_planner.lowering.redistribution import (
    Redistribution,
    RedistStep,
    planner_for,
    step_bytes,
)

DISPATCH, COMBINE = "moe_dispatch", "moe_combine"  # the AllToAlls' purposes (plan and audit)
RECEIVED, COUNTS = "moe_received", "moe_counts"  # a dropless exchange's (see dropless)
ROUTE_SCALE_UNIT = 1000  # attrs.route_scale counts the routed scaling factor in thousandths


def ffn_matrices(op: Op) -> int:
    """Matrices per expert: 3 for SwiGLU (gate, up, down), 2 for GELU."""
    return 3 if op.attrs.get("swiglu", 1) else 2


HF_FUSED, HF_INTERLEAVED = 1, 2
"""``attrs.hf_experts`` of an imported block: Mixtral's tensors, or GPT-OSS's (module
docstring)."""
GLU_UNIT = 1000  # attrs.glu_alpha and attrs.glu_limit count GPT-OSS's GLU constants in thousandths


def hf_experts(op: Op) -> bool:
    """Whether the op stands for an imported Hugging Face block (its tensors in the
    module's orientation, see the module docstring)."""
    return bool(op.attrs.get("hf_experts", 0))


def hf_form(op: Op) -> int:
    """0 (a built-in op), :data:`HF_FUSED` or :data:`HF_INTERLEAVED`."""
    return int(op.attrs.get("hf_experts", 0))


def clamped_glu(gate, up, alpha: float, limit: float):
    """GPT-OSS's expert activation ``(clamp(up, ±limit) + 1) · g · σ(α g)``, ``g =
    min(gate, limit)`` — on torch tensors or anything with their methods (one definition
    for the importer's stand-in and the runtime's kernel)."""
    g = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (g * (g * alpha).sigmoid())


def moe_param_shapes(op: Op) -> dict[str, tuple[int, ...]]:
    """The MoE op's parameters by role: ``router`` (h, E); ``w1``/``w3`` (E, h, f) the
    up (and SwiGLU gate) projections, ``w2`` (E, f, h) the down projection; shared experts
    fused into one dense MLP ``shared_w1``/``shared_w3`` (h, S·f_s), ``shared_w2`` (S·f_s, h);
    a sigmoid router's ``score_bias`` (E,), DeepSeek-V3's ``e_score_correction_bias``: it
    only selects experts, so its gradient is exactly zero and no optimizer moves it (kept
    as a parameter for its initial value and its bytes). An imported block's are its
    module's own (:func:`hf_experts`)."""
    h, e, f = op.output.shape[1], op.attr("experts"), op.attr("ffn")
    if hf_form(op) == HF_INTERLEAVED:
        return {"router": (e, h), "gate_up": (e, h, 2 * f), "down": (e, f, h),
                "router_bias": (e,), "gate_up_bias": (e, 2 * f), "down_bias": (e, h)}
    if hf_experts(op):
        return {"router": (e, h), "gate_up": (e, 2 * f, h), "down": (e, h, f)}
    out = {"router": (h, e), "w1": (e, h, f), "w2": (e, f, h)}
    if sigmoid_router(op):
        out["score_bias"] = (e,)
    if ffn_matrices(op) == 3:
        out["w3"] = (e, h, f)
    shared = op.attrs.get("shared", 0) * op.attrs.get("shared_ffn", 0)
    if shared:
        out["shared_w1"] = (h, shared)
        out["shared_w2"] = (shared, h)
        if ffn_matrices(op) == 3:
            out["shared_w3"] = (h, shared)
    return out


def moe_params(op_attrs: dict[str, int], hidden: int) -> int:
    """Parameters of an MoE op with these attributes (router, routed and shared experts)."""
    m = 3 if op_attrs.get("swiglu", 1) else 2
    e, f = op_attrs["experts"], op_attrs["ffn"]
    shared = op_attrs.get("shared", 0) * op_attrs.get("shared_ffn", 0)
    bias = e if op_attrs.get("sigmoid", 0) and not op_attrs.get("hf_experts", 0) else 0
    if op_attrs.get("hf_experts", 0) == HF_INTERLEAVED:  # router, gate/up and down biases
        bias = e * (1 + 2 * f + hidden)
    return hidden * e + bias + m * hidden * (e * f + shared)


def sigmoid_router(op: Op) -> bool:
    """Whether the router scores experts by a sigmoid and selects them by score plus a
    correction bias (DeepSeek-V3, ``attrs.sigmoid``) rather than by a softmax."""
    return bool(op.attrs.get("sigmoid", 0))



def expert_parallel(x: Layout) -> bool:
    """Whether the strategy with input layout ``x`` exchanges tokens over p1 (AllToAll)
    rather than slicing experts over replicated tokens."""
    return x.placements[1] == Split(0)


def _partial_if(fact: Factorisation, axis: int) -> Placement:
    return P if fact[axis].size > 1 else B


def moe_layouts(fact: Factorisation, ep: bool) -> tuple[Layout, Layout, Layout]:
    """(input, output, input gradient) layouts of the token tensors (T, h)."""
    ax1: Placement = Split(0) if ep else B
    x = Layout(fact, (Split(0), ax1, B))
    out = Layout(fact, (Split(0), ax1 if ep else _partial_if(fact, 1), _partial_if(fact, 2)))
    return x, out, out  # the input's gradient is partial where the output is


def moe_param_layouts(op: Op, x: Layout) -> dict[str, tuple[Layout, Layout]]:
    """Per role, (layout it is stored in, layout its gradient leaves the backward in)."""
    fact, ep = x.fact, expert_parallel(x)
    d0 = _partial_if(fact, 0)
    every = Layout(fact, (d0, _partial_if(fact, 1), _partial_if(fact, 2)))
    out = {"router": (Layout.replicated(fact), every),
           "router_bias": (Layout.replicated(fact), every),
           "score_bias": (Layout.replicated(fact), Layout.replicated(fact))}  # zero gradient
    # each expert tensor's hidden dim (GPT-OSS's ``(E, h, 2f)`` gate/up, ``(E, f, h)`` down;
    # its down bias has none)
    hidden: dict[str, int | None] = {"w1": 2, "w3": 2, "w2": 1, "gate_up": 1, "down": 2}
    if hf_form(op) == HF_INTERLEAVED:
        hidden = {"gate_up": 2, "down": 1, "gate_up_bias": 1, "down_bias": None}
    for role, hid in hidden.items():
        ax2: Placement = B if hid is None else Split(hid)  # (never split: no expert TP there)
        out[role] = (Layout(fact, (B, Split(0), ax2)), Layout(fact, (d0, Split(0), ax2)))
    for role, hid in (("shared_w1", 1), ("shared_w3", 1), ("shared_w2", 0)):
        # dense: replicated over the token-splitting axes, hidden split over the others
        ax1: Placement = B if ep else Split(hid)
        g1: Placement = _partial_if(fact, 1) if ep else Split(hid)
        out[role] = (Layout(fact, (B, ax1, Split(hid))), Layout(fact, (d0, g1, Split(hid))))
    roles = moe_param_shapes(op)
    return {r: v for r, v in out.items() if r in roles}


def token_groups(x: Layout) -> int:
    """Token blocks routed independently (one dispatch buffer each)."""
    return x.split_degree(0)


def dropless(op: Op) -> bool:
    """Whether the op routes every token (``attrs.dropless``, as Hugging Face's blocks do and
    the builder's ``dropless: true`` asks)
    with variable-size exchanges rather than a dense capacity buffer.

    Expert parallel, each rank first sends its per-expert token counts (one AllToAll of
    ``E`` int64 over p1, purpose ``moe_counts``), then exactly its routed copies, sorted by
    expert (``T_g · top_k`` rows), and gets the experts' outputs back. What a rank sends
    in the dispatch's forward and the combine's backward is its own ``T_g · top_k`` rows
    (purposes ``moe_dispatch``, ``moe_combine``); what it sends in the combine's forward
    and the dispatch's backward is what it received, which the router decides at run time
    (purpose ``moe_received``). All are priced at a balanced router — capacity factor 1,
    ``C = ⌈T_g · top_k / E⌉`` — the expected load, as are the expert compute and buffers;
    the audit holds ``moe_received`` to its bound, the group's ``p1 · T_g · top_k`` rows
    (:mod:`ilp_planner.plan.audit`), the rest to their planned bytes."""
    return bool(op.attrs.get("dropless", 0))


def capacity(op: Op, group_tokens: int) -> int:
    """Slots per expert for a group of ``group_tokens`` tokens (see the module docstring);
    a dropless op's priced load (:func:`dropless`)."""
    cf = 1.0 if dropless(op) else op.attrs.get("capacity_pct", 100) / 100.0
    slots = math.ceil(cf * group_tokens * op.attr("top_k") / op.attr("experts"))
    return max(1, min(group_tokens, slots))


def dispatch_tensor(op: Op, x: Layout) -> TensorSpec:
    """The global dispatch buffer ``(E, G·C, h)`` of ``G`` token groups."""
    g = token_groups(x)
    t, h = op.output.shape
    return TensorSpec((op.attr("experts"), g * capacity(op, t // g), h), op.output.dtype)


def _a2a(src: Layout, dst: Layout, tensor: TensorSpec, cluster: Cluster,
         packed: bool = True) -> tuple[RedistStep]:
    """The one AllToAll over p1 between two dispatch-buffer layouts, as a step the
    runtime's :class:`~runtime.comm.Comm` executes (``all_to_all_single``, with the local
    kernels it runs around it). Built directly, not searched: a path of re-views the edge
    search may prefer for an opaque tensor would move the buffer off the device that owns
    the expert. ``packed=False``: the call alone — a dropless op exchanges its sorted rows
    as they lie (``runtime.moe._Exchange``), with no stack or cat."""
    kind = CollectiveKind.ALL_TO_ALL
    if packed:
        c = planner_for(src, cluster).collective(kind, src, dst, 1, tensor)
    else:
        ax = src.fact[1]
        c = make_collective(kind, ax.size, step_bytes(kind, src, dst, 1, tensor), cluster,
                            ax.spans_nodes, (1,), nodes=ax.nodes)
    return (RedistStep(src, dst, c),)


def moe_programs(op: Op, x: Layout, cluster: Cluster, packed: bool = True
                 ) -> tuple[Redistribution, Redistribution] | None:
    """The dispatch and combine AllToAlls of an expert-parallel strategy over p1 (None
    where nothing is exchanged: expert slicing, or p1 = 1), as edge programs on the
    dispatch buffer. Dispatch moves ``(S1, S1, B) → (S1, S0, B)``; its gradient comes back
    partial over p2 where the experts are tensor-parallel (their ``dX`` is a partial sum),
    and is moved back as it is — the op's input gradient is partial there anyway. Combine
    moves the experts' output ``(S1, S0, P) → (S1, S1, P)``, its gradient replicated.
    ``packed``: as :func:`_a2a`'s."""
    fact = x.fact
    if not expert_parallel(x) or fact[1].size == 1:
        return None
    buf = dispatch_tensor(op, x)
    p2 = _partial_if(fact, 2)
    held, owned = (Split(1), Split(1)), (Split(1), Split(0))
    d_src, d_dst = Layout(fact, (*held, B)), Layout(fact, (*owned, B))
    g_dst, g_src = Layout(fact, (*owned, p2)), Layout(fact, (*held, p2))
    dispatch = Redistribution(d_src, d_dst, buf, _a2a(d_src, d_dst, buf, cluster, packed),
                              g_dst, _a2a(g_dst, g_src, buf, cluster, packed))
    combine = Redistribution(g_dst, g_src, buf, _a2a(g_dst, g_src, buf, cluster, packed),
                             d_src, _a2a(d_src, d_dst, buf, cluster, packed))
    return dispatch, combine


def moe_collectives(op: Op, x: Layout, cluster: Cluster) -> tuple[Collective, ...]:
    """The AllToAlls the strategy issues per micro-batch, forward and backward."""
    progs = moe_programs(op, x, cluster, packed=not dropless(op))
    if progs is None:
        return ()
    out: list[Collective] = []
    # (forward, backward) purposes of each exchange: what a dropless rank sends is its own
    # routed copies, or what it received (dropless)
    purposes = ((DISPATCH, RECEIVED), (RECEIVED, COMBINE)) if dropless(op) else (
        (DISPATCH, DISPATCH), (COMBINE, COMBINE))
    for prog, (fwd, bwd) in zip(progs, purposes, strict=True):
        out += [c.with_phase("forward", fwd) for c in prog.forward]
        out += [c.with_phase("backward", bwd) for c in prog.backward]
    if dropless(op):
        ax = x.fact[1]
        counts = make_collective(CollectiveKind.ALL_TO_ALL, ax.size, 8.0 * op.attr("experts"),
                                 cluster, ax.spans_nodes, (1,), nodes=ax.nodes)
        out.append(counts.with_phase("forward", COUNTS))
    return tuple(out)


@dataclass(frozen=True)
class MoeShape:
    """Per-device sizes of one strategy: what it computes and holds."""

    tokens: int  # tokens this device routes
    rows: int  # expert rows it computes (local experts × slots it receives)
    ffn: int  # expert hidden columns it holds
    shared_ffn: int  # shared-expert hidden columns it holds


def moe_shape(op: Op, x: Layout) -> MoeShape:
    t = op.output.shape[0]
    fact = x.fact
    tokens = t // token_groups(x)
    slots = capacity(op, tokens) * (fact[1].size if expert_parallel(x) else 1)
    rows = op.attr("experts") // fact[1].size * slots
    shared = op.attrs.get("shared", 0) * op.attrs.get("shared_ffn", 0)
    shared_split = fact[2].size * (1 if expert_parallel(x) else fact[1].size)
    return MoeShape(tokens, rows, op.attr("ffn") // fact[2].size, shared // shared_split)


def moe_flops(op: Op, x: Layout) -> float:
    """Forward FLOPs per device at capacity: the router on its tokens, its experts on the
    slots it receives (empty slots included: the buffer is dense), the shared experts."""
    s = moe_shape(op, x)
    h, m = op.output.shape[1], ffn_matrices(op)
    return 2.0 * s.tokens * h * op.attr("experts") + 2.0 * m * h * (s.rows * s.ffn
                                                                      + s.tokens * s.shared_ffn)


def moe_activation_bytes(op: Op, x: Layout, out: Layout) -> float:
    """Activations kept for the backward per device: the output block, the dispatch buffer
    in and the experts' output (both ``rows × h``), the expert hidden activations
    (``rows × f`` per matrix before the down projection), the shared experts' likewise."""
    s = moe_shape(op, x)
    h, m, item = op.output.shape[1], ffn_matrices(op), op.output.itemsize
    return out.local_bytes(op.output) + item * (
        2 * s.rows * h + m * s.rows * s.ffn + m * s.tokens * s.shared_ffn)


def moe_candidates(op: Op, facts: Iterable[Factorisation]) -> list[Layout]:
    """Input layouts of every strategy that divides evenly: tokens over the token-splitting
    axes, experts over p1, the expert (and shared) hidden dims over their axes."""
    t = op.output.shape[0]
    e, f = op.attr("experts"), op.attr("ffn")
    shared = op.attrs.get("shared", 0) * op.attrs.get("shared_ffn", 0)
    out = []
    for fact in facts:
        p0, p1, p2 = (a.size for a in fact)
        if p2 > 1 and hf_experts(op):
            continue  # no expert tensor parallelism for an imported block (module docstring)
        for ep in (True, False) if p1 > 1 else (True,):
            groups = p0 * (p1 if ep else 1)
            if t % groups or e % p1 or f % p2:
                continue
            if shared and shared % (p2 * (1 if ep else p1)):
                continue
            out.append(moe_layouts(fact, ep)[0])
    return out


def moe_label(x: Layout) -> str:
    f = x.fact
    return f"moe(dp={f[0]},{'ep' if expert_parallel(x) else 'xp'}={f[1]},etp={f[2]})"
