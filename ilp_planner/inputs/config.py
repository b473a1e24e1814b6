"""YAML configuration files → typed objects (:class:`Config`).

A configuration names one planning problem: a model (built-in builder or an explicit layer
graph), a cluster, the training memory model, and solver / pipeline options, e.g.::

    name: gpt-2.6b-2x4            # optional; defaults to the file stem
    model: {kind: gpt, hidden: 2560, layers: 32, heads: 32, seq_len: 2048, vocab: 51200,
            batch: 32, dtype: float16}
    cluster:
      nodes: 2
      devices_per_node: 4
      memory_gib: 16
      peak_tflops: 125
      links:
        intra: {latency_us: 5, bandwidth_gbps: 1200}
        inter: {latency_us: 10, bandwidth_gbps: 10}
    solver: {time_limit_s: 60}
    pipeline: {stages: auto, microbatches: 4}

or, by catalogue names (:mod:`ilp_planner.ir.device`, :mod:`ilp_planner.ir.links`), any raw
number given beside them overriding the figure it names::

    cluster: {gpu: a100-80gb, nodes: 16, devices_per_node: 8, intra: nvlink3,
              inter: 8x-ib-hdr200}

Every key, its type, default and meaning is declared once, in
:data:`ilp_planner.inputs.config_keys.SECTIONS`; this module's parsers read the allowed keys
and the plain values' checks from there, and
:func:`ilp_planner.inputs.config_keys.reference_markdown` prints the reference. What the
table cannot say is checked here: a model kind's cross-key rules (heads divide hidden, a
U-Transformer's even layers, VGG13's image divisible by 32), links given either physically or
fitted, ZeRO levels, stages against the cluster, micro-batches dividing the batch, sub-mesh
shapes.

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
import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config_keys import BUILDERS, MODEL_KINDS, SECTIONS, model_section
from ilp_planner.inputs.files import read_input
from ilp_planner.inputs.given_config import GivenConfig, ModelFacts, parse_given, resolve_given
from ilp_planner.inputs.importer import from_module
from ilp_planner.inputs.limits import check_limit
from ilp_planner.inputs.options import PipelineOptions, SolverOptions
from ilp_planner.inputs.schema import Reader, join
from ilp_planner.ir.cluster import Cluster, Link, submesh_shapes
from ilp_planner.ir.device import ComputeFit, DeviceSpec, device_names, device_spec
from ilp_planner.ir.graph import HALF_DTYPES, Graph
from ilp_planner.ir.links import catalogue_link, link_names
from ilp_planner.lowering.cost_model import OPTIMIZER_PRESETS, MemorySpec
from ilp_planner.lowering.grad_buckets import DDP_BUCKET_MB
from ilp_planner.lowering.strategies import ZERO_LEVELS

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
    compare: tuple[GivenConfig, ...] = ()  # configurations priced beside the plan

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
                                    "pipeline.microbatches": 1, "compare": None}).graph


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
        return _cluster_mapping(value)
    if isinstance(value, MemorySpec):
        return {"bytes_per_param": {"weight": value.weight_bytes, "grad": value.grad_bytes,
                                    "optimizer": value.optimizer_bytes}}
    if isinstance(value, (SolverOptions, PipelineOptions)):
        out = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        if "submeshes" in out:
            out["submeshes"] = [list(s) for s in out["submeshes"]]
        return out
    return value


def _cluster_mapping(c: Cluster) -> dict[str, Any]:
    """A :class:`Cluster` as its section: every figure as a number (so it parses back to
    the same cluster whatever the model's dtype), plus its catalogue device's name and its
    collective model; a launch cost only where a link has one (older readers' form
    otherwise)."""
    def link(x: Link) -> dict[str, float]:
        return {"alpha": x.alpha, "beta": x.beta, **({"launch": x.launch} if x.launch else {})}

    out = {"nodes": c.nodes, "devices_per_node": c.devices_per_node,
           "memory_gib": c.memory_bytes / _GIB, "peak_tflops": c.peak_flops / 1e12,
           "efficiency": c.efficiency, "name": c.name,
           "links": {"intra": link(c.intra), "inter": link(c.inter)}}
    if c.device is not None:
        out.update(_device_mapping(c.device))
    if c.collectives != "ring":
        out["collectives"] = c.collectives
    return out


def _device_mapping(device: DeviceSpec) -> dict[str, Any]:
    """A cluster's device as ``gpu`` (where the catalogue knows its name) and ``compute``:
    its roofline figures, only those that are not the catalogue entry's (a figure written
    back in other units would not parse to the very same float; the section's one peak
    would override the per-dtype ones)."""
    try:
        base = device_spec(device.name)
    except ConfigError:
        return {"compute": compute_mapping(device)}
    mine, theirs = compute_mapping(device), compute_mapping(base)
    if base.peak_flops == device.peak_flops:
        del mine["peak_tflops"]
    differ = {k: v for k, v in mine.items() if v != theirs[k]}
    return {"gpu": device.name, **({"compute": differ} if differ else {})}


def parse_config(data: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a parsed document (see the module docstring for the schema)."""
    r = Reader(source)
    top = r.section(data, "", SECTIONS["top level"])
    top = {k: section_mapping(v) for k, v in top.items()}
    graph, dtype, batch = _parse_model(r, top["model"])
    if isinstance(top["model"], Graph):
        top["model"] = models.graph_to_spec(graph)
    cluster = _parse_cluster(r, top["cluster"], dtype)
    own = dtype in HALF_DTYPES and any(op.attrs.get("own_precision") for op in graph.ops)
    memory, bucket_bytes = _parse_training(r, top.get("training"), dtype, own)
    solver = _parse_solver(r, top.get("solver"))
    pipeline = _parse_pipeline(r, top.get("pipeline"), cluster, batch)
    compare = _parse_compare(r, top.get("compare"), graph, cluster, batch)
    if "name" in top:
        name = r.read(SECTIONS["top level"]["name"], top["name"], "name")
    else:
        name = Path(source).stem if source else graph.name
    return Config(name, graph, copy.deepcopy(dict(top["model"])), cluster, memory, solver,
                  pipeline, source, copy.deepcopy(dict(top)), bucket_bytes, compare)


