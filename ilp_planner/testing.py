"""Plans built by hand for tests and benchmarks (planner-side fixtures; no torch, never on a rank).

* :func:`greedy_unit_tasks` — a cross-mesh transfer's unit tasks (Zhuang et al. §2.2, the
  planner's own :func:`~ilp_planner.inter_op.resharding.unit_tasks`), the sender of each the
  least-loaded holder and ``start_s`` from a greedy list schedule (one send and one receive
  per device at a time, α + nβ per task). Hand-built plans use this; the planner's own plans
  carry the CP-SAT order;
* :func:`restricted_plan` — the best single-mesh plan among strategies a filter keeps
  (e.g. force AutoDDL's 3-D family with partial sums), solved exactly like the baselines;
* :func:`sharded_plan` — the same with every shardable op at one ZeRO level (and every
  block recomputed, if asked);
* :func:`pipelined_plan` — a hand-built pipelined plan: the devices cut into equal
  contiguous stages, the layers cut into consecutive stages, each stage's layouts the
  intra-op optimum on its sub-mesh, a resharding entry (forward and backward unit tasks)
  for every edge crossing stages, and the schedule's action lists — the format the
  pipelined planner emits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from formulations.sbp_ilp import SbpIlp
from formulations.schedules import schedule_actions
from ilp_planner.errors import ConfigError, InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.assembly import stages_cost
from ilp_planner.inter_op.reprice_stages import price_stages
from ilp_planner.inter_op.resharding import unit_tasks
from ilp_planner.intra_op.baselines import Filter, restrict
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.cluster import Cluster, SubMesh
from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.strategies import (
    Strategy,
    resolve_partial,
)
from ilp_planner.plan.data import (
    PipelineSchedule,
    Plan,
    ReshardingEntry,
    SolverReport,
    Stage,
    UnitTask,
)

# -- regions and unit tasks ------------------------------------------------------------------








# -- schedules -------------------------------------------------------------------------------




# -- plans built by hand ---------------------------------------------------------------------


def greedy_unit_tasks(tensor: TensorSpec, src: SubMesh, src_layout: Layout, dst: SubMesh,
                      dst_layout: Layout, *, alpha: float = 1e-5, beta: float = 1e-9
                      ) -> list[UnitTask]:
    """The unit tasks of :func:`ilp_planner.inter_op.resharding.unit_tasks` as a hand-built plan
    carries them: each sent by its least-loaded holder, started by a greedy list schedule (one
    send and one receive per device at a time, ``α + nβ`` a task), in order of start."""
    sent: dict[int, float] = defaultdict(float)
    send_free: dict[int, float] = defaultdict(float)
    recv_free: dict[int, float] = defaultdict(float)
    tasks = []
    for t in unit_tasks(tensor, src, src_layout, dst, dst_layout):
        sender = min(t.holders, key=lambda h: (sent[h], t.holders.index(h)))
        sent[sender] += t.nbytes
        start = max([send_free[sender]] + [recv_free[r] for r in t.receivers])
        send_free[sender] = start + alpha + t.nbytes * beta
        for r in t.receivers:
            recv_free[r] = send_free[sender]
        tasks.append(UnitTask(t.region, sender, t.holders, t.receivers, start))
    tasks.sort(key=lambda t: t.start_s)
    return tasks


def _choose(gp, keep: Filter | None, time_limit_s: float) -> tuple[list[int], SolverReport]:
    if keep is None:
        problem, allowed = gp.problem, None
    else:
        res = restrict(gp, keep)
        if isinstance(res, str):
            raise InfeasibleError(res)
        problem, allowed = res
    out = SbpIlp(problem).solve(time_limit_s=time_limit_s)
    if out is None:
        raise InfeasibleError("the restricted ILP found no solution in time")
    choice = list(out.choice) if allowed is None else \
        [int(allowed[g][k]) for g, k in enumerate(out.choice)]
    return choice, SolverReport.of(out)


def restricted_plan(config: Config, keep: Filter | None = None, name: str | None = None,
                    time_limit_s: float = 30.0) -> Plan:
    """The best single-mesh plan using only strategies ``keep`` accepts (all if None), for
    one micro-batch with gradient accumulation over ``pipeline.microbatches`` (as
    :func:`ilp_planner.intra_op.solve_mesh.solve_mesh` plans)."""
    c = config.cluster
    gp = build_problem(config.microbatch_graph(), c, c.nodes, c.devices_per_node, config.memory,
                       tie_layers=config.solver.tie_layers,
                       max_weight_replication=config.solver.max_weight_replication,
                       microbatches=config.pipeline.microbatches,
                       grad_bucket_bytes=config.grad_bucket_bytes)
    choice, solver = _choose(gp, keep, time_limit_s)
    layers, cost = realise(gp, choice)
    return Plan(name or config.name, config.raw, solver, cost, layers)


def sharded_plan(config: Config, zero: int, *, recompute: bool = False,
                 keep: Filter | None = None, name: str | None = None,
                 time_limit_s: float = 30.0) -> Plan:
    """The best single-mesh plan in which every op that can shard its state among the
    strategies ``keep`` accepts does so at level ``zero``
    (:func:`ilp_planner.lowering.strategies.state_sharded`; the others keep theirs), with every
    block recomputed when ``recompute`` — to exercise one ZeRO level whatever the memory
    budget."""
    config = config.with_overrides({"solver.state_sharding": sorted({0, zero}),
                                    "solver.recompute": "always" if recompute else "never"})
    c = config.cluster
    graph = config.microbatch_graph()
    units = frozenset((op.block, op.block_index) for op in graph.ops
                      if recompute and op.block is not None and op.block_index is not None)
    gp = build_problem(graph, c, c.nodes, c.devices_per_node, config.memory,
                       tie_layers=config.solver.tie_layers,
                       max_weight_replication=config.solver.max_weight_replication,
                       microbatches=config.pipeline.microbatches,
                       grad_bucket_bytes=config.grad_bucket_bytes,
                       zero_levels=(0, zero) if zero else (0,), recompute=units)
    choice, solver = _sharded_choice(gp, zero, keep, time_limit_s)
    layers, cost = realise(gp, choice)
    return Plan(name or config.name, config.raw, solver, cost, layers)


def _sharded_choice(gp, zero: int, keep: Filter | None, time_limit_s: float
                    ) -> tuple[list[int], SolverReport]:
    """The best choice with every op at ``zero`` where a strategy ``keep`` accepts has it."""
    allowed = []
    for group in gp.groups:
        op = gp.graph[group[0]]
        passing = [k for k, o in enumerate(gp.options[group[0]])
                   if keep is None or keep(op, o.base)]
        at_level = [k for k in passing if gp.options[group[0]][k].base.zero == zero]
        idx = np.array(at_level or passing, dtype=int)
        if idx.size == 0:
            raise InfeasibleError(f"no strategy of {op.name!r} at zero{zero} passes the filter")
        allowed.append(idx)
    out = SbpIlp(gp.problem.subset(allowed)).solve(time_limit_s=time_limit_s)
    if out is None:
        raise InfeasibleError("the restricted ILP found no solution in time")
    return [int(allowed[g][k]) for g, k in enumerate(out.choice)], SolverReport.of(out)


def matmul_filter(predicate: Callable[[Op, Strategy], bool]) -> Filter:
    """Keep strategies of linear/embedding ops that satisfy ``predicate``; others free."""
    def keep(op: Op, s: Strategy) -> bool:
        if op.kind in (OpKind.LINEAR, OpKind.EMBEDDING):
            return predicate(op, s)
        return True
    return keep


def three_d_filter(sizes: tuple[int, int, int]) -> Filter:
    """Linear and embedding ops in AutoDDL's 3-D family on a ``p0 × p1 × p2`` mesh."""
    return matmul_filter(lambda op, s: s.label.startswith("3d")
                         and tuple(a.size for a in s.fact) == tuple(sizes))


