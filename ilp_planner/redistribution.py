"""Redistribution planner: the cheapest sequence of collectives between two layouts of the
same device set, possibly on different mesh factorisations (AutoDDL §4.3).

Plan, then execute: :func:`plan_redistribution` returns a :class:`Redistribution` — a list
of steps, each a layout change with the collective it issues (or none for a local slice).

The search is Dijkstra over the states ``(factorisation, placements)`` of every proper
factorisation with up to three axes (plus those of the endpoints). Edges:

1. one mesh axis changes state (DESIGN §3):
   ``P→B`` AllReduce, ``P→S(d)`` ReduceScatter, ``S(d)→B`` AllGather,
   ``S(i)→S(j)`` AlltoAll, ``B→S(d)``, ``B→P`` and ``S(d)→P`` local (free);
2. a *re-view*: two partial-free layouts on different factorisations in which every device
   holds the same block (equal :meth:`Layout.canonical_key`) are the same data — free;
3. a *reshuffle*: between partial-free layouts whose per-device shards have the same shape
   but sit on other devices — an AlltoAll over the whole device set.

AutoDDL's §4.3 path ``(S0:p0, S1:p1, P:p2) → (S0:p0, S1:p1p2) → (S0:p0′, S1:p1′p2′) →
(S0:p0′, B:p1′, S1:p2′)`` is ReduceScatter, re-view/reshuffle, AllGather in this graph.

Block order. A single-axis step is priced on any axis, as AutoDDL and OneFlow do. When an
axis that is not the minor-most of those splitting a dimension gathers or scatters, the
shards that result hold the right amount of data in a *strided* block order (DTensor's
``_StridedShard``), not the contiguous order :meth:`Layout.canonical_key` assumes. The cost
is the collective's either way; executing such a step with contiguous shards, as the
runtime's DTensor ``redistribute`` does, may issue more communication than planned (e.g.
the §4.3 path becomes AllReduce + AllGather + local slicing). The runtime's results are
exact regardless; only its communication volume can exceed the prediction.

The backward pass moves the gradient along the dual path (S stays S, B and P swap), which
issues the mirrored collectives with the same bytes — AllGather ↔ ReduceScatter, AllReduce
and AlltoAll unchanged — so the backward cost equals the forward cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from ilp_planner.cluster import Cluster, Factorisation, proper_factorisations
from ilp_planner.cost_model import Collective, CollectiveKind, make_collective
from ilp_planner.errors import LayoutError
from ilp_planner.graph import TensorSpec
from ilp_planner.layouts import B, Layout, P, Partial, Placement, Split, drop_unit_axes

_MIRROR = {
    CollectiveKind.ALL_GATHER: CollectiveKind.REDUCE_SCATTER,
    CollectiveKind.REDUCE_SCATTER: CollectiveKind.ALL_GATHER,
    CollectiveKind.ALL_REDUCE: CollectiveKind.ALL_REDUCE,
    CollectiveKind.ALL_TO_ALL: CollectiveKind.ALL_TO_ALL,
}


@dataclass(frozen=True)
class RedistStep:
    """One layout change; ``collective`` is None for a free local step or re-view."""

    src: Layout
    dst: Layout
    collective: Collective | None

    def __str__(self) -> str:
        c = self.collective
        how = "local" if c is None else f"{c.kind.value}(p={c.group_size}, {c.bytes:.3g} B, {c.link})"
        return f"{self.src} -> {self.dst}: {how}"


@dataclass(frozen=True)
class Redistribution:
    src: Layout
    dst: Layout
    tensor: TensorSpec
    steps: tuple[RedistStep, ...]

    @property
    def forward(self) -> list[Collective]:
        return [s.collective for s in self.steps if s.collective is not None]

    @property
    def backward(self) -> list[Collective]:
        """The gradient's collectives (dual path, reverse order)."""
        return [
            Collective(_MIRROR[c.kind], c.group_size, c.bytes, c.link, c.seconds, c.axes,
                       "backward", c.purpose)
            for c in reversed(self.forward)
        ]

    @property
    def forward_seconds(self) -> float:
        return sum(c.seconds for c in self.forward)

    @property
    def seconds(self) -> float:
        """Forward plus backward time."""
        return 2.0 * self.forward_seconds

    @property
    def bytes(self) -> float:
        return 2.0 * sum(c.bytes for c in self.forward)


