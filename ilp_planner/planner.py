"""The solve pipeline for one mesh: build the problem, check memory, run a fast search as
warm start and fallback, solve the ILP, turn the choice into a :class:`Plan`, and price
the baselines under the same cost model."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from formulations.elimination import EliminationResult, solve_elimination
from formulations.result import SolveResult
from formulations.sbp_ilp import SbpIlp
from formulations.sbp_problem import (
    BuildCache,
    GraphProblem,
    build_problem,
    describe_infeasible,
    dominated_free,
)
from formulations.sbp_search import SEARCHES
from ilp_planner.baselines import baseline_choices
from ilp_planner.config import Config, load_config, read_yaml
from ilp_planner.cost_model import Collective
from ilp_planner.errors import ConfigError, InfeasibleError
from ilp_planner.grad_buckets import exposed_grad_sync, fill_buckets
from ilp_planner.graph import Graph, OpKind
from ilp_planner.plan import CostBreakdown, LayerPlan, Plan
from ilp_planner.redistribution import plan_redistribution
from ilp_planner.stage_boundary import StageBoundary, export_program, import_program
from ilp_planner.strategies import SyncBucket, tied_exchange_collectives, tied_source


def solve(config: Config | str | Path | Graph | Mapping[str, Any], *, cluster: Any = None,
          training: Any = None, solver: Any = None, pipeline: Any = None,
          name: str | None = None, baselines: bool = True) -> Plan:
    """Solve a problem and return its plan. ``config`` is a :class:`Config`, a YAML path, a
    whole document as a mapping, or just the model — a :class:`Graph` (e.g. from
    :func:`ilp_planner.importer.from_module`) or a ``model:`` mapping — with the other
    sections as keywords, each a mapping in the schema's form or its object::

        plan = ilp_planner.solve(graph, cluster=cluster, solver={"time_limit_s": 10})
    """
    config = _as_config(config, cluster=cluster, training=training, solver=solver,
                        pipeline=pipeline, name=name)
    if config.pipeline.pipelined:
        from ilp_planner.pipeline_planner import solve_pipelined

        return solve_pipelined(config, baselines=baselines)
    cluster = config.cluster
    gp, result = solve_mesh(config, cluster.nodes, cluster.devices_per_node, cluster.memory_bytes)
    layers, cost = realise(gp, list(result.choice))
    plan = Plan(config.name, config.raw, result.to_dict(), cost, layers)
    if baselines:
        plan.baselines = price_baselines(gp, config.solver.time_limit_s)
    return plan


def _as_config(config: Any, **sections: Any) -> Config:
    given = {k: v for k, v in sections.items() if v is not None}
    if isinstance(config, Config) and not given:
        return config
    if isinstance(config, (str, Path)) and not given:
        return load_config(config)
    if isinstance(config, Config):
        doc = dict(config.raw)
    elif isinstance(config, (str, Path)):
        doc = dict(read_yaml(config))
    elif isinstance(config, Mapping) and "model" in config:
        doc = dict(config)
    elif isinstance(config, (Graph, Mapping)):
        doc = {"model": config}
    else:
        raise ConfigError(f"expected a Config, a YAML path, a document or a model (Graph or "
                          f"model mapping), got {type(config).__name__}")
    doc.update(given)
    if "cluster" not in doc:
        raise ConfigError("no cluster given: pass cluster=... (a mapping in the config "
                          "schema's form or a Cluster)", key="cluster")
    return load_config(doc)


def solve_mesh(config: Config, nodes: int, local: int, memory_budget: float | None,
               graph=None, microbatches: int | None = None,
               boundary: StageBoundary | None = None,
               cache: BuildCache | None = None) -> tuple[GraphProblem, SolveResult]:
    """Build and solve the intra-op problem of ``graph`` (default: the config's graph of
    one micro-batch, with gradient accumulation over ``pipeline.microbatches``) on an
    ``nodes × local`` mesh; ``boundary`` when ``graph`` is a pipeline stage; ``cache``
    carries per-op build work across solves of graphs cut from one model. Raises
    :class:`InfeasibleError` naming the binding layer."""
    opts = config.solver
    t0 = time.perf_counter()
    if graph is None:
        graph = config.microbatch_graph()
        microbatches = config.pipeline.microbatches
    try:
        gp = build_problem(graph, config.cluster, nodes, local, config.memory,
                           tie_layers=opts.tie_layers,
                           max_weight_replication=opts.max_weight_replication,
                           memory_budget=memory_budget, microbatches=microbatches or 1,
                           boundary=boundary, grad_bucket_bytes=config.grad_bucket_bytes,
                           cache=cache)
    except ValueError as exc:
        raise InfeasibleError(str(exc)) from exc
    problem_s = time.perf_counter() - t0
    if memory_budget is not None and gp.problem.min_memory()[0] > memory_budget:
        raise InfeasibleError(describe_infeasible(gp, memory_budget))
    if opts.fallback not in SEARCHES:
        raise ConfigError(f"unknown fallback search {opts.fallback!r}; expected one of "
                          f"{sorted(SEARCHES)}", key="solver.fallback")
    t1 = time.perf_counter()
    kept = dominated_free(gp.problem)
    problem = gp.problem.subset(kept)
    total = sum(len(c) for c in gp.problem.cost)
    notes = [f"{total - sum(len(k) for k in kept)} of {total} strategies dominated and dropped"]
    problem_s += time.perf_counter() - t1
    tied = _tied_warm_start(config, gp, kept, nodes, local, memory_budget, graph, microbatches,
                            boundary, cache)
    exact = None
    if opts.elimination:  # the fallback search gives an incumbent for pruning wide problems
        exact = solve_elimination(problem, gap=opts.gap, incumbents=[tied] if tied else [],
                                  search=lambda: SEARCHES[opts.fallback](problem,
                                                                         seed=opts.seed).choice)
    if exact is not None and exact.keep is None:
        result = dataclasses.replace(exact.result, build_s=problem_s, message="; ".join(
            [exact.result.message, *notes]))
    else:
        result = _solve_ilp(config, problem, exact, tied, notes, problem_s)
    full = tuple(int(kept[g][k]) for g, k in enumerate(result.choice))
    return gp, dataclasses.replace(result, choice=full)


def _solve_ilp(config: Config, problem, exact: EliminationResult | None, tied, notes: list[str],
               problem_s: float) -> SolveResult:
    """The ILP on ``problem`` (pruned indices). After an elimination: on the strategies
    its bound keeps (the optimum is among them), warm-started from its incumbent, whose
    proven bound also bounds the ILP's. Without one: on all strategies, warm-started from
    the fallback search or the tied optimum ``tied``."""
    opts = config.solver
    if exact is not None:
        index = [np.asarray(keep) for keep in exact.keep]
        sub = problem.subset(index)
        position = [{int(k): i for i, k in enumerate(keep)} for keep in index]
        warm_method = "tied ILP" if tied is not None and tuple(tied) == exact.result.choice \
            else "elimination"
        incumbent = tuple(position[g][k] for g, k in enumerate(exact.result.choice))
        warm, search_s = incumbent, exact.result.solve_s
        notes = [*notes, f"{sum(len(k) for k in index)} of {sum(len(c) for c in problem.cost)} "
                         f"strategies within the elimination bound ({exact.result.message})"]
    else:
        index, sub = None, problem
        heuristic = SEARCHES[opts.fallback](problem, seed=opts.seed)
        incumbent, search_s = heuristic.choice, heuristic.solve_s
        warm, warm_method = ((incumbent, opts.fallback) if problem.feasible(incumbent)
                             else (None, ""))
        if tied is not None and problem.feasible(tied) and (
                warm is None or problem.objective(tied) < problem.objective(warm)):
            warm, warm_method = tied, "tied ILP"
    ilp = SbpIlp(sub, opts.milp)
    result = ilp.solve(time_limit_s=opts.time_limit_s, threads=opts.threads, warm_start=warm,
                       seed=opts.seed, gap=opts.gap)
    build_s = problem_s + ilp.build_s
    if result is None and exact is not None:
        objective = sub.objective(incumbent)
        result = dataclasses.replace(
            exact.result, choice=incumbent, objective=objective, stats=ilp.stats,
            gap=max(0.0, (objective - exact.result.bound) / objective), method=warm_method,
            message=f"the ILP found nothing better within {opts.time_limit_s} s")
    elif result is None:
        choice = warm if warm is not None else incumbent
        result = SolveResult(
            "heuristic", problem.objective(choice), None, None, 0.0, 0.0, tuple(choice),
            warm_method or opts.fallback,
            f"the ILP found no solution within {opts.time_limit_s} s; using "
            f"{warm_method or opts.fallback}", ilp.stats)
    elif exact is not None:
        bound = result.bound if result.status == "optimal" else max(
            result.bound if result.bound is not None else -np.inf, exact.result.bound)
        gap = max(0.0, (result.objective - bound) / max(abs(result.objective), 1e-30))
        result = dataclasses.replace(result, bound=bound, gap=result.gap if result.status ==
                                     "optimal" else gap, method="elimination+ilp")
    result = dataclasses.replace(
        result, build_s=build_s, solve_s=result.solve_s + search_s,
        message="; ".join(m for m in (result.message, *notes) if m))
    if index is None:
        return result
    return dataclasses.replace(result, choice=tuple(int(index[g][k])
                                                    for g, k in enumerate(result.choice)))


def _tied_warm_start(config: Config, gp: GraphProblem, kept, nodes: int, local: int,
                     memory_budget: float | None, graph, microbatches: int | None,
                     boundary: StageBoundary | None,
                     cache: BuildCache | None = None) -> tuple[int, ...] | None:
    """For an untied solve of a graph with repeated blocks: the tied optimum (a valid
    untied choice, since tying only restricts) as a warm start, in the pruned problem's
    indices. The ILP alone can stall far above it on large untied models, and the
    elimination's incumbent ignores bucket rounding."""
    if config.solver.tie_layers or not any(op.tie_key for op in gp.graph.ops):
        return None
    tied_config = dataclasses.replace(
        config, solver=dataclasses.replace(config.solver, tie_layers=True))
    tgp, tres = solve_mesh(tied_config, nodes, local, memory_budget, graph, microbatches, boundary,
                           cache)
    full = [tres.choice[tgp.group_of[group[0]]] for group in gp.groups]
    positions = [{int(k): i for i, k in enumerate(kept[g])} for g in range(len(kept))]
    if any(k not in positions[g] for g, k in enumerate(full)):
        return None
    return tuple(positions[g][k] for g, k in enumerate(full))


