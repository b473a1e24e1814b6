"""Plan objects: what a solve returns, what ``plan.json`` holds, what the runtime reads.

A :class:`Plan` is plain data — per-layer strategies with their layouts and collectives,
the cost breakdown, the solver report, the baselines, and (for pipelined plans) stages,
schedule and cross-mesh resharding. ``to_dict``/``from_dict`` round-trip losslessly and the
file carries a schema version: loading a foreign or older file raises
:class:`~ilp_planner.errors.PlanFormatError`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from formulations.result import SolveResult, SolveStats
from ilp_planner.errors import LayoutError, PlanFormatError
from ilp_planner.inputs.files import read_input, write_output
from ilp_planner.ir.cluster import MeshAxis, fact_str
from ilp_planner.ir.layouts import Layout, parse_placement
from ilp_planner.ir.regions import Region
from ilp_planner.lowering.cost_model import ONCE_PER_STEP, Collective, CollectiveKind
from ilp_planner.plan.fields import (
    amount,
    finite,
    flag,
    integer,
    items,
    mapping,
    optional,
    required,
    string,
)

PLAN_SCHEMA = "ilp_planner.plan"  # the identity plan files carry (not a module path)
PLAN_VERSION = 5  # 2: resharding backward_tasks, priced stage forward_s/backward_s/cost; 3: shapes;
# 4: fused gradient buckets, exposed gradient synchronisation; 5: per-layer zero and recompute


def layout_to_dict(layout: Layout, shape: Sequence[int] | int | None = None) -> dict:
    """A layout as the plan stores it; with the tensor's ``shape`` (or just its rank) the
    GSPMD spelling too."""
    d = {
        "mesh": [[a.nodes, a.local] for a in layout.fact],
        "placements": [str(p) for p in layout.placements],
        "sbp": str(layout),
    }
    if shape is not None:
        rank = shape if isinstance(shape, int) else len(shape)
        if not isinstance(shape, int):
            d["shape"] = list(shape)
        d["rank"] = rank
        try:
            d["gspmd"] = layout.to_gspmd(rank)
        except LayoutError:
            d["gspmd"] = None
    return d


def layout_from_dict(d: dict) -> Layout:
    fact = tuple(MeshAxis(int(n), int(loc)) for n, loc in d["mesh"])
    return Layout(fact, tuple(parse_placement(p) for p in d["placements"]))


def text(value) -> str:
    """A JSON string, else a TypeError (see :func:`number`)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def number(value) -> float:
    """A JSON number as a float; anything else (a string, a list, a boolean) is a TypeError
    — plan files are parsed as untrusted input."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


@dataclass(frozen=True)
class CostBreakdown:
    """Per-device, per-step seconds and bytes. ``comm_s = activation_comm_s + grad_sync_s``;
    ``total_s = compute_s + comm_s`` (no overlap: what the ILP minimises).
    ``grad_sync_exposed_s`` is the part of ``grad_sync_s`` the step still waits for when the
    gradient buckets are reduced during the backward
    (:func:`~ilp_planner.lowering.grad_buckets.exposed_grad_sync`); ``step_s`` counts only that part."""

    compute_s: float
    activation_comm_s: float
    grad_sync_s: float
    activation_comm_bytes: float
    grad_sync_bytes: float
    peak_memory_bytes: float
    grad_sync_exposed_s: float

    @property
    def step_s(self) -> float:
        """Predicted step time with gradient synchronisation overlapped with the backward."""
        return self.compute_s + self.activation_comm_s + self.grad_sync_exposed_s

    @property
    def comm_s(self) -> float:
        return self.activation_comm_s + self.grad_sync_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_dict(self) -> dict:
        return {
            "total_s": self.total_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "activation_comm_s": self.activation_comm_s,
            "grad_sync_s": self.grad_sync_s,
            "grad_sync_exposed_s": self.grad_sync_exposed_s,
            "step_s": self.step_s,
            "activation_comm_bytes": self.activation_comm_bytes,
            "grad_sync_bytes": self.grad_sync_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict, path: str = "cost") -> CostBreakdown:
        """The breakdown a file stores; every figure (the derived totals too) a non-negative
        number."""
        for k in ("total_s", "comm_s", "step_s"):
            amount(required(d, k, path), f"{path}.{k}")
        return cls(*(float(amount(required(d, k, path), f"{path}.{k}"))
                     for k in ("compute_s", "activation_comm_s", "grad_sync_s",
                               "activation_comm_bytes", "grad_sync_bytes",
                               "peak_memory_bytes", "grad_sync_exposed_s")))

    @classmethod
    def of(cls, compute_s: float, collectives: list[Collective], memory: float,
           microbatches: int = 1, grad_sync_exposed_s: float | None = None) -> CostBreakdown:
        """Per step: compute and activation collectives (given per micro-batch) run
        ``microbatches`` times, weight-gradient synchronisation once (all of it exposed
        unless ``grad_sync_exposed_s`` says otherwise)."""
        act = [c for c in collectives if c.purpose not in ONCE_PER_STEP]
        grad = [c for c in collectives if c.purpose in ONCE_PER_STEP]
        m = microbatches
        grad_s = sum(c.seconds for c in grad)
        return cls(m * compute_s, m * sum(c.seconds for c in act), grad_s,
                   m * sum(c.bytes for c in act), sum(c.bytes for c in grad), memory,
                   grad_s if grad_sync_exposed_s is None else grad_sync_exposed_s)


@dataclass(frozen=True)
class LayerPlan:
    """One op's decision. ``collectives`` lists everything the op issues: the
    redistribution of its inputs into ``inputs`` layouts (forward and backward), the
    op's own collectives, and its weight-gradient synchronisation."""

    name: str
    kind: str
    strategy: str
    inputs: tuple[Layout, ...]
    weight: Layout | None
    output: Layout
    compute_s: float
    memory_bytes: float
    collectives: tuple[Collective, ...]
    stage: int = 0
    input_shapes: tuple[tuple[int, ...], ...] = ()  # of the tensors the layouts describe, so an
    output_shape: tuple[int, ...] = ()               # edited config is caught, not re-modelled
    zero: int = 0  # state sharding level (ilp_planner.lowering.strategies.state_sharded)
    recompute: bool = False  # activations recomputed in the backward (checkpointed block)

    def to_dict(self) -> dict:
        fact = self.output.fact
        return {
            "name": self.name,
            "kind": self.kind,
            "stage": self.stage,
            "strategy": {
                "label": self.strategy,
                "mesh": [[a.nodes, a.local] for a in fact],
                "mesh_str": fact_str(fact),
                "inputs": [layout_to_dict(x, shape) for x, shape in
                           zip(self.inputs, self.input_shapes or (None,) * len(self.inputs),
                               strict=True)],
                "weight": None if self.weight is None else layout_to_dict(self.weight),
                "output": layout_to_dict(self.output, self.output_shape or None),
            },
            "compute_s": self.compute_s,
            "memory_bytes": self.memory_bytes,
            "zero": self.zero,
            "recompute": self.recompute,
            "collectives": [c.to_dict() for c in self.collectives],
        }

    @classmethod
    def from_dict(cls, d: dict, path: str = "layer") -> LayerPlan:
        s = mapping(required(d, "strategy", path), f"{path}.strategy")
        where = f"{path}.strategy"
        output = _layout(required(s, "output", where), f"{where}.output")
        _check_strategy_mesh(s, output, where)
        return cls(
            text(d["name"]), text(d["kind"]), text(s["label"]),
            items(required(s, "inputs", where), f"{where}.inputs", _layout),
            optional(required(s, "weight", where), f"{where}.weight", _layout),
            output,
            float(amount(required(d, "compute_s", path), f"{path}.compute_s")),
            float(amount(required(d, "memory_bytes", path), f"{path}.memory_bytes")),
            items(required(d, "collectives", path), f"{path}.collectives", _collective),
            integer(d.get("stage", 0), f"{path}.stage"),
            tuple(_shape(x) for x in s["inputs"]),
            _shape(s["output"]),
            int(number(d["zero"])), flag(required(d, "recompute", path), f"{path}.recompute"),
        )


