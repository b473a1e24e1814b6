"""Cross-mesh resharding: choose the sender host and the start time of every unit task
(Zhuang et al. §3.2, eqs. 1–3), with OR-Tools CP-SAT and the paper's heuristics.

Problem (:class:`CrossMeshProblem`, solver-free data). Unit task ``i`` moves one data slice.
It is sent by one host ``n_i*`` chosen among the hosts ``n_i`` that hold a replica, to every
host of ``m_i`` (the destination hosts that need it). Choosing candidate ``k`` fixes

* ``d_ik`` — NIC time: while it runs, the sender's *send* side and every receiver's
  *receive* side are busy;
* ``e_ik`` — tail: work after the NICs are released (NVLink fan-out or an intra-node
  all-gather inside the destination hosts), which holds no scheduled resource.

With ``S_i`` the start of task ``i``::

    minimise  C_max = max_i  S_i + d_{i,k(i)} + e_{i,k(i)}                                (1)
    s.t.      k(i) ∈ candidates(i)   (the sender holds a replica)                         (2)
              [S_i, S_i + d_i) ∩ [S_j, S_j + d_j) = ∅   if n_i* = n_j*  or  m_i ∩ m_j ≠ ∅   (3)

Full duplex: a host's send side and receive side are separate resources, so (3) couples two
tasks through a shared sender or a shared receiver host, never through the sender of one
being a receiver of the other. Resource ids: ``h`` = send side of host ``h``,
``H + h`` = receive side.

Lower bound (:meth:`CrossMeshProblem.lower_bound`), the maximum of

    (a) max_i min_k (d_ik + e_ik)                                         one task alone
    (b) Σ_{i: h ∈ m_i} min_k d_ik + min_{i: h ∈ m_i} min_k e_ik            receive load of host h
    (c) Σ_{i: n_i ⊆ P} min_k d_ik / |P| + min_{i: n_i ⊆ P} min_k e_ik     send load of a pool P

where the pools P are every distinct candidate set and the union of all senders; a pool of
one host is that host's send load. This is the "largest per-host send or receive load" of
the paper, made valid when the sender is still to be chosen.

Schedules (:func:`simulate`). Every heuristic produces a sender choice plus a priority
order; tasks are appended in that order, each starting at the earliest time at which all its
resources have finished their previous tasks (a semi-active list schedule). Every
semi-active schedule arises from some order and some optimal schedule is semi-active, so a
search over (choice, order) is complete — :func:`brute_force` and an exhausted :func:`dfs`
are exact.

Algorithms — every one returns the same :class:`Result` (status, makespan, lower bound,
wall time, schedule = per task: candidate, sender host, start, end, finish):

``naive``               lowest-index sender, task order (the paper's baseline)
``load_balance``        LPT (eq. 4): tasks by decreasing duration, each to the currently
                        lightest sender; appended in that order ("load balance only")
``in_order_greedy``     lightest sender for the next task in task order (the baseline the
                        paper gives its Send/Recv and Alpa comparisons, §5.1.2)
``dfs``                 depth-first branch and bound over (next task, sender), pruned by the
                        node bound (b)+(c) on the remaining work, within a time budget
``randomized_greedy``   repeatedly pick, from many random orders, the largest set of
                        mutually non-conflicting tasks (most hosts busy) as one round
``cpsat``               CP-SAT model (:class:`CpSatModel`) seeded with the best heuristic
``brute_force``         every choice × every order (≤ 7 tasks; for tests)

CP-SAT works on integer ticks (durations rounded to about 1e-7 of the best heuristic's
makespan); its solution's sender choice and order are then re-timed in exact seconds by
:func:`simulate`. If that re-timed schedule is worse than the hint it was seeded with (a
rounding artefact at most a few ticks large), the hint is returned and ``note`` says so.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from ortools.sat.python import cp_model

from ilp_planner.errors import ConfigError, InfeasibleError

_REL_TOL = 1e-9
_DFS_CLASS_BOUND_MAX = 64  # per-class earliest-finish bound only below this many classes


class Status(str, Enum):
    """Solver-independent status. A heuristic whose makespan meets the lower bound is
    ``OPTIMAL`` (proved by the bound); otherwise ``FEASIBLE``. ``UNKNOWN``: no schedule."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    UNKNOWN = "unknown"


