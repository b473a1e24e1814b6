"""The backward of the steps an import folds into a value, counted as autograd runs it.

The element-wise steps and copies the importer folds into an activation (``Act.steps``:
a hand-written GELU's pow, mul, tanh, add; an RMSNorm's pow, mean, rsqrt; rotary; casts)
each run as eager kernels, and so does their backward — whose kernels are not the
forward's again: tanh's reads its output and the gradient (three tensors, not two), pow's
is three kernels, an add with a constant passes its gradient on with none, a value read by
two steps sums its two gradients (an add), a slice's gradient is written into a zero-filled
tensor of the sliced one's shape (``slice_backward``), a view of a transposed gradient is
copied back to its producer's layout. Rather than a table that re-derives
``derivatives.yaml`` op by op, the steps are replayed — with the views between them — on
the export's fake tensors (no memory, no data), the values they read that carry a gradient
as leaves, and their backward recorded below autograd (:func:`replay_backward`): the
kernels it dispatches, the bytes of the tensors each reads and writes (stored elements: a
broadcast dim read once, as the importer counts the forward), and one FLOP per element an
arithmetic kernel writes — or, for a matmul or convolution, what ``FlopCounterMode`` counts.
Torch is passed in (the importer's lazy import, ``torch.utils.flop_counter`` loaded), so
this module imports none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ilp_planner.inputs.lift_values import SPLITS, VIEWS, op_name


@dataclass(frozen=True)
class StepsBackward:
    """What the backward of a set of folded steps runs: kernels, bytes read and written,
    FLOPs (one per element an arithmetic kernel writes; data movement has none)."""

    kernels: int
    bytes: int
    flops: int


NO_BACKWARD = StepsBackward(0, 0, 0)

# nodes between steps that the replay runs too: views and picks, and the fresh tensor a
# model fills slice by slice (MLA's new_empty key)
_BETWEEN = VIEWS | SPLITS | {"getitem", "new_empty", "new_zeros"}
# ops with a tensor output that launch no kernel (a view torch's schema does not mark, an
# allocation) and ops that only move data (no FLOPs)
_FREE = frozenset({"_unsafe_view", "lift_fresh", "empty", "empty_like", "empty_strided",
                   "new_empty", "new_empty_strided"})
_MOVES = frozenset({"_to_copy", "copy_", "copy", "clone", "slice_backward",
                    "select_backward", "cat", "stack", "new_zeros", "zeros", "zeros_like",
                    "fill_", "zero_", "scalar_tensor", "expand_copy", "slice_scatter",
                    "select_scatter", "as_strided_scatter"})


def replay_backward(torch: Any, steps: Sequence[Any], trained: Callable[[str], bool]
                    ) -> StepsBackward:
    """The backward of the exported nodes ``steps`` as autograd runs it: the steps and
    the views between them replayed on fake tensors from the values they read — leaves
    where ``trained(name)`` (a value carrying a gradient in training), constants
    otherwise — and the gradient of each step no other step reads, taken back to the
    leaves under a recorder (module docstring)."""
    steps = list(dict.fromkeys(steps))
    region, roots = _region(torch, steps)
    sinks = _sinks(torch, steps, region)
    metas = [n.meta.get("val") for n in [*roots, *region]]
    fake = torch._guards.detect_fake_mode(
        [t for t in torch.utils._pytree.tree_leaves(metas) if isinstance(t, torch.Tensor)])
    if fake is None:
        return NO_BACKWARD
    with fake:
        env, leaves = {}, []
        for n in roots:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point() \
                    and trained(n.name):
                leaf = val.detach().requires_grad_()
                leaves.append(leaf)
                env[n.name] = leaf.clone()  # its backward passes on: no kernel
            else:
                env[n.name] = val
        for n in region:
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a,
                (n.args, n.kwargs))
            env[n.name] = n.target(*args, **kwargs)
        outs = [env[n.name] for n in sinks]
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs or not leaves:
            return NO_BACKWARD
        grads = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in outs]
        with _recorder(torch)() as rec, \
                torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    return StepsBackward(rec.kernels, rec.bytes, rec.flops + int(counter.get_total_flops()))


def _region(torch: Any, steps: list[Any]) -> tuple[list[Any], list[Any]]:
    """The nodes to replay, in graph order — ``steps`` and the views between them — and
    the nodes they read from outside (the roots)."""
    inside = {n.name for n in steps}
    region: dict[str, Any] = {}
    roots: dict[str, Any] = {}
    todo = list(steps)
    while todo:
        n = todo.pop()
        if n.name in region or n.name in roots:
            continue
        if n.name in inside or (n.op == "call_function" and op_name(n.target) in _BETWEEN):
            region[n.name] = n
            todo += [a for a in _node_args(torch, n)]
        else:
            roots[n.name] = n
    order = {n: i for i, n in enumerate(steps[0].graph.nodes)}
    return sorted(region.values(), key=order.__getitem__), list(roots.values())


def _sinks(torch: Any, steps: list[Any], region: list[Any]) -> list[Any]:
    """The steps no node of the region reads: the values the op pricing them reads."""
    read = {a.name for n in region for a in _node_args(torch, n)}
    return [n for n in steps if n.name not in read]


def _node_args(torch: Any, n: Any) -> list[Any]:
    return [a for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
            if isinstance(a, torch.fx.Node)]


def _recorder(torch: Any) -> type:
    """A dispatch mode counting every kernel below autograd: each op writing a tensor,
    views and allocations aside (:data:`_FREE`), with the stored bytes of the tensors it
    reads and writes and one FLOP per element it writes unless it only moves data or
    ``FlopCounterMode`` counts it (a matmul, a convolution: counted there, by its formula)."""
    counted = torch.utils.flop_counter.flop_registry

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kernels = self.bytes = self.flops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = op_name(func)
            outs = [t for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor)]
            if not outs or name in _FREE or _is_view(func):
                return out
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)]
            self.kernels += 1
            self.bytes += stored_bytes(ins) + stored_bytes(outs)
            if name not in _MOVES and func._overloadpacket not in counted:
                self.flops += sum(t.numel() for t in outs)
            return out

    return Recorder


def _is_view(func: Any) -> bool:
    """Whether an aten op returns views of its inputs (its schema's outputs alias them
    without writing): no kernel."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                              for r in rets)


def stored_bytes(tensors: Sequence[Any]) -> int:
    """The bytes ``tensors`` hold: a broadcast (stride 0) dim stores one element."""
    return sum(math.prod(d for d, st in zip(t.shape, t.stride(), strict=True) if st != 0)
               * t.element_size() for t in tensors)