def _parse_compare(r: Reader, value: Any, graph: Graph, cluster: Cluster,
                   batch: int | None) -> tuple[GivenConfig, ...]:
    """``compare:``: one configuration string or a list of them, each parsed and checked
    against the model and cluster (:mod:`ilp_planner.inputs.given_config`); errors name
    the item's key path (``compare[1]``)."""
    if value is None:
        return ()
    items = [("compare", value)] if isinstance(value, str) else [
        (f"compare[{i}]", v) for i, v in enumerate(r.sequence(value, "compare"))]
    facts = ModelFacts.of(graph, cluster.nodes, cluster.devices_per_node, batch)
    return tuple(resolve_given(parse_given(v, path, r.source), facts, path, r.source)
                 for path, v in items)


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


def _section(r: Reader, value: Any, path: str) -> dict[str, Any]:
    """An optional top-level section: absent or empty (``solver:``) means all defaults."""
    return {} if value is None else r.section(value, path, SECTIONS[path])


def _read_keys(r: Reader, d: Mapping[str, Any], section: str,
               special: Mapping[str, Callable[[Any, str, dict[str, Any]], Any]] = MappingProxyType({}),
               ) -> dict[str, Any]:
    """The keys ``d`` gives of ``section``, in declaration order: each read as
    :data:`SECTIONS` declares it, or by its ``special`` reader (which also sees the keys read
    before it); a null where the key allows one means its default, so it is left out."""
    kw: dict[str, Any] = {}
    for key, spec in SECTIONS[section].items():
        if key not in d or (spec.null and d[key] is None):
            continue
        path = join(section, key)
        kw[key] = special[key](d[key], path, kw) if key in special else r.read(spec, d[key], path)
    return kw


