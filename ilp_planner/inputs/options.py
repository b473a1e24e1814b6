"""Solver and pipeline options: plain frozen values passed explicitly to the formulations
(no module-global switches)."""

from __future__ import annotations

from dataclasses import dataclass

from formulations.result import MILP_BACKENDS

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b")
# heuristic searches the ILP falls back to (formulations.sbp_search.SEARCHES)
FALLBACKS = ("coordinate_descent", "metropolis_hastings", "random")
# MILP backends of the intra-op ILP (formulations.sbp_ilp runs them)
MILPS = MILP_BACKENDS
RECOMPUTE = ("never", "auto", "always")


@dataclass(frozen=True)
class SolverOptions:
    """Options of the intra-op ILP and its fallback searches.

    ``max_weight_replication`` caps p0, the replication of a linear's weight in AutoDDL's
    3-D family (§4.5.2); ``tie_layers`` gives every repetition of a block one strategy
    (§4.5.1); ``max_axes`` bounds the mesh factorisations considered per layer. ``milp``
    picks the ILP's solver: ``scip`` (in-process through OR-Tools, the default) or ``cbc``
    (PuLP's bundled CBC in a subprocess, the reference); see :mod:`formulations.sbp_ilp`.
    ``threads`` reaches CBC; OR-Tools' SCIP searches on one thread.
    ``elimination`` solves by exact variable elimination first
    (:mod:`formulations.elimination`), handing the ILP only the strategies its bound cannot
    rule out; False runs the ILP on the whole problem (the reference). ``gap`` is the
    relative optimality gap accepted as proof (0: proven exactly; the status is
    ``optimal`` either way and the plan reports the gap itself).

    The search space beyond AutoDDL's layouts: ``state_sharding`` lists the ZeRO levels a
    weighted op may take (0 none, 1 optimizer state, 2 + gradients, 3 + weights = FSDP;
    :func:`ilp_planner.lowering.strategies.state_sharded`), chosen per op by the ILP;
    ``recompute`` is ``never``, ``always`` (every block's activations recomputed) or
    ``auto`` (the planner picks how many blocks recompute, each count an exact solve;
    :func:`ilp_planner.intra_op.solve_mesh.solve_mesh`).
    """

    time_limit_s: float = 60.0
    tie_layers: bool = True
    max_weight_replication: int | None = None
    max_axes: int = 3
    threads: int = 1
    seed: int = 0
    fallback: str = "coordinate_descent"
    elimination: bool = True
    gap: float = 0.0
    milp: str = "scip"
    state_sharding: tuple[int, ...] = (0,)
    recompute: str = "never"


@dataclass(frozen=True)
class PipelineOptions:
    """Inter-op options. ``stages`` is 1 (no pipelining), an integer, or ``"auto"``;
    ``submeshes`` fixes the stage sub-mesh shapes ``(nodes, devices)`` by hand.

    ``submesh_space`` picks the shapes a stage may take (:func:`ilp_planner.ir.cluster.
    submesh_shapes`: ``all``, Alpa's ``power_of_two`` / ``small_power_of_two``, or
    ``divisors``: the whole-node counts dividing the cluster's, Megatron's even splits).
    ``max_units``: ``None`` gives the stage DP one unit per block (per weighted op without
    blocks); an integer merges consecutive units into at most that many — an explicit
    trade of plan quality for fewer intra-op stage solves, e.g. for block-free graphs of
    hundreds of ops. ``stage_time_limit_s`` bounds each stage's intra-op ILP (``None``:
    ``min(solver.time_limit_s, 10)``); a stage that hits it is priced by its best plan so
    far (status ``feasible``). ``stage_bound`` lets the planner skip the intra-op solve of
    a (range, sub-mesh) pair whose FLOP lower bound already loses to an even pipeline it
    priced first (exact: same optimum;
    :meth:`ilp_planner.inter_op.stage_solver.StageSolver.stage_cost`).

    ``virtual_stages`` (Megatron-LM's interleaving, :mod:`ilp_planner.inter_op.interleaved`):
    with ``schedule: interleaved-1f1b``, the model chunks per stage mesh (an integer ≥ 2,
    or ``auto``: the fastest); with another schedule, ``auto`` also prices interleaved
    pipelines on the stage DP's stage count and keeps one where it simulates faster, and
    1 (the default) never interleaves."""

    stages: int | str = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    submeshes: tuple[tuple[int, int], ...] | None = None
    imbalance_tolerance: float | None = None
    overlap: bool = True
    submesh_space: str = "all"
    max_units: int | None = None
    stage_time_limit_s: float | None = None
    stage_bound: bool = True
    virtual_stages: int | str = 1

    @property
    def interleaved(self) -> bool:
        """Whether the planner solves interleaved pipelines: forced (schedule
        ``interleaved-1f1b``) or offered beside the schedule's (``virtual_stages: auto``)."""
        return self.schedule == "interleaved-1f1b" or self.virtual_stages == "auto"

    @property
    def pipelined(self) -> bool:
        return self.stages == "auto" or (isinstance(self.stages, int) and self.stages > 1)
