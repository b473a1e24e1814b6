"""The stage solver's incumbent: a plan of the DP's own table priced before the DP runs
(even pipelines), whose latency bounds every pair worth solving and every position worth
a variant (:class:`~ilp_planner.inter_op.stage_solver.StageSolverState`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from formulations.schedules import inflight_microbatches
from formulations.stage_dp import admissible
from ilp_planner.inter_op.boundary_estimate import BoundaryCost
from ilp_planner.inter_op.stage_solver import StageSolver, pipeline_latency


def set_incumbent(solver: StageSolver, boundary: BoundaryCost, shapes: Sequence[tuple[int, int]],
                  num_stages: int | None, tolerance: float | None) -> None:
    """Price a few even pipelines (``S`` stages of ``L/S`` units on equal meshes of
    ``D/S`` devices: the largest such ``S`` whose meshes are whole nodes, then smaller
    ones — fewer micro-batches in flight — until two fit in memory) with real stage
    solves, which the DP reuses, and keep the best feasible one's latency as the bound
    for :meth:`StageSolver.stage_cost`. Exact: the incumbent is one of the DP's own plans
    (admissible pairs, memory checked by pipeline position).

    One stage (the whole cluster) comes last: its mesh has the most factorisations, so
    its build is the dearest by far (two of them took 238 of 262 s of builds for
    GPT-145.6B on 192 × 8 devices, 840 three-axis factorisations against 360 on 128 × 8),
    and the DP then needs only its relaxation (one build without a memory row, which
    :meth:`StageSolver.stage_cost` makes anyway) to drop it where a pipeline beats it."""

    pipe, cluster = solver.config.pipeline, solver.config.cluster
    L, D, dpn = len(solver.units), cluster.num_devices, cluster.devices_per_node
    sizes = {n * d: (n, d) for n, d in shapes}
    counts = [S for S in range(1, min(L, D) + 1) if D % S == 0 and D // S in sizes
              and (num_stages is None or S == num_stages)]
    counts.sort(key=lambda S: (S == 1, L % S != 0, D // S < dpn, -S))
    prefix = [float(i) for i in range(L + 1)]
    best, calls, tried, fits = None, solver.stats.calls, 0, 0
    for S in counts:
        if fits == 2 or (tried >= 2 and fits):
            break
        tried += 1
        shape = sizes[D // S]
        q, r = divmod(L, S)
        ends = list(itertools.accumulate(q + (j < r) for j in range(S)))
        times = []
        for j, e in enumerate(ends):
            a = ends[j - 1] if j else 0
            if not admissible(a, e, shape, L, D, tolerance, prefix):
                break
            held = inflight_microbatches(pipe.schedule, S - j, pipe.microbatches)
            t = _fastest_at(solver, a, e, shape, held)
            if t is None:
                break
            times.append(t + (boundary(e, shape) if e < L else 0.0))
        else:
            value = pipeline_latency(times, pipe.microbatches)
            if best is None or value < best:
                best = value
            fits += 1
    solver.state.incumbent_s, solver.stats.calls = best, calls
    if best is not None:  # the DP's optimum is at most the incumbent: exact bound
        solver.state.max_position = most_stages(solver, best)


def _fastest_at(solver: StageSolver, a: int, e: int, shape: tuple[int, int], held: int) -> float | None:
    """Time of the fastest plan of [a, e) on ``shape`` that fits holding ``held``
    micro-batches (one solve at that count at most; no variant table)."""
    budget = solver.config.cluster.memory_bytes
    for how in (None, held):
        solved = solver.solve(a, e, shape, how)
        if solved is None:
            return None
        c = solver.variant_cost(solved)
        if c.memory(held) <= budget:
            return c.time_s
    return None


def most_stages(solver: StageSolver, incumbent: float) -> int:
    """The most stages a plan faster than ``incumbent`` can have, so the deepest
    position a stage can take. With ``S`` stages of work ``W_j`` on ``z_j`` devices,
    ``Σ t ≥ Σ W_j / z_j ≥ (Σ √W_j)² / D`` (Cauchy–Schwarz, ``Σ z_j = D``) and ``max t ≥
    W / D``; the least ``Σ √W_j`` over contiguous splits into ``S`` ranges grows with
    ``S`` (merging two ranges never raises it), found by a DP over split points."""
    W = np.array(solver.work_prefix)
    L, D, M = len(solver.units), solver.num_devices, solver.config.pipeline.microbatches
    root = np.sqrt(np.maximum(W[None, :] - W[:, None], 0.0))
    root[np.tril_indices(L + 1)] = np.inf  # a range needs a unit
    f = root[0].copy()  # least Σ √W_j covering units [0, e) with s ranges
    floor = (M - 1) * W[-1] / D
    most = 1
    for S in range(2, min(L, D) + 1):
        f = (f[:, None] + root).min(axis=0)
        if f[L] ** 2 / D + floor > incumbent * (1 + 1e-9):
            break
        most = S
    return most