def _parse_model(r: Reader, value: Any) -> tuple[Graph, str, int | None]:
    """The model's graph, its dtype and its batch size (None for explicit graphs)."""
    if isinstance(value, Graph):
        return value, _graph_dtype(value), None
    if not isinstance(value, Mapping):
        r.fail("model", f"expected a mapping with a 'kind' key, got {value!r}")
    if "kind" not in value:
        r.fail("model.kind", f"missing required key 'kind'; expected one of: "
                             f"{', '.join(MODEL_KINDS)}")
    kind = r.read(SECTIONS["model"]["kind"], value["kind"], "model.kind")
    if kind == "graph":
        graph = models.graph_from_spec(value, r.source, key="model")
        # a plan's record of an imported module states no dtype: its tensors' own
        return graph, str(value["dtype"]) if "dtype" in value else _graph_dtype(graph), None
    if kind == "torch":
        graph = _parse_torch_model(r, value)
        return graph, _graph_dtype(graph), None
    return _parse_builder(r, kind, value)


def _parse_builder(r: Reader, kind: str, value: Mapping[str, Any]) -> tuple[Graph, str, int]:
    """A built-in model: its keys read as declared, the rules across keys checked here so
    the messages name the config's keys, then the builder called."""
    keys = SECTIONS[model_section(kind)]
    d = r.section(value, "model", {**SECTIONS["model"], **keys})
    kw: dict[str, Any] = {}
    for key in (k for k in keys if k in d):
        path = join("model", key)
        if key == "dims":
            dims = r.sequence(d[key], path, min_len=2)
            check_limit("layers", len(dims), "the number of MLP dims", source=r.source, key=path)
            kw[key] = _model_sizes(r, dims, path)
        elif key == "channels":
            widths = r.sequence(d[key], path)
            if len(widths) != len(models.VGG13_WIDTHS):
                r.fail(path, f"expected {len(models.VGG13_WIDTHS)} widths (one per VGG13 block), "
                             f"got {len(widths)}")
            kw[key] = _model_sizes(r, widths, path)
        else:
            kw[key] = r.read(keys[key], d[key], path)
        if keys[key].type == "integer":
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
        graph = BUILDERS[kind](**kw)
    except ConfigError as exc:  # builders name bare keys; re-anchor them under model.
        key = exc.key or ""
        msg = str(exc)[len(key) + 2:] if key and str(exc).startswith(key + ": ") else str(exc)
        key = key if key.startswith("model") else join("model", key) if key else "model"
        raise ConfigError(msg, source=r.source, key=key) from None
    return graph, kw.get("dtype", "float32"), kw["batch"]


def _model_sizes(r: Reader, items: list[Any], path: str) -> list[int]:
    """A list of widths: positive integers, each within the model-size limit."""
    sizes = [r.positive_int(x, join(path, i)) for i, x in enumerate(items)]
    for i, x in enumerate(sizes):
        check_limit("dim", x, "a model size", source=r.source, key=join(path, i))
    return sizes


def _graph_dtype(graph: Graph) -> str:
    """The compute dtype of a graph given as an object: its first floating-point tensor's."""
    return next((op.output.dtype for op in graph.ops if op.output.dtype.startswith(("float",
                                                                                      "bfloat"))),
                "float32")


def _parse_torch_model(r: Reader, value: Mapping[str, Any]) -> Graph:
    """``kind: torch``: import ``module`` (``"pkg.mod:Class"``), build it with ``kwargs`` on
    the meta device and trace it on ``example_inputs`` (:func:`ilp_planner.inputs.importer.
    from_module`)."""
    d = r.section(value, "model", {**SECTIONS["model"], **SECTIONS[model_section("torch")]})
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
    keys = SECTIONS["model.example_inputs[i]"]
    specs = []
    for key, spec in items:
        path = join("model.example_inputs", key)
        t = r.section(spec, path, keys)
        shape = r.shape(t["shape"], join(path, "shape"))
        dtype = r.read(keys["dtype"], t.get("dtype", keys["dtype"].default), join(path, "dtype"))
        high = r.read(keys["high"], t.get("high", keys["high"].default), join(path, "high"))
        specs.append((key, shape, dtype, high))

    import torch


    def tensor(shape: tuple[int, ...], dtype: str, high: int) -> torch.Tensor:
        if dtype.startswith("int"):
            return torch.randint(0, high, shape, dtype=getattr(torch, dtype), device="meta")
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")

    inputs = {k: tensor(*rest) for k, *rest in specs} if named else \
        tuple(tensor(*rest) for _, *rest in specs)
    hf_config = _hf_config_class(factory)
    if hf_config is not None:
        _check_hf_fields(r, hf_config, kwargs)
    try:
        with torch.device("meta"):
            module = factory(**kwargs) if hf_config is None else factory(
                hf_config(**{"use_cache": False, **kwargs}))
    except Exception as exc:  # noqa: BLE001 - any constructor failure is the config's
        call = "(**kwargs)" if hf_config is None else f"({hf_config.__name__}(**kwargs))"
        r.fail("model.kwargs", f"{target}{call} failed: {type(exc).__name__}: {exc}")
    name = r.string(d["name"], "model.name") if "name" in d else attr
    try:
        return from_module(module, inputs, name=name)
    except ConfigError as exc:
        raise ConfigError(str(exc), source=r.source, key="model.module") from None


