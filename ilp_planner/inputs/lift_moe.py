"""Mixture-of-experts blocks of imported models, recognised from their ``nn.Module``s and
lifted as one :data:`OpKind.MOE <ilp_planner.ir.graph.OpKind>` op.

``torch.export`` of a routed block records its data-dependent parts (``topk``, the
per-expert token gather, ``index_add``) as ops no strategy reads. So before exporting, the
importer finds every block built the Hugging Face way — a ``gate`` (or ``router``) with a
2-D ``weight (E, h)`` (its own, or HunYuan-MoE's linear ``wg``'s) and ``top_k``, and
``experts`` holding 3-D ``gate_up_proj (E, 2f, h)`` and ``down_proj (E, h, f)`` with a SiLU
activation, a module or the function (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE,
HunYuan-MoE, DeepSeek-V2, DeepSeek-V3, MiniMax-M2, HY-V3, LFM2-MoE), or GPT-OSS's form:
``gate_up_proj (E, h, 2f)`` with gate and up columns alternating, ``down_proj (E, f, h)``, a
bias on each and on the router, and a GLU clamped at ``limit`` with slope ``alpha``
(:func:`experts_form`) — and for the export only makes the router a pass-through and the
experts one call of the custom op ``ilp_planner::moe_experts`` (the router's routing, the
experts, weighted sum), which the walk lifts here. Structure is not behaviour: each block is
first run both ways on one random input (its router's logits spread well apart, so every
scoring differs), and one whose own output the op does not reproduce (PhiMoE's sparse mixer
has Mixtral's structure) is refused. The parameters keep their module paths, so the op owns
the router's and the experts' parameters; a block's shared experts (Qwen2-MoE's
``shared_expert``, DeepSeek's ``shared_experts``) stay outside the op, traced as the dense
MLP and gate they are.

Routers (:func:`routing_attrs`): Mixtral's and Qwen's renormalised softmax top-k (GPT-OSS's
and GraniteMoE's softmax over the top-k logits is the same weights), DeepSeek-V2's softmax
top-k (greedy or group-limited) and DeepSeek-V3's sigmoid scores with a correction bias (a
buffer the op reads at run time, never a parameter it owns: :func:`correction_bias`, the
router's or the block's) chosen within groups, each scaled by ``routed_scaling_factor`` —
routed by :func:`~ilp_planner.inputs.moe_routing.select`, which the runtime's kernel runs
too. A router none of these describes (another ``topk_method``, groups that do not divide
the experts) is refused with an error naming the config field rather than priced and run as
something else.

Routing is dropless, as Hugging Face runs it (``attrs.dropless``: variable-size exchanges of
exactly the routed tokens, :func:`~ilp_planner.lowering.moe_strategies.dropless`); the op's
capacity factor, ``E / top_k``, is what a capacity buffer dropping nothing would take. The
op's parameter roles are the module's own tensors (``attrs.hf_experts``,
:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`), which ``parallelize`` runs
through :mod:`runtime.applied_moe`.

torch is the importer's lazy dependency: these functions receive the module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.lift_graph import DraftGraph
from ilp_planner.inputs.lift_values import Act, Call, dtype_of, numel, param_name
from ilp_planner.inputs.moe_routing import ROUTING_DEFAULTS, ROUTING_KEYS, routing_values, select
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.moe_strategies import (
    GLU_UNIT,
    HF_FUSED,
    HF_INTERLEAVED,
    ROUTE_SCALE_UNIT,
    clamped_glu,
)

MOE_OP = "moe_experts"
_REGISTERED: dict[str, Any] = {}  # the custom op, registered once per process


def correction_bias(block: Any, gate: Any) -> Any:
    """A sigmoid router's correction bias (``e_score_correction_bias``, a buffer): the
    router's own (DeepSeek-V3's), or the block's, which hands it to the router
    (MiniMax-M2's, HY-V3's; LFM2-MoE's ``expert_bias``); None for a softmax router."""
    for holder, name in ((gate, "e_score_correction_bias"), (block, "e_score_correction_bias"),
                         (block, "expert_bias")):
        bias = getattr(holder, name, None)
        if bias is not None:
            return bias
    return None


def routing_attrs(path: str, block: Any, gate: Any) -> dict[str, int]:
    """The op's routing attributes (:mod:`ilp_planner.inputs.moe_routing`) for the router at
    ``path`` of ``block``: Mixtral's and Qwen's renormalised softmax top-k
    (``norm_topk_prob``), DeepSeek-V2's softmax top-k never renormalised, greedy or
    group-limited (``topk_method``), DeepSeek-V3's sigmoid with a correction bias
    (:func:`correction_bias`) and groups, either scaled by ``routed_scaling_factor`` (HY-V3's
    ``router_scaling_factor``). Raises :class:`ConfigError` naming the config field where
    the routing is none of these."""
    where = f"cannot import the MoE router {path} ({type(gate).__name__})"
    scale = float(getattr(gate, "routed_scaling_factor",
                          getattr(gate, "router_scaling_factor", 1.0)))
    pm = round(ROUTE_SCALE_UNIT * scale)
    if pm <= 0 or abs(pm - ROUTE_SCALE_UNIT * scale) > 1e-6 * ROUTE_SCALE_UNIT:
        raise ConfigError(f"{where}: routed_scaling_factor={scale:g}; the moe op holds a "
                          "positive multiple of 0.001")
    # a sigmoid router has a correction bias, or (LFM2-MoE's) flags whether it has one:
    # sigmoid scores either way — a meta import, which runs no check, must not take it
    # for a softmax one
    sigmoid = correction_bias(block, gate) is not None or hasattr(gate, "use_expert_bias")
    method = getattr(gate, "topk_method", None)
    if method not in (None, "greedy", "group_limited_greedy"):
        raise ConfigError(f"{where}: topk_method={method!r}; expected 'greedy' or "
                          "'group_limited_greedy'")
    grouped = sigmoid or method == "group_limited_greedy"
    groups = (int(getattr(gate, "num_group", 1)), int(getattr(gate, "topk_group", 1)))
    experts = router_weight(gate).shape[0]
    if grouped and (groups[0] < 1 or experts % groups[0] or not 1 <= groups[1] <= groups[0]):
        raise ConfigError(f"{where}: n_group={groups[0]}, topk_group={groups[1]}; expected "
                          f"n_group dividing the {experts} experts and 1 <= topk_group <= n_group")
    norm = bool(getattr(gate, "norm_topk_prob", True)) if method is None else False
    attrs = {"norm_topk": int(norm), "sigmoid": int(sigmoid), "route_scale": pm}
    if grouped and groups[1] < groups[0]:
        attrs.update(groups=groups[0], topk_groups=groups[1])
    return attrs


ROUTER_NAMES = ("gate", "router")
"""The attribute a Hugging Face block holds its router under: Mixtral's, Qwen's, OLMoE's and
DeepSeek's ``gate``; GraniteMoE's ``router``."""


def hf_router(block: Any) -> Any:
    """The block's router module (:data:`ROUTER_NAMES`), or None."""
    return next((r for n in ROUTER_NAMES if (r := getattr(block, n, None)) is not None), None)


def router_weight(gate: Any) -> Any:
    """The router's ``(E, h)`` weight: its own ``weight``, or that of the linear it holds as
    ``wg`` (HunYuan-MoE's), or None."""
    w = getattr(gate, "weight", None)
    return w if w is not None else getattr(getattr(gate, "wg", None), "weight", None)


def moe_blocks(root: Any) -> list[tuple[str, Any, Any]]:
    """(block path, router, experts) of every routed block of ``root`` the op can stand for."""
    out = []
    for path, block in root.named_modules():
        gate, experts = hf_router(block), getattr(block, "experts", None)
        if experts_form(gate, experts):
            out.append((path, gate, experts))
    return out


def experts_form(gate: Any, experts: Any) -> int:
    """The block's tensors' form (:data:`~ilp_planner.lowering.moe_strategies.HF_FUSED`:
    ``gate_up_proj (E, 2f, h)``, ``down_proj (E, h, f)``, SiLU;
    :data:`~ilp_planner.lowering.moe_strategies.HF_INTERLEAVED`: GPT-OSS's ``(E, h, 2f)``
    and ``(E, f, h)`` with biases, the router's too, and a clamped GLU), or 0: not a block
    the op stands for."""
    w = router_weight(gate)
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if (w is None or gu is None or down is None or not hasattr(gate, "top_k")
            or w.dim() != 2 or gu.dim() != 3 or down.dim() != 3):
        return 0
    e, h = w.shape
    act = getattr(experts, "act_fn", None)  # a module, or the function (LFM2-MoE's)
    if type(act).__name__ in ("SiLU", "SiLUActivation") or getattr(act, "__name__", "") == "silu":
        return HF_FUSED
    f = down.shape[1]
    biases = (getattr(gate, "bias", None), getattr(experts, "gate_up_proj_bias", None),
              getattr(experts, "down_proj_bias", None))
    if (tuple(gu.shape) == (e, h, 2 * f) and tuple(down.shape) == (e, f, h)
            and None not in biases and hasattr(experts, "alpha") and hasattr(experts, "limit")):
        return HF_INTERLEAVED
    return 0


def _glu_values(experts: Any) -> list[int]:
    """GPT-OSS's GLU constants ``[alpha, limit]`` in thousandths (``attrs.glu_alpha``,
    ``attrs.glu_limit``), refused where thousandths do not hold them."""
    out = []
    for name in ("alpha", "limit"):
        v = float(getattr(experts, name))
        q = round(GLU_UNIT * v)
        if q <= 0 or abs(q - GLU_UNIT * v) > 1e-6 * GLU_UNIT:
            raise ConfigError(f"cannot import the MoE experts {type(experts).__name__}: "
                              f"{name}={v:g}; the moe op holds a positive multiple of 0.001")
        out.append(q)
    return out


def _custom_op(torch: Any) -> Any:
    """``ilp_planner::moe_experts(x, router, gate_up, down, bias, routing)``: the routed
    experts' output, routed by :func:`~ilp_planner.inputs.moe_routing.select` (``routing``:
    the values of :data:`~ilp_planner.inputs.moe_routing.ROUTING_KEYS`; ``bias`` a sigmoid
    router's correction bias) and computed as Hugging Face's expert loop does (a meta tensor
    gives its shape)."""
    if MOE_OP in _REGISTERED:
        return _REGISTERED[MOE_OP]
    F = torch.nn.functional

    @torch.library.custom_op(f"ilp_planner::{MOE_OP}", mutates_args=(), schema=(
        "(Tensor x, Tensor router, Tensor gate_up, Tensor down, Tensor? bias, int[] routing, "
        "Tensor? router_bias=None, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
        "int[] glu=[]) -> Tensor"))
    def moe_experts(x: Any, router: Any, gate_up: Any, down: Any, bias: Any,
                    routing: list[int], router_bias: Any = None, gate_up_bias: Any = None,
                    down_bias: Any = None, glu: Sequence[int] = ()) -> Any:
        if x.is_meta:
            return torch.empty_like(x)
        weights, chosen = select(torch, F.linear(x.to(router.dtype), router, router_bias).float(),
                                 dict(zip(ROUTING_KEYS, routing, strict=True)), bias)
        out = torch.zeros_like(x)
        for e in range(gate_up.shape[0]):
            tok, slot = torch.where(chosen == e)
            if glu:  # GPT-OSS: (h, 2f) gate/up columns alternating, biases, clamped GLU
                gu = x[tok] @ gate_up[e] + gate_up_bias[e]
                act = clamped_glu(gu[..., ::2], gu[..., 1::2], glu[0] / GLU_UNIT,
                                  glu[1] / GLU_UNIT)
                y = act @ down[e] + down_bias[e]
            else:
                g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, down[e])
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
        return out

    @moe_experts.register_fake
    def _(x, router, gate_up, down, bias, routing, router_bias=None, gate_up_bias=None,
          down_bias=None, glu=()):
        return torch.empty_like(x)

    _REGISTERED[MOE_OP] = moe_experts
    return moe_experts


