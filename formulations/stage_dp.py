r"""Inter-op stage construction: Alpa §5 dynamic programme over layer slicings × sub-meshes.

Problem
-------
Layers ``0..L-1`` (in order) are cut into ``S`` contiguous stages ``[a_j, e_j)``; stage ``j``
runs on a sub-mesh of shape ``(n_j, d_j)`` drawn from the allowed shapes (default
:func:`ilp_planner.ir.cluster.submesh_shapes`: ``(1, d)`` for ``d | devices_per_node`` and
``(n, devices_per_node)``). With ``B`` micro-batches the pipeline latency is

.. math::  T = \sum_j t_j + (B - 1) \max_j t_j ,
           \qquad t_j = \mathrm{stage\_cost}(a_j, e_j, (n_j, d_j)).\mathrm{time}
                       + \mathrm{boundary\_cost}(e_j, (n_j, d_j))\ [e_j < L]

subject to

* **devices** — ``Σ_j n_j d_j = nodes × devices_per_node`` (every device used exactly once);
* **memory** — for the stage at position ``s = S − j`` counted from the end (``s = 1``: last
  stage), ``fixed_j + inflight(s) · act_j ≤ budget`` with ``inflight`` of the schedule:
  1F1B ``min(s, B)``, eager-1F1B ``min(2s − 1, B)``, GPipe ``B``
  (:func:`schedules.inflight_microbatches`).

Dynamic programme (built from the end, as Alpa does, so a stage's position is known)
--------------------------------------------------------------------------------------
For a bound ``T_max`` on every stage time, let ``F_s(k, d)`` be the least ``Σ t`` that covers
layers ``k..L-1`` with exactly ``s`` stages on ``d`` devices:

.. math::  F_s(k, d) = \min_{k \le i < L,\ \text{shape } m:\ t(k,i,m) \le T_{max},\
           \text{mem}_s(k,i,m) \le \text{budget}} \; t(k,i,m) + F_{s-1}(i+1,\ d - |m|),
           \qquad F_0(L, 0) = 0 .

``G(T_max) = \min_s F_s(0, N·M)`` and the answer is ``\min_{T_max} G(T_max) + (B−1)·T_max``
over the distinct stage times (Alpa's enumeration).

Exact speed-ups (what makes 96 layers × 512 devices take seconds):

1. **Position classes.** Memory feasibility of an entry is a prefix ``s ≤ s_max(k,i,m)`` of
   positions (``inflight`` is non-decreasing). Let ``P`` be the largest *finite* ``s_max``
   among the entries with ``t ≤ T_max``. Positions ``> P`` all admit the same entries, so
   they share one *tail* table ``F_{>P}(k, d) = min t + min(F_{>P}, F_P)(i+1, d−|m|)``;
   only ``P`` exact layers are computed (``P = 0`` when memory never depends on position,
   e.g. GPipe or a roomy budget; small ``T_max`` admits few entries, so ``P`` is small
   where the optimum usually lies). A fixed stage count ``S`` uses exact layers ``1..S``.
2. **One-pass feasibility.** Whether any assignment fits (for a ``T_max``, or for a memory
   budget) needs no position classes: ``N(k, d)``, the fewest stages of a feasible suffix,
   obeys ``N(k, d) = min N(i+1, d−|m|) + 1`` over entries with ``N(i+1, d−|m|) + 1 ≤
   s_max`` — fewer stages behind a stage is always better for every stage in front.
3. **T_max search.** ``G`` is non-increasing. Solving at ``T`` returns a solution whose
   true maximum ``T' ≤ T`` has ``G(T') = G(T)``, so every candidate in ``(T', T]`` is
   dominated. Starting at the first feasible candidate (found with 2.), index intervals
   ``[a, b]`` with a known lower bound ``g`` on ``G`` are bisected and dropped once
   ``g + (B−1)·T_a ≥`` the incumbent. Same optimum as Alpa's enumeration (kept as
   ``search="enumerate"`` and checked against it in the tests and the benchmark).
4. **Vectorisation.** Each DP row is computed with numpy over the device count ``d``,
   restricted to the finite span of the successor rows; the arg-min is not tabulated but
   recovered along the optimal path by recomputing that state's candidates.

Device packing
--------------
Like Alpa, the DP only counts devices. Shapes ``(n, devices_per_node)`` take whole nodes;
shapes ``(1, d)`` must be packed inside the remaining nodes. Alpa proves any multiset of
``(1, 2^k)`` meshes whose total fills the free nodes packs; the same holds when the divisors
of ``devices_per_node`` form a divisibility chain, and we checked it exhaustively for every
``devices_per_node ≤ 16`` with up to 4 free nodes (and 6, 10 up to 6 nodes); it fails for
e.g. 30 (items 15, 10, 10, 6, 6, 6, 6, 1 in two nodes of 30). So after the DP,
:func:`pack_submeshes` places the chosen meshes (exact search) and an
:class:`~ilp_planner.errors.InfeasibleError` explains the rare case that cannot be placed.

Imbalance tolerance (Alpa's ``stage_imbalance_tolerance``)
---------------------------------------------------------
Optional ``τ ≥ 0``: a (layer range, sub-mesh) pair is admissible only if the mesh's share of
devices is within a factor ``1 + τ`` of the range's share of the work,
``w/(1+τ) ≤ |m|/(N·M) ≤ w·(1+τ)`` with ``w = Σ_{range} work / Σ work`` (``layer_work``, one
unit per layer by default). It is applied *before* calling ``stage_cost``, so it saves the
expensive intra-op solves; it is a heuristic (it can exclude the optimum); ``None`` keeps the
search exact. Always applied (exact): a range covering every layer needs all devices, and
a mesh of all devices needs every layer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from formulations.schedules import check_schedule_name, inflight_microbatches
from ilp_planner.errors import ConfigError, InfeasibleError
from ilp_planner.ir.cluster import SubMesh, submesh_shapes

Shape = tuple[int, int]


@dataclass(frozen=True)
class StageCost:
    """What one stage costs on one sub-mesh, per micro-batch: ``time_s`` (forward +
    backward), ``memory_bytes_fixed`` (weights, gradients, optimiser state per device) and
    ``activation_bytes_per_microbatch`` (per device, held while the micro-batch is in
    flight)."""

    time_s: float
    memory_bytes_fixed: float
    activation_bytes_per_microbatch: float

    def memory(self, inflight: int) -> float:
        """Per-device bytes holding ``inflight`` micro-batches."""
        return self.memory_bytes_fixed + inflight * self.activation_bytes_per_microbatch


StageCostFn = Callable[[int, int, Shape], "StageCost | Sequence[StageCost] | None"]
"""A stage's cost, or its *variants*: plans of the same range on the same mesh trading time
for memory (say one that recomputes activations to fit deeper in the pipeline). The DP
picks, per stage, the fastest variant that fits at the stage's position."""
BoundaryCostFn = Callable[[int, Shape], float]


