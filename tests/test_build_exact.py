"""The fast build paths give exactly what the plain definitions give: state-graph edge
weights equal the scalar price of each move (:func:`step_bytes` on padded blocks), re-view
hubs join exactly the layouts with equal :meth:`Layout.block_key`, the bounded path search
walks back the full search's path (or declines), and problems built with a shared
:class:`BuildCache` are the problems built without one, array for array."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from scipy.sparse.csgraph import dijkstra

from ilp_planner.inputs.models import gpt
from ilp_planner.inter_op.layer_units import layer_units, subgraph
from ilp_planner.intra_op.problem import BuildCache, build_problem
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout, Split
from ilp_planner.lowering.cost_model import CollectiveKind, MemorySpec, make_collective
from ilp_planner.lowering.redistribution import (
    _EPS,
    _KIND_ID,
    RedistributionPlanner,
    _axis_moves,
    _axis_moves_rank,
    _walk_back,
    step_bytes,
)
from ilp_planner.lowering.stage_boundary import stage_boundary

INTRA = Link(alpha=2e-6, beta=1e-11)
INTER = Link(alpha=3e-5, beta=4e-10)
CLUSTER = Cluster(4, 8, memory_bytes=80e9, peak_flops=1e14, intra=INTRA, inter=INTER)

MESHES = [(2, 3), (3, 2), (2, 4), (1, 8)]
TENSORS = [TensorSpec((64, 96)), TensorSpec((7, 5), "float16"), TensorSpec((6,)),
           TensorSpec((12, 10, 3)), TensorSpec((1, 3))]


def _graphs():
    for nodes, local in MESHES:
        planner = RedistributionPlanner(CLUSTER, nodes, local)
        for tensor in TENSORS:
            yield planner, tensor, planner._graph(tensor)


@pytest.mark.parametrize("nodes,local", MESHES)
def test_edge_weights_and_hubs_are_the_scalar_definitions(nodes, local):
    planner = RedistributionPlanner(CLUSTER, nodes, local)
    for tensor in TENSORS:
        graph = planner._graph(tensor)
        n, m = len(graph.states), graph.matrix
        hub_of: dict[int, int] = {}
        for i, u in enumerate(graph.states):
            for e in range(m.indptr[i], m.indptr[i + 1]):
                j, w = int(m.indices[e]), float(m.data[e])
                if j >= n:  # re-view hub: free both ways
                    assert graph.hub_kind[j] == "view" and w == _EPS
                    assert m[j, i] == _EPS
                    hub_of[i] = j
                    continue
                v = graph.states[j]
                [axis] = [a for a in range(len(u.fact)) if u.placements[a] != v.placements[a]]
                [kind] = [kd for pl, ax, kd in _axis_moves(u, tensor)
                          if ax == axis and pl == v.placements[axis]]
                want = _EPS if kind is None else make_collective(
                    kind, u.fact[axis].size, step_bytes(kind, u, v, axis, tensor), CLUSTER,
                    u.fact[axis].spans_nodes).seconds
                assert w == want, (u, v, tensor)
        free = [i for i, u in enumerate(graph.states) if not u.has_partial]
        keys = {i: graph.states[i].block_key(tensor.shape) for i in free}
        # a hub joins every class of two or more states; a lone state has none
        shared = {k for k, c in collections.Counter(keys.values()).items() if c > 1}
        assert sorted(hub_of) == [i for i in free if keys[i] in shared]
        for i in hub_of:
            for j in hub_of:
                assert (hub_of[i] == hub_of[j]) == (keys[i] == keys[j])
        # hubs numbered in order of first appearance
        firsts = list(dict.fromkeys(hub_of[i] for i in free if i in hub_of))
        assert firsts == sorted(firsts) == list(range(n, n + len(firsts)))


@pytest.mark.parametrize("nodes,local", MESHES + [(1, 1), (2, 2), (16, 1), (4, 8)])
def test_the_move_structure_is_the_per_layout_rules(nodes, local):
    """The vectorised move structure lists exactly the moves :func:`_axis_moves_rank`
    gives layout by layout, in the same order (source, axis, new placement)."""
    planner = RedistributionPlanner(CLUSTER, nodes, local)
    for tensor in TENSORS + [TensorSpec((4096, 2560)), TensorSpec((4, 2, 3, 2))]:
        tables = planner._tables(tensor.rank)
        fits = tuple(np.all(tables.degrees <= np.array(tensor.shape), axis=1).tolist())
        states, index, moves = planner._move_structure(tensor.rank, fits)
        want = []
        for i, lay in enumerate(states):
            for pl, a, kind in _axis_moves_rank(lay, tensor.rank):
                pls = lay.placements
                j = index.get(Layout(lay.fact, pls[:a] + (pl,) + pls[a + 1:]))
                if j is not None:
                    dim = lay.placements[a].dim if kind is CollectiveKind.ALL_GATHER else (
                        pl.dim if isinstance(pl, Split) else 0)
                    want.append((i, j, -1 if kind is None else _KIND_ID[kind], lay.fact[a],
                                 lay.fact[a].size, dim))
        got = list(zip(moves.src.tolist(), moves.dst.tolist(), moves.kind.tolist(),
                       [moves.axes[x] for x in moves.axis.tolist()], moves.k.tolist(),
                       moves.dim.tolist(), strict=True))
        assert got == want, (nodes, local, tensor)
        assert np.array_equal(moves.gather, moves.kind == _KIND_ID[CollectiveKind.ALL_GATHER])


@pytest.mark.parametrize("nodes,local", MESHES + [(1, 1), (2, 2), (16, 1), (4, 8)])
def test_rank_tables_are_the_per_layout_definitions(nodes, local):
    """Split degrees, partial sums and re-view classes (numbered by first appearance,
    equal exactly when :meth:`Layout.canonical_key` is) of every candidate layout."""
    planner = RedistributionPlanner(CLUSTER, nodes, local)
    for rank in (1, 2, 3, 4):
        tables = planner._tables(rank)
        candidates = planner._candidates(rank)
        classes: dict[tuple, int] = {}
        for c, lay in enumerate(candidates):
            assert tables.degrees[c].tolist() == [lay.split_degree(d) for d in range(rank)]
            assert bool(tables.partial[c]) == lay.has_partial
            want = -1 if lay.has_partial else classes.setdefault(lay.canonical_key(), len(classes))
            assert tables.view_class[c] == want
        assert len(tables.view_class) == len(candidates)


def test_the_partial_free_reversed_search_settles_the_same_distances():
    """Between partial-free layouts the search on the partial-free part of the reversed
    graph gives the whole reversed graph's distances, bit for bit."""
    checked = 0
    for _, _, graph in _graphs():
        matrix, keep = graph.free_reversed()
        n = len(graph.states)
        free = np.flatnonzero(~graph.partial)
        assert np.array_equal(keep[keep < n], free)
        for t in free[:: max(1, len(free) // 6)].tolist():
            whole = dijkstra(graph.reversed(), directed=True, indices=t)
            part = dijkstra(matrix, directed=True, indices=int(np.searchsorted(keep, t)))
            assert np.array_equal(part[: len(free)], whole[free])
            checked += 1
    assert checked > 50


def test_bounded_path_search_returns_the_full_search_path():
    """The search bounded near the target walks back the path the full search's distances
    give (or declines), and that path is a shortest one: its edges exist and their weights
    sum to the distance."""
    found = declined = 0
    for _, _, graph in _graphs():
        n, m = len(graph.states), graph.matrix
        for s in range(0, n, max(1, n // 25)):
            dist = dijkstra(m, directed=True, indices=s)
            for t in range(n):
                if t == s or not np.isfinite(dist[t]):
                    continue
                full = _walk_back(graph.incoming(), dist, s, t)
                assert full is not None and full[0] == s and full[-1] == t
                got = RedistributionPlanner._bounded_path(graph, s, t)
                if got is None:
                    declined += 1
                    continue
                assert got == full
                weights = [m[u, v] for u, v in itertools.pairwise(full)]
                assert all(w > 0 for w in weights)
                assert sum(weights) == pytest.approx(dist[t], rel=1e-12)
                found += 1
    assert found > 1000 and declined > 0


def _stage_problems(cache: BuildCache | None, nodes: int, local: int):
    g = gpt(layers=5, hidden=32, heads=4, seq_len=8, vocab=64, batch=4)
    units = layer_units(g)
    out = []
    for a, e in [(0, 2), (1, 3), (2, 4), (3, 5), (1, 4), (0, 5), (2, 3)]:
        names = [n for u in units[a:e] for n in u]
        sub = subgraph(g, names)
        for tie in (True, False):
            out.append(build_problem(sub, CLUSTER, nodes, local, MemorySpec.preset("adam"),
                                     tie_layers=tie, boundary=stage_boundary(g, names),
                                     grad_bucket_bytes=1 << 20, cache=cache).problem)
    return out


@pytest.mark.parametrize("nodes,local", [(1, 4), (2, 2)])
def test_a_shared_build_cache_gives_the_same_problems(nodes, local):
    cache = BuildCache()
    shared = _stage_problems(cache, nodes, local)
    assert cache.options and cache.matrices and cache.programs
    size = (len(cache.options), len(cache.matrices), len(cache.programs))
    again = _stage_problems(cache, nodes, local)  # everything is found in the cache
    assert (len(cache.options), len(cache.matrices), len(cache.programs)) == size
    for p_ref, p_a, p_b in zip(_stage_problems(None, nodes, local), shared, again, strict=True):
        for p in (p_a, p_b):
            assert p.names == p_ref.names
            for x, y in zip(p.cost + p.memory, p_ref.cost + p_ref.memory, strict=True):
                assert np.array_equal(x, y)
            assert p.edges.keys() == p_ref.edges.keys()
            assert all(np.array_equal(p.edges[k], p_ref.edges[k]) for k in p.edges)
            assert np.array_equal(p.buckets.alpha, p_ref.buckets.alpha)
            assert all(np.array_equal(x, y) for x, y in zip(p.buckets.bytes, p_ref.buckets.bytes,
                                                            strict=True))


def test_bucket_terms_are_the_plain_per_strategy_loop():
    """Gradient-bucket rows (cached per options list, added with ``np.add.at``) equal the
    plain loop over every node's strategies and their reductions, and each strategy's
    cost lost the latency the loop moves out of it — to the last bits: the build sums a
    group's rows per options list (a repeated layer's copies counted), before its edges'
    diagonals, where the loop subtracts node by node after them."""
    from ilp_planner.lowering.cost_model import collective_time
    from ilp_planner.lowering.grad_buckets import device_groups

    g = gpt(layers=3, hidden=32, heads=4, seq_len=8, vocab=64, batch=4)
    for tie in (True, False):
        gp = build_problem(g, CLUSTER, 2, 2, MemorySpec.preset("adam"), tie_layers=tie,
                           grad_bucket_bytes=1 << 20)
        plain = build_problem(g, CLUSTER, 2, 2, MemorySpec.preset("adam"), tie_layers=tie)
        index: dict[tuple, int] = {}
        alpha: list[float] = []
        for node in gp.options:
            for o in gp.options[node]:
                for sb in o.syncs:
                    key = device_groups(sb.fact, sb.axes)
                    if key not in index:
                        index[key] = len(alpha)
                        c = sb.collective
                        alpha.append(collective_time(c.kind, c.group_size, 0.0,
                                                     CLUSTER.link(c.link == "inter")))
        want = [np.zeros((len(c), len(alpha))) for c in gp.problem.cost]
        cost = [c.copy() for c in plain.problem.cost]
        for node, grp in gp.group_of.items():
            moved = np.zeros(len(gp.options[node]))
            for k, o in enumerate(gp.options[node]):
                for sb in o.syncs:
                    j = index[device_groups(sb.fact, sb.axes)]
                    want[grp][k, j] += sb.collective.bytes
                    moved[k] += alpha[j]
            cost[grp] -= moved
        assert np.array_equal(gp.problem.buckets.alpha, np.array(alpha))
        assert all(np.array_equal(a, b) for a, b in zip(gp.problem.buckets.bytes, want,
                                                        strict=True))
        assert all(np.allclose(a, b, rtol=1e-12, atol=0.0)
                   for a, b in zip(gp.problem.cost, cost, strict=True))