# -- problem data -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One way to run a task: sent by host ``sender``; ``duration`` seconds of NIC time and
    ``tail`` seconds of intra-node work afterwards."""

    sender: int
    duration: float
    tail: float = 0.0


@dataclass(frozen=True)
class SchedTask:
    """A unit task as the scheduler sees it: receiving hosts and sender candidates."""

    name: str
    receivers: tuple[int, ...]
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class CrossMeshProblem:
    """Tasks over hosts ``0..num_hosts-1``. Validated on construction; errors name the task."""

    tasks: tuple[SchedTask, ...]
    num_hosts: int

    def __post_init__(self) -> None:
        if self.num_hosts < 1:
            raise ConfigError(f"num_hosts must be >= 1, got {self.num_hosts}")
        names = set()
        for i, t in enumerate(self.tasks):
            where = f"task {i} ({t.name!r})"
            if t.name in names:
                raise ConfigError(f"{where}: duplicate task name")
            names.add(t.name)
            if not t.candidates:
                raise ConfigError(f"{where}: no sender candidate (no host holds the slice)")
            if not t.receivers:
                raise ConfigError(f"{where}: no receiving host")
            senders = [c.sender for c in t.candidates]
            if len(set(senders)) != len(senders):
                raise ConfigError(f"{where}: sender host listed twice in {senders}")
            if len(set(t.receivers)) != len(t.receivers):
                raise ConfigError(f"{where}: receiving host listed twice in {t.receivers}")
            for h in senders + list(t.receivers):
                if not 0 <= h < self.num_hosts:
                    raise ConfigError(f"{where}: host {h} outside 0..{self.num_hosts - 1}")
            for c in t.candidates:
                if not (c.duration >= 0 and c.tail >= 0) or math.isinf(c.duration + c.tail):
                    raise ConfigError(f"{where}: sender {c.sender} has duration {c.duration} "
                                      f"and tail {c.tail}; both must be finite and >= 0")

    @property
    def size(self) -> int:
        return len(self.tasks)

    def resources(self, i: int, k: int) -> tuple[int, ...]:
        """Resource ids candidate ``k`` of task ``i`` holds: its send side, receive sides."""
        t = self.tasks[i]
        return (t.candidates[k].sender,) + tuple(self.num_hosts + h for h in t.receivers)

    @cached_property
    def _resources(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return tuple(tuple(self.resources(i, k) for k in range(len(t.candidates)))
                     for i, t in enumerate(self.tasks))

    @cached_property
    def classes(self) -> tuple[int, ...]:
        """Class id per task; tasks of one class are interchangeable (same receivers and
        candidates), which DFS and CP-SAT use to break symmetry."""
        ids: dict[tuple, int] = {}
        return tuple(ids.setdefault((t.receivers, t.candidates), len(ids)) for t in self.tasks)

    def lower_bound(self) -> float:
        """Bounds (a), (b), (c) of the module docstring."""
        if not self.tasks:
            return 0.0
        min_d = [min(c.duration for c in t.candidates) for t in self.tasks]
        lb = max(min(c.duration + c.tail for c in t.candidates) for t in self.tasks)
        recv_load: dict[int, float] = {}
        recv_tail: dict[int, float] = {}
        for t, d in zip(self.tasks, min_d, strict=True):
            e = min(c.tail for c in t.candidates)
            for h in t.receivers:
                recv_load[h] = recv_load.get(h, 0.0) + d
                recv_tail[h] = min(recv_tail.get(h, math.inf), e)
        lb = max(lb, max(recv_load[h] + recv_tail[h] for h in recv_load))
        sets = [frozenset(c.sender for c in t.candidates) for t in self.tasks]
        tails = [min(c.tail for c in t.candidates) for t in self.tasks]
        for pool in set(sets) | {frozenset().union(*sets)}:
            inside = [i for i, s in enumerate(sets) if s <= pool]
            load = sum(min_d[i] for i in inside)
            lb = max(lb, load / len(pool) + min(tails[i] for i in inside))
        return lb


# -- results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledTask:
    """Task ``task`` runs candidate ``candidate`` (sender host ``sender``): NICs busy in
    ``[start, end)``, data in place at ``finish`` (= end + tail)."""

    task: int
    candidate: int
    sender: int
    start: float
    end: float
    finish: float


@dataclass(frozen=True)
class Result:
    """The one result shape of every algorithm. ``schedule`` is indexed by task."""

    algorithm: str
    status: Status
    makespan: float
    lower_bound: float
    wall_s: float
    schedule: tuple[ScheduledTask, ...]
    note: str = ""

    @property
    def gap(self) -> float:
        """Relative distance to the lower bound: (makespan − LB) / makespan."""
        return 0.0 if self.makespan <= 0 else max(0.0, 1 - self.lower_bound / self.makespan)

    @property
    def assignment(self) -> dict[int, tuple[int, float]]:
        """task → (sender host, start seconds)."""
        return {s.task: (s.sender, s.start) for s in self.schedule}

    @property
    def order(self) -> tuple[int, ...]:
        """Tasks by start time (ties by task index)."""
        return tuple(s.task for s in sorted(self.schedule, key=lambda s: (s.start, s.task)))


@dataclass(frozen=True)
class SchedulerOptions:
    """CP-SAT and search settings. CP-SAT runs with a fixed seed; with several workers a
    time-limited run may still differ between runs (CP-SAT's portfolio is not
    deterministic under a wall-clock limit), never beyond its hint."""

    algorithms: tuple[str, ...] = ("naive", "load_balance", "dfs", "randomized_greedy", "cpsat")
    time_limit_s: float = 5.0
    num_workers: int = 2
    seed: int = 0
    dfs_budget_s: float = 1.0
    greedy_restarts: int = 4
    greedy_samples: int = 8
    model_dump: str | None = None  # write the CP-SAT model (text proto) here

    def __post_init__(self) -> None:
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if unknown:
            raise ConfigError(f"unknown scheduling algorithm(s) {unknown}; expected some of "
                              f"{sorted(ALGORITHMS)}")
        if self.time_limit_s <= 0 or self.dfs_budget_s <= 0:
            raise ConfigError("time limits must be positive")
        if self.num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {self.num_workers}")


# -- schedule evaluation --------------------------------------------------------------------------


def simulate(
    problem: CrossMeshProblem,
    choice: Sequence[int],
    order: Sequence[int],
    durations: Sequence[Sequence[float]] | None = None,
    tails: Sequence[Sequence[float]] | None = None,
) -> tuple[tuple[ScheduledTask, ...], float]:
    """Append tasks in ``order`` with candidate ``choice[i]``; each starts when all its
    resources are free. Returns (schedule indexed by task, makespan). ``durations`` /
    ``tails`` override the problem's (CP-SAT's integer ticks)."""
    n = problem.size
    if sorted(order) != list(range(n)):
        raise InfeasibleError(f"order {list(order)} is not a permutation of 0..{n - 1}")
    free = [0.0] * (2 * problem.num_hosts)
    out: list[ScheduledTask | None] = [None] * n
    makespan = 0.0
    for i in order:
        k = choice[i]
        cand = problem.tasks[i].candidates[k]
        d = cand.duration if durations is None else durations[i][k]
        e = cand.tail if tails is None else tails[i][k]
        res = problem._resources[i][k]
        start = max(free[r] for r in res)
        end = start + d
        for r in res:
            free[r] = end
        out[i] = ScheduledTask(i, k, cand.sender, start, end, end + e)
        makespan = max(makespan, end + e)
    return tuple(out), makespan  # type: ignore[arg-type]


def _result(problem: CrossMeshProblem, name: str, schedule: tuple[ScheduledTask, ...],
            makespan: float, t0: float, proved: bool = False, note: str = "") -> Result:
    lb = problem.lower_bound()
    optimal = proved or makespan <= lb * (1 + _REL_TOL)
    return Result(name, Status.OPTIMAL if optimal else Status.FEASIBLE, makespan, lb,
                  time.perf_counter() - t0, schedule, note)


# -- heuristics --------------------------------------------------------------------------------------


def naive(problem: CrossMeshProblem) -> Result:
    """Lowest-index sender host, tasks in their given order (Zhuang et al. §3.2 "Naive")."""
    t0 = time.perf_counter()
    choice = [min(range(len(t.candidates)), key=lambda k, t=t: t.candidates[k].sender)
              for t in problem.tasks]
    sched, mk = simulate(problem, choice, range(problem.size))
    return _result(problem, "naive", sched, mk, t0)


def load_balance(problem: CrossMeshProblem) -> Result:
    """LPT for eq. (4): longest task first, to the sender whose send load stays smallest;
    the order is that LPT order ("Load balance only", §5.3.1)."""
    t0 = time.perf_counter()
    order = sorted(range(problem.size),
                   key=lambda i: (-min(c.duration for c in problem.tasks[i].candidates), i))
    choice = _greedy_senders(problem, order)
    sched, mk = simulate(problem, choice, order)
    return _result(problem, "load_balance", sched, mk, t0)


def in_order_greedy(problem: CrossMeshProblem) -> Result:
    """The lightest sender for the next slice, in task order — the load balancing the
    paper gives its Send/Recv and Alpa baselines (§5.1.2)."""
    t0 = time.perf_counter()
    order = list(range(problem.size))
    sched, mk = simulate(problem, _greedy_senders(problem, order), order)
    return _result(problem, "in_order_greedy", sched, mk, t0)


def _greedy_senders(problem: CrossMeshProblem, order: Sequence[int]) -> list[int]:
    load = [0.0] * problem.num_hosts
    choice = [0] * problem.size
    for i in order:
        cands = problem.tasks[i].candidates
        k = min(range(len(cands)),
                key=lambda k: (load[cands[k].sender] + cands[k].duration, cands[k].sender))
        choice[i] = k
        load[cands[k].sender] += cands[k].duration
    return choice


def randomized_greedy(problem: CrossMeshProblem, seed: int = 0, restarts: int = 4,
                      samples: int = 8) -> Result:
    """Greedy search with randomisation (§3.2): build the schedule in rounds; each round
    draws ``samples`` random orders of the remaining tasks, scans each and keeps every task
    that conflicts with none kept so far (sender: the free candidate with the least send
    load), and commits the set that keeps the most hosts busy (ties: more work). Rounds are
    appended in order by :func:`simulate`; the best of ``restarts`` runs is returned."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    n, H = problem.size, problem.num_hosts
    all_recv = {h for t in problem.tasks for h in t.receivers}
    all_send = {c.sender for t in problem.tasks for c in t.candidates}
    best: tuple[float, tuple[ScheduledTask, ...]] | None = None
    for _ in range(max(1, restarts)):
        remaining = list(range(n))
        choice = [0] * n
        order: list[int] = []
        load = [0.0] * H
        while remaining:
            best_set: list[tuple[int, int]] = []
            best_score = (-1, -1.0)
            for _s in range(max(1, samples)):
                perm = remaining[:]
                rng.shuffle(perm)
                used_s: set[int] = set()
                used_r: set[int] = set()
                chosen: list[tuple[int, int]] = []
                work = 0.0
                for i in perm:
                    t = problem.tasks[i]
                    if used_r.intersection(t.receivers):
                        continue
                    free = [k for k, c in enumerate(t.candidates) if c.sender not in used_s]
                    if not free:
                        continue
                    k = min(free, key=lambda k, t=t: (load[t.candidates[k].sender]
                                                     + t.candidates[k].duration, rng.random()))
                    chosen.append((i, k))
                    used_s.add(t.candidates[k].sender)
                    used_r.update(t.receivers)
                    work += t.candidates[k].duration
                    if used_r >= all_recv or used_s >= all_send:
                        break
                score = (len(used_s) + len(used_r), work)
                if score > best_score:
                    best_score, best_set = score, chosen
            for i, k in sorted(best_set, key=lambda ik: -problem.tasks[ik[0]].candidates[ik[1]]
                               .duration):
                choice[i] = k
                order.append(i)
                load[problem.tasks[i].candidates[k].sender] += \
                    problem.tasks[i].candidates[k].duration
            taken = {i for i, _ in best_set}
            remaining = [i for i in remaining if i not in taken]
        sched, mk = simulate(problem, choice, order)
        if best is None or mk < best[0]:
            best = (mk, sched)
    assert best is not None
    return _result(problem, "randomized_greedy", best[1], best[0], t0)