def _check_strategy_mesh(strategy: dict, output: Layout, path: str) -> None:
    """The mesh a layer's strategy names is the one its layouts are on: the file states it
    twice, and an edit of one copy (every ``strategy.mesh`` set to 64 devices) would
    otherwise be read as whichever copy a reader looks at."""
    string(required(strategy, "mesh_str", path), f"{path}.mesh_str")
    mesh = items(required(strategy, "mesh", path), f"{path}.mesh",
                 lambda v, p: items(v, p, integer))
    expected = [[a.nodes, a.local] for a in output.fact]
    if [list(axis) for axis in mesh] != expected:
        raise PlanFormatError(f"{path}.mesh: {[list(a) for a in mesh]} is not the mesh of its "
                              f"layouts, {expected}")


def _top(d: dict, key: str) -> Any:
    """A top-level field of a plan file, or an error naming it as missing."""
    if key not in d:
        raise PlanFormatError(f"{key}: missing")
    return d[key]


def _collective(d, path: str) -> Collective:
    """A collective whose size, bytes and seconds are non-negative numbers, its link,
    phase and purpose strings and its mesh axes integers."""
    for k in ("group_size", "bytes", "seconds"):
        amount(required(d, k, path), f"{path}.{k}")
    kind = string(required(d, "kind", path), f"{path}.kind")
    if kind not in {k.value for k in CollectiveKind}:
        raise PlanFormatError(f"{path}.kind: {kind!r} is not a collective; expected one of "
                              f"{sorted(k.value for k in CollectiveKind)}")
    string(required(d, "link", path), f"{path}.link")
    for k in ("phase", "purpose"):
        optional(d.get(k), f"{path}.{k}", string)
    items(d.get("axes", []), f"{path}.axes", integer)
    return Collective.from_dict(d)


