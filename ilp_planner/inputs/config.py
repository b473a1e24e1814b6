"""YAML configuration files → typed objects (:class:`Config`).

A configuration names one planning problem: a model (built-in builder or an explicit layer
graph), a cluster, the training memory model, and solver / pipeline options. Reference::

    name: gpt-2.6b-2x4            # optional; defaults to the file stem
    model:
      kind: gpt                   # mlp | gpt | u_transformer | vgg13 | graph | torch
      # gpt:           hidden, layers, heads, seq_len, vocab, batch       (all required)
      # u_transformer: hidden, layers (even), heads, seq_len, batch       (all required)
      # mlp:           dims: [d0, d1, ..], batch (required); bias (false)
      # vgg13:         batch (required); image (224, divisible by 32), classes (1000),
      #                channels ([64, 128, 256, 512, 512]: one width per block), hidden (4096)
      # every builder: dtype (float32 | float16 | bfloat16 | float64; default float32)
      # graph:         ops: [ {name, kind, inputs: [..], shape: [..], dtype?, weight: [..]?,
      #                        params?, flops?, block?, block_index?, attrs?: {..}} ],
      #                name?, dtype?       (see ilp_planner.inputs.models.graph_from_spec)
      # torch:         module: "mypkg.models:GPT" (importable "module:attribute"), kwargs: {..},
      #                example_inputs: {name: {shape: [..], dtype: int64, high: 50304}} or a
      #                list of such specs (int tensors draw ids in [0, high)); the module is
      #                built and traced on the meta device (no memory) and imported
      #                (ilp_planner.inputs.importer.from_module)
      hidden: 2560
      layers: 32
      heads: 32
      seq_len: 2048
      vocab: 51200
      batch: 32
      dtype: float16
    cluster:
      nodes: 2
      devices_per_node: 4
      memory_gib: 16              # per device, GiB = 2^30 bytes
      peak_tflops: 125            # per device
      efficiency: 0.5             # optional, achieved / peak FLOP/s, in (0, 1]
      name: aws-p3               # optional
      links:                      # both levels required, even on one-device nodes
        intra: {latency_us: 5, bandwidth_gbps: 1200}   # Gbit/s; or {alpha: s, beta: s/byte}
        inter: {latency_us: 10, bandwidth_gbps: 10}
    training:                     # optional
      optimizer: adam_mixed       # a cost_model.OPTIMIZER_PRESETS name; default adam_mixed
                                  # for float16/bfloat16 models, adam otherwise
      bytes_per_param: {weight: 2, grad: 2, optimizer: 12}   # optional, overrides the preset
      grad_bucket_mb: 25          # optional, MiB per fused gradient AllReduce (DDP's default);
                                  # 0: one AllReduce per op and set of partial axes
    solver:                       # optional, SolverOptions fields
      time_limit_s: 60
      tie_layers: true
      elimination: true           # exact DP (variable elimination) first; false: the ILP alone
      gap: 0                      # relative optimality gap accepted as optimal (0.001 = 0.1 %)
      max_weight_replication: null
      max_axes: 3
      threads: 1
      seed: 0
      fallback: coordinate_descent   # | metropolis_hastings | random
      milp: scip                  # | cbc: the ILP's solver (SCIP in-process via OR-Tools;
                                  # cbc = PuLP's bundled CBC in a subprocess, the reference)
      state_sharding: [0]         # ZeRO levels the ILP may pick per weighted op: 0 none,
                                  # 1 optimizer state, 2 + gradients, 3 + weights (FSDP)
      recompute: never            # | auto (the planner picks how many blocks recompute)
                                  # | always (every block's activations recomputed)
    pipeline:                     # optional, PipelineOptions fields
      stages: 1                   # 1 (no pipelining) | N | auto
      microbatches: 1             # must divide model.batch
      schedule: 1f1b              # gpipe | 1f1b | eager-1f1b
      submeshes: [[1, 4], [1, 4]] # optional (nodes, devices) per stage; one per stage
      imbalance_tolerance: null
      overlap: true
      submesh_space: all          # | power_of_two | small_power_of_two (Alpa's shape spaces)
      max_units: null             # null: one layer unit per block; N: coarsen to ≤ N units
      stage_time_limit_s: null    # per stage ILP; null: min(solver.time_limit_s, 10)
      stage_bound: true           # skip or stop stage solves proven slower than a plan in hand (exact)

Rules: unknown keys are errors (the message lists the allowed ones), so a typo never falls
back to a default silently; missing required keys, wrong types, non-positive sizes and unknown
kinds, dtypes, optimizers and schedules are errors; YAML syntax errors and duplicated keys
are errors. Every error is a :class:`~ilp_planner.errors.ConfigError` naming the file, the
dotted key path and what was expected. Number fields also accept ``1e-6``-style strings
(PyYAML reads exponents without a dot as strings).

A :class:`Config` keeps the parsed document (``raw``) so a sweep can set dotted keys
(:func:`apply_overrides`, :meth:`Config.with_overrides`) and re-parse with full validation.

From Python, ``model`` may also be a :class:`~ilp_planner.ir.graph.Graph` object (an imported
model, say) — ``raw`` then holds its explicit ``kind: graph`` form, so plans still
round-trip — and every other section may be its object (:class:`Cluster`,
:class:`MemorySpec`, :class:`SolverOptions`, :class:`PipelineOptions`) instead of a mapping.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.files import read_input
from ilp_planner.inputs.importer import from_module
from ilp_planner.inputs.limits import check_limit
from ilp_planner.inputs.options import FALLBACKS, MILPS, RECOMPUTE, SCHEDULES, PipelineOptions, SolverOptions
from ilp_planner.inputs.schema import Reader, join
from ilp_planner.ir.cluster import SUBMESH_SPACES, Cluster, Link, submesh_shapes
from ilp_planner.ir.graph import Graph
from ilp_planner.lowering.cost_model import OPTIMIZER_PRESETS, MemorySpec
from ilp_planner.lowering.grad_buckets import DDP_BUCKET_MB
from ilp_planner.lowering.strategies import ZERO_LEVELS

MODEL_KINDS = ("mlp", "gpt", "u_transformer", "vgg13", "graph", "torch")
MODEL_DTYPES = ("float32", "float16", "bfloat16", "float64")

# kind -> (required keys, optional keys with defaults); "kind" itself is always allowed.
_BUILDER_SCHEMA: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "mlp": (("dims", "batch"), {"bias": False, "dtype": "float32"}),
    "gpt": (("hidden", "layers", "heads", "seq_len", "vocab", "batch"), {"dtype": "float32"}),
    "u_transformer": (("hidden", "layers", "heads", "seq_len", "batch"), {"dtype": "float32"}),
    "vgg13": (("batch",), {"image": 224, "classes": 1000, "dtype": "float32",
                           "channels": models.VGG13_WIDTHS, "hidden": models.VGG13_HIDDEN}),
}
_BUILDERS = {
    "mlp": models.mlp,
    "gpt": models.gpt,
    "u_transformer": models.u_transformer,
    "vgg13": models.vgg13,
}
_GIB = 2**30


@dataclass(frozen=True)
class Config:
    """One planning problem read from YAML.

    ``model`` is the raw ``model:`` mapping and ``raw`` the whole parsed document, both plain
    dicts (deep copies), so sweeps can vary any key and re-parse via :meth:`with_overrides`.
    """

    name: str
    graph: Graph
    model: dict
    cluster: Cluster
    memory: MemorySpec
    solver: SolverOptions
    pipeline: PipelineOptions
    source: str | None
    raw: dict
    grad_bucket_bytes: float = DDP_BUCKET_MB * 2**20

    def with_overrides(self, overrides: Mapping[str, Any]) -> Config:
        """Re-parse ``raw`` with dotted keys set, e.g. ``{"cluster.nodes": 4}``."""
        return parse_config(apply_overrides(self.raw, overrides), self.source)

    def microbatch_graph(self) -> Graph:
        """The graph of one micro-batch (``model.batch / pipeline.microbatches``): what is
        live at once under gradient accumulation or pipelining."""
        m = self.pipeline.microbatches
        if m == 1:
            return self.graph
        if "batch" not in self.model:
            raise ConfigError("micro-batching needs a model with a batch size (a builder, not "
                              "an explicit graph)", source=self.source, key="pipeline.microbatches")
        return self.with_overrides({"model.batch": self.model["batch"] // m,
                                    "pipeline.microbatches": 1}).graph


# -- entry points ---------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML keeps the last one
    silently, which hides copy-paste mistakes in cluster or model sections)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """Read one YAML document; a missing, unreadable, oversized, non-UTF-8, malformed
    (duplicate keys included) or empty file raises :class:`ConfigError` naming the file and
    the line."""
    source = str(path)
    text = read_input(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", source=source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML: {where}{problem}", source=source) from None
    if data is None:
        raise ConfigError("the file is empty", source=source)
    return data


def load_config(source: str | Path | Mapping[str, Any]) -> Config:
    """Read and validate one YAML configuration file, or a document given as a mapping
    (whose ``model`` may be a :class:`Graph` object and whose sections may be objects)."""
    if isinstance(source, Mapping):
        return parse_config(source)
    return parse_config(read_yaml(source), str(source))


def section_mapping(value: Any) -> Any:
    """A section given as its object (:class:`Cluster`, :class:`MemorySpec`,
    :class:`SolverOptions`, :class:`PipelineOptions`) in the schema's mapping form, so that
    it validates like YAML and the plan records it; anything else unchanged."""
    if isinstance(value, Cluster):
        return {"nodes": value.nodes, "devices_per_node": value.devices_per_node,
                "memory_gib": value.memory_bytes / _GIB, "peak_tflops": value.peak_flops / 1e12,
                "efficiency": value.efficiency, "name": value.name,
                "links": {"intra": {"alpha": value.intra.alpha, "beta": value.intra.beta},
                          "inter": {"alpha": value.inter.alpha, "beta": value.inter.beta}}}
    if isinstance(value, MemorySpec):
        return {"bytes_per_param": {"weight": value.weight_bytes, "grad": value.grad_bytes,
                                    "optimizer": value.optimizer_bytes}}
    if isinstance(value, (SolverOptions, PipelineOptions)):
        out = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        if "submeshes" in out:
            out["submeshes"] = [list(s) for s in out["submeshes"]]
        return out
    return value


def parse_config(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed document (see the module docstring for the schema)."""
    r = Reader(source)
    top = r.mapping(data, "", required=("model", "cluster"),
                    optional=("name", "training", "solver", "pipeline"))
    top = {k: section_mapping(v) for k, v in top.items()}
    graph, dtype, batch = _parse_model(r, top["model"])
    if isinstance(top["model"], Graph):
        top["model"] = models.graph_to_spec(graph)
    cluster = _parse_cluster(r, top["cluster"])
    memory, bucket_bytes = _parse_training(r, top.get("training"), dtype)
    solver = _parse_solver(r, top.get("solver"))
    pipeline = _parse_pipeline(r, top.get("pipeline"), cluster, batch)
    if "name" in top:
        name = r.string(top["name"], "name")
    else:
        name = Path(source).stem if source else graph.name
    return Config(name, graph, copy.deepcopy(dict(top["model"])), cluster, memory, solver,
                  pipeline, source, copy.deepcopy(dict(top)), bucket_bytes)


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """A deep copy of ``data`` with each dotted key (``cluster.links.inter.bandwidth_gbps``)
    set; missing intermediate mappings are created (validation happens on re-parse)."""
    out = copy.deepcopy(dict(data))
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"cannot set {dotted!r}: {'.'.join(parts[:i + 1])!r} is not a "
                                  f"mapping", key=dotted)
            node = nxt
        node[parts[-1]] = copy.deepcopy(value)
    return out