@dataclass
class _DfsState:
    best: float
    best_steps: list[tuple[int, int]] | None
    deadline: float
    nodes: int = 0
    timed_out: bool = False
    steps: list[tuple[int, int]] = field(default_factory=list)


def dfs(problem: CrossMeshProblem, budget_s: float = 1.0,
        incumbent: Result | None = None, fallback: Result | None = None) -> Result:
    """Depth-first branch and bound (§3.2 "DFS with pruning").

    A node is a partial append sequence. Children: the next task — one per class of
    interchangeable tasks — with each of its senders, tried by earliest finish first.
    Two steps on disjoint resources commute, so such an adjacent pair is only taken in
    increasing (class, candidate) order. A child is pruned when its bound — the current
    makespan; per resource, its free time plus the fixed remaining load on it; per sender
    pool, (Σ free times + remaining pool load)/|pool|; per remaining class, its earliest
    finish — is not below the best makespan found. Exhausting the tree proves optimality;
    otherwise the best schedule found within ``budget_s`` is returned. The first dive
    runs to its end whatever the budget — unless a ``fallback`` schedule (another
    algorithm's) is given: then the budget binds there too, and a dive cut short returns
    the fallback (on thousands of tasks one dive alone can take minutes)."""
    t0 = time.perf_counter()
    n = problem.size
    if n == 0:
        return _result(problem, "dfs", (), 0.0, t0, proved=True)
    root_lb = problem.lower_bound()
    tables = _DfsTables.of(problem)
    st = _DfsState(incumbent.makespan if incumbent else math.inf, None, t0 + budget_s)
    _dfs_search(problem, tables, st, root_lb, fallback)
    return _dfs_result(problem, tables, st, root_lb, t0, budget_s, incumbent, fallback)


