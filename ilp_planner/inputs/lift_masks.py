"""What hand-written attention's scores see between ``q @ kᵀ`` and the softmax: no mask
(bidirectional), a causal mask, or something else — decided from the traced graph by
evaluating the constants the scores are masked with, never by their names.

The runtime's executor runs plain causal attention (:func:`runtime.model.attention`); an
imported attention it would run as another computation is marked
``attrs.not_plain_causal`` (:func:`ilp_planner.inputs.lift_layers.lift_matmul`) so the
executor refuses it. The scores' mask state travels with the scores activation
(``Act.parts["mask"]``), one of :data:`NO_MASK`, :data:`CAUSAL`, :data:`OTHER`, updated by
each step on them (:func:`after_step`):

* a product / quotient with a scalar (the ``1/√d`` scale), a scalar added: unchanged
  (softmax is shift-invariant); views and casts: unchanged;
* ``masked_fill(mask, v)``, ``where(cond, scores, v)`` / ``where(cond, v, scores)`` or an
  additive tensor, whose mask and fill are constants: the pattern of kept positions is
  evaluated (:class:`ConstantValues`) and compared with the lower triangle for this
  sequence length; the masked positions must be −∞ or the dtype's lowest value (Hugging
  Face's ``finfo.min``), whose exponential after the softmax's max subtraction is exactly
  0 — any other additive values are a bias (ALiBi-like): :data:`OTHER`;
* anything else (a mask computed from the inputs — padding —, a tanh soft-cap, a product
  with a tensor): :data:`OTHER`.
"""

from __future__ import annotations

from typing import Any

NO_MASK, CAUSAL, OTHER = "none", "causal", "other"

MASK_EVAL_LIMIT = 1 << 24
"""Most elements of one constant the importer evaluates (a 4,096² mask): a larger mask is
not evaluated and the attention stays unproven (:data:`OTHER`), refused by the executor —
which trains tiny models on CPU — and still planned and run by ``parallelize``."""

SCALE_OPS = frozenset({"mul", "div", "true_divide", "add", "sub"})
MASK_OPS = frozenset({"masked_fill", "where", "add"})


class ConstantValues:
    """The real value of a node no model input flows into: evaluated from the exported
    program's buffers and lifted constants and the aten ops between them, on the CPU; None
    where it reads a parameter or a model input, a tensor without data (``meta``), or is
    larger than :data:`MASK_EVAL_LIMIT`."""

    def __init__(self, ep: Any, torch: Any):
        sig = ep.graph_signature
        stored = {**ep.state_dict, **ep.constants}
        names = {**sig.inputs_to_buffers,
                 **(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})}
        self.torch = torch
        self._stored = {ph: stored.get(name) for ph, name in names.items()}
        self._cache: dict[str, Any] = {}

    def __call__(self, a: Any) -> Any:
        torch = self.torch
        if isinstance(a, (list, tuple)):
            vals = [self(x) for x in a]
            return None if any(v is None for v in vals) else type(a)(vals)
        if not isinstance(a, torch.fx.Node):
            return torch.device("cpu") if isinstance(a, torch.device) else a
        if a.name not in self._cache:
            self._cache[a.name] = self._evaluate(a)
        return self._cache[a.name]

    def _evaluate(self, node: Any) -> Any:
        torch = self.torch
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > MASK_EVAL_LIMIT:
            return None
        if node.op == "placeholder":
            t = self._stored.get(node.name)
            return None if t is None or t.is_meta else t.detach().cpu()
        if node.op != "call_function":
            return None
        args, kwargs = self(list(node.args)), self(list(node.kwargs.values()))
        if args is None or kwargs is None:
            return None
        try:
            with torch.no_grad():
                return node.target(*args, **dict(zip(node.kwargs, kwargs, strict=True)))
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return None  # an op that does not run here: the value stays unknown


def combined(state: str, applied: str) -> str:
    """The mask state after ``applied`` on scores in ``state``: masking twice with the
    same pattern is that pattern; any unknown step makes the result unknown."""
    if OTHER in (state, applied):
        return OTHER
    return CAUSAL if CAUSAL in (state, applied) else NO_MASK


