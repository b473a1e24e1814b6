"""Mixture-of-experts blocks of imported models, recognised from their ``nn.Module``s and
lifted as one :data:`OpKind.MOE <ilp_planner.ir.graph.OpKind>` op.

``torch.export`` of a routed block records its data-dependent parts (``topk``, the
per-expert token gather, ``index_add``) as ops no strategy reads. So before exporting, the
importer finds every block built the Hugging Face way — a ``gate`` router with a 2-D
``weight (E, h)`` and ``top_k``, and ``experts`` holding 3-D ``gate_up_proj (E, 2f, h)`` and
``down_proj (E, h, f)`` with a SiLU activation (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) — and
for the export only makes the router a pass-through and the experts one call of the custom
op ``ilp_planner::moe_experts`` (softmax, top-k, renormalised where the router's
``norm_topk_prob`` says so, SwiGLU experts, weighted sum), which the walk lifts here. The
parameters keep their module paths, so the op owns the router's and the experts'
parameters; a block's shared expert (Qwen2-MoE) stays outside the op, traced as the dense
MLP and gate it is. Routing is dropless, as Hugging Face runs it (``attrs.dropless``:
variable-size exchanges of exactly the routed tokens,
:func:`~ilp_planner.lowering.moe_strategies.dropless`); the op's capacity factor,
``E / top_k``, is what a capacity buffer dropping nothing would take. The op's parameter
roles are the module's own tensors (``attrs.hf_experts``,
:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`), which ``parallelize`` runs
through :mod:`runtime.applied_moe`.

torch is the importer's lazy dependency: these functions receive the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ilp_planner.inputs.lift_graph import DraftGraph
from ilp_planner.inputs.lift_values import Act, Call, dtype_of, numel, param_name
from ilp_planner.ir.graph import OpKind

MOE_OP = "moe_experts"
_REGISTERED: dict[str, Any] = {}  # the custom op, registered once per process


def moe_blocks(root: Any) -> list[tuple[Any, Any]]:
    """(router, experts) of every routed block of ``root`` the op can stand for."""
    out = []
    for block in root.modules():
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        w = getattr(gate, "weight", None)
        gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if (w is None or gu is None or down is None or not hasattr(gate, "top_k")
                or w.dim() != 2 or gu.dim() != 3 or down.dim() != 3):
            continue
        if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            continue
        out.append((gate, experts))
    return out


def _custom_op(torch: Any) -> Any:
    """``ilp_planner::moe_experts(x, router, gate_up, down, top_k, norm)``: the routed
    experts' output, computed as Hugging Face's loop does (a meta tensor gives its shape)."""
    if MOE_OP in _REGISTERED:
        return _REGISTERED[MOE_OP]
    F = torch.nn.functional

    @torch.library.custom_op(f"ilp_planner::{MOE_OP}", mutates_args=(), schema=(
        "(Tensor x, Tensor router, Tensor gate_up, Tensor down, int top_k, bool norm) -> Tensor"))
    def moe_experts(x: Any, router: Any, gate_up: Any, down: Any, top_k: int, norm: bool) -> Any:
        if x.is_meta:
            return torch.empty_like(x)
        probs = torch.softmax(F.linear(x, router).float(), dim=-1)
        weights, chosen = probs.topk(top_k, dim=-1)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(gate_up.shape[0]):
            tok, slot = torch.where(chosen == e)
            g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, down[e]) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out

    @moe_experts.register_fake
    def _(x, router, gate_up, down, top_k, norm):
        return torch.empty_like(x)

    _REGISTERED[MOE_OP] = moe_experts
    return moe_experts


@contextmanager
def routed_as_one_op(root: Any, torch: Any) -> Iterator[int]:
    """While exporting: every block of :func:`moe_blocks` routes through the custom op
    (instance ``forward``s, removed afterwards); yields how many blocks it covers."""
    blocks = moe_blocks(root)
    op = _custom_op(torch) if blocks else None
    for gate, experts in blocks:
        norm = bool(getattr(gate, "norm_topk_prob", True))
        gate.forward = lambda x, _g=gate: (x, x, x)
        experts.forward = (lambda x, _i, _w, _g=gate, _e=experts, _n=norm:
                           op(x, _g.weight, _e.gate_up_proj, _e.down_proj, int(_g.top_k), _n))
    try:
        yield len(blocks)
    finally:
        for gate, experts in blocks:
            del gate.forward, experts.forward


def lift_moe(g: DraftGraph, call: Call) -> Any:
    """The custom op's node → one MoE op owning the router and the experts' parameters."""
    x, router, gate_up, down, top_k, norm = call.args[:6]
    names = [param_name(p) for p in (router, gate_up, down)]
    if not isinstance(x, Act) or None in names:
        return g.opaque(call.node, call.args, call.acts, call.val, MOE_OP)
    e, h = g.param_shape[names[0]]
    f = g.param_shape[names[2]][2]
    tokens = numel(call.val.shape) // h
    k = int(top_k)
    flops = 2.0 * tokens * h * (e + 3 * k * f)
    act = g.add(call.node, OpKind.MOE, [g.ir(call.node, x)], (tokens, h), dtype_of(call.val),
                weight=(e, h, f), params=names, flops=flops, experts=e, top_k=k, ffn=f,
                capacity_pct=-(-100 * e // k), swiglu=1,
                norm_topk=int(bool(norm)), hf_experts=1, dropless=1,
                shared=0, shared_ffn=0)
    return Act(act.src, tuple(call.val.shape), act.dtype)