@dataclass
class _DfsTables:
    """What :func:`dfs` branches over, per class of interchangeable tasks: its members, its
    representative's candidates and their resources, its least duration, the resources
    every candidate uses (``fixed``), and the sender pools (each with the classes it can
    serve); and what the bound tracks as tasks are placed: the tasks left per class
    (``count``), the fixed remaining load per resource and per pool, and each resource's
    free time."""

    members: dict[int, list[int]]
    cands: list
    res: list
    min_d: list[float]
    fixed: list[set[int]]
    pools: list[tuple[list[int], list[int]]]
    count: list[int]
    load: list[float]
    pool_load: list[float]
    free: list[float]

    @classmethod
    def of(cls, problem: CrossMeshProblem) -> _DfsTables:
        H = problem.num_hosts
        members: dict[int, list[int]] = {}
        for i, c in enumerate(problem.classes):
            members.setdefault(c, []).append(i)
        C = len(members)
        rep = [members[c][0] for c in range(C)]
        cands = [problem.tasks[rep[c]].candidates for c in range(C)]
        res = [problem._resources[rep[c]] for c in range(C)]
        min_d = [min(x.duration for x in cands[c]) for c in range(C)]
        fixed = [set(res[c][0][1:]) | ({cands[c][0].sender} if len(cands[c]) == 1 else set())
                 for c in range(C)]
        pool_sets = sorted({frozenset(x.sender for x in cands[c]) for c in range(C)}
                           | {frozenset(x.sender for c in range(C) for x in cands[c])}, key=sorted)
        pools = [(sorted(p), [c for c in range(C) if {x.sender for x in cands[c]} <= p])
                 for p in pool_sets]
        count = [len(members[c]) for c in range(C)]
        load = [0.0] * (2 * H)
        for c in range(C):
            for r in fixed[c]:
                load[r] += count[c] * min_d[c]
        pool_load = [sum(count[c] * min_d[c] for c in pcs) for _, pcs in pools]
        return cls(members, cands, res, min_d, fixed, pools, count, load, pool_load,
                   [0.0] * (2 * H))


