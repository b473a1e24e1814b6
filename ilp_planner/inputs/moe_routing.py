"""How the ``moe`` op routes, in torch: one implementation for the runtime's kernel
(:func:`runtime.moe.route`) and the importer's stand-in for a Hugging Face block
(:mod:`ilp_planner.inputs.lift_moe`), so that what the importer checks against the block
is what the runtime executes.

The rules, read from the op's integer attributes (:mod:`ilp_planner.ir.graph`)::

    scores   softmax(logits)                      (Mixtral, Qwen2-MoE, DeepSeek-V2)
             sigmoid(logits)                      attrs.sigmoid (DeepSeek-V3)
    choice   scores + bias                        a sigmoid router's correction bias,
                                                  which only selects
    groups   attrs.groups groups of experts; keep the attrs.topk_groups best — by their
             best choice score (softmax, DeepSeek-V2's group_limited_greedy) or the sum of
             their two best (sigmoid, DeepSeek-V3) — and pick the top_k among their experts
    weights  the chosen experts' scores, renormalised where attrs.norm_topk, times
             attrs.route_scale thousandths (routed_scaling_factor)

torch is passed in: this layer imports it lazily, and the callers hold it already.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ilp_planner.lowering.moe_strategies import ROUTE_SCALE_UNIT

ROUTING_KEYS = ("top_k", "norm_topk", "sigmoid", "route_scale", "groups", "topk_groups")
"""The attributes routing reads, in the order the importer's custom op takes them."""
ROUTING_DEFAULTS = {"norm_topk": 1, "sigmoid": 0, "route_scale": ROUTE_SCALE_UNIT, "groups": 1,
                    "topk_groups": 1}


def routing_values(attrs: Mapping[str, int]) -> list[int]:
    """``attrs`` as the list :data:`ROUTING_KEYS` orders (defaults where absent)."""
    return [int(attrs.get(k, ROUTING_DEFAULTS.get(k, 0))) for k in ROUTING_KEYS]


def select(torch: Any, logits: Any, attrs: Mapping[str, int], bias: Any = None) -> tuple[Any, Any]:
    """(weights, experts), each ``(T, top_k)``, from the router's float32 ``logits``
    ``(T, E)`` by the rules of the module docstring. A ``bias`` that is a parameter gets
    a gradient of exactly zero (it only selects), not none, as every parameter does."""
    a = {**ROUTING_DEFAULTS, **attrs}
    sigmoid = bool(a["sigmoid"])
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    groups, keep = a["groups"], a["topk_groups"]
    if keep < groups:
        t, e = choice.shape
        per = choice.view(t, groups, e // groups)
        rank = per.topk(2, dim=-1).values.sum(-1) if sigmoid else per.amax(-1)
        kept = torch.zeros_like(rank, dtype=torch.bool).scatter(1, rank.topk(keep, dim=-1).indices,
                                                                True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // groups, dim=1), float("-inf"))
    experts = choice.topk(a["top_k"], dim=-1).indices
    weights = scores.gather(1, experts)
    if bias is not None and bias.requires_grad:
        weights = weights + 0.0 * bias.float()[experts]
    if a["norm_topk"]:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * (a["route_scale"] / ROUTE_SCALE_UNIT), experts
