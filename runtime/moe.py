"""The mixture-of-experts op on this rank, and its single-process reference.

One code path for both: route each token to its ``top_k`` experts (:func:`route`: softmax
or sigmoid scores of the router's logits in float32, the top-k weights renormalised where
``attrs.norm_topk`` and scaled by the routed scaling factor), lay
the routed copies into a dispatch buffer ``(E, C, h)`` — expert ``e``'s slots filled in
token order, a copy beyond ``C`` dropped —, run every expert's MLP on its slots as one
batched matmul, and sum each token's expert outputs weighted by its routing weights.

Distributed (:func:`moe`), the strategy's roles (:mod:`ilp_planner.lowering.moe_strategies`)
decide what moves: expert parallel sends the buffer through the planned dispatch AllToAll
(``all_to_all_single`` over p1, :func:`~ilp_planner.lowering.moe_strategies.moe_programs`,
run by :meth:`runtime.comm.Comm.edge` so the recorder counts it and autograd runs its
backward program) and brings the experts' output back through the combine AllToAll;
expert slicing keeps the buffer and computes only this rank's experts; expert tensor
parallelism holds a slice of each expert's hidden dim, so the output is a partial sum. Every
rank routes its own tokens with ``C`` from its own token count, as the plan priced.

The reference (:func:`reference`) routes all tokens as one group with ``C = T``: nothing
drops, so a plan whose capacity drops nothing (``capacity_factor ≥ experts / top_k``, or a
balanced router) matches it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ilp_planner.inputs.moe_routing import select
from ilp_planner.ir.graph import Op
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.moe_strategies import (
    COMBINE,
    COUNTS,
    DISPATCH,
    GLU_UNIT,
    HF_INTERLEAVED,
    RECEIVED,
    capacity,
    clamped_glu,
    dropless,
    expert_parallel,
    hf_experts,
    hf_form,
    moe_layouts,
    moe_programs,
)
from ilp_planner.plan.data import LayerPlan
from runtime.comm import LVal
from runtime.errors import RuntimeSetupError
from runtime.recorder import tagged


def route(x: torch.Tensor, router: torch.Tensor, op: Op,
          score_bias: torch.Tensor | None = None,
          router_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each ``(T, top_k)``: the router's logits (plus GPT-OSS's
    ``router_bias``) in float32, scored, grouped and selected as
    :func:`ilp_planner.inputs.moe_routing.select` says (softmax top-k; DeepSeek-V3's sigmoid
    with its correction bias ``score_bias``; group-limited). A router held in another dtype
    than the tokens (HunYuan's float32 router in a bfloat16 model) reads them in its own,
    as Hugging Face's does."""
    xr = x.to(router.dtype)
    logits = xr @ router if router_bias is None else xr @ router + router_bias
    weights, experts = select(torch, logits.float(), op.attrs, score_bias)
    return weights.to(x.dtype), experts