def _dfs_bound(t: _DfsTables, num_hosts: int):
    """:func:`dfs`'s bound on a node's makespan (its current one ``cur``), as a closure over
    the tables (hot: read through closure cells)."""
    cands, res, pools = t.cands, t.res, t.pools
    count, load, pool_load, free = t.count, t.load, t.pool_load, t.free
    C, R = len(t.members), 2 * num_hosts

    def bound(cur: float) -> float:
        lb = cur
        for r in range(R):
            if load[r] > 0:
                lb = max(lb, free[r] + load[r])
        for (hosts, _), pl in zip(pools, pool_load, strict=True):
            if pl > 0:
                lb = max(lb, (sum(free[h] for h in hosts) + pl) / len(hosts))
        if C <= _DFS_CLASS_BOUND_MAX:
            for c in range(C):
                if count[c]:
                    lb = max(lb, min(max(free[r] for r in res[c][k]) + x.duration + x.tail
                                     for k, x in enumerate(cands[c])))
        return lb

    return bound


def _dfs_apply(t: _DfsTables):
    """Places (``sign`` +1) or takes back (-1) a task of class ``c`` in the bound's
    remaining loads, as a closure over the tables."""
    min_d, fixed, pools = t.min_d, t.fixed, t.pools
    count, load, pool_load = t.count, t.load, t.pool_load

    def apply(c: int, k: int, sign: int) -> None:
        for r in fixed[c]:
            load[r] -= sign * min_d[c]
        for j, (_, pcs) in enumerate(pools):
            if c in pcs:
                pool_load[j] -= sign * min_d[c]
        count[c] -= sign

    return apply


def _dfs_children(t: _DfsTables):
    """A node's children, earliest finish first: (makespan, end, class, candidate), skipping
    the second of two commuting steps out of (class, candidate) order."""
    cands, res, count, free = t.cands, t.res, t.count, t.free
    C = len(t.members)

    def children(cur: float, last: tuple[int, int] | None) -> list:
        out = []
        for c in range(C):
            if not count[c]:
                continue
            for k, x in enumerate(cands[c]):
                if last is not None and (c, k) < last and \
                        not set(res[c][k]).intersection(res[last[0]][last[1]]):
                    continue
                start = max(free[r] for r in res[c][k])
                out.append((max(cur, start + x.duration + x.tail), start + x.duration, c, k))
        out.sort()
        return out

    return children


def _dfs_search(problem: CrossMeshProblem, t: _DfsTables, st: _DfsState, root_lb: float,
                fallback: Result | None) -> None:
    """The branch and bound of :func:`dfs`, recording the best steps in ``st``. Its parts
    are closures over the tables (:func:`_dfs_bound`, :func:`_dfs_apply`,
    :func:`_dfs_children`): the recursion reads them through closure cells (hot: millions
    of nodes)."""
    n, res, free = problem.size, t.res, t.free
    bound, apply, children = _dfs_bound(t, problem.num_hosts), _dfs_apply(t), _dfs_children(t)

    def threshold() -> float:
        """Only strictly better schedules (beyond float noise) are worth exploring."""
        return st.best * (1 - 1e-12) if math.isfinite(st.best) else math.inf

    def visit(cur: float, depth: int, last: tuple[int, int] | None) -> None:
        st.nodes += 1
        # The budget binds once a schedule is known: the first dive always completes.
        if st.nodes % 256 == 0 and (math.isfinite(st.best) or fallback is not None) \
                and time.perf_counter() > st.deadline:
            st.timed_out = True
        if st.timed_out:
            return
        if depth == n:
            if cur < threshold():
                st.best, st.best_steps = cur, list(st.steps)
            return
        for new_cur, end, c, k in children(cur, last):
            if new_cur >= threshold():
                continue
            saved = [free[r] for r in res[c][k]]
            for r in res[c][k]:
                free[r] = end
            apply(c, k, +1)
            if bound(new_cur) < threshold():
                st.steps.append((c, k))
                visit(new_cur, depth + 1, (c, k))
                st.steps.pop()
            apply(c, k, -1)
            for r, v in zip(res[c][k], saved, strict=True):
                free[r] = v
            if st.timed_out or st.best <= root_lb * (1 + _REL_TOL):
                return

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, n + 1000))
    try:
        visit(0.0, 0, None)
    finally:
        sys.setrecursionlimit(limit)