# -- sections ---------------------------------------------------------------------------------


def _section(r: Reader, value: Any, path: str, optional: tuple[str, ...]) -> dict[str, Any]:
    """An optional top-level section: absent or empty (``solver:``) means all defaults."""
    return {} if value is None else r.mapping(value, path, optional=optional)


def _parse_model(r: Reader, value: Any) -> tuple[Graph, str, int | None]:
    """The model's graph, its dtype and its batch size (None for explicit graphs)."""
    if isinstance(value, Graph):
        return value, _graph_dtype(value), None
    if not isinstance(value, Mapping):
        r.fail("model", f"expected a mapping with a 'kind' key, got {value!r}")
    if "kind" not in value:
        r.fail("model.kind", f"missing required key 'kind'; expected one of: "
                             f"{', '.join(MODEL_KINDS)}")
    kind = r.choice(value["kind"], "model.kind", MODEL_KINDS, "model kind")
    if kind == "graph":
        graph = models.graph_from_spec(value, r.source, key="model")
        return graph, str(value.get("dtype", "float32")), None
    if kind == "torch":
        graph = _parse_torch_model(r, value)
        return graph, _graph_dtype(graph), None

    required, defaults = _BUILDER_SCHEMA[kind]
    d = r.mapping(value, "model", required=("kind",) + required, optional=tuple(defaults))
    kw: dict[str, Any] = {}
    for key in required + tuple(k for k in defaults if k in d):
        path = join("model", key)
        v = d[key]
        if key == "dims":
            dims = r.sequence(v, path, min_len=2)
            check_limit("layers", len(dims), "the number of MLP dims", source=r.source, key=path)
            kw[key] = [r.positive_int(x, join(path, i)) for i, x in enumerate(dims)]
            for i, x in enumerate(kw[key]):
                check_limit("dim", x, "a model size", source=r.source, key=join(path, i))
        elif key == "channels":
            widths = r.sequence(v, path)
            if len(widths) != len(models.VGG13_WIDTHS):
                r.fail(path, f"expected {len(models.VGG13_WIDTHS)} widths (one per VGG13 block), "
                             f"got {len(widths)}")
            kw[key] = [r.positive_int(x, join(path, i)) for i, x in enumerate(widths)]
            for i, x in enumerate(kw[key]):
                check_limit("dim", x, "a model size", source=r.source, key=join(path, i))
        elif key == "bias":
            kw[key] = r.boolean(v, path)
        elif key == "dtype":
            kw[key] = r.choice(v, path, MODEL_DTYPES, "dtype")
        else:
            kw[key] = r.positive_int(v, path)
            check_limit("layers" if key == "layers" else "dim", kw[key],
                        "the number of layers" if key == "layers" else "a model size",
                        source=r.source, key=path)
    if "heads" in kw and kw["hidden"] % kw["heads"]:
        r.fail("model.heads", f"hidden size {kw['hidden']} is not divisible by "
                              f"{kw['heads']} heads")
    if kind == "u_transformer" and kw["layers"] % 2:
        r.fail("model.layers", f"a U-Transformer needs an even number of layers, "
                               f"got {kw['layers']}")
    if kind == "vgg13" and kw.get("image", 224) % 32:
        r.fail("model.image", f"VGG13 needs an image size divisible by 32, got {kw['image']}")
    try:
        graph = _BUILDERS[kind](**kw)
    except ConfigError as exc:  # builders name bare keys; re-anchor them under model.
        key = exc.key or ""
        msg = str(exc)[len(key) + 2:] if key and str(exc).startswith(key + ": ") else str(exc)
        key = key if key.startswith("model") else join("model", key) if key else "model"
        raise ConfigError(msg, source=r.source, key=key) from None
    return graph, kw.get("dtype", "float32"), kw["batch"]


