"""Redistribution lowering: the exact collective program that moves a tensor between two
layouts of the same device set — forward *and* the backward autograd runs — priced by the
cost model and executed, step for step, by the runtime (:mod:`runtime.comm`).

Plan, then execute: :func:`plan_redistribution` returns a :class:`Redistribution` with two
step lists. Each :class:`RedistStep` is one layout change and the collective it issues (or
none for a local slice or a re-view); the runtime derives the operation from the step's two
layouts, so the program priced is the program run.

The search is Dijkstra over the states ``(factorisation, placements)`` of every proper
factorisation with up to three axes (plus those of the endpoints). Edges:

1. one mesh axis ``a`` changes state (AutoDDL, Table 2): ``P→B`` AllReduce, ``P→S(d)``
   ReduceScatter, ``S(d)→B`` AllGather, ``S(i)→S(j)`` AlltoAll, ``B→S(d)`` local slice —
   but only where the result keeps *contiguous* nested blocks: a dim split by several axes
   is chunked major-first, so axis ``a`` may gather (or give away) dim ``d`` only when it
   is the minor-most axis splitting ``d``, and may scatter (or slice) onto ``d`` only when
   no later axis already splits ``d``. A step on a major axis would leave a strided block
   order that no single collective produces (DTensor then gathers the later axes first);
   such steps are not offered, so their cheap price never reaches the ILP;
2. a *re-view*: two partial-free layouts on different factorisations in which every device
   holds the same block (equal :meth:`Layout.block_key`, real ``torch.chunk`` regions for
   uneven shapes) are the same data — free.

No edge leads *into* a partial sum: a P state is only ever a source (an op's partial output,
a partial gradient), never produced by a layout change, so no path the runtime cannot run
exists. A destination may keep partial sums the source already has on the same axes (the
other axes change around them, as ``DTensor.redistribute`` does); one with a partial axis
the source lacks is refused.

``DTensor.redistribute``'s own path is always a candidate: each of its steps changes one mesh
axis and keeps contiguous blocks (it gathers the later axes of a nested split first), so
it is a path of this graph and the cheapest path is never dearer —
``tests/test_redistribution_fidelity.py`` checks that pair by pair against what DTensor
issues, and that the runtime issues exactly the program lowered here.

Bytes are the *n* of the α–β formula per rank, padded as executed: every local piece is
padded to the layout's largest block (:meth:`Layout.padded_shape`) so all ranks move the
same bytes — the tensor for AllReduce, the gathered output for AllGather, the input for
ReduceScatter and AlltoAll.

Backward. The value arrives at its consumer in layout ``dst``; the consumer's backward
hands back the gradient in a layout ``grad_dst`` (``dst`` with some replicated axes turned
partial when the consumer's local backward yields partial sums there, e.g. the input of a
column-parallel matmul). The producer needs it in :func:`~ilp_planner.ir.layouts.grad_layout`
``(src)`` (``src`` with partial sums read as replicas). The backward program is the
cheapest path ``grad_dst → grad_layout(src)`` in the same graph — e.g. forward AllGather,
backward ReduceScatter when the consumer's gradient is partial; forward local slice,
backward AllGather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np
from scipy.sparse import csc_matrix, csr_matrix
from scipy.sparse.csgraph import dijkstra

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import Cluster, Factorisation, MeshAxis, axis_coordinates, proper_factorisations
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, Partial, Placement, Split, drop_unit_axes, grad_layout
from ilp_planner.lowering.compute_model import PhaseWork, phase_seconds
from ilp_planner.lowering.cost_model import Collective, CollectiveKind, collective_seconds, make_collective


@dataclass(frozen=True)
class RedistStep:
    """One layout change; ``collective`` is None for a local slice or re-view. A step on one
    factorisation changes exactly one mesh axis; a step between factorisations is a re-view
    (same block on every device). ``local_s``: a slice's copy where its piece is strided
    (:func:`step_work`; a collective's own local kernels are in its ``seconds``)."""

    src: Layout
    dst: Layout
    collective: Collective | None
    local_s: float = 0.0

    @property
    def is_view(self) -> bool:
        return self.src.fact != self.dst.fact

    @property
    def axis(self) -> int:
        """The mesh axis a same-factorisation step changes."""
        return next(i for i, (a, b) in enumerate(zip(self.src.placements, self.dst.placements,
                                                     strict=True)) if a != b)

    def __str__(self) -> str:
        c = self.collective
        how = "local" if c is None else f"{c.kind.value}(p={c.group_size}, {c.bytes:.3g} B, {c.link})"
        return f"{self.src} -> {self.dst}: {how}"


@dataclass(frozen=True)
class Redistribution:
    """The lowered program of one edge: ``steps`` move the value ``src → dst`` forward,
    ``backward_steps`` move its gradient ``grad_dst → grad_layout(src)``."""

    src: Layout
    dst: Layout
    tensor: TensorSpec
    steps: tuple[RedistStep, ...]
    grad_dst: Layout | None = None
    backward_steps: tuple[RedistStep, ...] = ()

    @property
    def forward(self) -> list[Collective]:
        return [s.collective for s in self.steps if s.collective is not None]

    @property
    def backward(self) -> list[Collective]:
        return [s.collective.with_phase("backward") for s in self.backward_steps
                if s.collective is not None]

    @property
    def local_forward_s(self) -> float:
        """The forward steps' slice copies (:attr:`RedistStep.local_s`): local work beside
        the collectives, which a caller pricing the collectives adds to compute."""
        return sum(s.local_s for s in self.steps)

    @property
    def local_backward_s(self) -> float:
        return sum(s.local_s for s in self.backward_steps)

    @property
    def forward_seconds(self) -> float:
        return sum(c.seconds for c in self.forward) + self.local_forward_s

    @property
    def seconds(self) -> float:
        """Forward plus backward time."""
        return self.forward_seconds + sum(c.seconds for c in self.backward) \
            + self.local_backward_s

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.forward + self.backward)