@dataclass(frozen=True)
class StageChoice:
    """One stage of the answer. Layers ``[start, end)``; ``time_s`` = compute + boundary;
    ``variant``: which of ``stage_cost``'s variants for that range and mesh (0 when it gave
    one cost)."""

    start: int
    end: int
    submesh: Shape
    time_s: float
    compute_time_s: float
    boundary_time_s: float
    memory_bytes: float
    inflight_microbatches: int
    placement: SubMesh | None = None
    variant: int = 0

    @property
    def devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    def to_dict(self) -> dict:
        d = {
            "layers": [self.start, self.end],
            "submesh": list(self.submesh),
            "time_s": self.time_s,
            "compute_time_s": self.compute_time_s,
            "boundary_time_s": self.boundary_time_s,
            "memory_bytes": self.memory_bytes,
            "inflight_microbatches": self.inflight_microbatches,
            "variant": self.variant,
        }
        if self.placement is not None:
            d["devices"] = self.placement.device_ids()
            d["placement"] = str(self.placement)
        return d


@dataclass(frozen=True)
class StagePlan:
    """The stage DP's answer: ``objective_s = sum_time_s + (B − 1) · t_max_s``."""

    stages: tuple[StageChoice, ...]
    objective_s: float
    sum_time_s: float
    t_max_s: float
    num_microbatches: int
    schedule: str
    memory_budget_bytes: float
    method: str
    dp_solves: int = 0
    feasibility_checks: int = 0
    candidates: int = 0
    table_s: float = 0.0
    solve_s: float = 0.0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "schedule": self.schedule,
            "microbatches": self.num_microbatches,
            "objective_s": self.objective_s,
            "sum_time_s": self.sum_time_s,
            "t_max_s": self.t_max_s,
            "memory_budget_bytes": self.memory_budget_bytes,
            "stages": [s.to_dict() for s in self.stages],
            "dp_solves": self.dp_solves,
            "feasibility_checks": self.feasibility_checks,
            "candidates": self.candidates,
            "table_s": self.table_s,
            "solve_s": self.solve_s,
        }


# ---------------------------------------------------------------------------------------------
# Inputs


def _check_shapes(shapes: Sequence[Shape], nodes: int, dpn: int, what: str) -> list[Shape]:
    out = []
    for sh in shapes:
        n, d = int(sh[0]), int(sh[1])
        whole = d == dpn and 1 <= n <= nodes
        part = n == 1 and 1 <= d <= dpn and dpn % d == 0
        if not (whole or part):
            raise ConfigError(
                f"sub-mesh shape {tuple(sh)} cannot be placed on {nodes} × {dpn} devices: "
                f"use (1, d) with d dividing {dpn} or (n, {dpn}) with n ≤ {nodes}",
                key=what,
            )
        out.append((n, d))
    return out


def _positions_saturate(schedule: str, M: int) -> int:
    """Smallest position ``s`` from which ``inflight(s) = M`` (memory stops growing)."""
    s = 1
    while inflight_microbatches(schedule, s, M) < M:
        s += 1
    return s


@dataclass(frozen=True)
class StageCostTable:
    """All admissible (range, shape) costs. Arrays are ``[k, i, m]`` for layers ``k..i``
    (inclusive) on column ``m``: shape ``shapes[m]``, variant ``variants[m]`` (a shape has
    as many columns as its most variants; a range with fewer has ``inf`` in the rest);
    ``time`` includes the boundary send; ``inf``/``nan`` mark pairs that are infeasible,
    pruned or impossible."""

    num_layers: int
    num_devices: int
    shapes: tuple[Shape, ...]
    sizes: np.ndarray
    time: np.ndarray
    compute: np.ndarray
    boundary: np.ndarray
    mem_fixed: np.ndarray
    act: np.ndarray
    calls: int
    pruned: int
    undefined: int
    variants: tuple[int, ...]

    def columns(self, shape: Shape) -> list[int]:
        """The columns (variants) of ``shape``."""
        return [m for m, sh in enumerate(self.shapes) if sh == shape]


def admissible(
    start: int,
    end: int,
    shape: Shape,
    num_layers: int,
    num_devices: int,
    imbalance_tolerance: float | None,
    work_prefix: Sequence[float] | None,
) -> bool:
    """Whether (layers ``[start, end)``, ``shape``) may be a stage at all (module docstring:
    the exact all-layers ⇔ all-devices rule and the optional imbalance tolerance)."""
    z = shape[0] * shape[1]
    everything = start == 0 and end == num_layers
    if everything != (z == num_devices):
        return False
    if imbalance_tolerance is None or everything:
        return True
    assert work_prefix is not None
    w = (work_prefix[end] - work_prefix[start]) / work_prefix[-1]
    share = z / num_devices
    f = 1.0 + imbalance_tolerance
    return w / f <= share <= w * f


def _work_prefix(num_layers: int, layer_work: Sequence[float] | None) -> list[float]:
    work = [1.0] * num_layers if layer_work is None else [float(x) for x in layer_work]
    if len(work) != num_layers or any(x < 0 for x in work) or sum(work) <= 0:
        raise ConfigError(
            f"layer_work needs {num_layers} non-negative numbers with a positive sum",
            key="pipeline.layer_work",
        )
    return [0.0, *itertools.accumulate(work)]


def _stage_cost_checked(fn: StageCostFn, a: int, e: int, sh: Shape) -> list[StageCost]:
    """``stage_cost``'s variants as a list (empty: infeasible), each checked."""
    out = fn(a, e, sh)
    variants = [] if out is None else [out] if isinstance(out, StageCost) else list(out)
    for c in variants:
        if not (
            isinstance(c, StageCost)
            and math.isfinite(c.time_s)
            and c.time_s >= 0
            and c.memory_bytes_fixed >= 0
            and c.activation_bytes_per_microbatch >= 0
        ):
            raise ConfigError(
                f"stage_cost({a}, {e}, {sh}) returned {out}: times and memory must be finite "
                f"and non-negative (return None for an infeasible stage)"
            )
    return variants