def _hf_config_class(factory: Any) -> type | None:
    """A Hugging Face model class's configuration class (``GPT2LMHeadModel`` →
    ``GPT2Config``), which its constructor takes instead of keywords; None for any other
    factory. ``model.kwargs`` then are the configuration's fields, with ``use_cache``
    False unless given: a training step keeps no key/value cache."""
    config_class = getattr(factory, "config_class", None)
    if isinstance(factory, type) and isinstance(config_class, type) \
            and hasattr(factory, "from_pretrained"):
        return config_class
    return None


def _check_hf_fields(r: Reader, config_class: type, kwargs: Mapping[str, Any]) -> None:
    """Refuse a ``model.kwargs`` key that is no field of the Hugging Face configuration
    class: the class would keep it as a stray attribute and build its default model (a
    misspelt ``n_layers`` gives GPT-2's 12 layers)."""
    try:
        default = config_class()
    except Exception:  # noqa: BLE001 - a class without defaults is checked by its constructor
        return
    fields = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for key in kwargs:
        if key not in fields:
            near = difflib.get_close_matches(str(key), sorted(fields), n=1)
            r.fail(join("model.kwargs", key),
                   f"not a field of {config_class.__name__}"
                   + (f" (did you mean {near[0]!r}?)" if near else ""))


def _parse_link(r: Reader, value: Any, path: str, base: Link | None = None) -> Link:
    """``{latency_us, bandwidth_gbps}`` (Gbit/s) or ``{alpha, beta}`` (s, s/byte), with an
    optional launch cost (``launch_us``, or ``launch`` in s). Over a catalogue link
    ``base`` (the level is also named by ``cluster.intra`` / ``cluster.inter``) each key
    is optional and replaces the named link's figure."""
    keys = SECTIONS["cluster.links.<intra|inter>"]
    d = r.section(value, path, keys)
    physical = [k for k in ("latency_us", "bandwidth_gbps") if k in d]
    fitted = [k for k in ("alpha", "beta") if k in d]
    if physical and fitted:
        r.fail(path, f"give either latency_us + bandwidth_gbps or alpha + beta, not both "
                     f"(got {', '.join(physical + fitted)})")
    if base is None and fitted:
        for k in ("alpha", "beta"):
            if k not in d:
                r.fail(join(path, k), f"missing required key {k!r} (alpha and beta go together)")
    elif base is None:
        for k in ("latency_us", "bandwidth_gbps"):
            if k not in d:
                r.fail(join(path, k), f"missing required key {k!r} (expected latency_us and "
                                      f"bandwidth_gbps, or alpha and beta)")
    v = {k: r.read(keys[k], d[k], join(path, k)) for k in keys if k in d}
    alpha = v["alpha"] if "alpha" in v else (
        v["latency_us"] * 1e-6 if "latency_us" in v else base.alpha)
    beta = v["beta"] if "beta" in v else (
        8.0 / (v["bandwidth_gbps"] * 1e9) if "bandwidth_gbps" in v else base.beta)
    if "launch" in v and "launch_us" in v:
        r.fail(path, "give either launch_us or launch, not both")
    launch = v["launch"] if "launch" in v else v["launch_us"] * 1e-6 if "launch_us" in v else (
        base.launch if base else 0.0)
    return Link(alpha=alpha, beta=beta, launch=launch)