def realise(gp: GraphProblem, choice: list[int], stage: int = 0,
            stage_of: dict[str, int] | None = None) -> tuple[list[LayerPlan], CostBreakdown]:
    """Per-layer plans and the cost breakdown of a choice: intra-op collectives of each op
    plus the redistribution of every input into the layout its consumer needs, and, for a
    pipeline stage, its boundary programs (:mod:`ilp_planner.stage_boundary`). Each op's
    gradient synchronisation is fused into the runtime's buckets
    (:func:`~ilp_planner.grad_buckets.fill_buckets`, per stage when ``stage_of`` cuts the
    graph into stages), listed on the layer completing each."""
    chosen = gp.node_choice(choice)
    graph = gp.graph
    rows: list[tuple] = []
    syncs: list[tuple[str, SyncBucket]] = []
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        node = gp.owner[op.name]
        pos = gp.position[op.name]
        opt = chosen[node]
        colls: list[Collective] = []
        for idx, src in enumerate(op.inputs):
            want = opt.inputs[pos][idx]
            if src in gp.boundary.imported:
                red = import_program(want, opt.grads[pos][idx], graph[src].output, gp.ctx.cluster)
                colls += red.forward + red.backward
                continue
            if graph[src].kind is OpKind.INPUT:
                continue
            if gp.owner[src] == node:
                continue  # a follower reads its producer inside the node (resolve counted)
            have = chosen[gp.owner[src]].outputs[gp.position[src]]
            red = plan_redistribution(have, want, graph[src].output, gp.ctx.cluster,
                                      opt.grads[pos][idx])
            colls += red.forward + red.backward
        colls += [c for c in opt.collectives[pos] if c.purpose != "grad_sync"]
        if pos == 0:  # the strategy's grad_sync collectives, as SyncBuckets to fuse
            syncs += [(op.name, b) for b in opt.syncs]
        if op.name in gp.boundary.exported:
            red = export_program(opt.outputs[pos], op.output, gp.ctx.cluster)
            colls += red.forward + red.backward
        emb = tied_source(graph, op) if op.attrs.get("tied") else None
        if emb is not None and emb.name in gp.owner and pos == 0:
            colls += tied_exchange_collectives(chosen[gp.owner[emb.name]].base.weight,
                                               opt.base.weight, emb.weight, gp.ctx.cluster)
        rows.append((op, pos, node, opt, colls))
    where = stage_of or {}
    colls_of = {r[0].name: r[4] for r in rows}
    for s in sorted({where.get(name, stage) for name, _ in syncs}):
        mine = [(name, b) for name, b in syncs if where.get(name, stage) == s]
        for bucket in fill_buckets(mine, gp.grad_bucket_bytes, gp.ctx):
            colls_of[bucket.launcher].append(bucket.collective)
    layers: list[LayerPlan] = []
    for op, pos, node, opt, colls in rows:
        is_base = pos == 0
        mem = (opt.state_bytes if is_base else 0.0) + opt.outputs[pos].local_bytes(op.output)
        layers.append(LayerPlan(
            op.name, op.kind.value, opt.base.label if is_base else f"follows {node}",
            opt.inputs[pos], opt.base.weight if is_base else None, opt.outputs[pos],
            opt.compute_s[pos], mem, tuple(colls), stage,
            tuple(graph[s].output.shape for s in op.inputs), op.output.shape,
        ))
    compute = sum(ly.compute_s for ly in layers)
    memory = sum(ly.memory_bytes for ly in layers)
    return layers, CostBreakdown.of(compute, [c for ly in layers for c in ly.collectives], memory,
                                    gp.microbatches, exposed_grad_sync(layers))


def price_baselines(gp: GraphProblem, time_limit_s: float) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, choice in baseline_choices(gp, time_limit_s).items():
        if isinstance(choice, str):
            out[name] = {"error": choice}
        else:
            out[name] = realise(gp, choice)[1].to_dict()
    return out
