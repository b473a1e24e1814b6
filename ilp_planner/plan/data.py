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

from ilp_planner.errors import LayoutError, PlanFormatError
from ilp_planner.inputs.files import read_input, write_output
from ilp_planner.ir.cluster import MeshAxis, fact_str
from ilp_planner.ir.layouts import Layout, parse_placement
from ilp_planner.lowering.cost_model import ONCE_PER_STEP, Collective

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
    def from_dict(cls, d: dict) -> CostBreakdown:
        return cls(*(number(d[k]) for k in ("compute_s", "activation_comm_s", "grad_sync_s",
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
    def from_dict(cls, d: dict) -> LayerPlan:
        s = d["strategy"]
        stage = d.get("stage", 0)
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise TypeError(f"stage: expected an integer, got {type(stage).__name__}")
        return cls(
            text(d["name"]), text(d["kind"]), text(s["label"]),
            tuple(layout_from_dict(x) for x in s["inputs"]),
            None if s["weight"] is None else layout_from_dict(s["weight"]),
            layout_from_dict(s["output"]), number(d["compute_s"]), number(d["memory_bytes"]),
            tuple(Collective.from_dict(c) for c in d["collectives"]), stage,
            tuple(_shape(x) for x in s["inputs"]),
            _shape(s["output"]),
            int(number(d["zero"])), _flag(d["recompute"]),
        )


def _flag(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {type(value).__name__}")
    return value


def _shape(layout_dict: dict) -> tuple[int, ...]:
    shape = layout_dict.get("shape")
    return () if shape is None else tuple(int(n) for n in shape)


@dataclass
class Plan:
    """A solved plan. ``config`` is the raw configuration it was solved from (so the
    runtime can rebuild the same graph); ``baselines`` maps a baseline name to its cost
    block or to ``{"error": reason}``."""

    name: str
    config: dict
    solver: dict
    cost: CostBreakdown
    layers: list[LayerPlan]
    baselines: dict[str, dict] = field(default_factory=dict)
    stages: list[dict] = field(default_factory=list)
    schedule: dict | None = None
    resharding: list[dict] = field(default_factory=list)
    version: int = PLAN_VERSION

    def to_dict(self) -> dict:
        return {
            "schema": PLAN_SCHEMA,
            "version": self.version,
            "name": self.name,
            "config": self.config,
            "solver": self.solver,
            "cost": self.cost.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
            "baselines": self.baselines,
            "stages": self.stages,
            "schedule": self.schedule,
            "resharding": self.resharding,
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
                d["name"], d["config"], d["solver"], CostBreakdown.from_dict(d["cost"]),
                [LayerPlan.from_dict(x) for x in d["layers"]], d.get("baselines", {}),
                d.get("stages", []), d.get("schedule"), d.get("resharding", []), d["version"],
            )
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
        if self.schedule and "step_s" in self.schedule:
            return float(self.schedule["step_s"])
        if self.schedule and self.schedule.get("makespan_s") is not None:
            return float(self.schedule["makespan_s"])  # a schedule written without it
        return self.cost.total_s



def baseline_seconds(block: dict) -> float:
    """A baseline's seconds per step as ratios compare them: a pipelined baseline's
    latency (``pipeline_s``), else its cost breakdown's total."""
    if "pipeline_s" in block:
        return number(block["pipeline_s"])
    return CostBreakdown.from_dict(block).total_s