def _graph_dtype(graph: Graph) -> str:
    """The compute dtype of a graph given as an object: its first floating-point tensor's."""
    return next((op.output.dtype for op in graph.ops if op.output.dtype.startswith(("float",
                                                                                      "bfloat"))),
                "float32")


_TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")


def _parse_torch_model(r: Reader, value: Mapping[str, Any]) -> Graph:
    """``kind: torch``: import ``module`` (``"pkg.mod:Class"``), build it with ``kwargs`` on
    the meta device and trace it on ``example_inputs`` (:func:`ilp_planner.inputs.importer.
    from_module`)."""
    d = r.mapping(value, "model", required=("kind", "module", "example_inputs"),
                  optional=("kwargs", "name"))
    target = r.string(d["module"], "model.module")
    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        r.fail("model.module", f"expected 'package.module:Class', got {target!r}")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        r.fail("model.module", f"cannot import {target!r}: {exc}")
    kwargs = d.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        r.fail("model.kwargs", f"expected a mapping of constructor arguments, got {kwargs!r}")
    raw_inputs = d["example_inputs"]
    named = isinstance(raw_inputs, Mapping)
    items = list(raw_inputs.items()) if named else list(enumerate(
        r.sequence(raw_inputs, "model.example_inputs", min_len=1)))
    specs = []
    for key, spec in items:
        path = join("model.example_inputs", key)
        t = r.mapping(spec, path, required=("shape",), optional=("dtype", "high"))
        shape = r.shape(t["shape"], join(path, "shape"))
        dtype = r.choice(t.get("dtype", "float32"), join(path, "dtype"), _TORCH_DTYPES, "dtype")
        high = r.positive_int(t["high"], join(path, "high")) if "high" in t else 2
        specs.append((key, shape, dtype, high))

    import torch


    def tensor(shape: tuple[int, ...], dtype: str, high: int) -> torch.Tensor:
        if dtype.startswith("int"):
            return torch.randint(0, high, shape, dtype=getattr(torch, dtype), device="meta")
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")

    inputs = {k: tensor(*rest) for k, *rest in specs} if named else \
        tuple(tensor(*rest) for _, *rest in specs)
    try:
        with torch.device("meta"):
            module = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - any constructor failure is the config's
        r.fail("model.kwargs", f"{target}(**kwargs) failed: {type(exc).__name__}: {exc}")
    name = r.string(d["name"], "model.name") if "name" in d else attr
    try:
        return from_module(module, inputs, name=name)
    except ConfigError as exc:
        raise ConfigError(str(exc), source=r.source, key="model.module") from None