def build_cost_table(
    num_layers: int,
    nodes: int,
    devices_per_node: int,
    stage_cost: StageCostFn,
    *,
    boundary_cost: BoundaryCostFn | None = None,
    shapes: Sequence[Shape] | None = None,
    imbalance_tolerance: float | None = None,
    layer_work: Sequence[float] | None = None,
) -> StageCostTable:
    """Call ``stage_cost(start, end, shape)`` for every admissible pair (``end`` exclusive)
    and ``boundary_cost(end, shape)`` for every ``end < L``."""
    L, D = num_layers, nodes * devices_per_node
    if L < 1:
        raise ConfigError(f"need at least one layer, got {L}", key="model.layers")
    if imbalance_tolerance is not None and imbalance_tolerance < 0:
        raise ConfigError(
            f"imbalance tolerance must be >= 0, got {imbalance_tolerance}",
            key="pipeline.imbalance_tolerance",
        )
    shapes = _check_shapes(
        submesh_shapes(nodes, devices_per_node) if shapes is None else shapes,
        nodes,
        devices_per_node,
        "pipeline.submesh_shapes",
    )
    shapes = list(dict.fromkeys(shapes))
    prefix = _work_prefix(L, layer_work)
    bcost = _boundary_costs(L, shapes, boundary_cost)
    calls = pruned = undefined = 0
    found: dict[tuple[int, int, int], list[StageCost]] = {}
    for k in range(L):
        for i in range(k, L):
            for m, sh in enumerate(shapes):
                if not admissible(k, i + 1, sh, L, D, imbalance_tolerance, prefix):
                    pruned += 1
                    continue
                calls += 1
                found[k, i, m] = _stage_cost_checked(stage_cost, k, i + 1, sh)
                undefined += not found[k, i, m]
    return _table(L, D, shapes, found, bcost, calls, pruned, undefined)


def _boundary_costs(L: int, shapes: Sequence[Shape],
                    boundary_cost: BoundaryCostFn | None) -> np.ndarray:
    """``boundary_cost(end, shape)`` for every cut ``0 < end < L`` and shape (checked: seconds
    ≥ 0), zero elsewhere."""
    bcost = np.zeros((L + 1, len(shapes)))
    if boundary_cost is not None:
        for e in range(1, L):
            for m, sh in enumerate(shapes):
                b = float(boundary_cost(e, sh))
                if not (math.isfinite(b) and b >= 0):
                    raise ConfigError(f"boundary_cost({e}, {sh}) returned {b}: need seconds >= 0")
                bcost[e, m] = b
    return bcost


def _table(L: int, D: int, shapes: list[Shape], found: dict[tuple[int, int, int], list[StageCost]],
           bcost: np.ndarray, calls: int, pruned: int, undefined: int) -> StageCostTable:
    """The stage costs ``found`` per (first, last unit, shape) laid out as the DP reads
    them: one column per (shape, variant), infinite time where a pair has no variant."""
    # one column per (shape, variant)
    width = [max((len(v) for (_, _, m), v in found.items() if m == j), default=0) or 1
             for j in range(len(shapes))]
    first = [0, *itertools.accumulate(width)]
    cols = [(sh, v) for sh, w in zip(shapes, width, strict=True) for v in range(w)]
    ncol = len(cols)
    time_ = np.full((L, L, ncol), np.inf)
    compute = np.full((L, L, ncol), np.inf)
    boundary = np.zeros((L, L, ncol))
    mem = np.full((L, L, ncol), np.nan)
    act = np.full((L, L, ncol), np.nan)
    for (k, i, m), variants in found.items():
        b = bcost[i + 1, m] if i + 1 < L else 0.0
        for v, c in enumerate(variants):
            col = first[m] + v
            compute[k, i, col] = c.time_s
            boundary[k, i, col] = b
            time_[k, i, col] = c.time_s + b
            mem[k, i, col] = c.memory_bytes_fixed
            act[k, i, col] = c.activation_bytes_per_microbatch
    return StageCostTable(
        L,
        D,
        tuple(sh for sh, _ in cols),
        np.array([a * b for (a, b), _ in cols], dtype=np.int64),
        time_,
        compute,
        boundary,
        mem,
        act,
        calls,
        pruned,
        undefined,
        tuple(v for _, v in cols),
    )


# ---------------------------------------------------------------------------------------------
# DP engine

_INF_POS = np.iinfo(np.int64).max // 2


def device_step(table: StageCostTable) -> int:
    """The common divisor of the device counts a plan can add up: the whole mesh's and
    every sub-mesh size with a finite entry. Every sum of stage sizes is a multiple of
    it, so the DP's device axis steps by it — exactly, and that many times fewer states
    when the small sub-meshes cannot hold a stage (a large model on many devices)."""
    used = np.isfinite(table.time).any(axis=(0, 1))
    return math.gcd(table.num_devices, *table.sizes[used].tolist())


def _max_positions(table: StageCostTable, schedule: str, M: int, budget: float) -> np.ndarray:
    """``s_max[k,i,m]``: the entry is memory-feasible exactly at positions ``1..s_max``
    (``_INF_POS``: at every position; 0: nowhere or undefined)."""
    return _positions_within(_table_memory(table, schedule, M), np.isfinite(table.time),
                             _positions_saturate(schedule, M), budget)


MemoryAt = Callable[[int], np.ndarray]
"""Per position ``p`` (from the end), each entry's memory ``[k, i, m]`` there (inf: none)."""


def _table_memory(table: StageCostTable, schedule: str, M: int) -> MemoryAt:
    """The table's own memory: ``fixed + inflight(p)·act`` of each defined entry."""
    finite = np.isfinite(table.time)
    mem, act = np.nan_to_num(table.mem_fixed), np.nan_to_num(table.act)
    return lambda p: np.where(finite, mem + inflight_microbatches(schedule, p, M) * act, np.inf)


def _positions_within(mem_at: MemoryAt, finite: np.ndarray, sat: int, budget: float
                      ) -> np.ndarray:
    """:func:`_max_positions` of any memory (non-decreasing in the position)."""
    smax = np.zeros(finite.shape, dtype=np.int64)
    for s in range(1, sat + 1):
        smax[finite & (mem_at(s) <= budget)] = s
    smax[smax == sat] = _INF_POS
    return smax