def _last_splitter(layout: Layout, dim: int) -> int:
    axes = layout.split_axes(dim)
    return axes[-1] if axes else -1


def _axis_moves(layout: Layout, tensor: TensorSpec) -> list[tuple[Placement, int, CollectiveKind | None]]:
    """(new placement, axis, collective kind or None) for every single-axis change that
    keeps contiguous blocks (module docstring, rule 1)."""
    return _axis_moves_rank(layout, tensor.rank)


def _axis_moves_rank(layout: Layout, rank: int) -> list[tuple[Placement, int, CollectiveKind | None]]:
    moves = []

    def may_take(a: int, d: int) -> bool:  # axis a may start splitting dim d
        return _last_splitter(layout, d) < a

    for a, cur in enumerate(layout.placements):
        if layout.fact[a].size == 1:
            continue
        if isinstance(cur, Partial):
            moves.append((B, a, CollectiveKind.ALL_REDUCE))
            moves += [(Split(d), a, CollectiveKind.REDUCE_SCATTER) for d in range(rank) if may_take(a, d)]
        elif isinstance(cur, Split):
            if _last_splitter(layout, cur.dim) != a:
                continue
            moves.append((B, a, CollectiveKind.ALL_GATHER))
            moves += [(Split(d), a, CollectiveKind.ALL_TO_ALL) for d in range(rank)
                      if d != cur.dim and may_take(a, d)]
        else:
            moves += [(Split(d), a, None) for d in range(rank) if may_take(a, d)]
    return moves


def step_bytes(kind: CollectiveKind, src: Layout, dst: Layout, axis: int, tensor: TensorSpec,
               src_block: tuple[int, ...] | None = None,
               dst_block: tuple[int, ...] | None = None) -> float:
    """The formula's *n* of a single-axis step, padded as executed (module docstring).
    ``src_block`` / ``dst_block``: the layouts' padded shapes when the caller has them."""
    shape = list(src_block or src.padded_shape(tensor.shape))
    k = src.fact[axis].size
    if kind is CollectiveKind.ALL_GATHER:
        d = src.placements[axis].dim
        shape[d] *= k
    elif kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        d = dst.placements[axis].dim
        shape[d] = (dst_block or dst.padded_shape(tensor.shape))[d] * k
    return float(math.prod(shape) * tensor.itemsize)


def step_local_work(kind: CollectiveKind, nbytes: float, k: int, uneven: bool,
                    pack: bool = True, unpack: bool = True) -> PhaseWork:
    """The local kernels :mod:`runtime.comm` runs around one step's collective on a device,
    ``nbytes`` the formula's *n* (:func:`step_bytes`), ``k`` the axis size. An AllReduce
    reduces a fresh copy of its block in place (one copy; where padded, the block is
    copied out of it again, so that every step hands on a contiguous block). A
    ReduceScatter sends its ``k`` pieces one after another: their stack where they do not
    already lie so (``pack``: a dim before the split one holds more than one element); an
    AllGather's ``k`` blocks are joined by a cat where they do not already lie so
    (``unpack``: likewise before the gathered dim); an AlltoAll does both. Each kernel
    reads and writes its bytes. Where a dim does not split evenly (``uneven``: some rank's
    block is smaller than the padded one) the slowest rank also pads — each of a
    ReduceScatter's or AlltoAll's pieces, an AllGather's block — packs and unpacks, and a
    ReduceScatter copies its unpadded piece out: an upper bound for that rank (a rank
    whose pieces are whole pads fewer). A local slice (``B → S``, no collective) is
    :func:`slice_work`."""
    pack, unpack = pack or uneven, unpack or uneven
    if kind is CollectiveKind.ALL_REDUCE:  # uneven: the padded copy, and the block out
        return PhaseWork(0.0, 4 * nbytes, 2) if uneven else PhaseWork(0.0, 2 * nbytes, 1)
    if kind is CollectiveKind.REDUCE_SCATTER:
        extra = (k + 1, 2 * nbytes + 2 * nbytes / k) if uneven else (0, 0.0)
        return PhaseWork(0.0, 2 * nbytes * pack + extra[1], int(pack) + extra[0])
    if kind is CollectiveKind.ALL_GATHER:
        extra = (1, 2 * nbytes / k) if uneven else (0, 0.0)
        return PhaseWork(0.0, 2 * nbytes * unpack + extra[1], int(unpack) + extra[0])
    if kind is CollectiveKind.ALL_TO_ALL:
        extra = (k, 2 * nbytes) if uneven else (0, 0.0)
        return PhaseWork(0.0, 2 * nbytes * (pack + unpack) + extra[1],
                         int(pack) + int(unpack) + extra[0])
    return PhaseWork(0.0, 0.0, 0)


def step_local_seconds(kind: CollectiveKind, nbytes: float, k: int, uneven: bool,
                       tensor: TensorSpec, cluster: Cluster, pack: bool = True,
                       unpack: bool = True) -> float:
    """:func:`step_local_work` on the cluster's device (0 on a flat cluster, which prices
    no kernel)."""
    if cluster.device is None:
        return 0.0
    return phase_seconds(step_local_work(kind, nbytes, k, uneven, pack, unpack),
                         cluster.device, tensor.dtype)