def _parse_link(r: Reader, value: Any, path: str) -> Link:
    """``{latency_us, bandwidth_gbps}`` (Gbit/s) or ``{alpha, beta}`` (s, s/byte)."""
    d = r.mapping(value, path, optional=("latency_us", "bandwidth_gbps", "alpha", "beta"))
    physical = [k for k in ("latency_us", "bandwidth_gbps") if k in d]
    fitted = [k for k in ("alpha", "beta") if k in d]
    if physical and fitted:
        r.fail(path, f"give either latency_us + bandwidth_gbps or alpha + beta, not both "
                     f"(got {', '.join(physical + fitted)})")
    if fitted:
        for k in ("alpha", "beta"):
            if k not in d:
                r.fail(join(path, k), f"missing required key {k!r} (alpha and beta go together)")
        return Link(alpha=r.number(d["alpha"], join(path, "alpha"), nonneg=True),
                    beta=r.number(d["beta"], join(path, "beta"), positive=True))
    for k in ("latency_us", "bandwidth_gbps"):
        if k not in d:
            r.fail(join(path, k), f"missing required key {k!r} (expected latency_us and "
                                  f"bandwidth_gbps, or alpha and beta)")
    return Link.from_bandwidth(
        r.number(d["latency_us"], join(path, "latency_us"), nonneg=True, at_most=_PHYSICAL_MAX),
        r.number(d["bandwidth_gbps"], join(path, "bandwidth_gbps"), positive=True,
                 at_most=_PHYSICAL_MAX),
    )