def _shape(layout_dict: dict) -> tuple[int, ...]:
    shape = layout_dict.get("shape")
    return () if shape is None else tuple(int(n) for n in shape)


def _layout(value, path: str) -> Layout:
    """A layout the plan stores with its tensor's shape: mesh and placements parsed, the
    derived spellings (SBP, rank, GSPMD, shape) of their types."""
    string(required(value, "sbp", path), f"{path}.sbp")
    if "shape" in value:
        items(value["shape"], f"{path}.shape", integer)
    if "rank" in value:
        integer(value["rank"], f"{path}.rank")
    optional(value.get("gspmd"), f"{path}.gspmd", string)
    try:
        return layout_from_dict(value)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, LayoutError) as exc:
        raise PlanFormatError(f"{path}: not a layout ({type(exc).__name__}: {exc})") from exc


def _amounts(d: dict, keys: Sequence[str], path: str) -> list[float]:
    return [amount(required(d, k, path), f"{path}.{k}") for k in keys]


def _stats(d, path: str) -> SolveStats:
    """A solver's statistics: counts non-negative integers, times non-negative, each may be null."""
    counts = {k: optional(required(d, k, path), f"{path}.{k}", integer)
              for k in ("variables", "integer_variables", "constraints", "nodes")}
    times = {k: optional(required(d, k, path), f"{path}.{k}", amount)
             for k in ("build_s", "presolve_s", "search_s", "proof_s")}
    return SolveStats(**counts, **times, note=string(required(d, "note", path), f"{path}.note"))


_STAGE_COUNTS = ("units", "stage_solves", "stage_pairs", "stage_bounded", "stage_relaxed",
                 "stage_cut_off")