def _stage_shape(nodes: int, local: int, stages: int) -> tuple[int, int]:
    if nodes % stages == 0:
        return nodes // stages, local
    if nodes == 1 and local % stages == 0:
        return 1, local // stages
    raise ConfigError(f"cannot cut a {nodes}x{local} cluster into {stages} equal stage meshes")


def _stage_mesh(cluster: Cluster, nodes: int, local: int, index: int) -> SubMesh:
    """Stage ``index``'s mesh when the cluster is cut into equal contiguous stage meshes of
    ``nodes × local`` (along the nodes, or along one node's devices)."""
    if nodes == cluster.nodes and local < cluster.devices_per_node:
        return SubMesh(0, nodes, index * local, local, cluster.devices_per_node)
    return SubMesh(index * nodes, nodes, 0, local, cluster.devices_per_node)


def _whole_nodes(names: list[str], owner: dict[str, str], k: int) -> int:
    """The first position from ``k`` after which a stage cut leaves every fused node whole
    (a follower stays on its producer's stage, as the planner's stages keep them)."""
    while k + 1 < len(names) and owner[names[k + 1]] in {owner[n] for n in names[:k + 1]}:
        k += 1
    return k


def pipelined_plan(config: Config, *, stages: int = 2, schedule: str = "1f1b",
                   microbatches: int = 2, cut_after: Sequence[str] | None = None,
                   keep: Filter | None = None, name: str | None = None,
                   time_limit_s: float = 30.0, zero: int = 0) -> Plan:
    """A hand-built pipelined plan (see the module docstring). ``cut_after`` names the last
    op of each stage but the last (default: the layer list cut into equal counts).

    The layouts come from one ILP over the whole graph on the stage mesh, whose gradient
    bucket terms count one buffer per device group for the whole graph; the plan prices
    each stage as the pipeline planner does (its ops on its sub-mesh with its boundary:
    :func:`~ilp_planner.inter_op.reprice_stages.price_stages`), so its figures are what
    ``check`` derives from its layouts, but the choice is only near-optimal for them — the
    pipeline planner's per-stage ILPs are exact. ``zero`` > 0: every op that can shard its state does so at
    that level (:func:`sharded_plan`)."""
    raw = dict(config.raw)
    raw["pipeline"] = {"stages": stages, "microbatches": microbatches, "schedule": schedule}
    cfg = config.with_overrides({"pipeline": raw["pipeline"]})
    if zero:
        cfg = cfg.with_overrides({"solver.state_sharding": [0, zero]})
    c = cfg.cluster
    n_s, d_s = _stage_shape(c.nodes, c.devices_per_node, stages)
    graph = cfg.microbatch_graph()
    gp = build_problem(graph, c, n_s, d_s, cfg.memory, tie_layers=cfg.solver.tie_layers,
                       max_weight_replication=cfg.solver.max_weight_replication,
                       microbatches=microbatches, grad_bucket_bytes=cfg.grad_bucket_bytes,
                       zero_levels=(0, zero) if zero else (0,))
    choice, solver = (_sharded_choice(gp, zero, keep, time_limit_s) if zero
                      else _choose(gp, keep, time_limit_s))
    names = [op.name for op in graph.ops if op.kind is not OpKind.INPUT]
    if cut_after is None:
        cuts = [names[_whole_nodes(names, gp.owner, (len(names) * (s + 1)) // stages - 1)]
                for s in range(stages - 1)]
    else:
        cuts = list(cut_after)
    if len(cuts) != stages - 1 or any(x not in names for x in cuts) or any(
            _whole_nodes(names, gp.owner, names.index(x)) != names.index(x) for x in cuts):
        raise ConfigError(f"cut_after must name {stages - 1} ops of the graph, each closing "
                          f"its fused node (the planner never cuts one), got {cuts}")
    stage_of: dict[str, int] = {}
    s = 0
    for n in names:
        stage_of[n] = s
        if s < stages - 1 and n == cuts[s]:
            s += 1
    layers = [replace(lp, stage=stage_of[lp.name])
              for lp in realise(gp, choice, stage_of=stage_of)[0]]
    meshes = [_stage_mesh(c, n_s, d_s, i) for i in range(stages)]
    devices = [m.device_ids() for m in meshes]
    stage_list = [Stage(i, tuple(devices[i]), (n_s, d_s),
                        tuple(n for n in names if stage_of[n] == i)) for i in range(stages)]
    by_name = {lp.name: lp for lp in layers}
    resharding = []
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        for idx, src in enumerate(op.inputs):
            if graph[src].kind is OpKind.INPUT or stage_of[src] == stage_of[op.name]:
                continue
            tensor = graph[src].output
            src_layout = resolve_partial(by_name[src].output, tensor)
            dst_layout = by_name[op.name].inputs[idx]
            a, b = stage_of[src], stage_of[op.name]
            resharding.append(ReshardingEntry(
                a, b, src, op.name, tuple(tensor.shape), tensor.dtype, src_layout, dst_layout,
                tuple(greedy_unit_tasks(tensor, meshes[a], src_layout, meshes[b], dst_layout)),
                tuple(greedy_unit_tasks(tensor, meshes[b], dst_layout, meshes[a], src_layout))))
    actions = schedule_actions(schedule, stages, microbatches)
    sched = PipelineSchedule(schedule, microbatches,
                             tuple(tuple(actions[str(i)]) for i in range(stages)))
    # priced as the planner prices a pipeline: each stage on its own with its boundary
    layers, times = price_stages(cfg, stage_list, layers, resharding)
    stage_list = [replace(st, times=t) for st, t in zip(stage_list, times, strict=True)]
    return Plan(name or f"{cfg.name}-pp{stages}-{schedule}", cfg.raw, solver,
                stages_cost(times, 1), layers, {}, stage_list, sched, resharding)
