"""A given configuration's layout on one mesh (or one pipeline stage's sub-mesh): the
planner's own problem restricted to exactly the engine's layouts, solved exactly.

The restriction is the Megatron baseline's (:func:`~ilp_planner.intra_op.baselines.megatron_filter`)
on the configuration's one ``dp × tp`` factorisation — TP innermost, column/row-parallel
linears, attention split by heads, the rest split over data parallel, with sequence
parallelism when asked — with replicated state (Megatron's DP, torchtitan's DDP) or ZeRO-3
(torchtitan's FSDP) and the configuration's recomputed blocks. What is left open inside
that restriction (which linear is column- and which row-parallel) is solved exactly, so
the price is that of the engine's best use of its layout, as the baselines are. It is
priced without a memory budget: a configuration that does not fit still gets its time and
its peak, which the report sets against the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from formulations.sbp_ilp import SbpIlp
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inputs.given_config import GivenConfig, mesh_axes, recomputed_blocks
from ilp_planner.intra_op.baselines import Filter, megatron_filter, restrict
from ilp_planner.intra_op.problem import BuildCache, GraphProblem, build_problem
from ilp_planner.ir.graph import Graph
from ilp_planner.lowering.stage_boundary import StageBoundary


@dataclass(frozen=True)
class GivenLayout:
    """The configuration's choice on one mesh: the problem it was priced on and the choice
    (full-problem strategy indices). Its exact peak, FSDP's gathered weights included, is
    :func:`~ilp_planner.intra_op.problem.peak_memory`."""

    gp: GraphProblem
    choice: list[int]


def solve_given_layout(g: GivenConfig, config: Config, graph: Graph, shape: tuple[int, int],
                       microbatches: int, boundary: StageBoundary | None = None,
                       cache: BuildCache | None = None) -> GivenLayout:
    """``graph`` (one micro-batch of ``microbatches`` per step; a pipeline stage at
    ``boundary``) on a ``shape`` mesh in ``g``'s layout (module docstring). Raises
    :class:`InfeasibleError` saying why the layout is not in the planner's space for this
    graph, why the restricted solve found nothing, or which coupling of a functional
    fan-out its best choice breaks (:meth:`~ilp_planner.intra_op.problem.GraphProblem.unrunnable`:
    priced as if it ran, it would be a price of something ``parallelize`` refuses)."""
    n, d = shape
    gp = build_problem(graph, config.cluster, n, d, config.memory,
                       tie_layers=config.solver.tie_layers, microbatches=microbatches,
                       boundary=boundary, grad_bucket_bytes=config.grad_bucket_bytes,
                       cache=cache, zero_levels=(0, g.zero) if g.zero else (0,),
                       recompute=recomputed_blocks(g, graph))
    res = restrict(gp, given_filter(g, gp, shape))
    if isinstance(res, str):
        raise InfeasibleError(res)
    sub, allowed = res
    sub.memory_budget = None
    out = SbpIlp(sub).solve(time_limit_s=config.solver.time_limit_s)
    if out is None:
        raise InfeasibleError(f"the restricted ILP found no solution in "
                              f"{config.solver.time_limit_s:g} s")
    choice = [int(allowed[grp][k]) for grp, k in enumerate(out.choice)]
    gp.refuse_unrunnable(choice, "this configuration's layout" if out.status == "optimal" else
                         f"the best choice in this configuration's layout found in "
                         f"{config.solver.time_limit_s:g} s (a runnable one may exist)")
    return GivenLayout(gp, choice)


def given_filter(g: GivenConfig, gp: GraphProblem, shape: tuple[int, int]) -> Filter:
    """``g``'s layouts on ``gp``'s ``shape`` mesh: Megatron's on its ``dp × tp`` axes, with
    replicated state, or state sharded at ``g.zero`` (FSDP's ZeRO-3, the distributed
    optimizer's ZeRO-1) for every op the planner can shard that way (an op without such a
    strategy, an embedding, keeps its state replicated)."""
    dp, tp = mesh_axes(g, shape)
    layouts = megatron_filter(dp, tp, bool(g.sp), state=lambda s: True)
    sharded = sharded_ops(gp, g.zero) if g.zero else frozenset()

    def keep(op, s) -> bool:
        return s.zero == (g.zero if op.name in sharded else 0) and layouts(op, s)
    return keep


def sharded_ops(gp: GraphProblem, level: int) -> frozenset[str]:
    """The ops (node leaders) the planner offers strategies of state-sharding ``level`` for."""
    return frozenset(n for n, opts in gp.options.items()
                     if any(o.base.zero == level for o in opts))