@dataclass(frozen=True)
class StageSolves:
    """What a pipelined solve did on top of its stage ILPs (the solver report's pipeline
    part): layer units, stage solves and the (range, sub-mesh) pairs priced, how many the
    bounds pruned, and where the time went (``timings``: named non-negative seconds)."""

    units: int
    stage_solves: int
    stage_pairs: int
    stage_bounded: int
    stage_relaxed: int
    stage_cut_off: int
    incumbent_s: float | None
    stage_not_optimal: int
    stage_time_limit_s: float
    timings: dict[str, float]

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in _STAGE_COUNTS},
                "incumbent_s": self.incumbent_s, "stage_not_optimal": self.stage_not_optimal,
                "stage_time_limit_s": self.stage_time_limit_s, "timings": dict(self.timings)}

    @classmethod
    def from_dict(cls, d: dict, path: str) -> StageSolves:
        timings = mapping(required(d, "timings", path), f"{path}.timings")
        return cls(*(integer(required(d, k, path), f"{path}.{k}") for k in _STAGE_COUNTS),
                   optional(required(d, "incumbent_s", path), f"{path}.incumbent_s", amount),
                   integer(required(d, "stage_not_optimal", path), f"{path}.stage_not_optimal"),
                   amount(required(d, "stage_time_limit_s", path), f"{path}.stage_time_limit_s"),
                   {k: amount(v, f"{path}.timings.{k}") for k, v in timings.items()})


@dataclass(frozen=True)
class SolverReport:
    """How a plan (or a stage of it) was solved. A report without ``build_s`` is a priced
    point, not a solve (a pipelined grid stage): it carries only status, objective and
    method. A solve's report carries its bound, gap, times and message, and either its
    model's ``stats`` or, for a pipelined solve, its ``stages`` (:class:`StageSolves`)."""

    status: str
    objective: float
    method: str
    bound: float | None = None
    gap: float | None = None
    build_s: float | None = None
    solve_s: float | None = None
    message: str = ""
    stats: SolveStats | None = None
    stages: StageSolves | None = None

    @classmethod
    def of(cls, result: SolveResult) -> SolverReport:
        """The report of one ILP (or search) solve."""
        return cls(result.status, result.objective, result.method, result.bound, result.gap,
                   result.build_s, result.solve_s, result.message, result.stats)

    def to_dict(self) -> dict:
        if self.build_s is None:
            return {"status": self.status, "objective": self.objective, "method": self.method}
        head = {"status": self.status, "objective": self.objective, "bound": self.bound,
                "gap": self.gap, "build_s": self.build_s, "solve_s": self.solve_s,
                "method": self.method, "message": self.message}
        if self.stages is not None:
            return {**head, **self.stages.to_dict()}
        return {**head, "stats": None if self.stats is None else self.stats.to_dict()}

    @classmethod
    def from_dict(cls, d, path: str) -> SolverReport:
        status = string(required(d, "status", path), f"{path}.status")
        objective = finite(required(d, "objective", path), f"{path}.objective")
        method = string(required(d, "method", path), f"{path}.method")
        if "build_s" not in d:
            return cls(status, objective, method)
        pipelined = "units" in d
        return cls(
            status, objective, method,
            optional(required(d, "bound", path), f"{path}.bound", finite),
            optional(required(d, "gap", path), f"{path}.gap", amount),
            *_amounts(d, ("build_s", "solve_s"), path),
            string(required(d, "message", path), f"{path}.message"),
            None if pipelined else optional(required(d, "stats", path), f"{path}.stats", _stats),
            StageSolves.from_dict(d, path) if pipelined else None,
        )


_STAGE_TIMES = ("forward_s", "backward_s", "grad_sync_s", "grad_sync_exposed_s")


@dataclass(frozen=True)
class StageTimes:
    """What a stage's layers price (:func:`ilp_planner.inter_op.pipeline.stage_costs`): per
    micro-batch ``forward_s`` and ``backward_s``, per step ``grad_sync_s`` and its exposed
    part, and the stage's cost breakdown."""

    forward_s: float
    backward_s: float
    grad_sync_s: float
    grad_sync_exposed_s: float
    cost: CostBreakdown

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in _STAGE_TIMES}, "cost": self.cost.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, path: str) -> StageTimes:
        cost = mapping(required(d, "cost", path), f"{path}.cost")
        return cls(*_amounts(d, _STAGE_TIMES, path), CostBreakdown.from_dict(cost, f"{path}.cost"))