def _named(r: Reader, d: dict, key: str, lookup: Callable[[str], Any]) -> Any:
    """The catalogue entry ``cluster.<key>`` names (None where the key is absent); an
    unknown name's error lists the valid ones."""
    if key not in d:
        return None
    path = join("cluster", key)
    try:
        return lookup(r.read(SECTIONS["cluster"][key], d[key], path))
    except ConfigError as exc:
        if exc.key:  # already located
            raise
        raise ConfigError(str(exc), source=r.source, key=path) from None


def _parse_links(r: Reader, d: dict) -> tuple[Link, Link]:
    """The intra- and inter-node links: catalogue names (``cluster.intra``,
    ``cluster.inter``), numbers (``cluster.links``), or names with numbers overriding."""
    named = {lvl: _named(r, d, lvl, catalogue_link) for lvl in ("intra", "inter")}
    if "links" not in d and None in named.values():
        r.fail("cluster.links", f"missing required key 'links' (or name both levels: "
                                f"cluster.intra and cluster.inter, from {link_names()})")
    links = r.section(d.get("links", {}), "cluster.links", SECTIONS["cluster.links"])
    out = []
    for lvl in ("intra", "inter"):
        path = join("cluster.links", lvl)
        if lvl not in links and named[lvl] is None:
            r.fail(path, f"missing required key {lvl!r} (or name the link: cluster.{lvl}: "
                         f"one of {link_names()})")
        out.append(_parse_link(r, links[lvl], path, named[lvl]) if lvl in links else named[lvl])
    return out[0], out[1]


def _parse_cluster(r: Reader, value: Any, dtype: str) -> Cluster:
    """The cluster section: a catalogue ``gpu`` sets memory and peak (the peak of the
    model's ``dtype``: tensor-core half precision for float16 / bfloat16, else fp32), raw
    numbers override it; links come from :func:`_parse_links`."""
    keys = SECTIONS["cluster"]
    d = r.section(value, "cluster", keys)
    nodes = r.read(keys["nodes"], d["nodes"], "cluster.nodes")
    per_node = r.read(keys["devices_per_node"], d["devices_per_node"], "cluster.devices_per_node")
    check_limit("devices", nodes * per_node, "the number of devices (nodes × devices_per_node)",
                source=r.source, key="cluster.nodes")
    device = _named(r, d, "gpu", device_spec)
    figures = {}
    for key, scale, default in (("memory_gib", _GIB, device and device.memory_bytes),
                                ("peak_tflops", 1e12, device and device.peak(dtype))):
        path = join("cluster", key)
        if key not in d and device is None:
            r.fail(path, f"missing required key {key!r} (or name a catalogue device: "
                         f"cluster.gpu: one of {device_names()})")
        figures[key] = r.read(keys[key], d[key], path) * scale if key in d else default
    efficiency = r.read(keys["efficiency"], d.get("efficiency", keys["efficiency"].default),
                        "cluster.efficiency")
    intra, inter = _parse_links(r, d)
    named_links = "intra" in d or "inter" in d
    collectives = r.read(keys["collectives"], d["collectives"], "cluster.collectives") \
        if "collectives" in d else ("nccl" if named_links else "ring")
    default_name = f"{nodes}x{per_node}" + (f"-{device.name}" if device else "")
    name = r.read(keys["name"], d["name"], "cluster.name") if "name" in d else default_name
    cluster = Cluster(nodes, per_node, figures["memory_gib"], figures["peak_tflops"], intra,
                      inter, efficiency, name, device, collectives)
    return _with_compute(r, d["compute"], cluster) if "compute" in d else cluster


def parse_cluster(raw: Mapping[str, Any], source: str | None = None) -> Cluster:
    """The cluster of a configuration document alone (a plan's ``config``), without building
    its model. The peak follows the dtype the document states (``model.dtype``, float32
    where absent: a ``torch`` module's own dtype is known to :func:`parse_config` only)."""
    r = Reader(source)
    if not isinstance(raw, Mapping) or "cluster" not in raw:
        r.fail("cluster", "missing required key 'cluster'")
    model = raw.get("model")
    dtype = str(model.get("dtype", "float32")) if isinstance(model, Mapping) else "float32"
    return _parse_cluster(r, section_mapping(raw["cluster"]), dtype)