def _axis_moves(layout: Layout, tensor: TensorSpec) -> list[tuple[Placement, int, CollectiveKind | None]]:
    """(new placement, axis, collective kind or None) for every single-axis change."""
    moves = []
    rank = tensor.rank
    for a, cur in enumerate(layout.placements):
        if layout.fact[a].size == 1:
            continue
        if isinstance(cur, Partial):
            moves.append((B, a, CollectiveKind.ALL_REDUCE))
            moves += [(Split(d), a, CollectiveKind.REDUCE_SCATTER) for d in range(rank)]
        elif isinstance(cur, Split):
            moves.append((B, a, CollectiveKind.ALL_GATHER))
            moves.append((P, a, None))
            moves += [(Split(d), a, CollectiveKind.ALL_TO_ALL) for d in range(rank) if d != cur.dim]
        else:
            moves.append((P, a, None))
            moves += [(Split(d), a, None) for d in range(rank)]
    return moves


def _replace(layout: Layout, axis: int, pl: Placement) -> Layout:
    pls = list(layout.placements)
    pls[axis] = pl
    return Layout(layout.fact, tuple(pls))


def _fits(layout: Layout, tensor: TensorSpec) -> bool:
    return all(d < tensor.rank and k <= tensor.shape[d] for d, k in layout._degrees.items())


_EPS = 1e-15  # weight of free edges: csgraph needs strictly positive weights