_STAGE_DP_TIMES = ("dp_time_s", "dp_boundary_time_s", "memory_bytes")


@dataclass(frozen=True)
class StageDP:
    """How the stage DP chose a stage: the sub-mesh's placement, the layer-unit range, the
    DP's time and boundary time for it, its memory at ``inflight_microbatches``, the
    in-flight count its memory was solved for (None: the stage ILP's own), and the stage
    ILP's report."""

    placement: str
    layer_units: tuple[int, int]
    dp_time_s: float
    dp_boundary_time_s: float
    memory_bytes: float
    inflight_microbatches: int
    memory_solved_for_inflight: int | None
    solver: SolverReport

    def to_dict(self) -> dict:
        return {"layer_units": list(self.layer_units),
                **{k: getattr(self, k) for k in _STAGE_DP_TIMES},
                "inflight_microbatches": self.inflight_microbatches,
                "memory_solved_for_inflight": self.memory_solved_for_inflight,
                "solver": self.solver.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, path: str) -> StageDP:
        units = items(required(d, "layer_units", path), f"{path}.layer_units", integer)
        if len(units) != 2:
            raise PlanFormatError(f"{path}.layer_units: expected [start, end], got {list(units)}")
        return cls(string(required(d, "placement", path), f"{path}.placement"), (units[0], units[1]),
                   *_amounts(d, _STAGE_DP_TIMES, path),
                   integer(required(d, "inflight_microbatches", path), f"{path}.inflight_microbatches"),
                   optional(required(d, "memory_solved_for_inflight", path),
                            f"{path}.memory_solved_for_inflight", integer),
                   SolverReport.from_dict(mapping(required(d, "solver", path), f"{path}.solver"),
                                          f"{path}.solver"))


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its index, global device ids (mesh order), sub-mesh shape
    ``(nodes, devices per node)`` and layer names; ``dp`` where the stage DP chose it,
    ``times`` once its layers are priced."""

    index: int
    devices: tuple[int, ...]
    mesh: tuple[int, int]
    layers: tuple[str, ...]
    dp: StageDP | None = None
    times: StageTimes | None = None

    def to_dict(self) -> dict:
        d: dict = {"index": self.index, "devices": list(self.devices), "mesh": list(self.mesh)}
        if self.dp is not None:
            d["placement"] = self.dp.placement
        d["layers"] = list(self.layers)
        if self.dp is not None:
            d.update(self.dp.to_dict())
        if self.times is not None:
            d.update(self.times.to_dict())
        return d

    @classmethod
    def from_dict(cls, d, path: str) -> Stage:
        mesh = items(required(d, "mesh", path), f"{path}.mesh", lambda v, p: integer(v, p, 1))
        if len(mesh) != 2:
            raise PlanFormatError(f"{path}.mesh: expected [nodes, devices per node], got "
                                  f"{list(mesh)}")
        return cls(integer(required(d, "index", path), f"{path}.index"),
                   items(required(d, "devices", path), f"{path}.devices", integer), (mesh[0], mesh[1]),
                   items(required(d, "layers", path), f"{path}.layers", string),
                   StageDP.from_dict(d, path) if "placement" in d else None,
                   StageTimes.from_dict(d, path) if "forward_s" in d else None)


_SIMULATED = ("makespan_s", "bubble_fraction")


@dataclass(frozen=True)
class Simulated:
    """The planner's schedule as simulated: makespan, bubble fraction, peak in-flight
    micro-batches per stage, whether transfers overlap compute, the stage DP's objective,
    and the step (makespan + the exposed gradient synchronisation tail)."""

    makespan_s: float
    bubble_fraction: float
    peak_inflight: tuple[int, ...]
    overlap: bool
    dp_objective_s: float
    step_s: float

    def to_dict(self) -> dict:
        return {"makespan_s": self.makespan_s, "bubble_fraction": self.bubble_fraction,
                "peak_inflight": list(self.peak_inflight), "overlap": self.overlap,
                "dp_objective_s": self.dp_objective_s, "step_s": self.step_s}

    @classmethod
    def from_dict(cls, d: dict, path: str) -> Simulated:
        return cls(*_amounts(d, _SIMULATED, path),
                   items(required(d, "peak_inflight", path), f"{path}.peak_inflight", integer),
                   flag(required(d, "overlap", path), f"{path}.overlap"),
                   *_amounts(d, ("dp_objective_s", "step_s"), path))


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipelined plan's schedule: its name, micro-batches per step, per stage the actions
    it runs (``"F0"``, ``"B1"``, …; lowered and validated by the check), and where the
    planner simulated it, the simulation (``simulated``).

    Interleaved 1F1B (``virtual_stages`` = v > 1): the plan's stages are the model's
    ``p·v`` chunks, chunk ``j`` on the devices of stage ``j mod p``; ``actions`` has one row
    per stage mesh (``p`` rows), each action naming its chunk (``"2F0"``)."""

    name: str
    num_microbatches: int
    actions: tuple[tuple[str, ...], ...]
    simulated: Simulated | None = None
    virtual_stages: int = 1

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "num_microbatches": self.num_microbatches,
                   "actions": {str(i): list(row) for i, row in enumerate(self.actions)}}
        if self.virtual_stages != 1:
            d["virtual_stages"] = self.virtual_stages
        return d if self.simulated is None else {**d, **self.simulated.to_dict()}

    @classmethod
    def from_dict(cls, d, path: str) -> PipelineSchedule:
        acts = mapping(required(d, "actions", path), f"{path}.actions")
        if list(acts) != [str(i) for i in range(len(acts))]:
            raise PlanFormatError(f"{path}.actions: expected one list per stage keyed "
                                  f"'0'..'{len(acts) - 1}', got keys {list(acts)[:8]}")
        return cls(string(required(d, "name", path), f"{path}.name"),
                   integer(required(d, "num_microbatches", path), f"{path}.num_microbatches", 1),
                   tuple(items(row, f"{path}.actions.{k}", string) for k, row in acts.items()),
                   Simulated.from_dict(d, path) if "makespan_s" in d else None,
                   integer(d.get("virtual_stages", 1), f"{path}.virtual_stages", 1))