def _dfs_result(problem: CrossMeshProblem, t: _DfsTables, st: _DfsState, root_lb: float,
                t0: float, budget_s: float, incumbent: Result | None,
                fallback: Result | None) -> Result:
    """The schedule of the best steps :func:`_dfs_search` found (or the incumbent, or the
    fallback, when it found none)."""
    n = problem.size
    exhausted = not st.timed_out
    if st.best_steps is None:
        if incumbent is None and fallback is not None and st.timed_out:
            return Result("dfs", fallback.status, fallback.makespan, root_lb,
                          time.perf_counter() - t0, fallback.schedule,
                          f"first dive stopped at the {budget_s:g} s budget "
                          f"({st.nodes} nodes); {fallback.algorithm}'s schedule returned")
        if incumbent is None:
            raise InfeasibleError("DFS found no schedule within its budget")
        return Result("dfs", incumbent.status if not exhausted else Status.OPTIMAL,
                      incumbent.makespan, root_lb, time.perf_counter() - t0,
                      incumbent.schedule, "no improvement on the incumbent")
    choice = [0] * n
    order = []
    nxt = {c: iter(ms) for c, ms in t.members.items()}
    for c, k in st.best_steps:
        i = next(nxt[c])
        choice[i] = k
        order.append(i)
    sched, mk = simulate(problem, choice, order)
    note = f"{st.nodes} nodes" + ("" if exhausted else f", stopped at the {budget_s:g} s budget")
    return _result(problem, "dfs", sched, mk, t0, proved=exhausted, note=note)


def brute_force(problem: CrossMeshProblem, max_tasks: int = 7) -> Result:
    """Every sender choice × every order, exactly; for tests on tiny instances."""
    t0 = time.perf_counter()
    n = problem.size
    if n > max_tasks:
        raise ConfigError(f"brute force is limited to {max_tasks} tasks, got {n}")
    best: tuple[float, tuple[ScheduledTask, ...]] = (math.inf, ())
    for choice in itertools.product(*(range(len(t.candidates)) for t in problem.tasks)):
        for order in itertools.permutations(range(n)):
            sched, mk = simulate(problem, choice, order)
            if mk < best[0]:
                best = (mk, sched)
    return _result(problem, "brute_force", best[1], best[0] if n else 0.0, t0, proved=True)


# -- CP-SAT ------------------------------------------------------------------------------------------