# No device has 10^9 GiB, 10^9 TFLOP/s or 10^9 Gbit/s links, and no link 10^9 µs of latency:
# beyond this a figure is a typo, and it would overflow the memory row or underflow β to 0.
_PHYSICAL_MAX = 1e9


def _parse_cluster(r: Reader, value: Any) -> Cluster:
    d = r.mapping(value, "cluster",
                  required=("nodes", "devices_per_node", "memory_gib", "peak_tflops", "links"),
                  optional=("efficiency", "name"))
    nodes = r.positive_int(d["nodes"], "cluster.nodes")
    per_node = r.positive_int(d["devices_per_node"], "cluster.devices_per_node")
    check_limit("devices", nodes * per_node, "the number of devices (nodes × devices_per_node)",
                source=r.source, key="cluster.nodes")
    memory = r.number(d["memory_gib"], "cluster.memory_gib", positive=True,
                      at_most=_PHYSICAL_MAX) * _GIB
    peak = r.number(d["peak_tflops"], "cluster.peak_tflops", positive=True,
                    at_most=_PHYSICAL_MAX) * 1e12
    efficiency = 0.5
    if "efficiency" in d:
        efficiency = r.number(d["efficiency"], "cluster.efficiency", positive=True, at_most=1.0)
    links = r.mapping(d["links"], "cluster.links", required=("intra", "inter"))
    intra = _parse_link(r, links["intra"], "cluster.links.intra")
    inter = _parse_link(r, links["inter"], "cluster.links.inter")
    name = r.string(d["name"], "cluster.name") if "name" in d else f"{nodes}x{per_node}"
    return Cluster(nodes, per_node, memory, peak, intra, inter, efficiency, name)