@dataclass
class _StateGraph:
    """All layouts of one tensor on one device set as a weighted digraph. Node ids below
    ``len(states)`` are layouts; the rest are hubs joining re-view groups (free) and
    reshuffle groups (one AlltoAll)."""

    states: list[Layout]
    index: dict[Layout, int]
    matrix: object  # scipy.sparse.csr_matrix
    hub_kind: dict[int, str]


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
        self.spans_nodes = nodes > 1
        self._graph = lru_cache(maxsize=64)(self._build_graph)
        self._search = lru_cache(maxsize=8192)(self._dijkstra)

    def _collective(self, kind: CollectiveKind, layout: Layout, axis: int, tensor: TensorSpec) -> Collective:
        size = layout.fact[axis].size
        local = layout.local_bytes(tensor)
        nbytes = local * size if kind is CollectiveKind.ALL_GATHER else local
        return make_collective(kind, size, nbytes, self.cluster, layout.fact[axis].spans_nodes, (axis,))

    def _reshuffle(self, layout: Layout, tensor: TensorSpec) -> Collective:
        p = self.nodes * self.local
        return make_collective(CollectiveKind.ALL_TO_ALL, p, layout.local_bytes(tensor),
                               self.cluster, self.spans_nodes)

    def _build_graph(self, tensor: TensorSpec) -> _StateGraph:
        states = [
            lay
            for fact in self.universe
            for pls in _all_placements(len(fact), tensor.rank)
            if _fits(lay := Layout(fact, pls), tensor)
        ]
        index = {lay: i for i, lay in enumerate(states)}
        rows: list[int] = []
        cols: list[int] = []
        weights: list[float] = []
        hubs: dict[tuple, int] = {}
        hub_kind: dict[int, str] = {}

        def hub(key: tuple, kind: str) -> int:
            if key not in hubs:
                hubs[key] = len(states) + len(hubs)
                hub_kind[hubs[key]] = kind
            return hubs[key]

        for i, lay in enumerate(states):
            for pl, axis, kind in _axis_moves(lay, tensor):
                j = index.get(_replace(lay, axis, pl))
                if j is None:
                    continue
                rows.append(i)
                cols.append(j)
                weights.append(_EPS if kind is None else self._collective(kind, lay, axis, tensor).seconds)
            if lay.has_partial:
                continue
            h = hub(("view", lay.canonical_key()), "view")
            rows += [i, h]
            cols += [h, i]
            weights += [_EPS, _EPS]
            if self.nodes * self.local > 1:
                h = hub(("shuffle", lay.local_shape(tensor.shape)), "shuffle")
                rows += [i, h]
                cols += [h, i]
                weights += [self._reshuffle(lay, tensor).seconds + _EPS, _EPS]
        n = len(states) + len(hubs)
        matrix = csr_matrix((weights, (rows, cols)), shape=(n, n))
        return _StateGraph(states, index, matrix, hub_kind)

    def _dijkstra(self, src: Layout, tensor: TensorSpec) -> tuple[np.ndarray, np.ndarray]:
        graph = self._graph(tensor)
        dist, pred = dijkstra(graph.matrix, directed=True, indices=graph.index[src],
                              return_predecessors=True)
        return dist, pred

    def forward_cost(self, src: Layout, dst: Layout, tensor: TensorSpec) -> float:
        """Forward seconds of the cheapest path (free steps weigh 1e-15 s each), without
        building the step list — what the ILP's cost matrices need."""
        a, b = drop_unit_axes(src), drop_unit_axes(dst)
        if a == b:
            return 0.0
        graph = self._graph(tensor)
        dist, _ = self._search(a, tensor)
        return float(dist[graph.index[b]])

    def plan(self, src: Layout, dst: Layout, tensor: TensorSpec) -> Redistribution:
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
            return Redistribution(src, dst, tensor, ())
        graph = self._graph(tensor)
        for lay in (a, b):
            if lay not in graph.index:
                raise LayoutError(f"layout {lay} uses a factorisation with more than three axes")
        _, pred = self._search(a, tensor)
        target = graph.index[b]
        if pred[target] < 0:
            raise LayoutError(f"no redistribution path from {a} to {b}")
        path = [target]
        while path[-1] != graph.index[a]:
            path.append(int(pred[path[-1]]))
        path.reverse()
        steps: list[RedistStep] = []
        k = 0
        while k < len(path) - 1:
            u = graph.states[path[k]]
            if path[k + 1] in graph.hub_kind:
                v = graph.states[path[k + 2]]
                kind = graph.hub_kind[path[k + 1]]
                steps.append(RedistStep(u, v, None if kind == "view" else self._reshuffle(u, tensor)))
                k += 2
                continue
            v = graph.states[path[k + 1]]
            axis = next(i for i in range(len(u.placements)) if u.placements[i] != v.placements[i])
            kind = next(kd for pl, ax, kd in _axis_moves(u, tensor)
                        if ax == axis and pl == v.placements[axis])
            steps.append(RedistStep(u, v, None if kind is None else self._collective(kind, u, axis, tensor)))
            k += 1
        return Redistribution(src, dst, tensor, tuple(steps))


@cache
def _all_placements(k: int, rank: int) -> list[tuple[Placement, ...]]:
    opts: list[Placement] = [B, P] + [Split(d) for d in range(rank)]
    out: list[tuple[Placement, ...]] = [()]
    for _ in range(k):
        out = [t + (o,) for t in out for o in opts]
    return out


@lru_cache(maxsize=64)
def _planner(cluster: Cluster, nodes: int, local: int) -> RedistributionPlanner:
    return RedistributionPlanner(cluster, nodes, local)


def planner_for(layout: Layout, cluster: Cluster) -> RedistributionPlanner:
    """The (cached) planner of the device set ``layout`` lives on."""
    nodes = math.prod(a.nodes for a in layout.fact)
    local = math.prod(a.local for a in layout.fact)
    return _planner(cluster, nodes, local)


def plan_redistribution(src: Layout, dst: Layout, tensor: TensorSpec, cluster: Cluster) -> Redistribution:
    """Cheapest forward path from ``src`` to ``dst`` (same device set) for ``tensor``."""
    return planner_for(src, cluster).plan(src, dst, tensor)


def redistribution_seconds(src: Layout, dst: Layout, tensor: TensorSpec, cluster: Cluster) -> float:
    """Forward + backward seconds of the cheapest path (fast: no step list)."""
    return 2.0 * planner_for(src, cluster).forward_cost(src, dst, tensor)