@dataclass(frozen=True)
class UnitTask:
    """One broadcast of a resharding schedule: ``region`` from ``sender`` (one of the
    ``holders``) to ``receivers``, starting at ``start_s`` in the solved schedule;
    ``bytes`` where the solver priced it."""

    region: Region
    sender: int
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    start_s: float
    bytes: float | None = None

    @property
    def group(self) -> tuple[int, ...]:
        return tuple(sorted({self.sender, *self.receivers}))

    def to_dict(self) -> dict:
        d = {"slice": [list(r) for r in self.region], "sender": self.sender,
             "holders": list(self.holders), "receivers": list(self.receivers),
             "start_s": self.start_s}
        return d if self.bytes is None else {**d, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, d, path: str) -> UnitTask:
        region = items(required(d, "slice", path), f"{path}.slice", _interval)
        return cls(region, integer(required(d, "sender", path), f"{path}.sender"),
                   items(required(d, "holders", path), f"{path}.holders", integer),
                   items(required(d, "receivers", path), f"{path}.receivers", integer),
                   amount(required(d, "start_s", path), f"{path}.start_s"),
                   optional(d.get("bytes"), f"{path}.bytes", amount))


def _interval(value, path: str) -> tuple[int, int]:
    bounds = items(value, path, integer)
    if len(bounds) != 2:
        raise PlanFormatError(f"{path}: expected [start, end], got {list(bounds)}")
    return bounds[0], bounds[1]


_TRANSFER_TIMES = ("makespan_s", "lower_bound_s")


