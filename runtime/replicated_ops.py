"""Aten ops DTensor has no sharding rule of its own for, run under the runtime's, for
:mod:`runtime.apply`.

The importer records the aten ops an imported model dispatches, forward and backward, that
DTensor cannot run (``Graph.replicated_ops``, :mod:`ilp_planner.inputs.dtensor_gaps`):
``weight_norm``'s backward, ReLU6's (``hardtanh_backward``). Each is given a rule (DTensor's
``register_sharding``): an activation's backward — element-wise in its same-shaped operands —
runs on whatever blocks its operands share, as the plan splits the activation; any other op
takes every tensor it reads and writes replicated, every rank computing it on the whole
values as one process does and as the plan lays out the op reading them (an op the planner
cannot shard is ``opaque``, replicated), so nothing moves. Where a value reached such an op
split, DTensor would gather it first — a collective the plan does not price, which the
dispatch-level audit shows as untagged, never a silent wrong value.

``as_strided``, which DTensor serves with a handler of its own consulted before any rule (it
runs only the restride that changes nothing), gets a handler instead: on a replicated value
it runs on the whole value (adaptive pooling's backward, FocalNet's head).

Only ops this process's DTensor still lacks a rule for are registered (the plan may come from
another torch), so no rule DTensor has is replaced; an op reading a list of tensors (which a
rule over single tensors cannot describe) is refused before the module is touched."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental import register_sharding

from ilp_planner.inputs.dtensor_gaps import lacks_rule
from runtime.errors import RuntimeSetupError

_REGISTERED: set[str] = set()
"""The ops given the runtime's rule in this process (registration is process-wide)."""


def run_replicated(names: Iterable[str]) -> tuple[str, ...]:
    """Register the runtime's rule (:func:`_rule`) for each of ``names``
    (``aten.<op>.<overload>``) this torch's DTensor has none for; the ones registered. Raises
    :class:`~runtime.errors.RuntimeSetupError` naming an op it cannot describe."""
    ops = [(name, _overload(name)) for name in names if name not in _REGISTERED]
    todo = [(name, op) for name, op in ops if lacks_rule(torch, op)]
    for name, op in todo:
        if any(_tensor_list(a.type) for a in op._schema.arguments):
            raise RuntimeSetupError(
                f"the model's code calls {name}, which DTensor has no sharding rule for and "
                f"which reads a list of tensors: the runtime cannot run it replicated")
    for name, op in todo:
        if op is torch.ops.aten.as_strided.default:
            _replicated_as_strided()
        else:
            register_sharding(op)(_rule(op))
        _REGISTERED.add(name)
    return tuple(name for name, _ in todo)


def _replicated_as_strided() -> None:
    """``as_strided`` on a replicated DTensor runs on every rank's whole value. DTensor
    serves it with a handler of its own, consulted before any sharding rule, that runs only
    the ``as_strided`` changing nothing: the backward of adaptive average pooling to one
    output on a value whose strides suggest channels-last (its forward restrides with
    ``as_strided_``; FocalNet's pooler over its transposed tokens) failed there, mid-step.
    A split value still goes to DTensor's handler (its blocks' strides are not the whole
    value's)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    op = torch.ops.aten.as_strided.default
    dtensor_own = handlers[op]

    def handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
        x = args[0]
        if not all(isinstance(p, Replicate) for p in x.placements):
            return dtensor_own(op_call, args, kwargs)
        local = op_call(x._local_tensor, *args[1:], **kwargs)
        meta = TensorMeta(local.shape, local.stride(), local.dtype)
        return DTensor(local, DTensorSpec(x.device_mesh, x.placements, meta),
                       requires_grad=False)

    handlers[op] = handler


def _tensor_list(kind: torch._C.JitType) -> bool:
    """Whether an argument of type ``kind`` is a list of (optional) tensors."""
    if not isinstance(kind, torch.ListType):
        return False
    element = kind.getElementType()
    if isinstance(element, torch.OptionalType):
        element = element.getElementType()
    return element.isSubtypeOf(torch._C.TensorType.get())


def _overload(name: str) -> torch._ops.OpOverload:
    """The aten op ``aten.<op>.<overload>`` names, or a setup error naming it."""
    parts = name.split(".")
    try:
        if len(parts) != 3 or parts[0] != "aten":
            raise AttributeError(name)
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except AttributeError:
        raise RuntimeSetupError(f"the plan's graph lists {name!r} among the ops to run "
                                f"replicated, which this torch does not have") from None


ELEMENTWISE = frozenset({
    "hardtanh_backward", "threshold_backward", "gelu_backward", "silu_backward",
    "elu_backward", "leaky_relu_backward", "hardsigmoid_backward", "hardswish_backward",
    "softplus_backward", "mish_backward", "sigmoid_backward", "tanh_backward",
})
"""Activations' backward ops: element-wise in their same-shaped operands, so they run on
any block the operands share (torch tags few of them ``pointwise``)."""


def _elementwise(op: torch._ops.OpOverload) -> bool:
    return op._schema.name.removeprefix("aten::") in ELEMENTWISE or torch.Tag.pointwise in op.tags


def _rule(op: torch._ops.OpOverload):
    """A ``register_sharding`` rule for ``op``: every output and tensor input replicated;
    for an element-wise op whose operands all have its output's shape, also all of them
    split alike on any one dim (the operands' shared blocks: nothing moves)."""
    outputs = len(op._schema.returns)
    pointwise = _elementwise(op) and outputs == 1

    def rule(*args, **kwargs):
        given = (*args, *kwargs.values())
        specs = [a for a in given if isinstance(a, DTensorSpec)]
        out = [([Replicate()] * outputs,
                [Replicate() if isinstance(a, DTensorSpec) else None for a in given])]
        shapes = {None if a.tensor_meta is None else tuple(a.tensor_meta.shape) for a in specs}
        if pointwise and len(shapes) == 1 and None not in shapes:
            for d in range(len(next(iter(shapes)))):
                out.append(([Shard(d)], [Shard(d) if isinstance(a, DTensorSpec) else None
                                         for a in given]))
        return out

    return rule
