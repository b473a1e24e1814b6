"""Layer units: what the stage DP slices, and the signature classes of unit ranges.

The DP slices a sequence of *units*: each repetition of a block is a unit (ops before the
first block join the first, ops after the last join the last); a graph without blocks has
one unit per weighted op with its followers. There is no ceiling on the number of units:
a 96-block model gives the DP 96 units. ``pipeline.max_units`` coarsens explicitly
(consecutive units merged into that many, their sizes differing by at most one) where a
long block-free graph would otherwise need too many distinct intra-op solves.

Ranges with the same signature (the ops, their in-range wiring and which tensors cross
the range's boundary; the test oracle ``tests/helpers/oracles.py: signature`` spells it
out) share one solve per sub-mesh shape, so for a
model of ``L`` identical blocks the intra-op solves number about ``3 L`` per shape (a
range is its block count, whether it holds the first unit's extra ops and whether it
holds the last's), not ``L²/2``. :class:`RangeKeys` finds a range's signature class from
per-unit parts, without building the range's op list.
"""

from __future__ import annotations

from collections.abc import Sequence

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import Config
from ilp_planner.ir.graph import Graph, Op, OpKind


def layer_units(graph: Graph, max_units: int | None = None) -> list[list[str]]:
    """Op names per unit, in graph order (inputs excluded): one unit per block, or per
    weighted op in a graph without blocks. ``max_units`` (``pipeline.max_units``) merges
    consecutive units into at most that many; ``None`` keeps them all."""
    ops = [op for op in graph.ops if op.kind is not OpKind.INPUT]
    blocks = [op.block_index for op in ops]
    if any(b is not None for b in blocks):
        first = next(i for i, b in enumerate(blocks) if b is not None)
        units: list[list[str]] = []
        current: int | None = None
        for i, op in enumerate(ops):
            b = op.block_index
            if i < first:
                b = blocks[first]
            elif b is None:
                b = current
            if b != current:
                units.append([])
                current = b
            units[-1].append(op.name)
    else:
        units = []
        for op in ops:
            weighted = op.weight is not None or op.params > 0
            if weighted or not units:
                units.append([])
            units[-1].append(op.name)
    return units if max_units is None else _coarsen(units, max_units)


def _coarsen(units: list[list[str]], max_units: int) -> list[list[str]]:
    """``units`` merged into exactly ``max_units`` consecutive groups whose sizes differ by
    at most one, the larger groups first (``numpy.array_split``'s order): a uniform cut
    such as the engines' ``pp`` stages stays a cut of the coarse units, and no group is
    left silently short (a ceiling split left the last unit with the remainder only)."""
    if len(units) <= max_units:
        return units
    q, r = divmod(len(units), max_units)
    out, start = [], 0
    for i in range(max_units):
        end = start + q + (1 if i < r else 0)
        out.append(sum(units[start:end], []))
        start = end
    return out


def subgraph(graph: Graph, names: Sequence[str]) -> Graph:
    """The ops ``names`` as a graph; tensors produced outside become inputs (they arrive by
    cross-mesh resharding, whose cost is the boundary cost, so loading them is free here)."""
    inside = set(names)
    ops: list[Op] = []
    added: set[str] = set()
    for name in names:
        op = graph[name]
        for src in op.inputs:
            if src not in inside and src not in added:
                ops.append(Op(src, OpKind.INPUT, (), graph[src].output))
                added.add(src)
        ops.append(op)
    return Graph(f"{graph.name}[{names[0]}..{names[-1]}]", ops)


def _op_key(op: Op) -> tuple:
    """What of an op, besides its wiring, its stage problem depends on (no names)."""
    return (op.kind, op.output, op.weight, op.params, op.flops,
            tuple(sorted(op.attrs.items())), op.tie_key)


class RangeKeys:
    """Signature classes of unit ranges ``[a, e)`` without building their op lists.

    A range's signature (module docstring) is the concatenation of its units' parts, and unit ``u``'s
    part depends on the range only through which of its inputs come from before ``a`` and
    which of its outputs are read at or after ``e``: that is, through ``x = min(u − a,
    back(u))`` and ``y = min(e − 1 − u, ahead(u))`` with ``back``/``ahead`` the farthest
    unit its ops read from / are read by (1 for a chain of blocks; more with skip edges).
    In-range wiring is kept as offsets in the global op order, equal to the offsets in the
    range's own list (units are contiguous). So :meth:`key` — the tuple of part ids — is
    equal for two ranges iff their signatures are equal with the same unit lengths; parts
    are built once per ``(u, x, y)``, and a key costs ``O(e − a)`` integer look-ups."""

    def __init__(self, graph: Graph, units: Sequence[Sequence[str]]):
        self.graph = graph
        self.units = [list(u) for u in units]
        self.unit_of = {n: j for j, u in enumerate(self.units) for n in u}
        order = [n for u in self.units for n in u]
        self.pos = {n: i for i, n in enumerate(order)}
        self.back: list[int] = []
        self.ahead: list[int] = []
        for j, u in enumerate(self.units):
            self.back.append(max((j - self.unit_of[s] for n in u for s in graph[n].inputs
                                  if s in self.unit_of), default=0))
            self.ahead.append(max((self.unit_of[c] - j for n in u for c in graph.consumers(n)),
                                  default=0))
        self._parts: dict[tuple[int, int, int], int] = {}
        self._part_ids: dict[tuple, int] = {}
        self._keys: dict[tuple[int, int], tuple[int, ...]] = {}

    def part(self, u: int, x: int, y: int) -> int:
        """Id of unit ``u``'s signature part when ``x`` units of the range precede it
        (capped at ``back(u)``) and ``y`` follow it (capped at ``ahead(u)``)."""
        k = (u, x, y)
        if k not in self._parts:
            g, a, e = self.graph, u - x, u + y + 1
            sig = []
            for n in self.units[u]:
                op = g[n]
                sig.append((
                    *_op_key(op),
                    any(self.unit_of[c] >= e for c in g.consumers(n)),
                    tuple(self.pos[s] - self.pos[n]
                          if s in self.unit_of and self.unit_of[s] >= a
                          else ("ext", g[s].output, s in self.unit_of) for s in op.inputs)))
            self._parts[k] = self._part_ids.setdefault(tuple(sig), len(self._part_ids))
        return self._parts[k]

    def key(self, a: int, e: int) -> tuple[int, ...]:
        """The signature class of units ``[a, e)``."""
        k = (a, e)
        if k not in self._keys:
            self._keys[k] = tuple(self.part(u, min(u - a, self.back[u]), min(e - 1 - u, self.ahead[u]))
                                  for u in range(a, e))
        return self._keys[k]


def check_stage_count(config: Config, num_units: int | None = None) -> None:
    """Raise :class:`ConfigError` (the file, ``pipeline.stages``) where the config asks for
    more stages than the model has layer units (``num_units``: its units, derived here when
    not given) — a config error ``validate`` reports too."""
    pipe = config.pipeline
    if not pipe.pipelined or pipe.stages == "auto":
        return
    if num_units is None:
        num_units = len(layer_units(config.microbatch_graph(), pipe.max_units))
    if int(pipe.stages) > num_units:
        raise ConfigError(f"{pipe.stages} stages requested but the model has only {num_units} "
                          f"layer units to distribute", source=config.source,
                          key="pipeline.stages")