def slice_work(piece_bytes: float, strided: bool) -> PhaseWork:
    """A local slice (``B → S``, :func:`runtime.comm._slice`): one copy of the piece where
    it is strided (a dim before the sliced one holds more than one element), nothing where
    it is a view."""
    return PhaseWork(0.0, 2 * piece_bytes, 1) if strided else PhaseWork(0.0, 0.0, 0)


def _spread(block: Sequence[int], dim: int) -> bool:
    """Whether a dim before ``dim`` of a block holds more than one element: its pieces
    along ``dim`` are then strided in memory (a stack or cat moves them)."""
    return math.prod(block[:dim]) > 1


def _before(blocks: np.ndarray) -> np.ndarray:
    """Per block (row) and dim, the elements of the dims before it: :func:`_spread` of
    many blocks at once (above 1: spread)."""
    return np.concatenate([np.ones((len(blocks), 1), dtype=np.int64),
                           np.cumprod(blocks, axis=1)[:, :-1]], axis=1)


def _uneven(layout: Layout, tensor: TensorSpec) -> bool:
    """Whether some dim of ``tensor`` does not split evenly under ``layout``."""
    return any(n % layout.split_degree(d) for d, n in enumerate(tensor.shape))


def step_work(step: RedistStep, tensor: TensorSpec) -> PhaseWork:
    """The local kernels the runtime runs for one lowered step (:mod:`runtime.comm`): a
    collective's (:func:`step_local_work`), a slice's (:func:`slice_work`), a re-view's
    none. Exact where the tensor splits evenly; else the slowest rank's at most."""
    src, dst = step.src, step.dst
    if step.is_view:
        return PhaseWork(0.0, 0.0, 0)
    a, c = step.axis, step.collective
    if c is None:
        piece = math.prod(dst.padded_shape(tensor.shape)) * tensor.itemsize
        return slice_work(piece, _spread(src.padded_shape(tensor.shape), dst.placements[a].dim))
    pack = unpack = False
    if c.kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        pack = _spread(src.padded_shape(tensor.shape), dst.placements[a].dim)
    if c.kind in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL):
        unpack = _spread(dst.padded_shape(tensor.shape), src.placements[a].dim)
    return step_local_work(c.kind, c.bytes, c.group_size,
                           _uneven(src, tensor) or _uneven(dst, tensor), pack, unpack)


def step_kernel_seconds(step: RedistStep, tensor: TensorSpec, cluster: Cluster) -> float:
    """The seconds of a lowered step's local kernels (:func:`step_work`) on the cluster's
    device (0 on a flat cluster): a collective's are part of its ``seconds`` beside the
    call's, a slice's its :attr:`RedistStep.local_s`."""
    if cluster.device is None:
        return 0.0
    return phase_seconds(step_work(step, tensor), cluster.device, tensor.dtype)


_EPS = 1e-15  # weight of free edges: csgraph needs strictly positive weights


_KINDS: tuple[CollectiveKind, ...] = tuple(CollectiveKind)
_KIND_ID = {kd: i for i, kd in enumerate(_KINDS)}


@dataclass(frozen=True)
class _Moves:
    """The single-axis moves of a state graph as arrays, one entry per move: source and
    destination state, the tensor dim whose block size changes (gathered dim, or the new
    split dim; 0 for none), the axis size ``k``, the collective kind (an index into
    ``_KINDS``, -1 for a free local re-split), the mesh axis (an index into ``axes``),
    and whether the move gathers or scatters its block. ``cand``: the candidate index of
    every state."""

    src: np.ndarray
    dst: np.ndarray
    dim: np.ndarray
    k: np.ndarray
    kind: np.ndarray
    axis: np.ndarray
    axes: tuple[MeshAxis, ...]
    gather: np.ndarray
    scatter: np.ndarray
    cand: np.ndarray


@dataclass(frozen=True)
class _RankTables:
    """Tensor-independent facts about the candidate layouts of one tensor rank: the split
    degree of every dim, whether the layout has partial sums, and for partial-free ones a
    class id equal exactly when :meth:`Layout.canonical_key` is (the re-view class of an
    evenly split tensor)."""

    degrees: np.ndarray  # (candidates, rank)
    partial: np.ndarray  # (candidates,) bool
    view_class: np.ndarray  # (candidates,) int, -1 for layouts with partial sums


# a search on the reversed graph costs up to about this many forward ones (2.8-3.5×
# measured on 128 × 8 from a partial-free destination: the reversed graph reaches the partial-sum
# layouts, which no forward search from a partial-free layout does) ...
REVERSED_COST = 3.0
# ... and this many on the partial-free part of the reversed graph (1.2-1.4× measured on
# 128 × 8), which holds every path between partial-free layouts
FREE_REVERSED_COST = 1.2


@dataclass
class _StateGraph:
    """All layouts of one tensor on one device set as a weighted digraph. Node ids below
    ``len(states)`` are layouts; the rest are hubs joining re-view groups (free)."""

    states: list[Layout]
    index: dict[Layout, int]
    matrix: csr_matrix
    hub_kind: dict[int, str]
    partial: np.ndarray  # (states,) bool: the layout has partial sums
    _incoming: csc_matrix | None = None
    _reversed: csr_matrix | None = None
    _free_reversed: tuple[csr_matrix, np.ndarray] | None = None

    def incoming(self) -> csc_matrix:
        """The matrix by columns: the in-edges of every node."""
        if self._incoming is None:
            self._incoming = self.matrix.tocsc()
        return self._incoming

    def reversed(self) -> csr_matrix:
        """The graph with every edge turned round (the in-edges' arrays as rows)."""
        if self._reversed is None:
            inc = self.incoming()
            self._reversed = csr_matrix((inc.data, inc.indices, inc.indptr), shape=inc.shape)
        return self._reversed

    def free_reversed(self) -> tuple[csr_matrix, np.ndarray]:
        """The reversed graph on the partial-free layouts and the hubs, and those nodes'
        ids. No move creates partial sums, so every path between two partial-free layouts
        lies in it, and a search there settles the same distances as on the whole reversed
        graph, without visiting the partial-sum layouts (more than half on 128 × 8)."""
        if self._free_reversed is None:
            keep = np.flatnonzero(np.concatenate(
                [~self.partial, np.ones(self.matrix.shape[0] - len(self.states), dtype=bool)]))
            self._free_reversed = (self.reversed()[keep][:, keep].tocsr(), keep)
        return self._free_reversed