def parse_links(section: Mapping[str, Any], source: str | None = None) -> tuple[Link, Link]:
    """The intra- and inter-node links of a ``cluster:`` section — names, numbers or both —
    leaving its other keys unread: what a command that needs the links alone takes from a
    cluster file."""
    r = Reader(source)
    if not isinstance(section, Mapping):
        r.fail("cluster", f"expected a mapping, got {section!r}")
    return _parse_links(r, dict(section))


def _with_compute(r: Reader, value: Any, cluster: Cluster) -> Cluster:
    """``cluster.compute``: the roofline's parameters (:class:`ComputeFit`), overriding the
    catalogue device's where the cluster names one, else making a device of the cluster's
    own numbers (its peak for every dtype; ``hbm_gbps`` then required)."""
    path, keys = "cluster.compute", SECTIONS["cluster.compute"]
    d = r.section(value, path, keys)
    got = {k: r.read(keys[k], d[k], join(path, k)) for k in keys if k in d}
    base = cluster.device
    if base is None and "hbm_gbps" not in got:
        r.fail(join(path, "hbm_gbps"), "missing required key 'hbm_gbps' (the cluster names no "
                                       "catalogue device to take its memory bandwidth from)")
    fit = base.fit if base is not None else ComputeFit()
    fit = ComputeFit(got.get("matmul_efficiency", fit.matmul_efficiency),
                     got.get("matmul_half_dim", fit.matmul_half_dim),
                     got.get("memory_efficiency", fit.memory_efficiency),
                     got["kernel_floor_us"] * 1e-6 if "kernel_floor_us" in got
                     else fit.kernel_floor_s, got.get("attention", fit.attention),
                     got["dispatch_us"] * 1e-6 if "dispatch_us" in got else fit.dispatch_s,
                     got["replay_us"] * 1e-6 if "replay_us" in got else fit.replay_s)
    peak = got.get("peak_tflops", cluster.peak_flops / 1e12 if base is None else None)
    peaks = ({dt: peak * 1e12 for dt in ("float32", "float16", "bfloat16")} if peak is not None
             else base.peak_flops)
    hbm = got["hbm_gbps"] * 1e9 if "hbm_gbps" in got else base.hbm_bytes_per_s
    device = DeviceSpec(base.name if base is not None else cluster.name,
                        cluster.memory_bytes, peaks, hbm,
                        base.aliases if base is not None else (), fit)
    return dataclasses.replace(cluster, device=device)


def compute_mapping(device: DeviceSpec) -> dict[str, float | str]:
    """A device's roofline figures as a ``cluster.compute`` section (every dtype at the
    largest peak where they differ: the section has one)."""
    return {"hbm_gbps": device.hbm_bytes_per_s / 1e9,
            "peak_tflops": max(device.peak_flops.values()) / 1e12,
            "matmul_efficiency": device.fit.matmul_efficiency,
            "matmul_half_dim": device.fit.matmul_half_dim,
            "memory_efficiency": device.fit.memory_efficiency,
            "kernel_floor_us": device.fit.kernel_floor_s * 1e6,
            "attention": device.fit.attention,
            "dispatch_us": device.fit.dispatch_s * 1e6,
            "replay_us": device.fit.replay_s * 1e6}


def _parse_training(r: Reader, value: Any, dtype: str,
                    own_precision: bool = False) -> tuple[MemorySpec, float]:
    """Bytes per parameter, and the gradient bucket cap in bytes. ``own_precision``: a
    half-precision module whose parameters train as they are (``attrs.own_precision``),
    whose default optimizer keeps no float32 copy."""
    d = _section(r, value, "training")
    kw = _read_keys(r, d, "training", {"bytes_per_param": lambda v, path, _: _read_keys(
        r, r.section(v, path, SECTIONS[path]), path)})
    optimizer = kw.get("optimizer", "adam_half" if own_precision else "adam_mixed"
                       if dtype in HALF_DTYPES else "adam")
    weight, grad, opt_state = OPTIMIZER_PRESETS[optimizer]
    per_param = kw.get("bytes_per_param", {})
    weight = per_param.get("weight", weight)
    grad = per_param.get("grad", grad)
    opt_state = per_param.get("optimizer", opt_state)
    bucket_mb = kw.get("grad_bucket_mb", SECTIONS["training"]["grad_bucket_mb"].default)
    if bucket_mb > 2**20:
        r.fail("training.grad_bucket_mb", f"{bucket_mb} MiB is beyond any device's memory; "
               f"expected a bucket size in MiB, e.g. 25")
    return MemorySpec(weight, grad, opt_state), bucket_mb * 2**20


