"""The one entry of a solve: config → graph → intra-op solve on one mesh, or inter-op
(pipelined) solve over stages → :class:`~ilp_planner.plan.data.Plan` with its baselines."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import Config, load_config, read_yaml
from ilp_planner.inter_op.given_price import price_given, priced_once
from ilp_planner.inter_op.given_rival import mesh_if_faster
from ilp_planner.inter_op.pipeline import solve_pipelined
from ilp_planner.intra_op.baseline_prices import price_baselines, price_grid
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest, PhaseTimes
from ilp_planner.intra_op.solve_mesh import solve_single_mesh
from ilp_planner.ir.graph import Graph
from ilp_planner.plan.data import Plan, SolverReport


def solve(config: Config | str | Path | Graph | Mapping[str, Any], *, cluster: Any = None,
          training: Any = None, solver: Any = None, pipeline: Any = None,
          compare: Any = None, name: str | None = None, baselines: bool = True,
          times: PhaseTimes | None = None) -> Plan:
    """Solve a problem and return its plan. ``config`` is a :class:`Config`, a YAML path, a
    whole document as a mapping, or just the model — a :class:`Graph` (e.g. from
    :func:`ilp_planner.inputs.importer.from_module`) or a ``model:`` mapping — with the other
    sections as keywords, each a mapping in the schema's form or its object::

        plan = ilp_planner.solve(graph, cluster=cluster, solver={"time_limit_s": 10})

    ``times``, if given, collects the wall time spent solving and pricing baselines. The
    configurations of the config's ``compare:`` (or ``compare=``, e.g.
    ``["megatron: tp=8 pp=2"]``, replacing it) are priced beside the plan, baselines or not.
    """
    config = _as_config(config, cluster=cluster, training=training, solver=solver,
                        pipeline=pipeline, compare=compare, name=name)
    times = times or PhaseTimes()
    # a compared configuration: one pricing, as rival and beside the plan
    with _young_collections_only(), priced_once():
        plan = _solve_plan(config, baselines, times)
        if config.compare:
            with times.timing("solve_s"):
                plan = mesh_if_faster(config, plan)  # never slower than a one-mesh one
            with times.timing("baselines_s"):
                for given in config.compare:
                    plan.baselines.update(price_given(config, given, plan))
    return plan


@contextmanager
def _young_collections_only() -> Iterator[None]:
    """The build caches keep millions of small objects (layouts, options, a stage table's
    rows); the cyclic collector's full passes walk all of them again and free nothing
    there (a fifth of a 1,024-device pipelined plan's time; 0.1 s of a 0.5 s solve with
    its baselines). While the planner runs only the young generations are collected; the
    previous thresholds come back after."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1] if len(old) > 1 else 10, 10**9)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _solve_plan(config: Config, baselines: bool, times: PhaseTimes) -> Plan:
    """The plan of ``config``, with the usual baselines when asked (a faster compared
    configuration kept as the plan: :mod:`~ilp_planner.inter_op.given_rival`)."""
    if config.pipeline.pipelined:
        return _solve_pipelined_timed(config, baselines, times)
    gp, result, grid = solve_single_mesh(config, grid=baselines, times=times)
    layers, cost = realise(gp, list(result.choice))
    plan = Plan(config.name, config.raw, SolverReport.of(result), cost, layers)
    if baselines:
        with times.timing("baselines_s"):
            plan.baselines = price_baselines(MeshSolveRequest.whole_cluster(config))
            plan.baselines.update(price_grid(grid))
    return plan


def _solve_pipelined_timed(config: Config, baselines: bool, times: PhaseTimes) -> Plan:
    """A pipelined solve, its time split as its report splits it: the solver's own total
    (its report's build plus solve seconds: stage solves, DP, assembly — for an interleaved
    schedule the chunk solves and their DP) less the pipelined grid it priced is solving, the
    rest (the single-mesh baselines, the grid) the baselines; without baselines, all of it
    is solving."""
    t0 = time.perf_counter()
    plan = solve_pipelined(config, baselines=baselines)
    elapsed = time.perf_counter() - t0
    report = plan.solver
    total = (report.build_s or 0.0) + (report.solve_s or 0.0)
    grid = report.stages.timings.get("grid_s", 0.0) if report.stages else 0.0
    solving = min(elapsed, total - grid) if baselines and report.build_s is not None \
        else elapsed
    times.solve_s += solving
    times.baselines_s += elapsed - solving
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
