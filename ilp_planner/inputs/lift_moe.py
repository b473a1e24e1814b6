"""Mixture-of-experts blocks of imported models, recognised from their ``nn.Module``s and
lifted as one :data:`OpKind.MOE <ilp_planner.ir.graph.OpKind>` op.

``torch.export`` of a routed block records its data-dependent parts (``topk``, the
per-expert token gather, ``index_add``) as ops no strategy reads. So before exporting, the
importer finds every block built the Hugging Face way — a ``gate`` router with a 2-D
``weight (E, h)`` and ``top_k``, and ``experts`` holding 3-D ``gate_up_proj (E, 2f, h)`` and
``down_proj (E, h, f)`` with a SiLU activation (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V2) — and for the export only makes the router a pass-through and the experts one
call of the custom op ``ilp_planner::moe_experts`` (softmax, top-k, renormalised where the
router's ``norm_topk_prob`` says so, SwiGLU experts, weighted sum), which the walk lifts
here. The parameters keep their module paths, so the op owns the router's and the experts'
parameters; a block's shared experts (Qwen2-MoE's ``shared_expert``, DeepSeek's
``shared_experts``) stay outside the op, traced as the dense MLP and gate they are.

A router is taken only where the op computes what it does (:func:`routing_norm`):
DeepSeek-V2's ``greedy`` top-k of the softmax is the op without renormalisation; a router
whose routing differs — weights scaled by ``routed_scaling_factor``, group-limited selection
that drops groups, DeepSeek-V3's sigmoid scores with ``e_score_correction_bias`` — is
refused with an error naming the config field rather than priced and run as something else.

Routing is dropless, as Hugging Face runs it (``attrs.dropless``: variable-size exchanges of
exactly the routed tokens, :func:`~ilp_planner.lowering.moe_strategies.dropless`); the op's
capacity factor, ``E / top_k``, is what a capacity buffer dropping nothing would take. The
op's parameter roles are the module's own tensors (``attrs.hf_experts``,
:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`), which ``parallelize`` runs
through :mod:`runtime.applied_moe`.

torch is the importer's lazy dependency: these functions receive the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.lift_graph import DraftGraph
from ilp_planner.inputs.lift_values import Act, Call, dtype_of, numel, param_name
from ilp_planner.ir.graph import OpKind

MOE_OP = "moe_experts"
_REGISTERED: dict[str, Any] = {}  # the custom op, registered once per process


def routing_norm(path: str, gate: Any) -> bool:
    """Whether the router at ``path`` renormalises its top-k weights (``norm_topk_prob``,
    Mixtral's always, DeepSeek-V2's never); raises :class:`ConfigError` naming the config
    field where its routing is not the op's softmax top-k (module docstring)."""
    where = f"cannot import the MoE router {path} ({type(gate).__name__})"
    if hasattr(gate, "e_score_correction_bias"):
        raise ConfigError(f"{where}: it routes on sigmoid scores plus e_score_correction_bias "
                          "(DeepSeek-V3); the moe op routes on the softmax's top-k")
    scale = float(getattr(gate, "routed_scaling_factor", 1.0))
    if scale != 1.0:
        raise ConfigError(f"{where}: routed_scaling_factor={scale:g} scales the routing "
                          "weights; the moe op supports only routed_scaling_factor=1.0")
    method = getattr(gate, "topk_method", None)
    if method is None:
        return bool(getattr(gate, "norm_topk_prob", True))
    groups = (getattr(gate, "num_group", 1), getattr(gate, "topk_group", 1))
    if method != "greedy" and not (method == "group_limited_greedy" and groups[0] == groups[1]):
        raise ConfigError(f"{where}: topk_method={method!r} with n_group={groups[0]}, "
                          f"topk_group={groups[1]} drops expert groups; expected 'greedy' "
                          "(or topk_group == n_group)")
    return False


def moe_blocks(root: Any) -> list[tuple[str, Any, Any]]:
    """(block path, router, experts) of every routed block of ``root`` the op can stand for."""
    out = []
    for path, block in root.named_modules():
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        w = getattr(gate, "weight", None)
        gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if (w is None or gu is None or down is None or not hasattr(gate, "top_k")
                or w.dim() != 2 or gu.dim() != 3 or down.dim() != 3):
            continue
        if type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            continue
        out.append((path, gate, experts))
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
    norms = [routing_norm(f"{path}.gate", gate) for path, gate, _ in blocks]
    for (_, gate, experts), norm in zip(blocks, norms, strict=True):
        gate.forward = lambda x, _g=gate: (x, x, x)
        experts.forward = (lambda x, _i, _w, _g=gate, _e=experts, _n=norm:
                           op(x, _g.weight, _e.gate_up_proj, _e.down_proj, int(_g.top_k), _n))
    try:
        yield len(blocks)
    finally:
        for _, gate, experts in blocks:
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