@contextmanager
def routed_as_one_op(root: Any, torch: Any) -> Iterator[int]:
    """While exporting: every block of :func:`moe_blocks` routes through the custom op
    (instance ``forward``s, removed afterwards), each checked first to compute what the
    block computes (:func:`_check_reproduced`); yields how many blocks it covers."""
    blocks = moe_blocks(root)
    op = _custom_op(torch) if blocks else None
    # every refusal of the routing or the GLU constants before any forward is swapped
    stand_ins = []
    for path, gate, experts in blocks:
        block = root.get_submodule(path)
        routing = routing_attrs(_router_path(root, path, gate), block, gate)
        stand_ins.append(_stand_in(op, gate, experts, correction_bias(block, gate),
                                   routing_values({"top_k": int(gate.top_k), **routing})))
    swapped: list[tuple[Any, Any]] = []
    try:
        for (path, gate, experts), stand_in in zip(blocks, stand_ins, strict=True):
            block = root.get_submodule(path)
            want = _block_output(block, gate, torch)
            gate.forward = lambda x, *_: (x, x, x)  # (MiniMax-M2's takes the bias too)
            experts.forward = stand_in
            swapped.append((gate, experts))
            if want is not None:
                _check_reproduced(path, block, gate, want,
                                  _swapped_output(path, block, gate, torch), torch)
        yield len(blocks)
    finally:
        for gate, experts in swapped:
            del gate.forward, experts.forward


