"""Repeated blocks of an imported model, marked so tying applies to them.

Children ``i`` of a ``ModuleList`` / ``Sequential`` are one block each; those whose ops have
the container's majority signature (names relative to the block, kinds, shapes, weights,
attributes, inputs) are marked ``block`` / ``block_index``. A block that differs — a first
layer with another width, a last one without its MLP — stays untied rather than be tied to
a plan that does not fit it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ilp_planner.inputs.lift_values import Draft


def mark_blocks(drafts: Sequence[Draft]) -> dict[str, tuple[str, int]]:
    """Op name → ``(block, index)`` for the ops of every block with its container's
    majority signature (when at least two blocks share it)."""
    members: dict[tuple[str, int], list[Draft]] = {}
    for d in drafts:
        b = _block_of(d.scope)
        if b is not None:
            members.setdefault(b, []).append(d)
    sigs = {b: _signature(b, ds) for b, ds in members.items()}
    by_block: dict[str, list[int]] = {}
    for block, i in members:
        by_block.setdefault(block, []).append(i)
    out: dict[str, tuple[str, int]] = {}
    for block, idx in by_block.items():
        best, n = max(Counter(sigs[(block, i)] for i in idx).items(), key=lambda kv: kv[1])
        if n < 2:
            continue
        for i in idx:
            if sigs[(block, i)] == best:
                for d in members[(block, i)]:
                    out[d.name] = (block or "blocks", i)
    return out


def _block_of(scope: tuple[tuple[str, str], ...]) -> tuple[str, int] | None:
    """The outermost ``<container>.<i>`` module on the op's scope."""
    for path, _ in scope:
        head, _, last = path.rpartition(".")
        if last.isdigit():
            return head or "", int(last)
    return None


def _signature(block: tuple[str, int], drafts: list[Draft]) -> tuple:
    """What two blocks must share to be tied, with op names relative to the block."""
    container, i = block
    prefix = f"{container}.{i}." if container else f"{i}."
    return tuple(
        (d.name.removeprefix(prefix), d.kind, d.shape, d.weight, tuple(sorted(d.attrs.items())),
         tuple(_relative(x, prefix) for x in d.inputs)) for d in drafts)


def _relative(name: str, prefix: str) -> str:
    return name.removeprefix(prefix) if name.startswith(prefix) else "<outside>"
