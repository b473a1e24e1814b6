"""Repeated blocks of an imported model, marked so tying applies to them.

Children ``i`` of a ``ModuleList`` / ``Sequential`` are one block each; those whose ops have
the container's majority signature (names relative to the block, kinds, shapes, weights,
attributes, inputs) are marked ``block`` / ``block_index``. A block that differs — a first
layer with another width, a last one without its MLP — stays untied rather than be tied to
a plan that does not fit it, and its ops are tried again at the next numbered container
inside it. Only the structure counts, never the names: Hugging Face's ``h.N``,
``layer.N``, ``block.N`` and ResNet's ``stages.N.layers.M`` tie alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ilp_planner.inputs.lift_values import Draft


def mark_blocks(drafts: Sequence[Draft]) -> dict[str, tuple[str, int]]:
    """Op name → ``(block, index)`` for the ops of every block with its container's
    majority signature (when at least two blocks share it). Containers are tried outermost
    first, whatever they are called (``layers``, ``h``, ``layer``, ``block``); ops whose
    outer blocks differ (ResNet's stages, each of another width) are tried at the next
    numbered container inside (the stage's own repeated layers)."""
    out: dict[str, tuple[str, int]] = {}
    depth = 0
    while True:
        pending = [d for d in drafts if d.name not in out]
        members = _members_at(pending, depth)
        if not members:
            return out
        out.update(_tied(members))
        depth += 1


def _members_at(drafts: Sequence[Draft], depth: int) -> dict[tuple[str, int], list[Draft]]:
    """The drafts grouped by their ``depth``-th numbered container on the scope."""
    members: dict[tuple[str, int], list[Draft]] = {}
    for d in drafts:
        blocks = _blocks_of(d.scope)
        if len(blocks) > depth:
            members.setdefault(blocks[depth], []).append(d)
    return members


def _tied(members: dict[tuple[str, int], list[Draft]]) -> dict[str, tuple[str, int]]:
    """Per container, the ops of the blocks with its majority signature, if two share it."""
    sigs = {b: _signature(b, ds) for b, ds in members.items()}
    by_container: dict[str, list[int]] = {}
    for container, i in members:
        by_container.setdefault(container, []).append(i)
    out: dict[str, tuple[str, int]] = {}
    for container, idx in by_container.items():
        best, n = max(Counter(sigs[(container, i)] for i in idx).items(), key=lambda kv: kv[1])
        if n < 2:
            continue
        for i in idx:
            if sigs[(container, i)] == best:
                for d in members[(container, i)]:
                    out[d.name] = (container or "blocks", i)
    return out


def _blocks_of(scope: tuple[tuple[str, str], ...]) -> list[tuple[str, int]]:
    """Every ``<container>.<i>`` module on the op's scope, outermost first."""
    out = []
    for path, _ in scope:
        head, _, last = path.rpartition(".")
        if last.isdigit():
            out.append((head or "", int(last)))
    return out


def _signature(block: tuple[str, int], drafts: list[Draft]) -> tuple:
    """What two blocks must share to be tied, with op names relative to the block."""
    container, i = block
    prefix = f"{container}.{i}." if container else f"{i}."
    return tuple(
        (d.name.removeprefix(prefix), d.kind, d.shape, d.weight, tuple(sorted(d.attrs.items())),
         tuple(_relative(x, prefix) for x in d.inputs)) for d in drafts)


def _relative(name: str, prefix: str) -> str:
    return name.removeprefix(prefix) if name.startswith(prefix) else "<outside>"