def _route(x: torch.Tensor, op: Op, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return route(x, p["router"], op, p.get("score_bias"), p.get("router_bias"))


def slots(experts: torch.Tensor, num_experts: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, kept) per routed copy, flattened token-major: expert ``e``'s copies take its
    slots ``e·C, e·C + 1, …`` in token order; a copy past ``C`` is dropped."""
    flat = experts.reshape(-1)
    one_hot = F.one_hot(flat, num_experts)
    pos = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return flat * cap + pos, pos < cap


def dispatch(x: torch.Tensor, slot: torch.Tensor, kept: torch.Tensor, top_k: int,
             num_experts: int, cap: int) -> torch.Tensor:
    """The ``(E, C, h)`` buffer of routed copies (empty slots zero)."""
    copies = x.repeat_interleave(top_k, dim=0)[kept]
    buf = x.new_zeros(num_experts * cap, x.shape[1]).index_add(0, slot[kept], copies)
    return buf.view(num_experts, cap, x.shape[1])


EXPERT_ROLES = ("w1", "w3", "w2", "b1", "b3", "b2")
"""The kernel's per-expert tensors (leading dim the experts): the projections, and GPT-OSS's
biases."""


def experts_mlp(buf: torch.Tensor, p: dict[str, torch.Tensor],
                glu: tuple[float, float] | None = None) -> torch.Tensor:
    """Each expert's MLP on its slots, batched over experts, from the roles of ``p``
    (:data:`EXPERT_ROLES`, leading dim the experts of ``buf``): SwiGLU
    ``(silu(xW1) ⊙ xW3)W2`` where ``w3`` is given, else GELU ``gelu(xW1)W2``; with ``glu``
    (GPT-OSS's alpha and limit) the biased projections and its clamped GLU
    (:func:`~ilp_planner.lowering.moe_strategies.clamped_glu`)."""
    hidden = _biased(torch.bmm(buf, p["w1"]), p.get("b1"))
    if glu is not None:
        act = clamped_glu(hidden, _biased(torch.bmm(buf, p["w3"]), p.get("b3")), *glu)
    elif p.get("w3") is not None:
        act = F.silu(hidden) * torch.bmm(buf, p["w3"])
    else:
        act = F.gelu(hidden)
    return _biased(torch.bmm(act, p["w2"]), p.get("b2"))


def _biased(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b[:, None, :]


def experts_of(p: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """The roles of experts ``lo`` to ``hi`` of those ``p`` holds."""
    return {r: p[r][lo:hi] for r in EXPERT_ROLES if p.get(r) is not None}


def glu_of(op: Op) -> tuple[float, float] | None:
    """GPT-OSS's GLU (alpha, limit), None for the other experts."""
    if hf_form(op) != HF_INTERLEAVED:
        return None
    return op.attr("glu_alpha") / GLU_UNIT, op.attr("glu_limit") / GLU_UNIT


def dense_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              w3: torch.Tensor | None) -> torch.Tensor:
    """The shared experts, fused into one dense MLP of the same form."""
    p = {"w1": w1[None], "w2": w2[None]} | ({} if w3 is None else {"w3": w3[None]})
    return experts_mlp(x[None], p)[0]


def combine(out: torch.Tensor, slot: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor,
            first: int, cap: int) -> torch.Tensor:
    """Σ over each token's kept copies of routing weight × expert output, reading the
    experts ``out`` holds (``(E_local, C, h)`` from expert ``first``): the rest add nothing."""
    local = slot - first * cap
    mine = kept & (local >= 0) & (local < out.shape[0] * cap)
    flat = out.reshape(-1, out.shape[-1])
    picked = flat[torch.where(mine, local, torch.zeros_like(local))]
    contrib = picked * (weights.reshape(-1, 1) * mine[:, None].to(weights.dtype))
    tokens = weights.shape[0]
    return contrib.view(tokens, -1, flat.shape[-1]).sum(dim=1)


def _shared(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if "shared_w1" not in p:
        return None
    return dense_mlp(x, p["shared_w1"], p["shared_w2"], p.get("shared_w3"))


def kernel_roles(op: Op, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The op's parameters by its roles (:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`)
    as the kernel's: an imported block's through :func:`hf_roles`."""
    if not hf_experts(op):
        return params
    roles = hf_roles(op, params)
    if "score_bias" in params:  # a Hugging Face router's buffer, handed in beside its tensors
        roles["score_bias"] = params["score_bias"]
    return roles


def reference(op: Op, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The op on full tensors (``params`` by role), every token in one group, none dropped."""
    params = kernel_roles(op, params)
    e, k, t = op.attr("experts"), op.attr("top_k"), x.shape[0]
    weights, chosen = _route(x, op, params)
    slot, kept = slots(chosen, e, t)
    out = experts_mlp(dispatch(x, slot, kept, k, e, t), params, glu_of(op))
    y = combine(out, slot, kept, weights, 0, t)
    shared = _shared(x, params)
    return y if shared is None else y + shared


def moe(ctx, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal], data: dict) -> LVal:
    """This rank's part of the MoE op (module docstring), ``ctx`` its
    :class:`runtime.ops.StageContext`."""
    x = xs[0]
    p = kernel_roles(op, {r: v.t for r, v in params.items()})
    y = local_moe(ctx.comm, op, lp, x.t, x.layout, p)
    return LVal(y, lp.output)


def hf_roles(op: Op, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face block's tensors by the op's roles
    (:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`) as the kernel's — views,
    so gradients reach the module's parameters: Mixtral's router ``(E, h)``, ``gate_up``
    ``(E, 2f, h)`` gate rows then up rows, ``down`` ``(E, h, f)``; GPT-OSS's ``gate_up``
    ``(E, h, 2f)`` gate and up columns alternating, ``down`` ``(E, f, h)``, and their biases
    (:func:`~ilp_planner.lowering.moe_strategies.hf_form`)."""
    router, gate_up, down = params["router"], params["gate_up"], params["down"]
    if hf_form(op) == HF_INTERLEAVED:
        gub = params["gate_up_bias"]
        return {"router": router.t(), "router_bias": params["router_bias"],
                "w1": gate_up[..., 0::2], "w3": gate_up[..., 1::2], "w2": down,
                "b1": gub[:, 0::2], "b3": gub[:, 1::2], "b2": params["down_bias"]}
    f = down.shape[2]
    return {"router": router.t(), "w1": gate_up[:, :f].transpose(1, 2),
            "w3": gate_up[:, f:].transpose(1, 2), "w2": down.transpose(1, 2)}


def local_moe(comm, op: Op, lp: LayerPlan, x: torch.Tensor, lay: Layout,
              p: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's block of the op's output from its block ``x`` (in layout ``lay``) and
    its parameter blocks ``p`` by the kernel's roles; ``comm`` (a :class:`runtime.comm.Comm`)
    runs the planned AllToAlls."""
    ep = expert_parallel(lay)
    want, out_layout, _ = moe_layouts(lay.fact, ep)
    if (lay, lp.output) != (want, out_layout):
        raise RuntimeSetupError(f"moe {op.name!r}: {lay} -> {lp.output} is not one of the MoE "
                                f"strategies' layouts ({want} -> {out_layout})")
    e, k = op.attr("experts"), op.attr("top_k")
    weights, chosen = _route(x, op, p)
    progs = moe_programs(op, lay, comm.cluster)
    if dropless(op):
        y = _dropless(comm, op, x, lay, p, weights, chosen, progs is not None)
        shared = _shared(x, p)
        return y if shared is None else y + shared
    cap = capacity(op, x.shape[0])
    slot, kept = slots(chosen, e, cap)
    buf = dispatch(x, slot, kept, k, e, cap)
    local = e // lay.fact[1].size
    first = 0 if ep else comm.coord(lay, 1) * local
    if progs is not None:
        buf = comm.edge(LVal(buf, progs[0].src), progs[0], DISPATCH, op.name).t
    elif not ep:
        buf = buf[first:first + local]
    out = experts_mlp(buf, p, glu_of(op))
    if progs is not None:
        out = comm.edge(LVal(out, progs[1].src), progs[1], COMBINE, op.name).t
    y = combine(out, slot, kept, weights, first, cap)
    shared = _shared(x, p)
    return y if shared is None else y + shared


class _Exchange(torch.autograd.Function):
    """A variable-size AllToAll of rows (``all_to_all_single`` with split sizes): ``send[q]``
    rows to the group's ``q``-th rank, ``recv[q]`` from it; the backward sends the
    gradients back the same way. ``purposes``: the (forward, backward) audit tags."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, send: list[int], recv: list[int],
                purposes: tuple[str, str], where: str) -> torch.Tensor:
        ctx.args = (group, send, recv, purposes[1], where)
        out = x.new_empty(sum(recv), x.shape[1])
        with tagged("forward", purposes[0], where):
            dist.all_to_all_single(out, x.detach().contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        group, send, recv, purpose, where = ctx.args
        gx = g.new_empty(sum(send), g.shape[1])
        with tagged("backward", purpose, where):
            dist.all_to_all_single(gx, g.contiguous(), send, recv, group=group)
        return gx, None, None, None, None, None


def _dropless(comm, op: Op, x: torch.Tensor, lay: Layout, p: dict[str, torch.Tensor],
              weights: torch.Tensor, chosen: torch.Tensor, exchange: bool) -> torch.Tensor:
    """Every routed copy computed, none padded (:func:`~ilp_planner.lowering.moe_strategies.dropless`):
    the copies sorted by expert; expert parallel (``exchange``), the per-expert counts
    first, then exactly the copies to the ranks owning their experts and the outputs back
    the same way; otherwise this rank's experts take their own copies. Each local expert's
    MLP runs on the rows it got; the outputs, unsorted, are weighted and summed per token
    (a partial sum where this rank holds some of the experts of replicated tokens)."""
    e, k, p1 = op.attr("experts"), op.attr("top_k"), lay.fact[1].size
    local = e // p1
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    copies = x.repeat_interleave(k, dim=0)[order]
    if exchange:
        group = comm.group(lay, (1,))
        got_counts = torch.empty_like(counts)
        with tagged("forward", COUNTS, op.name):
            dist.all_to_all_single(got_counts, counts, group=group)
        send = counts.view(p1, local).sum(1).tolist()
        recv = got_counts.view(p1, local).sum(1).tolist()
        got = _Exchange.apply(copies, group, send, recv, (DISPATCH, RECEIVED), op.name)
        expert_of = torch.arange(local).repeat(p1).repeat_interleave(got_counts)
    else:
        first = 0 if expert_parallel(lay) else comm.coord(lay, 1) * local
        lo, hi = int(counts[:first].sum()), int(counts[:first + local].sum())
        got = copies[lo:hi]
        expert_of = torch.arange(local).repeat_interleave(counts[first:first + local])
    out = torch.zeros_like(got)
    for j in range(local):
        rows = torch.nonzero(expert_of == j).squeeze(1)
        y = experts_mlp(got[rows][None], experts_of(p, j, j + 1), glu_of(op))[0]
        out = out.index_add(0, rows, y)
    if exchange:
        back = _Exchange.apply(out, group, recv, send, (RECEIVED, COMBINE), op.name)
    else:
        back = torch.cat([out.new_zeros(lo, out.shape[1]), out,
                          out.new_zeros(copies.shape[0] - hi, out.shape[1])])
    unsorted = torch.zeros_like(back).index_copy(0, order, back)
    return (unsorted.view(x.shape[0], k, -1) * weights[..., None]).sum(dim=1)