class CpSatModel:
    """CP-SAT model of eqs. (1)–(3) on integer ticks (``scale`` ticks per second).

    Variables (:meth:`_add_variables`)
        start[i] ∈ [0, horizon]; x[i,h] ∈ {0,1} task i sent by host h;
        iv[i,h] optional interval (start[i], d_ih) present iff x[i,h]; cmax.
    Constraints
        Σ_h x[i,h] = 1                                     eq. (2)  :meth:`_add_sender_choice`
        NoOverlap{iv[i,h] : sender h}        per host h    eq. (3a) :meth:`_add_send_no_overlap`
        NoOverlap{iv[i,·] : h ∈ m_i}         per host h    eq. (3b) :meth:`_add_recv_no_overlap`
        cmax ≥ start[i] + d_ih + e_ih  if x[i,h]           eq. (1)  :meth:`_add_makespan`
        start[i] ≤ start[j] for interchangeable i < j      symmetry :meth:`_add_symmetry_breaking`
    Objective: minimise cmax, cmax ≥ the lower bound of the tick-rounded problem.

    In (3b) every candidate interval of a task joins the receiver's NoOverlap; only the
    present one is active, so the receive side sees the duration of the chosen sender.
    """

    def __init__(self, problem: CrossMeshProblem, scale: float,
                 hint: Sequence[ScheduledTask] | None = None):
        self.problem = problem
        self.scale = scale
        self.model = cp_model.CpModel()
        self.d = [[self.ticks(c.duration) for c in t.candidates] for t in problem.tasks]
        self.e = [[self.ticks(c.tail) for c in t.candidates] for t in problem.tasks]
        self.horizon = sum(max(d + e for d, e in zip(di, ei, strict=True))
                           for di, ei in zip(self.d, self.e, strict=True))
        self.hint_ticks: tuple[tuple[ScheduledTask, ...], int] | None = None
        if hint is not None:
            # Re-time the hint on ticks (rounding may shift it) and tighten the horizon.
            order = sorted(range(problem.size), key=lambda i: (hint[i].start, i))
            choice = [hint[i].candidate for i in range(problem.size)]
            sched, mk = simulate(problem, choice, order, self.d, self.e)
            self.hint_ticks = (sched, int(round(mk)))
            self.horizon = min(self.horizon, int(round(mk)))
        self._add_variables()
        self._add_sender_choice()
        self._add_send_no_overlap()
        self._add_recv_no_overlap()
        self._add_makespan()
        self._add_symmetry_breaking()
        if self.hint_ticks is not None:
            self._add_hint(self.hint_ticks[0])
        self.model.minimize(self.cmax)

    def ticks(self, seconds: float) -> int:
        return 0 if seconds <= 0 else max(1, int(round(seconds * self.scale)))

    def _add_variables(self) -> None:
        """start[i], x[i,h], optional interval iv[i,h] (size d_ih) and cmax; names carry
        the task name and the sender host."""
        m, p = self.model, self.problem
        tick_problem = CrossMeshProblem(
            tuple(SchedTask(t.name, t.receivers, tuple(
                Candidate(c.sender, self.d[i][k], self.e[i][k])
                for k, c in enumerate(t.candidates))) for i, t in enumerate(p.tasks)),
            p.num_hosts)
        lb = min(int(math.floor(tick_problem.lower_bound() * (1 - 1e-12))), self.horizon)
        self.cmax = m.new_int_var(max(0, lb), self.horizon, "cmax")
        self.start = [m.new_int_var(0, self.horizon, f"start[{t.name}]") for t in p.tasks]
        self.x: list[list[cp_model.IntVar]] = []
        self.iv: list[list[cp_model.IntervalVar]] = []
        for i, t in enumerate(p.tasks):
            xs, ivs = [], []
            for k, c in enumerate(t.candidates):
                lit = m.new_bool_var(f"x[{t.name},h{c.sender}]")
                ivs.append(m.new_optional_fixed_size_interval_var(
                    self.start[i], self.d[i][k], lit, f"iv[{t.name},h{c.sender}]"))
                xs.append(lit)
            self.x.append(xs)
            self.iv.append(ivs)

    def _add_sender_choice(self) -> None:
        """Eq. (2): exactly one sender among the hosts holding the slice."""
        for xs in self.x:
            self.model.add_exactly_one(xs)

    def _add_send_no_overlap(self) -> None:
        """Eq. (3a): a host sends one task at a time — NoOverlap of the intervals whose
        candidate sender is that host."""
        per_host: dict[int, list[cp_model.IntervalVar]] = {}
        for i, t in enumerate(self.problem.tasks):
            for k, c in enumerate(t.candidates):
                per_host.setdefault(c.sender, []).append(self.iv[i][k])
        for _h, ivs in sorted(per_host.items()):
            if len(ivs) > 1:
                self.model.add_no_overlap(ivs)

    def _add_recv_no_overlap(self) -> None:
        """Eq. (3b): a host receives one task at a time — NoOverlap of every candidate
        interval of the tasks it receives (only the chosen one is present)."""
        per_host: dict[int, list[cp_model.IntervalVar]] = {}
        for i, t in enumerate(self.problem.tasks):
            for h in t.receivers:
                per_host.setdefault(h, []).extend(self.iv[i])
        for _h, ivs in sorted(per_host.items()):
            if len(ivs) > 1:
                self.model.add_no_overlap(ivs)

    def _add_makespan(self) -> None:
        """Eq. (1): cmax is at least every task's finish (NIC end plus tail)."""
        for i, xs in enumerate(self.x):
            for k, lit in enumerate(xs):
                self.model.add(self.cmax >= self.start[i] + self.d[i][k] + self.e[i][k]) \
                    .only_enforce_if(lit)

    def _add_symmetry_breaking(self) -> None:
        """Interchangeable tasks (same receivers and candidates) start in index order —
        any schedule can be relabelled to satisfy this."""
        last: dict[int, int] = {}
        for i, c in enumerate(self.problem.classes):
            if c in last:
                self.model.add(self.start[last[c]] <= self.start[i])
            last[c] = i

    def _add_hint(self, sched: Sequence[ScheduledTask]) -> None:
        """Seed the search with a heuristic schedule (on ticks), relabelled within each
        class of interchangeable tasks so that it satisfies the symmetry breaking."""
        by_class: dict[int, list[int]] = {}
        for i, c in enumerate(self.problem.classes):
            by_class.setdefault(c, []).append(i)
        for tasks in by_class.values():
            slots = sorted((sched[i].start, sched[i].candidate) for i in tasks)
            for i, (s, k) in zip(tasks, slots, strict=True):
                self.model.add_hint(self.start[i], int(round(s)))
                for kk, lit in enumerate(self.x[i]):
                    self.model.add_hint(lit, kk == k)
        self.model.add_hint(self.cmax, self.horizon)

    def solve(self, time_limit_s: float, num_workers: int, seed: int
              ) -> tuple[str, list[int], list[int], float]:
        """Returns (CP-SAT status name, choice, start ticks, best bound in seconds)."""
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = num_workers
        solver.parameters.random_seed = seed
        solver.parameters.log_search_progress = False
        status = solver.solve(self.model)
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return name, [], [], 0.0
        choice = [next(k for k, lit in enumerate(xs) if solver.boolean_value(lit))
                  for xs in self.x]
        starts = [solver.value(s) for s in self.start]
        return name, choice, starts, solver.best_objective_bound / self.scale