@dataclass(frozen=True)
class Transfer:
    """How the resharding planner solved an entry (:mod:`ilp_planner.inter_op.resharding`):
    the GSPMD specs of both ends, the chosen algorithm and its status, the forward makespan
    and lower bound, every algorithm's makespan, and the backward's makespan and bound."""

    src_spec: str
    dst_spec: str
    algorithm: str
    status: str
    makespan_s: float
    lower_bound_s: float
    algorithms: dict[str, float]
    backward_makespan_s: float
    backward_lower_bound_s: float

    @classmethod
    def from_dict(cls, d: dict, path: str) -> Transfer:
        algorithms = mapping(required(d, "algorithms", path), f"{path}.algorithms")
        return cls(*(string(required(d, k, path), f"{path}.{k}")
                     for k in ("src_spec", "dst_spec", "algorithm", "status")),
                   *_amounts(d, _TRANSFER_TIMES, path),
                   {k: amount(v, f"{path}.algorithms.{k}") for k, v in algorithms.items()},
                   *_amounts(d, ("backward_makespan_s", "backward_lower_bound_s"), path))


@dataclass(frozen=True)
class ReshardingEntry:
    """A tensor moving between two stages: ``tensor`` (its producer) to ``consumer`` on
    ``dst_stage``, from ``src_layout`` on the source stage's devices to ``dst_layout`` on
    the destination's; ``tasks`` forward and ``backward_tasks`` for its gradient going
    back; ``transfer`` where the resharding planner solved it (hand-built plans have
    only the tasks)."""

    src_stage: int
    dst_stage: int
    tensor: str
    consumer: str
    shape: tuple[int, ...]
    dtype: str
    src_layout: Layout
    dst_layout: Layout
    tasks: tuple[UnitTask, ...]
    backward_tasks: tuple[UnitTask, ...]
    transfer: Transfer | None = None

    def to_dict(self) -> dict:
        d: dict = {"src_stage": self.src_stage, "dst_stage": self.dst_stage,
                   "tensor": self.tensor, "consumer": self.consumer, "shape": list(self.shape),
                   "dtype": self.dtype,
                   "src_layout": layout_to_dict(self.src_layout, self.shape),
                   "dst_layout": layout_to_dict(self.dst_layout, self.shape)}
        tasks = [t.to_dict() for t in self.tasks]
        back = [t.to_dict() for t in self.backward_tasks]
        t = self.transfer
        if t is None:
            return {**d, "tasks": tasks, "backward_tasks": back}
        return {**d, "src_spec": t.src_spec, "dst_spec": t.dst_spec, "algorithm": t.algorithm,
                "status": t.status, "makespan_s": t.makespan_s, "lower_bound_s": t.lower_bound_s,
                "algorithms": dict(t.algorithms), "tasks": tasks,
                "backward_makespan_s": t.backward_makespan_s,
                "backward_lower_bound_s": t.backward_lower_bound_s, "backward_tasks": back}

    @classmethod
    def from_dict(cls, d, path: str) -> ReshardingEntry:
        return cls(integer(required(d, "src_stage", path), f"{path}.src_stage"),
                   integer(required(d, "dst_stage", path), f"{path}.dst_stage"),
                   string(required(d, "tensor", path), f"{path}.tensor"),
                   string(required(d, "consumer", path), f"{path}.consumer"),
                   items(required(d, "shape", path), f"{path}.shape", integer),
                   string(required(d, "dtype", path), f"{path}.dtype"),
                   _layout(required(d, "src_layout", path), f"{path}.src_layout"),
                   _layout(required(d, "dst_layout", path), f"{path}.dst_layout"),
                   items(required(d, "tasks", path), f"{path}.tasks", UnitTask.from_dict),
                   items(required(d, "backward_tasks", path), f"{path}.backward_tasks",
                         UnitTask.from_dict),
                   Transfer.from_dict(d, path) if "algorithm" in d else None)


