"""Aten ops DTensor has no sharding rule for, run replicated, for :mod:`runtime.apply`.

The importer records the aten ops an imported model dispatches, forward and backward, that
DTensor cannot run (``Graph.replicated_ops``, :mod:`ilp_planner.inputs.dtensor_gaps`):
``weight_norm``'s backward, for one. Each is given a rule taking every tensor it reads and
writes replicated (DTensor's ``register_sharding``): every rank computes it on the whole
values, as one process does and as the plan lays out the op reading them (an op the planner
cannot shard is ``opaque``, replicated), so nothing moves. Where a value reached such an op
split, DTensor would gather it first — a collective the plan does not price, which the
dispatch-level audit shows as untagged, never a silent wrong value.

Only ops this process's DTensor still lacks a rule for are registered (the plan may come from
another torch), so no rule DTensor has is replaced; an op reading a list of tensors (which a
rule over single tensors cannot describe) is refused before the module is touched."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import register_sharding

from ilp_planner.inputs.dtensor_gaps import lacks_rule
from runtime.errors import RuntimeSetupError

_REGISTERED: set[str] = set()
"""The ops given the replicated rule in this process (registration is process-wide)."""


def run_replicated(names: Iterable[str]) -> tuple[str, ...]:
    """Register the replicated rule for each of ``names`` (``aten.<op>.<overload>``) this
    torch's DTensor has none for; the ones registered. Raises
    :class:`~runtime.errors.RuntimeSetupError` naming an op it cannot describe."""
    ops = [(name, _overload(name)) for name in names if name not in _REGISTERED]
    todo = [(name, op) for name, op in ops if lacks_rule(torch, op)]
    for name, op in todo:
        if any(_tensor_list(a.type) for a in op._schema.arguments):
            raise RuntimeSetupError(
                f"the model's code calls {name}, which DTensor has no sharding rule for and "
                f"which reads a list of tensors: the runtime cannot run it replicated")
    for name, op in todo:
        register_sharding(op)(_replicated(len(op._schema.returns)))
        _REGISTERED.add(name)
    return tuple(name for name, _ in todo)


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


def _replicated(outputs: int):
    """A ``register_sharding`` rule: every output and every tensor input replicated."""

    def rule(*args, **kwargs):
        inputs = [Replicate() if isinstance(a, DTensorSpec) else None
                  for a in (*args, *kwargs.values())]
        return [([Replicate()] * outputs, inputs)]

    return rule