def cpsat(problem: CrossMeshProblem, time_limit_s: float = 5.0, num_workers: int = 2,
          seed: int = 0, hint: Result | None = None, model_dump: str | None = None) -> Result:
    """Solve with :class:`CpSatModel`; see the module docstring for ticks and the hint."""
    t0 = time.perf_counter()
    n = problem.size
    if n == 0:
        return _result(problem, "cpsat", (), 0.0, t0, proved=True)
    if hint is None:
        hint = load_balance(problem)
    scale = 1e7 / max(hint.makespan, 1e-30)
    model = CpSatModel(problem, scale, hint.schedule)
    if model_dump and not model.model.export_to_file(model_dump):
        raise ConfigError(f"{model_dump}: cannot write the CP-SAT model there")
    status, choice, starts, _bound = model.solve(time_limit_s, num_workers, seed)
    if not choice:
        return Result("cpsat", hint.status, hint.makespan, hint.lower_bound,
                      time.perf_counter() - t0, hint.schedule,
                      f"CP-SAT {status}: no solution within {time_limit_s:g} s; hint returned")
    order = sorted(range(n), key=lambda i: (starts[i], i))
    sched, mk = simulate(problem, choice, order)
    proved = status == "OPTIMAL"
    note = f"CP-SAT {status}"
    if mk > hint.makespan:
        sched, mk = hint.schedule, hint.makespan
        note += f"; re-timed solution worse than its hint ({hint.algorithm}), hint returned"
    return _result(problem, "cpsat", sched, mk, t0, proved=proved, note=note)


# -- driver ------------------------------------------------------------------------------------------

ALGORITHMS: dict[str, Callable[..., Result]] = {
    "naive": naive,
    "load_balance": load_balance,
    "in_order_greedy": in_order_greedy,
    "dfs": dfs,
    "randomized_greedy": randomized_greedy,
    "cpsat": cpsat,
    "brute_force": brute_force,
}

# Preference among equal makespans: exact methods first.
_PREFERENCE = ("cpsat", "brute_force", "dfs", "randomized_greedy", "load_balance",
               "in_order_greedy", "naive")


def solve_all(problem: CrossMeshProblem, options: SchedulerOptions | None = None
              ) -> dict[str, Result]:
    """Run the requested algorithms; CP-SAT runs last, seeded with the best heuristic."""
    opts = options or SchedulerOptions()
    out: dict[str, Result] = {}
    for name in opts.algorithms:
        if name in ("cpsat", "brute_force"):
            continue
        if name == "dfs":
            out[name] = dfs(problem, opts.dfs_budget_s,
                            fallback=best_result(out) if out else None)
        elif name == "randomized_greedy":
            out[name] = randomized_greedy(problem, opts.seed, opts.greedy_restarts,
                                          opts.greedy_samples)
        else:
            out[name] = ALGORITHMS[name](problem)
    if "brute_force" in opts.algorithms:
        out["brute_force"] = brute_force(problem)
    if "cpsat" in opts.algorithms:
        hint = best_result(out) if out else load_balance(problem)
        out["cpsat"] = cpsat(problem, opts.time_limit_s, opts.num_workers, opts.seed, hint,
                             opts.model_dump)
    return out


def best_result(results: dict[str, Result]) -> Result:
    """Smallest makespan; among equal ones the most exact method."""
    if not results:
        raise InfeasibleError("no scheduling algorithm was run")

    def key(r: Result) -> tuple[float, int]:
        rank = _PREFERENCE.index(r.algorithm) if r.algorithm in _PREFERENCE else len(_PREFERENCE)
        return (r.makespan, rank)

    return min(results.values(), key=key)