def _parse_training(r: Reader, value: Any, dtype: str) -> tuple[MemorySpec, float]:
    """Bytes per parameter, and the gradient bucket cap in bytes."""
    d = _section(r, value, "training", ("optimizer", "bytes_per_param", "grad_bucket_mb"))
    default = "adam_mixed" if dtype in ("float16", "bfloat16") else "adam"
    optimizer = r.choice(d.get("optimizer", default), "training.optimizer",
                         OPTIMIZER_PRESETS, "optimizer")
    weight, grad, opt_state = OPTIMIZER_PRESETS[optimizer]
    if d.get("bytes_per_param") is not None:
        path = "training.bytes_per_param"
        b = r.mapping(d["bytes_per_param"], path, optional=("weight", "grad", "optimizer"))
        if "weight" in b:
            weight = r.number(b["weight"], join(path, "weight"), positive=True)
        if "grad" in b:
            grad = r.number(b["grad"], join(path, "grad"), positive=True)
        if "optimizer" in b:
            opt_state = r.number(b["optimizer"], join(path, "optimizer"), nonneg=True)
    bucket_mb = DDP_BUCKET_MB
    if d.get("grad_bucket_mb") is not None:
        bucket_mb = r.number(d["grad_bucket_mb"], "training.grad_bucket_mb", nonneg=True)
        if bucket_mb > 2**20:
            r.fail("training.grad_bucket_mb", f"{bucket_mb} MiB is beyond any device's memory; "
                   f"expected a bucket size in MiB, e.g. 25")
    return MemorySpec(weight, grad, opt_state), bucket_mb * 2**20


def _parse_solver(r: Reader, value: Any) -> SolverOptions:
    d = _section(r, value, "solver", ("time_limit_s", "tie_layers", "max_weight_replication",
                                      "max_axes", "threads", "seed", "fallback",
                                      "elimination", "gap", "milp", "state_sharding",
                                      "recompute"))
    kw: dict[str, Any] = {}
    if "time_limit_s" in d:
        kw["time_limit_s"] = r.number(d["time_limit_s"], "solver.time_limit_s", positive=True)
    if "tie_layers" in d:
        kw["tie_layers"] = r.boolean(d["tie_layers"], "solver.tie_layers")
    if "elimination" in d:
        kw["elimination"] = r.boolean(d["elimination"], "solver.elimination")
    if "gap" in d:
        kw["gap"] = r.number(d["gap"], "solver.gap", nonneg=True, at_most=1)
    if d.get("max_weight_replication") is not None:
        kw["max_weight_replication"] = r.positive_int(d["max_weight_replication"],
                                                      "solver.max_weight_replication")
    for key in ("max_axes", "threads"):
        if key in d:
            kw[key] = r.positive_int(d[key], join("solver", key))
    if "seed" in d:
        kw["seed"] = r.nonneg_int(d["seed"], "solver.seed")
    if "fallback" in d:
        kw["fallback"] = r.choice(d["fallback"], "solver.fallback", FALLBACKS, "fallback")
    if "milp" in d:
        kw["milp"] = r.choice(d["milp"], "solver.milp", MILPS, "MILP solver")
    if "state_sharding" in d:
        levels = d["state_sharding"]
        if not isinstance(levels, list) or not levels or any(
                isinstance(z, bool) or z not in ZERO_LEVELS for z in levels):
            r.fail("solver.state_sharding", f"expected a non-empty list of ZeRO levels from "
                   f"{list(ZERO_LEVELS)}, got {levels!r}")
        kw["state_sharding"] = tuple(sorted(set(levels) | {0}))
    if "recompute" in d:
        kw["recompute"] = r.choice(d["recompute"], "solver.recompute", RECOMPUTE,
                                   "recomputation policy")
    return SolverOptions(**kw)