class RedistributionPlanner:
    """Shortest-path search over layouts of one device set, cached per tensor and source.

    Searching every proper factorisation with up to three axes makes the costs satisfy the
    triangle inequality over that universe (a detour through a third factorisation's axis
    is never cheaper than the planned path). The graph is built once per tensor and searched
    with SciPy's Dijkstra.
    """

    def __init__(self, cluster: Cluster, nodes: int, local: int, max_axes: int = 3):
        self.cluster = cluster
        self.nodes = nodes
        self.local = local
        self.universe: tuple[Factorisation, ...] = proper_factorisations(nodes, local, max_axes)
        self._graph = lru_cache(maxsize=64)(self._build_graph)
        self._candidates = cache(self._candidate_layouts)
        self._tables = cache(self._rank_tables)
        self._moves = lru_cache(maxsize=16)(self._move_structure)
        self._search = lru_cache(maxsize=8192)(self._dijkstra)
        self._search_to = lru_cache(maxsize=8192)(self._dijkstra_to)
        self._path = lru_cache(maxsize=65536)(self._find_path)

    def collective(self, kind: CollectiveKind, src: Layout, dst: Layout, axis: int,
                   tensor: TensorSpec) -> Collective:
        """One step's collective, its seconds the call's and the local kernels' around it
        (:func:`step_local_work`): the time the runtime's step takes."""
        ax = src.fact[axis]
        c = make_collective(kind, ax.size, step_bytes(kind, src, dst, axis, tensor),
                            self.cluster, ax.spans_nodes, (axis,), nodes=ax.nodes)
        local = step_kernel_seconds(RedistStep(src, dst, c), tensor, self.cluster)
        return dataclasses.replace(c, seconds=c.seconds + local) if local else c

    def _build_graph(self, tensor: TensorSpec) -> _StateGraph:
        tables = self._tables(tensor.rank)
        shape = np.array(tensor.shape, dtype=np.int64)
        fits = tuple(np.all(tables.degrees <= shape, axis=1).tolist())
        states, index, arrays = self._moves(tensor.rank, fits)
        weights = self._move_seconds(arrays, tensor)
        # re-view hubs: one per class of two or more partial-free states holding the same
        # block on every device (Layout.block_key), numbered in order of first appearance
        # (a lone state's hub would only lead back to it: most classes on 128 × 8)
        free = np.flatnonzero(~tables.partial[arrays.cand])
        degrees = tables.degrees[arrays.cand[free]]
        even = np.all(shape % degrees == 0, axis=1)
        keys = tables.view_class[arrays.cand[free]].copy()
        regions: dict[bytes, int] = {}
        base = int(tables.view_class.max(initial=-1)) + 1
        for j in np.flatnonzero(~even).tolist():
            key = states[free[j]].block_key(tensor.shape)[1]
            keys[j] = base + regions.setdefault(key, len(regions))
        uniq, first, inverse, count = np.unique(keys, return_index=True, return_inverse=True,
                                                return_counts=True)
        inverse = inverse.reshape(-1)
        shared = count > 1
        number = np.full(len(uniq), -1, dtype=np.int64)
        order = np.argsort(first, kind="stable")
        number[order[shared[order]]] = np.arange(int(shared.sum()))
        member = shared[inverse]
        free, hub = free[member], len(states) + number[inverse[member]]
        rows = np.empty(2 * len(free), dtype=np.int64)
        cols = np.empty(2 * len(free), dtype=np.int64)
        rows[0::2], rows[1::2] = free, hub
        cols[0::2], cols[1::2] = hub, free
        hubs = int(shared.sum())
        hub_kind = {len(states) + h: "view" for h in range(hubs)}
        weights = np.concatenate([weights, np.full(len(rows), _EPS)])
        n = len(states) + hubs
        matrix = csr_matrix((weights, (np.concatenate([arrays.src, rows]),
                                       np.concatenate([arrays.dst, cols]))), shape=(n, n))
        return _StateGraph(states, index, matrix, hub_kind, tables.partial[arrays.cand])

    def _candidate_layouts(self, rank: int) -> tuple[Layout, ...]:
        return tuple(Layout(fact, pls) for fact in self.universe
                     for pls in _all_placements(len(fact), rank))

    def _rank_tables(self, rank: int) -> _RankTables:
        """:func:`_rank_tables_of` this planner's universe."""
        return _rank_tables_of(self.universe, rank)

    def _move_structure(self, rank: int, fits: tuple[bool, ...]
                        ) -> tuple[list[Layout], dict[Layout, int], _Moves]:
        """:func:`_move_structure_of` this planner's universe."""
        return _move_structure_of(self.universe, self._candidates(rank), rank, fits)

    def _move_seconds(self, moves: _Moves, tensor: TensorSpec) -> np.ndarray:
        """Seconds of every move: :func:`step_bytes` from the layouts' padded blocks (a
        nested ceil-division per dim is one ceil-division by the dim's split degree),
        priced once per distinct (kind, axis, bytes)."""
        tables = self._tables(tensor.rank)
        shape = np.array(tensor.shape, dtype=np.int64)
        blocks = -(-shape // tables.degrees[moves.cand])
        src, dst, dim, k = moves.src, moves.dst, moves.dim, moves.k
        whole = np.prod(blocks, axis=1)[src]
        moved = np.where(moves.gather, whole * k, whole)
        moved = np.where(moves.scatter,
                         whole // np.maximum(blocks[src, dim], 1) * blocks[dst, dim] * k, moved)
        out = np.full(len(src), _EPS)
        _slice_seconds(moves, blocks, tensor, self.cluster, out)
        priced = np.flatnonzero(moves.kind >= 0)
        if not len(priced):
            return out
        sizes, size_of = np.unique(moved[priced] * tensor.itemsize, return_inverse=True)
        # where a device prices kernels, each move's local kernels too (the same
        # :meth:`collective` prices a path's steps at), which an uneven split changes
        flags = _local_flags(moves, blocks, shape, tables.degrees[moves.cand],
                             self.cluster)[priced]
        keys = ((moves.kind[priced] * len(moves.axes) + moves.axis[priced]) * len(sizes)
                + size_of) * 8 + flags
        uniq, inverse = np.unique(keys, return_inverse=True)
        rest, flag = np.divmod(uniq, 8)
        ka, nb = np.divmod(rest, len(sizes))
        kd, a = np.divmod(ka, len(moves.axes))
        seconds = np.array([
            collective_seconds(_KINDS[k_], moves.axes[a_].size, float(n_), self.cluster,
                               moves.axes[a_].spans_nodes, moves.axes[a_].nodes)
            + step_local_seconds(_KINDS[k_], float(n_), moves.axes[a_].size, bool(f_ & 4),
                                 tensor, self.cluster, bool(f_ & 2), bool(f_ & 1))
            for k_, a_, n_, f_ in zip(kd.tolist(), a.tolist(), sizes[nb].tolist(),
                                      flag.tolist(), strict=True)])
        out[priced] = seconds[inverse]
        return out

    def _dijkstra(self, src: Layout, tensor: TensorSpec) -> tuple[np.ndarray, np.ndarray]:
        graph = self._graph(tensor)
        dist, pred = dijkstra(graph.matrix, directed=True, indices=graph.index[src],
                              return_predecessors=True)
        return dist, pred

    def _dijkstra_to(self, dst: Layout, tensor: TensorSpec, free: bool) -> np.ndarray:
        """Every layout's distance to ``dst``: the search on the reversed graph; with
        ``free``, on its partial-free part (:meth:`_StateGraph.free_reversed`: the
        distances of partial-free layouts, the same; inf for the others)."""
        graph = self._graph(tensor)
        if not free:
            return dijkstra(graph.reversed(), directed=True, indices=graph.index[dst])
        matrix, keep = graph.free_reversed()
        out = np.full(graph.matrix.shape[0], np.inf)
        out[keep] = dijkstra(matrix, directed=True,
                             indices=int(np.searchsorted(keep, graph.index[dst])))
        return out

    def forward_cost(self, src: Layout, dst: Layout, tensor: TensorSpec) -> float:
        """Seconds of the cheapest path ``src → dst`` (free steps weigh 1e-15 s each),
        without building the step list — what the ILP's cost matrices need."""
        a, b = drop_unit_axes(src), drop_unit_axes(dst)
        if a == b:
            return 0.0
        graph = self._graph(tensor)
        dist, _ = self._search(a, tensor)
        cost = float(dist[graph.index[b]])
        if not math.isfinite(cost):
            raise LayoutError(f"no redistribution path from {a} to {b} for {tensor.shape}")
        return cost

    def edge_cost(self, src: Layout, dst: Layout, tensor: TensorSpec,
                  grad_dst: Layout | None = None) -> float:
        """Forward plus backward seconds of the edge's lowered program."""
        back = grad_dst if grad_dst is not None else grad_layout(dst)
        return self.forward_cost(src, dst, tensor) + self.forward_cost(back, grad_layout(src), tensor)

    def forward_costs(self, srcs: Sequence[Layout], dsts: Sequence[Layout],
                      tensor: TensorSpec) -> np.ndarray:
        """:meth:`forward_cost` of every (source, destination) pair, read off one Dijkstra
        row per source, or per destination on the reversed graph where destinations are
        fewer by ``REVERSED_COST`` (``FREE_REVERSED_COST`` where every layout is
        partial-free: the search then keeps to the partial-free part; the ILP's matrices
        need thousands of pairs). A distance summed from the other end may differ from
        :meth:`forward_cost`'s in the last bits; the choice depends on the layouts asked
        for alone, so a problem's matrices do not depend on what was built before."""
        graph = self._graph(tensor)
        srcs = [drop_unit_axes(s) for s in srcs]
        dsts = [drop_unit_axes(d) for d in dsts]
        unfit = next((lay for lay in (*srcs, *dsts) if lay not in graph.index), None)
        if unfit is not None:  # an op's layout meant for another view of the value
            raise LayoutError(f"layout {unfit} does not fit a tensor of {tensor.shape} "
                              f"(it splits a dimension finer than its size)")
        free = not any(lay.has_partial for lay in (*srcs, *dsts))
        if (FREE_REVERSED_COST if free else REVERSED_COST) * len(set(dsts)) < len(set(srcs)):
            rows = [graph.index[s] for s in srcs]  # a search per destination
            out = np.array([self._search_to(d, tensor, free)[rows] for d in dsts]).T
        else:
            cols = [graph.index[d] for d in dsts]
            out = np.array([self._search(s, tensor)[0][cols] for s in srcs])
        out = out.reshape(len(srcs), len(dsts))
        if not np.all(np.isfinite(out)):
            raise LayoutError(f"no redistribution path between some layouts of {tensor.shape}")
        return out

    def edge_costs(self, srcs: Sequence[Layout], dsts: Sequence[tuple[Layout, Layout | None]],
                   tensor: TensorSpec) -> np.ndarray:
        """:meth:`edge_cost` of every (source, (destination, its gradient layout or None))
        pair."""
        forward = self.forward_costs(srcs, [d for d, _ in dsts], tensor)
        backward = self.forward_costs([g if g is not None else grad_layout(d) for d, g in dsts],
                                      [grad_layout(s) for s in srcs], tensor)
        return forward + backward.T

    def path(self, src: Layout, dst: Layout, tensor: TensorSpec) -> tuple[RedistStep, ...]:
        """The steps of the cheapest path ``src → dst`` (unit axes dropped); cached, since
        the repeated layers of a model ask for the same paths."""
        return self._path(src, dst, tensor)

    def _find_path(self, src: Layout, dst: Layout, tensor: TensorSpec) -> tuple[RedistStep, ...]:
        a, b = drop_unit_axes(src), drop_unit_axes(dst)
        for lay, name in ((a, "source"), (b, "destination")):
            lay.check(tensor)
            nodes = math.prod(ax.nodes for ax in lay.fact)
            local = math.prod(ax.local for ax in lay.fact)
            if (nodes, local) != (self.nodes, self.local):
                raise LayoutError(
                    f"{name} layout {lay} covers {nodes}x{local} devices, not {self.nodes}x{self.local}"
                )
        if a == b:
            return ()
        if b.has_partial and not (a.fact == b.fact and all(
                isinstance(a.placements[i], Partial) for i in b.partial_axes)):
            raise LayoutError(f"no layout change produces partial sums: {a} -> {b}")
        graph = self._graph(tensor)
        for lay in (a, b):
            if lay not in graph.index:
                raise LayoutError(f"layout {lay} uses a factorisation with more than three axes")
        source, target = graph.index[a], graph.index[b]
        path = self._bounded_path(graph, source, target)
        if path is None:
            dist, pred = self._search(a, tensor)
            if pred[target] < 0:
                raise LayoutError(f"no redistribution path from {a} to {b}")
            path = _walk_back(graph.incoming(), dist, source, target)
        if path is None:  # rounding left no walk back: the search's own tree
            path = [target]
            while path[-1] != source:
                path.append(int(pred[path[-1]]))
            path.reverse()
        steps: list[RedistStep] = []
        k = 0
        while k < len(path) - 1:
            u = graph.states[path[k]]
            if path[k + 1] in graph.hub_kind:
                steps.append(RedistStep(u, graph.states[path[k + 2]], None))
                k += 2
                continue
            v = graph.states[path[k + 1]]
            axis = next(i for i in range(len(u.placements)) if u.placements[i] != v.placements[i])
            kind = next(kd for pl, ax, kd in _axis_moves(u, tensor)
                        if ax == axis and pl == v.placements[axis])
            if kind is None:  # a slice: its copy, where strided, beside the program's calls
                cut = RedistStep(u, v, None)
                steps.append(dataclasses.replace(
                    cut, local_s=step_kernel_seconds(cut, tensor, self.cluster)))
            else:
                steps.append(RedistStep(u, v, self.collective(kind, u, v, axis, tensor)))
            k += 1
        return tuple(steps)

    @staticmethod
    def _bounded_path(graph: _StateGraph, source: int, target: int) -> list[int] | None:
        """:func:`_walk_back`'s path from ``source`` to ``target``, found by a search that
        stops at an upper bound on the distance — a path of up to four edges — or None (no
        such path, or no walk back).

        Exact: every node at most the bound away is settled with the same distance as in
        the full search (weights are positive and float addition is monotone, so Dijkstra's
        distances do not depend on the order nodes are scanned in), and the walk back reads
        only nodes nearer than the target, so it takes the same path on either search."""
        # two edges out of the source meeting two into the target
        bound = float(np.min(_near(graph.matrix, source) + _near(graph.reversed(), target)))
        if not math.isfinite(bound):
            return None
        # the halves were summed in another order than the search sums its path
        dist = dijkstra(graph.matrix, directed=True, indices=source, limit=bound * (1 + 1e-9))
        if not math.isfinite(dist[target]):
            return None
        return _walk_back(graph.incoming(), dist, source, target)

    def plan(self, src: Layout, dst: Layout, tensor: TensorSpec,
             grad_dst: Layout | None = None) -> Redistribution:
        back = grad_dst if grad_dst is not None else grad_layout(dst)
        return Redistribution(src, dst, tensor, self.path(src, dst, tensor), back,
                              self.path(back, grad_layout(src), tensor))


def _slice_seconds(moves: _Moves, blocks: np.ndarray, tensor: TensorSpec, cluster: Cluster,
                   out: np.ndarray) -> None:
    """Into ``out`` (:meth:`RedistributionPlanner._move_seconds`'s): each strided slice's
    copy (:func:`slice_work`), priced once per distinct piece size; the other slices stay
    free."""
    if cluster.device is None:
        return
    strided = np.flatnonzero((moves.kind < 0) & (_before(blocks)[moves.src, moves.dim] > 1))
    if not len(strided):
        return
    pieces, inverse = np.unique(np.prod(blocks[moves.dst[strided]], axis=1),
                                return_inverse=True)
    seconds = np.array([phase_seconds(slice_work(float(n) * tensor.itemsize, True),
                                      cluster.device, tensor.dtype) for n in pieces.tolist()])
    out[strided] = seconds[inverse]


def _local_flags(moves: _Moves, blocks: np.ndarray, shape: np.ndarray, degrees: np.ndarray,
                 cluster: Cluster) -> np.ndarray:
    """Per move, what its local kernels depend on besides kind, axis and bytes
    (:func:`step_work`'s reading of the layouts): 4 where a dim splits unevenly, 2 where
    its pieces must be packed, 1 where the received blocks must be unpacked; all 0 on a
    flat cluster, which prices no kernel."""
    if cluster.device is None:
        return np.zeros(len(moves.src), dtype=np.int64)
    uneven = np.any(shape % degrees != 0, axis=1)
    odd = uneven[moves.src] | uneven[moves.dst]
    before = _before(blocks)
    kind = moves.kind
    a2a = kind == _KIND_ID[CollectiveKind.ALL_TO_ALL]
    scatters = (kind == _KIND_ID[CollectiveKind.REDUCE_SCATTER]) | a2a
    gathers = (kind == _KIND_ID[CollectiveKind.ALL_GATHER]) | a2a
    # the gathered dim: an AllGather's ``dim``; an AlltoAll's is the dim whose block grows
    grown = np.argmax(blocks[moves.dst] > blocks[moves.src], axis=1)
    gathered = np.where(a2a, grown, moves.dim)
    pack = scatters & (before[moves.src, moves.dim] > 1)
    unpack = gathers & (before[moves.dst, gathered] > 1)
    return (odd * 4 + pack * 2 + unpack).astype(np.int64)


def _rank_tables_of(universe: tuple[Factorisation, ...], rank: int) -> _RankTables:
    """The tables of every candidate, a factorisation's placement codes at a time
    (:func:`_placement_codes`): split degrees and partial sums from the codes, and
    the re-view classes from every device's block index (the key
    :meth:`Layout.canonical_key` compares: equal degrees and equal blocks)."""
    degrees, partial, view_class = [], [], []
    classes: dict[tuple, int] = {}
    for fact in universe:
        opts = _placement_codes(len(fact), rank)
        coords = axis_coordinates(fact)
        deg = np.ones((len(opts), rank), dtype=np.int64)
        # per candidate and device, the block index of every dim, nested major first
        blocks = np.zeros((len(opts), len(coords), rank), dtype=np.int64)
        for i, ax in enumerate(fact):
            for d in range(rank):
                on = opts[:, i] == 2 + d
                deg[on, d] *= ax.size
                blocks[on, :, d] = blocks[on, :, d] * ax.size + coords[:, i]
        part = np.any(opts == 1, axis=1)
        # one number per device: the block's position in the row-major grid of blocks
        flat = np.zeros((len(opts), len(coords)), dtype=np.int64)
        for d in range(rank):
            flat = flat * deg[:, d, None] + blocks[:, :, d]
        for c in range(len(opts)):
            view_class.append(-1 if part[c] else classes.setdefault(
                (tuple(deg[c].tolist()), flat[c].tobytes()), len(classes)))
        degrees.append(deg)
        partial.append(part)
    return _RankTables(np.concatenate(degrees), np.concatenate(partial),
                       np.array(view_class, dtype=np.int64))


def _move_structure_of(universe: tuple[Factorisation, ...], candidates: tuple[Layout, ...],
                       rank: int, fits: tuple[bool, ...]
                       ) -> tuple[list[Layout], dict[Layout, int], _Moves]:
    """The states (the ``candidates`` of ``universe`` that fit) and single-axis moves
    between them: the same for every tensor of one rank whose dimensions admit the same
    layouts.

    The rules of :func:`_axis_moves_rank`, applied to every candidate of a
    factorisation at once: a candidate is its factorisation's offset plus its
    placement code (:func:`_placement_codes`), so the move on axis ``a`` to option
    ``o`` leads to ``code + (o - current) · (rank + 2)^(k-1-a)``. Moves are ordered by
    source, axis and new placement (B, then S(0), S(1), …), as the rules list them."""
    fits_arr = np.asarray(fits, dtype=bool)
    cand = np.flatnonzero(fits_arr)
    state_of = np.full(len(fits_arr), -1, dtype=np.int64)
    state_of[cand] = np.arange(len(cand))
    states = [candidates[c] for c in cand]
    index = {lay: i for i, lay in enumerate(states)}
    base = rank + 2
    axis_id: dict[MeshAxis, int] = {}
    cols: list[tuple[np.ndarray, ...]] = []  # src, dst, dim, kind, axis, axis no., target
    offset = 0
    for fact in universe:
        k = len(fact)
        opts = _placement_codes(k, rank)
        codes = np.arange(len(opts))
        # the minor-most axis splitting each dim (-1: none)
        last = np.full((len(opts), rank), -1, dtype=np.int64)
        for i in range(k):
            for d in range(rank):
                last[opts[:, i] == 2 + d, d] = i
        for a, ax in enumerate(fact):
            if ax.size == 1:
                continue
            cur = opts[:, a]
            split = cur >= 2
            cur_dim = np.where(split, cur - 2, 0)
            # a split axis may change only if it is the minor-most one on its dim
            movable = split & (last[codes, cur_dim] == a)
            # (which candidates, new option, kind, the dim whose block changes)
            moves = [(cur == 1, 0, _KIND_ID[CollectiveKind.ALL_REDUCE], 0 * cur),
                     (movable, 0, _KIND_ID[CollectiveKind.ALL_GATHER], cur_dim)]
            for d in range(rank):
                take = last[:, d] < a  # no later axis splits d yet
                dim = np.full(len(opts), d)
                moves += [
                    ((cur == 1) & take, 2 + d, _KIND_ID[CollectiveKind.REDUCE_SCATTER], dim),
                    (movable & (cur != 2 + d) & take, 2 + d,
                     _KIND_ID[CollectiveKind.ALL_TO_ALL], dim),
                    ((cur == 0) & take, 2 + d, -1, dim)]
            step = base ** (k - 1 - a)
            for mask, new, kind, dim in moves:
                src = state_of[offset + codes[mask]]
                dst = state_of[offset + codes[mask] + (new - cur[mask]) * step]
                ok = (src >= 0) & (dst >= 0)
                n = int(ok.sum())
                if not n:
                    continue
                cols.append((src[ok], dst[ok], dim[mask][ok], np.full(n, kind),
                             np.full(n, ax.size),
                             np.full(n, axis_id.setdefault(ax, len(axis_id))),
                             np.full(n, a), np.full(n, new)))
        offset += len(opts)
    src, dst, dim, kind, size, axis, axis_no, target = (
        np.concatenate(c).astype(np.int64) for c in zip(*cols, strict=True)
    ) if cols else (np.zeros(0, dtype=np.int64) for _ in range(8))
    order = np.lexsort((target, axis_no, src))
    kind = kind[order]
    moves = _Moves(
        src=src[order], dst=dst[order], dim=dim[order], k=size[order], kind=kind,
        axis=axis[order], axes=tuple(axis_id),
        gather=kind == _KIND_ID[CollectiveKind.ALL_GATHER],
        scatter=(kind == _KIND_ID[CollectiveKind.REDUCE_SCATTER])
        | (kind == _KIND_ID[CollectiveKind.ALL_TO_ALL]),
        cand=cand)
    return states, index, moves


def _walk_back(incoming: csc_matrix, dist: np.ndarray, source: int, target: int
               ) -> list[int] | None:
    """The shortest path ``source → target`` that steps back from each node to its
    lowest-numbered in-neighbour ``u`` on a shortest path (``dist[u] + w == dist[v]``,
    ``dist[u] < dist[v]``). Commuting moves tie often (a free re-view before or after a
    collective); this rule settles the tie by the distances alone, so a search bounded
    near the target and the full search return the same path. None when float rounding
    absorbed a free step into a long path's distance and no such in-neighbour is left."""
    path = [target]
    while path[-1] != source:
        v = path[-1]
        lo, hi = incoming.indptr[v], incoming.indptr[v + 1]
        us = incoming.indices[lo:hi]
        du = dist[us]
        on = (du + incoming.data[lo:hi] == dist[v]) & (du < dist[v])
        if not on.any():
            return None
        path.append(int(us[on].min()))
    path.reverse()
    return path


def _near(m: csr_matrix, start: int) -> np.ndarray:
    """Per node, the least weight of a path of at most two edges from ``start`` in ``m``
    (inf where there is none)."""
    indptr, indices, data = m.indptr, m.indices, m.data
    out = np.full(len(indptr) - 1, np.inf)
    out[start] = 0.0
    lo, hi = indptr[start], indptr[start + 1]
    np.minimum.at(out, indices[lo:hi], data[lo:hi])
    for u, w in zip(indices[lo:hi].tolist(), data[lo:hi].tolist(), strict=True):
        a, b = indptr[u], indptr[u + 1]
        np.minimum.at(out, indices[a:b], w + data[a:b])
    return out


@cache
def _all_placements(k: int, rank: int) -> list[tuple[Placement, ...]]:
    opts: list[Placement] = [B, Partial()] + [Split(d) for d in range(rank)]
    out: list[tuple[Placement, ...]] = [()]
    for _ in range(k):
        out = [t + (o,) for t in out for o in opts]
    return out


@cache
def _placement_codes(k: int, rank: int) -> np.ndarray:
    """``(rank+2)^k × k``: option of every axis in :func:`_all_placements`'s order (0 B,
    1 P, 2 + d S(d); the first axis most significant)."""
    base = rank + 2
    codes = np.arange(base ** k)
    out = np.stack([codes // base ** (k - 1 - i) % base for i in range(k)], axis=1)
    out.setflags(write=False)  # cached: shared by every table built from it
    return out


@lru_cache(maxsize=64)
def _planner(cluster: Cluster, nodes: int, local: int) -> RedistributionPlanner:
    return RedistributionPlanner(cluster, nodes, local)


def planner_for(layout: Layout, cluster: Cluster) -> RedistributionPlanner:
    """The (cached) planner of the device set ``layout`` lives on."""
    nodes = math.prod(a.nodes for a in layout.fact)
    local = math.prod(a.local for a in layout.fact)
    return _planner(cluster, nodes, local)


def plan_redistribution(src: Layout, dst: Layout, tensor: TensorSpec, cluster: Cluster,
                        grad_dst: Layout | None = None) -> Redistribution:
    """The lowered program of an edge (same device set): cheapest forward path
    ``src → dst`` and backward path ``grad_dst → grad_layout(src)``; ``grad_dst`` defaults
    to ``grad_layout(dst)`` (a consumer whose local backward is exact)."""
    return planner_for(src, cluster).plan(src, dst, tensor, grad_dst)


def redistribution_seconds(src: Layout, dst: Layout, tensor: TensorSpec, cluster: Cluster,
                           grad_dst: Layout | None = None) -> float:
    """Forward + backward seconds of the edge's program (fast: no step list)."""
    return planner_for(src, cluster).edge_cost(src, dst, tensor, grad_dst)