def after_step(values: ConstantValues | None, call: Any, scores: Any) -> str:
    """The mask state of ``scores`` (an activation with ``role == "scores"``) after the
    element-wise step ``call`` (its one activation argument is ``scores``)."""
    state = scores.parts.get("mask", NO_MASK)
    op, args = call.op, list(call.node.args)
    others = [a for a, v in zip(args, call.args, strict=False) if v is not scores]
    if tuple(call.val.shape) != tuple(scores.shape):
        return OTHER  # broadcast up to another shape: not a mask of these scores
    if op in SCALE_OPS and len(others) == 1 and _scalar(values, others[0]):
        return state
    if values is None or op not in MASK_OPS:
        return OTHER
    at = next(i for i, v in enumerate(call.args) if v is scores)
    kept = _kept(values, op, args, at, call.val.dtype)
    return combined(state, OTHER if kept is None else _pattern(kept, tuple(scores.shape)))


def _scalar(values: ConstantValues | None, a: Any) -> bool:
    """A Python number, or a constant tensor of one element."""
    if isinstance(a, (int, float)):
        return True
    t = values(a) if values is not None else None
    return t is not None and t.numel() == 1


def _kept(values: ConstantValues, op: str, args: list[Any], at: int, dtype: Any) -> Any:
    """The positions the step keeps (a boolean tensor), or None where it is not a mask
    with constant pattern and −∞ (or the dtype's lowest value) elsewhere."""
    torch = values.torch
    vals = [0.0 if i == at else values(a) if isinstance(a, torch.fx.Node) else a
            for i, a in enumerate(args)]
    if any(v is None for v in vals):
        return None

    def masked(v: Any) -> bool:
        """−∞, or the lowest value of the scores' dtype or of the mask's own."""
        lowest = torch.finfo(dtype).min
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            lowest = max(lowest, torch.finfo(v.dtype).min)
        return bool((torch.as_tensor(v, dtype=torch.float64) <= lowest).all())

    if op == "masked_fill" and at == 0:
        return ~vals[1].bool() if masked(vals[2]) else None
    if op == "where" and at in (1, 2):
        fill = vals[3 - at]
        return (vals[0].bool() if at == 1 else ~vals[0].bool()) if masked(fill) else None
    if op == "add" and at in (0, 1) and len(vals) == 2 and isinstance(vals[1 - at], torch.Tensor):
        bias = vals[1 - at]
        kept = bias == 0
        return kept if kept.all() or masked(bias[~kept]) else None
    return None


def _pattern(kept: Any, shape: tuple[int, ...]) -> str:
    """:data:`NO_MASK` where every position is kept, :data:`CAUSAL` where exactly the
    lower triangle is (query ``i`` sees keys ``0..i``, square scores), else :data:`OTHER`."""
    try:
        kept = kept.expand(shape)
    except RuntimeError:
        return OTHER
    if bool(kept.all()):
        return NO_MASK
    sq, sk = shape[-2:]
    if sq != sk:
        return OTHER
    return CAUSAL if bool((kept == kept.new_ones(sq, sk).tril()).all()) else OTHER


def sdpa_mask(values: ConstantValues | None, mask: Any, shape: tuple[int, ...],
              dtype: Any) -> str:
    """The state of SDPA's explicit ``attn_mask`` on scores of ``shape``: a boolean mask
    keeps its True positions, a float one is added (0 kept, −∞ / the dtype's lowest
    masked); a mask computed from the inputs, or any other values, is :data:`OTHER`."""
    if values is None or not isinstance(mask, values.torch.fx.Node):
        return OTHER
    t = values(mask)
    if t is None:
        return OTHER
    if t.dtype == values.torch.bool:
        return _pattern(t, shape)
    kept = _kept(values, "add", [None, mask], 0, dtype)
    return OTHER if kept is None else _pattern(kept, shape)