def _parse_pipeline(r: Reader, value: Any, cluster: Cluster, batch: int | None) -> PipelineOptions:
    d = _section(r, value, "pipeline", ("stages", "microbatches", "schedule", "submeshes",
                                        "imbalance_tolerance", "overlap", "submesh_space",
                                        "max_units", "stage_time_limit_s", "stage_bound"))
    kw: dict[str, Any] = {}
    if "stages" in d:
        stages = d["stages"]
        if stages != "auto":
            if isinstance(stages, str) or isinstance(stages, bool) or not isinstance(stages, int):
                r.fail("pipeline.stages", f"expected a positive integer or 'auto', got {stages!r}")
            stages = r.positive_int(stages, "pipeline.stages")
            if stages > cluster.num_devices:
                r.fail("pipeline.stages", f"{stages} stages need at least {stages} devices; the "
                                          f"cluster has {cluster.num_devices}")
        kw["stages"] = stages
    if "microbatches" in d:
        m = r.positive_int(d["microbatches"], "pipeline.microbatches")
        check_limit("microbatches", m, "the number of micro-batches", source=r.source,
                    key="pipeline.microbatches")
        if batch is not None and batch % m:
            r.fail("pipeline.microbatches", f"model.batch {batch} is not divisible by {m} "
                                            f"micro-batches")
        kw["microbatches"] = m
    if "schedule" in d:
        kw["schedule"] = r.choice(d["schedule"], "pipeline.schedule", SCHEDULES, "schedule")
    if d.get("submeshes") is not None:
        kw["submeshes"] = _parse_submeshes(r, d["submeshes"], cluster, kw.get("stages", 1))
    if d.get("imbalance_tolerance") is not None:
        kw["imbalance_tolerance"] = r.number(d["imbalance_tolerance"],
                                             "pipeline.imbalance_tolerance", nonneg=True)
    if "overlap" in d:
        kw["overlap"] = r.boolean(d["overlap"], "pipeline.overlap")
    if "submesh_space" in d:
        kw["submesh_space"] = r.choice(d["submesh_space"], "pipeline.submesh_space",
                                       SUBMESH_SPACES, "sub-mesh space")
    if d.get("max_units") is not None:
        kw["max_units"] = r.positive_int(d["max_units"], "pipeline.max_units")
    if d.get("stage_time_limit_s") is not None:
        kw["stage_time_limit_s"] = r.number(d["stage_time_limit_s"], "pipeline.stage_time_limit_s",
                                            positive=True)
    if "stage_bound" in d:
        kw["stage_bound"] = r.boolean(d["stage_bound"], "pipeline.stage_bound")
    return PipelineOptions(**kw)


def _parse_submeshes(r: Reader, value: Any, cluster: Cluster,
                     stages: int | str) -> tuple[tuple[int, int], ...]:
    """Stage sub-mesh shapes: Alpa's ``(1, d)`` with ``d | devices_per_node`` or
    ``(n, devices_per_node)``; together no more devices than the cluster has."""
    path = "pipeline.submeshes"
    items = r.sequence(value, path, min_len=1)
    allowed = submesh_shapes(cluster.nodes, cluster.devices_per_node)
    out = []
    for i, item in enumerate(items):
        p = join(path, i)
        pair = r.sequence(item, p)
        if len(pair) != 2:
            r.fail(p, f"expected [nodes, devices_per_node], got {item!r}")
        shape = (r.positive_int(pair[0], join(p, 0)), r.positive_int(pair[1], join(p, 1)))
        if shape not in allowed:
            r.fail(p, f"sub-mesh {list(shape)} is not usable on a {cluster.nodes}x"
                      f"{cluster.devices_per_node} cluster; allowed: "
                      f"{', '.join(str(list(s)) for s in allowed)}")
        out.append(shape)
    total = sum(n * dev for n, dev in out)
    if total > cluster.num_devices:
        r.fail(path, f"the sub-meshes use {total} devices; the cluster has {cluster.num_devices}")
    if isinstance(stages, int) and len(out) != stages:
        r.fail(path, f"{len(out)} sub-meshes given for {stages} stages (pipeline.stages)")
    return tuple(out)