def _parse_solver(r: Reader, value: Any) -> SolverOptions:
    d = _section(r, value, "solver")
    return SolverOptions(**_read_keys(r, d, "solver", {"state_sharding": _state_sharding(r)}))


def _state_sharding(r: Reader) -> Callable[[Any, str, dict[str, Any]], tuple[int, ...]]:
    """The reader of ``solver.state_sharding``: ZeRO levels, 0 always among them."""

    def read(levels: Any, path: str, _: dict[str, Any]) -> tuple[int, ...]:
        if not isinstance(levels, list) or not levels or any(
                isinstance(z, bool) or z not in ZERO_LEVELS for z in levels):
            r.fail(path, f"expected a non-empty list of ZeRO levels from "
                   f"{list(ZERO_LEVELS)}, got {levels!r}")
        return tuple(sorted(set(levels) | {0}))

    return read


def _parse_pipeline(r: Reader, value: Any, cluster: Cluster, batch: int | None) -> PipelineOptions:
    d = _section(r, value, "pipeline")

    def stages(value: Any, path: str, _: dict[str, Any]) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, str) or isinstance(value, bool) or not isinstance(value, int):
            r.fail(path, f"expected a positive integer or 'auto', got {value!r}")
        n = r.positive_int(value, path)
        if n > cluster.num_devices:
            r.fail(path, f"{n} stages need at least {n} devices; the cluster has "
                         f"{cluster.num_devices}")
        return n

    def microbatches(value: Any, path: str, _: dict[str, Any]) -> int:
        m = r.read(SECTIONS["pipeline"]["microbatches"], value, path)
        check_limit("microbatches", m, "the number of micro-batches", source=r.source, key=path)
        if batch is not None and batch % m:
            r.fail(path, f"model.batch {batch} is not divisible by {m} micro-batches")
        return m

    def submeshes(value: Any, path: str, kw: dict[str, Any]) -> tuple[tuple[int, int], ...]:
        return _parse_submeshes(r, value, cluster, kw.get("stages", 1))

    kw = _read_keys(r, d, "pipeline", {
        "stages": stages, "microbatches": microbatches, "submeshes": submeshes,
        "virtual_stages": _virtual_stages(r)})
    _check_interleaving(r, kw)
    return PipelineOptions(**kw)


def _virtual_stages(r: Reader) -> Callable[[Any, str, dict[str, Any]], int | str]:
    """The reader of ``pipeline.virtual_stages``: a positive integer or ``auto``."""

    def read(value: Any, path: str, _: dict[str, Any]) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, str) or isinstance(value, bool) or not isinstance(value, int):
            r.fail(path, f"expected a positive integer or 'auto', got {value!r}")
        return r.positive_int(value, path)

    return read


def _check_interleaving(r: Reader, kw: dict[str, Any]) -> None:
    """Interleaved 1F1B's requirements, each named: an integer count of at least 2 only with
    schedule ``interleaved-1f1b``, which needs ``virtual_stages`` ≥ 2 (or auto) and stages.
    (Micro-batches in whole rounds of the stages, Megatron-LM's rule, is the solver's
    check: the micro-batch graph is parsed with one micro-batch.)"""
    v, schedule = kw.get("virtual_stages", 1), kw.get("schedule", "1f1b")
    if isinstance(v, int) and v > 1 and schedule != "interleaved-1f1b":
        r.fail("pipeline.virtual_stages", f"{v} chunks per stage need pipeline.schedule: "
                                          f"interleaved-1f1b (got {schedule}); or use auto")
    if schedule != "interleaved-1f1b":
        return
    if v == 1:
        r.fail("pipeline.virtual_stages", "schedule interleaved-1f1b needs 2 or more model "
                                          "chunks per stage, or auto; got 1")
    if kw.get("stages", 1) == 1:
        r.fail("pipeline.stages", "schedule interleaved-1f1b needs 2 or more stages, or auto")


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