@dataclass
class Plan:
    """A solved plan. ``config`` is the raw configuration it was solved from (so the
    runtime can rebuild the same graph); ``baselines`` maps a baseline name to its cost
    block or to ``{"error": reason}``."""

    name: str
    config: dict
    solver: SolverReport
    cost: CostBreakdown
    layers: list[LayerPlan]
    baselines: dict[str, dict] = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)
    schedule: PipelineSchedule | None = None
    resharding: list[ReshardingEntry] = field(default_factory=list)
    version: int = PLAN_VERSION

    def to_dict(self) -> dict:
        return {
            "schema": PLAN_SCHEMA,
            "version": self.version,
            "name": self.name,
            "config": self.config,
            "solver": self.solver.to_dict(),
            "cost": self.cost.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
            "baselines": self.baselines,
            "stages": [s.to_dict() for s in self.stages],
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "resharding": [e.to_dict() for e in self.resharding],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<plan>") -> Plan:
        if not isinstance(d, dict) or d.get("schema") != PLAN_SCHEMA:
            raise PlanFormatError(f"{source}: not an ilp_planner plan (missing schema "
                                  f"{PLAN_SCHEMA!r})")
        if d.get("version") != PLAN_VERSION:
            raise PlanFormatError(
                f"{source}: plan schema version {d.get('version')!r} is not supported "
                f"(this ilp_planner reads version {PLAN_VERSION}); re-solve the config"
            )
        try:
            return cls(
                string(d.get("name"), "name"), mapping(d.get("config"), "config"),
                SolverReport.from_dict(mapping(_top(d, "solver"), "solver"), "solver"),
                CostBreakdown.from_dict(mapping(_top(d, "cost"), "cost")),
                list(items(_top(d, "layers"), "layers", LayerPlan.from_dict)),
                _baselines(d.get("baselines", {})),
                list(items(d.get("stages", []), "stages", Stage.from_dict)),
                optional(d.get("schedule"), "schedule", PipelineSchedule.from_dict),
                list(items(d.get("resharding", []), "resharding", ReshardingEntry.from_dict)),
                d["version"],
            )
        except PlanFormatError as exc:
            raise PlanFormatError(f"{source}: {exc}") from exc
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError,
                LayoutError) as exc:
            # parsing untrusted data: any of these means a field of the wrong shape or type
            raise PlanFormatError(f"{source}: corrupt plan ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from exc

    def to_json(self) -> str:
        """The plan file's text (what :meth:`save` writes and :meth:`load` reads)."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        """Write the plan file (parent folders created; errors name the path)."""
        write_output(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        text = read_input(path, PlanFormatError)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"{path}: not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise PlanFormatError(f"{path}: not a plan file (JSON nested too deeply)") from exc
        return cls.from_dict(data, str(path))

    @property
    def num_devices(self) -> int:
        c = self.config["cluster"]
        return int(c["nodes"]) * int(c["devices_per_node"])

    def layer(self, name: str) -> LayerPlan:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    @property
    def step_s(self) -> float:
        """Predicted seconds per training step: the simulated pipeline makespan plus the
        slowest stage's gradient synchronisation for pipelined plans, else compute +
        communication of the single mesh."""
        if self.schedule is not None and self.schedule.simulated is not None:
            return self.schedule.simulated.step_s
        return self.cost.total_s


def _baselines(value) -> dict[str, dict]:
    """The baselines block, each entry an error or a cost breakdown (with a pipelined
    baseline's ``pipeline_s`` and ``dp_formula_s``), every figure non-negative."""
    for name, block in mapping(value, "baselines").items():
        path = f"baselines.{name}"
        if "error" in mapping(block, path):
            string(block["error"], f"{path}.error")
            continue
        CostBreakdown.from_dict(block, path)
        for k in ("pipeline_s", "dp_formula_s"):
            optional(block.get(k), f"{path}.{k}", amount)
    return value


def baseline_seconds(block: dict) -> float:
    """A baseline's seconds per step as ratios compare them: a pipelined baseline's
    latency (``pipeline_s``), else its cost breakdown's total."""
    if "pipeline_s" in block:
        return number(block["pipeline_s"])
    return CostBreakdown.from_dict(block).total_s