def _stand_in(op: Any, gate: Any, experts: Any, score_bias: Any, routing: list[int]) -> Any:
    """The experts module's forward during the export: one call of the custom op on the
    block's tensors (GPT-OSS's with its biases and GLU constants; ``score_bias``: a sigmoid
    router's :func:`correction_bias`)."""
    if experts_form(gate, experts) == HF_INTERLEAVED:
        glu = _glu_values(experts)
        return lambda x, *_: op(x, router_weight(gate), experts.gate_up_proj, experts.down_proj,
                                score_bias, routing, gate.bias, experts.gate_up_proj_bias,
                                experts.down_proj_bias, glu)
    return lambda x, *_: op(x, router_weight(gate), experts.gate_up_proj, experts.down_proj,
                            score_bias, routing)


def _router_path(root: Any, path: str, gate: Any) -> str:
    """The router's module path (under whichever of :data:`ROUTER_NAMES` it is held)."""
    block = root.get_submodule(path)
    name = next(n for n in ROUTER_NAMES if getattr(block, n, None) is gate)
    return f"{path}.{name}" if path else name


CHECK_TOKENS_PER_EXPERT = 4
"""Tokens per expert in the random input :func:`_block_output` runs a block on."""
CHECK_LOGIT_STD = 2.0
"""The spread of the router's logits on that input (it is scaled so)."""