def _finite_span(F: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``F``: first and last finite column (``lo > hi`` for an all-inf row)."""
    fin = np.isfinite(F)
    width = F.shape[-1]
    any_ = fin.any(axis=-1)
    lo = np.where(any_, fin.argmax(axis=-1), width)
    hi = np.where(any_, width - 1 - fin[..., ::-1].argmax(axis=-1), -1)
    return lo, hi


def _relax_row(
    c: np.ndarray,
    nxt: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    sizes: np.ndarray,
    combine,
) -> np.ndarray:
    """One DP row: ``best[d] = min_{r, m} combine(c[r, m], nxt[r, d − |m|])`` with ``r`` the
    offset of the stage's last layer and ``lo``/``hi`` the finite column span of each
    ``nxt`` row (only that span is computed)."""
    width = nxt.shape[1]
    best = np.full(width, np.inf)
    ok = np.isfinite(c) & (hi >= 0)[:, None]
    shapes = np.flatnonzero(ok.any(axis=0))
    if not len(shapes):
        return best
    # per shape, at once: its candidate rows and their finite columns' span
    okm = ok[:, shapes]
    of_shape, row = np.nonzero(okm.T)
    rows = np.split(row, np.flatnonzero(np.diff(of_shape)) + 1)
    d0 = np.where(okm, lo[:, None], width).min(axis=0)
    d1 = np.minimum(np.where(okm, hi[:, None], -1).max(axis=0), width - 1 - sizes[shapes])
    for m, r, lo_d, hi_d in zip(shapes.tolist(), rows, d0.tolist(), d1.tolist(), strict=True):
        if hi_d < lo_d:
            continue
        z = int(sizes[m])
        vals = combine(c[r, m][:, None], nxt[r, lo_d : hi_d + 1])
        seg = best[lo_d + z : hi_d + z + 1]
        np.minimum(seg, vals.min(axis=0), out=seg)
    return best


def _relax_class(C: np.ndarray, prev: np.ndarray, sizes: np.ndarray, combine) -> np.ndarray:
    """A whole exact-position layer: ``F[k, d] = min_{i ≥ k, m} combine(C[k, i, m],
    prev[i + 1, d − |m|])``, row by row (per-row column spans keep the arrays small; a
    gather over all (k, i) pairs at once measured 2-4× slower)."""
    L, width = C.shape[0], prev.shape[1]
    F = np.full((L + 1, width), np.inf)
    lo, hi = _finite_span(prev)
    for k in range(L - 1, -1, -1):
        F[k] = _relax_row(C[k, k:], prev[k + 1 :], lo[k + 1 :], hi[k + 1 :], sizes, combine)
    return F


@dataclass
class _DPResult:
    value: float
    stages: list[tuple[int, int, int]]  # (start, last layer inclusive, shape index)


def _dp(
    cost_at: Callable[[int], np.ndarray],
    exact: int,
    tail: np.ndarray | None,
    sizes: np.ndarray,
    num_layers: int,
    num_devices: int,
    combine,
    fixed_stages: int | None,
) -> _DPResult:
    """Min over slicings of ``combine``-accumulated stage costs (np.add: Σ; np.maximum:
    max). ``cost_at(p)`` is the ``[k, i, m]`` cost at exact position ``p = 1..exact``;
    ``tail`` the cost at every position ``> exact`` (``None``: no such positions).

    Only values are tabulated; the argmin of each state on the optimal path is recovered
    afterwards by recomputing its candidates (bit-identical arithmetic)."""
    L, D = num_layers, num_devices
    F = np.full((exact + 1, L + 1, D + 1), np.inf)
    F[0, L, 0] = 0.0
    for p in range(1, exact + 1):
        F[p] = _relax_class(cost_at(p), F[p - 1], sizes, combine)
    Ft = nxt = None
    if tail is not None:
        Ft = np.full((L + 1, D + 1), np.inf)
        nxt = F[exact].copy()  # min(F_tail, F_exact), completed row by row
        lo, hi = _finite_span(nxt)
        for k in range(L - 1, -1, -1):
            Ft[k] = _relax_row(tail[k, k:], nxt[k + 1 :], lo[k + 1 :], hi[k + 1 :], sizes, combine)
            np.minimum(nxt[k], Ft[k], out=nxt[k])
            lo[k], hi[k] = (int(v) for v in _finite_span(nxt[k]))
    # best final class
    if fixed_stages is not None:
        cls, value = fixed_stages, F[fixed_stages, 0, D]
    else:
        cls, value = None, np.inf
        for p in range(1, exact + 1):
            if F[p, 0, D] < value:
                cls, value = p, F[p, 0, D]
        if Ft is not None and Ft[0, D] < value:
            cls, value = "tail", Ft[0, D]
    if not np.isfinite(value):
        return _DPResult(float("inf"), [])
    # walk the optimal path, recovering each state's choice
    stages, k, d, target = [], 0, D, value
    while cls != 0:
        C = tail if cls == "tail" else cost_at(cls)
        table = nxt if cls == "tail" else F[cls - 1]
        fits = np.flatnonzero(sizes <= d)
        c = C[k, k:][:, fits]
        # an entry without a cost is no candidate, whatever ``combine`` makes of it (as
        # in :func:`_relax_row`)
        cand = np.where(np.isfinite(c), combine(c, table[k + 1 :, d - sizes[fits]]), np.inf)
        r, j = np.argwhere(cand == target)[0]
        m = int(fits[j])
        i = k + int(r)
        stages.append((k, i, m))
        k, d = i + 1, d - int(sizes[m])
        target = table[k, d]
        if cls == "tail":
            cls = "tail" if Ft[k, d] < F[exact, k, d] else exact
        else:
            cls -= 1
    return _DPResult(float(value), stages)


def _dp_fixed_shapes(
    cost_at: Callable[[int], np.ndarray],
    shape_cols: Sequence[Sequence[int]],
    num_layers: int,
    combine,
) -> _DPResult:
    """Stage ``j`` must use one of the columns ``shape_cols[j]`` (its fixed shape's
    variants): DP over (stage, first layer)."""
    L, S = num_layers, len(shape_cols)
    V = np.full((S + 1, L + 1), np.inf)
    V[S, L] = 0.0
    arg = np.full((S + 1, L + 1), -1, dtype=np.int64)
    col = np.full((S + 1, L + 1), -1, dtype=np.int64)
    for j in range(S - 1, -1, -1):
        cs = list(shape_cols[j])
        c = cost_at(S - j)[:, :, cs]  # [k, i, variant]
        for k in range(L):
            vals = combine(c[k, k:], V[j + 1, k + 1 :, None])
            if vals.size and np.isfinite(vals).any():
                r, v = np.unravel_index(int(np.argmin(vals)), vals.shape)
                V[j, k], arg[j, k], col[j, k] = vals[r, v], k + r, cs[v]
    if not np.isfinite(V[0, 0]):
        return _DPResult(np.inf, [])
    stages, k = [], 0
    for j in range(S):
        i = int(arg[j, k])
        stages.append((k, i, int(col[j, k])))
        k = i + 1
    return _DPResult(float(V[0, 0]), stages)


# ---------------------------------------------------------------------------------------------
# Packing


def pack_submeshes(shapes: Sequence[Shape], nodes: int, devices_per_node: int) -> list[SubMesh]:
    """Place the stage meshes (in stage order) on the cluster: whole-node meshes take
    consecutive free nodes, ``(1, d)`` meshes are bin-packed into the remaining nodes
    (largest first, exact search). Raises :class:`InfeasibleError` if they cannot fit."""
    dpn = devices_per_node
    whole_nodes = sum(n for n, d in shapes if d == dpn)
    partial = [(j, d) for j, (n, d) in enumerate(shapes) if d < dpn]
    free = nodes - whole_nodes
    if free < 0 or sum(d for _, d in partial) > free * dpn:
        raise InfeasibleError(
            f"sub-meshes {list(shapes)} need more than the {nodes} × {dpn} devices available"
        )
    order = sorted(partial, key=lambda x: -x[1])
    caps = [dpn] * free
    assign: dict[int, int] = {}
    failed: set[tuple[int, tuple[int, ...]]] = set()

    def place(t: int) -> bool:
        if t == len(order):
            return True
        key = (t, tuple(sorted(caps)))
        if key in failed:
            return False
        j, d = order[t]
        tried = set()
        for b in range(free):
            if caps[b] >= d and caps[b] not in tried:
                tried.add(caps[b])
                caps[b] -= d
                assign[j] = b
                if place(t + 1):
                    return True
                caps[b] += d
        failed.add(key)
        return False

    if not place(0):
        raise InfeasibleError(
            f"the stage sub-meshes {list(shapes)} add up to the cluster but the (1, d) meshes "
            f"{sorted(d for _, d in partial)} cannot be packed into {free} node(s) of {dpn} "
            f"devices; restrict the shapes to a divisibility chain (e.g. powers of two)"
        )
    out: list[SubMesh] = []
    next_node, bin_node, bin_fill = 0, {}, {}
    for j, (n, d) in enumerate(shapes):
        if d == dpn:
            out.append(SubMesh(next_node, n, 0, dpn, dpn))
            next_node += n
        else:
            b = assign[j]
            if b not in bin_node:
                bin_node[b], bin_fill[b] = next_node, 0
                next_node += 1
            out.append(SubMesh(bin_node[b], 1, bin_fill[b], d, dpn))
            bin_fill[b] += d
    return out


# ---------------------------------------------------------------------------------------------
# Search


def _fmt_bytes(x: float) -> str:
    return f"{x / 2**30:.3g} GiB"


class _Problem:
    """Shared state of one stage-DP solve: the table, position classes and the evaluator."""

    def __init__(
        self,
        table: StageCostTable,
        schedule: str,
        M: int,
        budget: float,
        num_stages: int | None,
        fixed_idx: list[list[int]] | None,
    ):
        self.table, self.schedule, self.M, self.budget = table, schedule, M, budget
        self.num_stages, self.fixed_idx = num_stages, fixed_idx
        L, D = table.num_layers, table.num_devices
        step = device_step(table)
        self.devices = D // step
        # a column no entry uses gets a size no device count reaches
        self.sizes = np.where(table.sizes % step == 0, table.sizes // step, self.devices + 1)
        self.smax = _max_positions(table, schedule, M, budget)
        finite_pos = self.smax[(self.smax > 0) & (self.smax < _INF_POS)]
        self.max_stages = min(L, D)
        if num_stages is not None:
            self.exact, self.has_tail = num_stages, False
        else:
            P = int(finite_pos.max()) if finite_pos.size else 0
            self.exact = min(P, self.max_stages)
            self.has_tail = self.exact < self.max_stages
        usable = self.smax > 0
        if fixed_idx is not None:
            mask = np.zeros_like(usable)
            mask[:, :, sorted({m for cols in fixed_idx for m in cols})] = True
            usable &= mask
        self.candidates = np.unique(table.time[usable])
        self.solves = 0
        self.checks = 0

    def _time_at(self, p: int, T: float) -> np.ndarray:
        ok = (self.smax >= p) & (self.table.time <= T)
        return np.where(ok, self.table.time, np.inf)

    def _fewest_stages(self, smax: np.ndarray, usable: np.ndarray) -> _DPResult:
        """Feasibility in one pass, without position classes: ``N(k, d)`` = fewest stages of
        a feasible suffix. Placing entry ``e`` in front of a suffix of ``n`` stages puts it
        at position ``n + 1``, allowed iff ``n + 1 ≤ s_max(e)``; fewer stages behind is
        always better for every stage in front, so keeping only the fewest is exact."""
        t = self.table
        c = np.where(usable & (smax > 0), smax.astype(float), np.inf)

        def after(cap: np.ndarray, n: np.ndarray) -> np.ndarray:
            return np.where(n + 1 <= cap, n + 1, np.inf)

        return _dp(lambda p: c, 0, c, self.sizes, t.num_layers, self.devices, after, None)

    def feasible(self, T: float) -> bool:
        """Whether some assignment has every stage time ``≤ T`` and fits the budget (free
        stage count only; one cheap pass)."""
        self.checks += 1
        return bool(np.isfinite(self._fewest_stages(self.smax, self.table.time <= T).value))

    def evaluate(self, T: float) -> _DPResult:
        """``G(T)``: least ``Σ t`` with every stage time ``≤ T`` (and its solution)."""
        self.solves += 1
        t = self.table
        if self.fixed_idx is not None:
            return _dp_fixed_shapes(lambda p: self._time_at(p, T), self.fixed_idx, t.num_layers, np.add)
        exact, has_tail = self.exact, self.has_tail
        if self.num_stages is None:
            # only entries with time <= T matter: fewer exact position classes
            pos = self.smax[(t.time <= T) & (self.smax > 0) & (self.smax < _INF_POS)]
            exact = min(int(pos.max()) if pos.size else 0, self.max_stages)
            has_tail = exact < self.max_stages
        tail = self._time_at(exact + 1, T) if has_tail else None  # only _INF_POS entries
        return _dp(
            lambda p: self._time_at(p, T),
            exact,
            tail,
            self.sizes,
            t.num_layers,
            self.devices,
            np.add,
            self.num_stages,
        )

    def min_memory(self, mem_at: MemoryAt | None = None
                   ) -> tuple[float, list[tuple[int, int, int]]]:
        """Least possible max-stage memory over all complete assignments (no budget), and
        one assignment that achieves it. ``mem_at``: each entry's memory per position
        (non-decreasing in it; default the table's ``fixed + inflight·act``).

        Free stage count: bisection over the candidate values ``mem(e, p)`` between a
        lower bound (every stage charged position 1) and an upper bound (every stage
        charged the saturated in-flight count), each probe one :meth:`_fewest_stages`
        pass with the budget set to the probe. Fixed stage count or shapes: a min-max DP
        over the exact positions."""
        t = self.table
        finite = np.isfinite(t.time)
        sat = _positions_saturate(self.schedule, self.M)
        L, D, sizes = t.num_layers, self.devices, self.sizes
        mem_at = mem_at or _table_memory(t, self.schedule, self.M)
        if self.fixed_idx is not None:
            r = _dp_fixed_shapes(mem_at, self.fixed_idx, L, np.maximum)
            return r.value, r.stages
        if self.num_stages is not None:
            S = self.num_stages
            r = _dp(mem_at, S, None, sizes, L, D, np.maximum, S)
            return r.value, r.stages
        lo_arr, hi_arr = mem_at(1), mem_at(sat)
        low = _dp(lambda p: lo_arr, 0, lo_arr, sizes, L, D, np.maximum, None).value
        high = _dp(lambda p: hi_arr, 0, hi_arr, sizes, L, D, np.maximum, None)
        if not np.isfinite(high.value):
            return np.inf, []
        vals = np.unique(np.concatenate([mem_at(p)[finite] for p in range(1, sat + 1)]))
        cand = vals[(vals >= low) & (vals <= high.value)]
        best: tuple[float, list[tuple[int, int, int]]] = (high.value, high.stages)
        a, b = 0, cand.size - 1  # feasible at cand[b] (the upper bound)
        while a <= b:
            mid = (a + b) // 2
            r = self._fewest_stages(_positions_within(mem_at, finite, sat, float(cand[mid])),
                                    finite)
            if np.isfinite(r.value):
                best = (float(cand[mid]), r.stages)
                b = mid - 1
            else:
                a = mid + 1
        return best


def _search(prob: _Problem) -> tuple[float, _DPResult, float]:
    """Exact minimisation of ``H(T) = G(T) + (B − 1)·T`` over the sorted candidates ``c``.

    Work list of index intervals ``[a, b]`` with ``g`` a lower bound of ``G`` on them
    (``G`` is non-increasing; ``exact`` when ``g = G(c[b])`` and ``H(c[b])`` is already
    counted). An interval is cut to the indices with ``g + (B−1)·c[idx] <`` best (the rest
    cannot win) and bisected; solving at ``c[mid]`` returns a solution with true maximum
    ``c[j] ≤ c[mid]``, so ``G`` is constant on ``[j, mid]`` and only ``[a, j]`` (exact) and
    ``[mid+1, b]`` remain. The search starts at the first feasible candidate, found by
    galloping up from the smallest (probes at small ``T`` are cheap) with the one-pass
    :meth:`_Problem.feasible` test (full solves when the stage count is fixed), so an
    incumbent exists early; with ``B = 1`` it is just ``G`` at the largest candidate."""
    c, B = prob.candidates, prob.M
    n = c.size
    none = (np.inf, _DPResult(np.inf, []), np.inf)
    if n == 0:
        return none

    def tmax_of(r: _DPResult) -> float:
        return max(float(prob.table.time[k, i, m]) for k, i, m in r.stages)

    free = prob.num_stages is None and prob.fixed_idx is None
    if B == 1:
        if free and not prob.feasible(float(c[-1])):
            return none
        r = prob.evaluate(float(c[-1]))
        return (r.value, r, tmax_of(r)) if np.isfinite(r.value) else none
    # gallop up from the smallest candidate to the first feasible one (probes at small T
    # are cheap: few entries fit), then bisect back; free stage counts probe with the
    # one-pass feasibility test, fixed ones with full solves
    probe = (lambda T: prob.feasible(T)) if free else (lambda T: np.isfinite(prob.evaluate(T).value))
    lo, idx, step = 0, 0, 1
    while not probe(float(c[idx])):
        if idx == n - 1:
            return none
        lo, idx, step = idx + 1, min(n - 1, idx + step), step * 2
    hi = idx
    while lo < hi:  # c[lo - 1] infeasible, c[hi] feasible
        mid = (lo + hi) // 2
        if probe(float(c[mid])):
            hi = mid
        else:
            lo = mid + 1
    idx = lo
    r = prob.evaluate(float(c[idx]))
    tm = tmax_of(r)
    best = (r.value + (B - 1) * tm, r, tm)
    stack = [(idx + 1, n - 1, 0.0, False), (lo, int(np.searchsorted(c, tm)), r.value, True)]
    while stack:
        a, b, g, exact = stack.pop()
        # keep only indices that could still beat the incumbent
        b_cut = min(b, int(np.searchsorted(c, (best[0] - g) / (B - 1), side="left")) - 1)
        if b_cut < b:
            b, exact = b_cut, False
        if a > b or (exact and a == b):
            continue
        mid = (a + b - 1) // 2 if exact else (a + b) // 2
        r = prob.evaluate(float(c[mid]))
        stack.append((mid + 1, b, g, exact))
        if not np.isfinite(r.value):
            continue
        tm = tmax_of(r)
        if r.value + (B - 1) * tm < best[0]:
            best = (r.value + (B - 1) * tm, r, tm)
        stack.append((a, int(np.searchsorted(c, tm)), r.value, True))
    return best


def _search_enumerate(prob: _Problem) -> tuple[float, _DPResult, float]:
    """Alpa's plain enumeration (the baseline the bisection must match): solve at every
    candidate ``T`` in ascending order and stop once ``B·T ≥`` best — a solution whose
    largest stage time is ``≥ T`` costs at least ``B·T``, and every solution with a smaller
    maximum was already seen at an earlier candidate."""
    c, B = prob.candidates, prob.M
    best = (np.inf, _DPResult(np.inf, []), np.inf)
    for T in c:
        if B * float(T) >= best[0]:
            break
        r = prob.evaluate(float(T))
        if np.isfinite(r.value):
            tm = max(float(prob.table.time[k, i, m]) for k, i, m in r.stages)
            if r.value + (B - 1) * tm < best[0]:
                best = (r.value + (B - 1) * tm, r, tm)
    return best


LeastMemoryFn = Callable[[int, int, Shape, int], float]
"""``(k, i, shape, n)`` → a lower bound on the per-device memory any plan of layers ``k..i``
(inclusive) on ``shape`` needs holding ``n`` micro-batches: for a stage solver whose plans
are more than the table's variants (ones that recompute or shard state to fit), what the
infeasibility message may claim. Any value within the budget where a plan fits."""


def _least_memory_at(prob: _Problem, least: LeastMemoryFn) -> MemoryAt:
    """``least`` per position, for every defined entry of the table (inf elsewhere),
    once per (range, shape, in-flight count)."""
    t = prob.table
    entries = np.argwhere(np.isfinite(t.time))
    by_count: dict[int, np.ndarray] = {}
    known: dict[tuple[int, int, Shape, int], float] = {}

    def mem_at(p: int) -> np.ndarray:
        n = inflight_microbatches(prob.schedule, p, prob.M)
        if n not in by_count:
            out = np.full(t.time.shape, np.inf)
            for k, i, m in entries:
                key = (int(k), int(i), t.shapes[m], n)
                if key not in known:
                    known[key] = float(least(*key))
                out[k, i, m] = known[key]
            by_count[n] = out
        return by_count[n]

    return mem_at


def _infeasible(prob: _Problem, least: LeastMemoryFn | None = None) -> InfeasibleError:
    """Why nothing fits: the least memory any assignment of the table's variants needs,
    or with ``least`` a lower bound on what any assignment of the stage solver's plans
    needs (``at least``) — the binding stage named either way."""
    t = prob.table
    where = (
        f"{t.num_layers} layers on {t.num_devices} devices"
        + (f" with {prob.num_stages} stages" if prob.num_stages is not None else "")
        + (
            f" on the fixed sub-meshes {[t.shapes[cols[0]] for cols in prob.fixed_idx]}"
            if prob.fixed_idx is not None
            else ""
        )
    )
    mem_at = None if least is None else _least_memory_at(prob, least)
    mm_value, mm_stages = prob.min_memory(mem_at)
    if np.isfinite(mm_value) and (least is None or mm_value > prob.budget):
        S = len(mm_stages)
        worst = None
        for j, (k, i, m) in enumerate(mm_stages):
            n_in = inflight_microbatches(prob.schedule, S - j, prob.M)
            need = (t.mem_fixed[k, i, m] + n_in * t.act[k, i, m] if mem_at is None
                    else mem_at(S - j)[k, i, m])
            if worst is None or need > worst[0]:
                worst = (need, k, i, m, n_in)
        need, k, i, m, n_in = worst  # type: ignore[misc]
        bound = "" if least is None else "at least "
        err = InfeasibleError(
            f"no stage assignment of {where} fits the memory budget of "
            f"{_fmt_bytes(prob.budget)} per device under {prob.schedule} with {prob.M} "
            f"micro-batches: the least memory any assignment needs is {bound}"
            f"{_fmt_bytes(mm_value)} (its fullest stage: layers {k}–{i} on "
            f"{t.shapes[m][0]}×{t.shapes[m][1]} holding {n_in} micro-batch"
            f"{'es' if n_in != 1 else ''} needs {bound}{_fmt_bytes(need)}). Raise the budget, "
            f"give stages more devices, or hold fewer micro-batches in flight (1f1b instead "
            f"of gpipe/eager-1f1b, fewer micro-batches)."
        )
        err.needed_bytes, err.budget_bytes = float(mm_value), float(prob.budget)
        return err
    if np.isfinite(mm_value):  # the bounds prove nothing: no figure to give
        err = InfeasibleError(
            f"no stage assignment of {where} fits the memory budget of "
            f"{_fmt_bytes(prob.budget)} per device under {prob.schedule} with {prob.M} "
            f"micro-batches: every assignment holds a stage at a position where none of its "
            f"plans fits. Raise the budget, give stages more devices, or hold fewer "
            f"micro-batches in flight.")
        err.needed_bytes, err.budget_bytes = None, float(prob.budget)
        return err
    err = InfeasibleError(
        f"no assignment of {where} uses every device exactly once with defined stage costs "
        f"(sub-meshes {list(dict.fromkeys(t.shapes))}; stage_cost returned None for {t.undefined} of "
        f"{t.calls} (range, mesh) pairs, {t.pruned} pairs pruned by the all-devices rule or "
        f"the imbalance tolerance)"
    )
    err.needed_bytes, err.budget_bytes = None, float(prob.budget)
    return err


def solve_stages_from_table(
    table: StageCostTable,
    num_microbatches: int,
    *,
    nodes: int,
    devices_per_node: int,
    schedule: str = "1f1b",
    memory_budget_bytes: float = math.inf,
    num_stages: int | None = None,
    fixed_submeshes: Sequence[Shape] | None = None,
    search: str = "bisect",
    least_memory: LeastMemoryFn | None = None,
) -> StagePlan:
    """Run the DP search on a prepared :class:`StageCostTable` (see :func:`solve_stages`).
    ``search``: ``bisect`` (default) or ``enumerate`` (Alpa's loop over every candidate
    ``T_max``; same optimum, many more DP solves — kept as the baseline).
    ``least_memory``: what the infeasibility message may claim (:data:`LeastMemoryFn`)."""
    t0 = time.perf_counter()
    schedule = check_schedule_name(schedule)
    M = int(num_microbatches)
    if M < 1:
        raise ConfigError(f"need at least one micro-batch, got {M}", key="pipeline.microbatches")
    L, D = table.num_layers, table.num_devices
    fixed_idx = None
    if fixed_submeshes is not None:
        fixed_idx = _fixed_columns(table, fixed_submeshes, num_stages, nodes, devices_per_node)
        num_stages = len(fixed_idx)
    if num_stages is not None and not 1 <= num_stages <= min(L, D):
        raise ConfigError(
            f"{num_stages} stages impossible: need 1 ≤ stages ≤ min(layers={L}, devices={D})",
            key="pipeline.stages",
        )
    prob = _Problem(table, schedule, M, memory_budget_bytes, num_stages, fixed_idx)
    if search not in ("bisect", "enumerate"):
        raise ConfigError(f"unknown stage search {search!r}: use 'bisect' or 'enumerate'")
    obj, res, t_max = (_search if search == "bisect" else _search_enumerate)(prob)
    if not np.isfinite(obj):
        raise _infeasible(prob, least_memory)
    stages = _stage_choices(table, res.stages, schedule, M, nodes, devices_per_node)
    return StagePlan(
        stages=tuple(stages),
        objective_s=float(obj),
        sum_time_s=float(res.value),
        t_max_s=float(t_max),
        num_microbatches=M,
        schedule=schedule,
        memory_budget_bytes=float(memory_budget_bytes),
        method="dp" if search == "bisect" else "dp-enumerate",
        dp_solves=prob.solves,
        feasibility_checks=prob.checks,
        candidates=int(prob.candidates.size),
        solve_s=time.perf_counter() - t0,
    )


def _fixed_columns(table: StageCostTable, fixed_submeshes: Sequence[Shape],
                   num_stages: int | None, nodes: int, devices_per_node: int) -> list:
    """The table's columns of each sub-mesh the config fixes, one per stage in order,
    after checking that they cover the cluster, match the stage count, are in the table
    and pack onto the nodes."""
    D = table.num_devices
    fixed = _check_shapes(fixed_submeshes, nodes, devices_per_node, "pipeline.submeshes")
    if num_stages is not None and num_stages != len(fixed):
        raise ConfigError(
            f"{num_stages} stages requested but {len(fixed)} fixed sub-meshes given",
            key="pipeline.submeshes",
        )
    if sum(n * d for n, d in fixed) != D:
        raise ConfigError(
            f"fixed sub-meshes {fixed} use {sum(n * d for n, d in fixed)} devices; the cluster has {D}",
            key="pipeline.submeshes",
        )
    missing = [sh for sh in fixed if sh not in table.shapes]
    if missing:
        raise ConfigError(
            f"fixed sub-meshes {missing} are not in the cost table shapes", key="pipeline.submeshes"
        )
    pack_submeshes(fixed, nodes, devices_per_node)
    return [table.columns(sh) for sh in fixed]


def _stage_choices(table: StageCostTable, chosen, schedule: str, M: int, nodes: int,
                   devices_per_node: int) -> list[StageChoice]:
    """The DP's stages ``(first unit, last unit, column)`` as :class:`StageChoice` rows,
    packed onto the nodes, each with its memory at the micro-batches its position holds."""
    shapes = [table.shapes[m] for _, _, m in chosen]
    placement = pack_submeshes(shapes, nodes, devices_per_node)
    S = len(chosen)
    stages = []
    for j, (k, i, m) in enumerate(chosen):
        n_in = inflight_microbatches(schedule, S - j, M)
        stages.append(
            StageChoice(
                start=k,
                end=i + 1,
                submesh=table.shapes[m],
                time_s=float(table.time[k, i, m]),
                compute_time_s=float(table.compute[k, i, m]),
                boundary_time_s=float(table.boundary[k, i, m]),
                memory_bytes=float(table.mem_fixed[k, i, m] + n_in * table.act[k, i, m]),
                inflight_microbatches=n_in,
                placement=placement[j],
                variant=table.variants[m],
            )
        )
    return stages


def solve_stages(
    num_layers: int,
    nodes: int,
    devices_per_node: int,
    num_microbatches: int,
    stage_cost: StageCostFn,
    *,
    boundary_cost: BoundaryCostFn | None = None,
    schedule: str = "1f1b",
    memory_budget_bytes: float = math.inf,
    num_stages: int | None = None,
    submesh_shapes: Sequence[Shape] | None = None,
    fixed_submeshes: Sequence[Shape] | None = None,
    imbalance_tolerance: float | None = None,
    layer_work: Sequence[float] | None = None,
    least_memory: LeastMemoryFn | None = None,
) -> StagePlan:
    """Optimal stages for ``Σ t_i + (B − 1)·max t_j`` (module docstring).

    ``stage_cost(start, end, shape)`` costs layers ``[start, end)`` on a ``shape = (nodes,
    devices)`` sub-mesh, or returns ``None`` if that stage is infeasible; it is called once
    per admissible pair (cache inside it if it is expensive). ``boundary_cost(end, shape)``
    is the cross-mesh send time of the activations leaving a stage that ends before layer
    ``end`` (only for ``end < L``). ``num_stages`` fixes the stage count; ``fixed_submeshes``
    fixes every stage's shape (in order). Raises :class:`InfeasibleError` naming the least
    memory any assignment needs when nothing fits the budget (of the variants, or at least
    ``least_memory``'s: :data:`LeastMemoryFn`)."""
    t0 = time.perf_counter()
    table = build_cost_table(
        num_layers,
        nodes,
        devices_per_node,
        stage_cost,
        boundary_cost=boundary_cost,
        shapes=submesh_shapes
        if fixed_submeshes is None
        else list(dict.fromkeys([*(submesh_shapes or []), *fixed_submeshes])),
        imbalance_tolerance=imbalance_tolerance,
        layer_work=layer_work,
    )
    table_s = time.perf_counter() - t0
    plan = solve_stages_from_table(
        table,
        num_microbatches,
        nodes=nodes,
        devices_per_node=devices_per_node,
        schedule=schedule,
        memory_budget_bytes=memory_budget_bytes,
        num_stages=num_stages,
        fixed_submeshes=fixed_submeshes,
        least_memory=least_memory,
    )
    return dataclasses.replace(plan, table_s=table_s)