def _block_output(block: Any, gate: Any, torch: Any) -> Any:
    """The block's output on a fixed random input of ``CHECK_TOKENS_PER_EXPERT`` tokens
    per expert (no gradient; the global random state left as it was, so every rank of a
    launch that imports on one rank draws alike afterwards); None where its weights are
    on the meta device: nothing to compute, so a meta import goes by structure alone.

    The input is scaled so that the router's logits spread by ``CHECK_LOGIT_STD``: a freshly
    initialised router's are near zero, where every scoring gives nearly equal weights — a
    sigmoid router checked as a softmax one differed by 1e-4 (MiniMax-M2's), at the edge of
    the tolerance."""
    w = router_weight(gate)
    if w.is_meta:
        return None
    experts, hidden = w.shape
    x = torch.randn(1, CHECK_TOKENS_PER_EXPERT * experts, hidden,
                    generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        spread = float((x @ w.T).float().std())
    if spread > 0:
        x = x * (CHECK_LOGIT_STD / spread)
    # in the experts' dtype: a router may be held in another (HunYuan's float32 router in
    # a bfloat16 model reads the tokens in float32)
    x = x.to(block.experts.down_proj.dtype)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # a block drawing noise draws alike in both runs
        out = block(x)
    return next(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def _swapped_output(path: str, block: Any, gate: Any, torch: Any) -> Any:
    """:func:`_block_output` with the moe op in place of the router and the experts; a
    block whose own code cannot run so (Llama 4's unpacks two values from its router and
    scales the experts' inputs by its scores) is refused naming it."""
    try:
        return _block_output(block, gate, torch)
    except (TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise ConfigError(
            f"cannot import the MoE block {path} ({type(block).__name__}, router "
            f"{type(gate).__name__}): its forward does not run around one moe op routed by "
            f"softmax or sigmoid top-k in place of its router and experts "
            f"({type(exc).__name__}: {exc}) — it routes another way, which the planner "
            f"cannot price or run") from None


def _check_reproduced(path: str, block: Any, gate: Any, want: Any, got: Any,
                      torch: Any) -> None:
    """Raises :class:`ConfigError` where the op's output (``got``) is not the block's own
    (``want``) on the same input: a router whose scores, selection or weights the routing
    attributes do not describe (PhiMoE's sparse mixer, jitter noise while training), or
    experts computing something else, would otherwise be planned and run as Mixtral's."""
    half = want.dtype in (torch.float16, torch.bfloat16)
    rtol, atol = (2e-2, 2e-2) if half else (1e-4, 1e-5)
    if got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol, atol):
        return
    gap = (got.float() - want.float()).abs().max().item() if got.shape == want.shape \
        else f"shape {tuple(got.shape)} against {tuple(want.shape)}"
    raise ConfigError(
        f"cannot import the MoE block {path} ({type(block).__name__}, router "
        f"{type(gate).__name__}): one moe op routed by softmax or sigmoid top-k does not "
        f"compute what the block computes on a random input (largest difference {gap}) — "
        f"its router scores, selects or weights experts another way (a sparse mixer, "
        f"noise drawn while training), which the planner cannot price or run; "
        f"model.eval() if the difference is training-time noise")


def lift_moe(g: DraftGraph, call: Call) -> Any:
    """The custom op's node → one MoE op owning the router and the experts' parameters."""
    x, router, gate_up, down, _bias, routing = call.args[:6]
    biases = [a for a in call.args[6:9] if a is not None]  # GPT-OSS's router, gate/up, down
    glu = call.args[9] if len(call.args) > 9 else []
    names = [param_name(p) for p in (router, gate_up, down, *biases)]
    if not isinstance(x, Act) or None in names or (biases or glu) and (
            len(biases) != 3 or len(glu) != 2):
        return g.opaque(call.node, call.args, call.acts, call.val, MOE_OP)
    e, h = g.param_shape[names[0]]
    f = math.prod(g.param_shape[names[1]]) // (2 * e * h)
    tokens = numel(call.val.shape) // h
    attrs = dict(zip(ROUTING_KEYS, (int(v) for v in routing), strict=True))
    k = attrs["top_k"]
    flops = 2.0 * tokens * h * (e + 3 * k * f)
    form = {"hf_experts": HF_INTERLEAVED, "glu_alpha": int(glu[0]),
            "glu_limit": int(glu[1])} if glu else {"hf_experts": HF_FUSED}
    # named ``<experts module>.moe`` even where that module has no children (GPT-OSS's):
    # the runtime finds the module it swaps the kernel into by that name
    act = g.add(call.node, OpKind.MOE, [g.ir(call.node, x)], (tokens, h), dtype_of(call.val),
                main=False, weight=(e, h, f), params=names, flops=flops, experts=e, ffn=f,
                capacity_pct=-(-100 * e // k), swiglu=1, **form, dropless=1,
                shared=0, shared_ffn=0, **_routing_only(attrs))
    return Act(act.src, tuple(call.val.shape), act.dtype)


def _routing_only(attrs: dict[str, int]) -> dict[str, int]:
    """The routing attributes an op records: top_k and norm_topk always, the others only
    where they differ from the softmax top-k (so a Mixtral op's attributes stay as they
    were), the group pair together."""
    grouped = attrs["topk_groups"] < attrs["groups"]
    return {k: v for k, v in attrs.items() if k in ("top_k", "norm_topk")
            or (grouped and k in ("groups", "topk_groups")) or v != ROUTING_DEFAULTS[k]}
