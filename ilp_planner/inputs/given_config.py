"""A parallel configuration the user already runs, in their engine's own terms.

``"megatron: tp=8 pp=8 dp=16 vpp=2 mbs=1 recompute=full sp=true"`` or
``"torchtitan: fsdp=32 tp=8 pp=1 ac=selective"`` (``solve --compare``, the config's
``compare:`` list) becomes a :class:`GivenConfig`, checked against the model and the
cluster it is to be priced on (:func:`resolve_given`) so that nonsense — an unknown key, a
TP degree not dividing the heads, degrees whose product is not the device count — is one
line naming the key, not a wrong price. Each configuration renders the command-line flags
of its engine that reproduce it (:func:`engine_flags`) and the canonical text it parses
back from (:meth:`GivenConfig.text`).

Torch-free; the pricing itself is :mod:`ilp_planner.inter_op.given_price`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import Graph, OpKind

ENGINES = ("megatron", "torchtitan")
RECOMPUTE = ("none", "full", "selective")

# key → (GivenConfig field, kind) per engine; the kinds are read by _value
_KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "megatron": {"tp": ("tp", "int"), "pp": ("pp", "int"), "dp": ("replicate", "int"),
                 "vpp": ("vpp", "int"), "mbs": ("mbs", "int"),
                 "recompute": ("recompute", "recompute"), "sp": ("sp", "bool"),
                 "distopt": ("distopt", "bool")},
    "torchtitan": {"fsdp": ("shard", "int"), "ddp": ("replicate", "int"), "tp": ("tp", "int"),
                   "pp": ("pp", "int"), "vpp": ("vpp", "int"), "mbs": ("mbs", "int"),
                   "ac": ("recompute", "recompute")},
}
_ITEM = re.compile(r"([A-Za-z_]+)\s*=\s*([^\s,=]+)")


@dataclass(frozen=True)
class GivenConfig:
    """One engine's parallel configuration. Degrees: ``tp`` tensor, ``pp`` pipeline, ``vpp``
    model chunks per pipeline rank (interleaving), and data parallel as ``replicate``
    (Megatron's DP, torchtitan's DDP degree) × ``shard`` (torchtitan's FSDP degree, ZeRO-3);
    ``None`` for a degree left to fill the devices. ``mbs`` the micro-batch size per data
    parallel rank (None: the whole per-rank batch without pipelining, 1 with it, as both
    engines default); ``recompute`` none / full / selective; ``sp`` sequence parallelism
    (None: the engine's default — off in Megatron; torchtitan sequence-parallelises
    whenever it tensor-parallelises, so it has no such key); ``distopt`` Megatron's
    distributed optimizer (optimizer state sharded over data parallel: ZeRO-1)."""

    engine: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    replicate: int | None = 1
    shard: int | None = 1
    mbs: int | None = None
    recompute: str = "none"
    sp: bool | None = None
    distopt: bool = False

    @property
    def dp(self) -> int:
        """The data-parallel degree (resolved configurations only)."""
        assert self.replicate is not None and self.shard is not None
        return self.replicate * self.shard

    @property
    def fsdp(self) -> bool:
        """Parameters, gradients and optimizer state sharded over data parallel (ZeRO-3)."""
        return self.shard is not None and self.shard > 1

    @property
    def zero(self) -> int:
        """The state-sharding level over data parallel: 3 FSDP, 1 Megatron's distributed
        optimizer, 0 replicated."""
        return 3 if self.fsdp else 1 if self.distopt else 0

    def text(self) -> str:
        """The canonical spelling, every key given (``distopt`` only when on);
        :func:`parse_given` reads it back."""
        keys = {v[0]: k for k, v in _KEYS[self.engine].items()}
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "engine" or f.name not in keys or value is None:
                continue
            if f.name == "distopt" and not value:
                continue  # the default, left out of the canonical text
            parts.append(f"{keys[f.name]}={str(value).lower() if isinstance(value, bool) else value}")
        return f"{self.engine}: {' '.join(parts)}"

    def label(self) -> str:
        """The name of its row beside the plan, e.g. ``given megatron(tp=8,pp=8,dp=16,…)``."""
        return "given " + self.text().replace(": ", "(", 1).replace(" ", ",") + ")"


def parse_given(text: object, where: str = "--compare", source: str | None = None) -> GivenConfig:
    """Read ``"engine: key=value ..."`` (spaces or commas between items). Refuses, in one
    line naming ``where`` (the option or the key path ``compare[1]``), an unknown engine, an
    unknown or repeated key, a value of the wrong kind."""

    def fail(msg: str) -> ConfigError:
        return ConfigError(msg, source=source, key=where)

    if not isinstance(text, str) or ":" not in text:
        raise fail(f"expected 'ENGINE: key=value ...' with ENGINE one of {', '.join(ENGINES)}, "
                   f"got {text!r}")
    engine, _, rest = text.partition(":")
    engine = engine.strip().lower()
    if engine not in ENGINES:
        raise fail(f"unknown engine {engine!r}: expected one of {', '.join(ENGINES)}")
    keys = _KEYS[engine]
    leftover = _ITEM.sub("", rest).replace(",", " ").strip()
    if leftover:
        raise fail(f"cannot read {leftover.split()[0]!r}: expected key=value items, keys "
                   f"{', '.join(keys)}")
    values: dict[str, object] = {}
    for key, raw in _ITEM.findall(rest):
        key = key.lower()
        if key not in keys:
            raise fail(f"unknown {engine} key {key!r}: expected one of {', '.join(keys)}")
        field, kind = keys[key]
        if field in values:
            raise fail(f"{key} is given twice")
        values[field] = _value(raw, kind, key, fail)
    # the data-parallel degree left out fills the devices (torchtitan's shard degree -1)
    values.setdefault("shard" if engine == "torchtitan" else "replicate", None)
    return GivenConfig(engine, **values)  # type: ignore[arg-type]


def _value(raw: str, kind: str, key: str, fail) -> int | bool | str:
    low = raw.lower()
    if kind == "int":
        if not low.isdigit() or int(low) < 1:
            raise fail(f"{key}: expected a positive integer, got {raw!r}")
        return int(low)
    if kind == "bool":
        if low not in ("true", "false", "on", "off", "1", "0"):
            raise fail(f"{key}: expected true or false, got {raw!r}")
        return low in ("true", "on", "1")
    if low not in RECOMPUTE:
        raise fail(f"{key}: expected one of {', '.join(RECOMPUTE)}, got {raw!r}")
    return low


@dataclass(frozen=True)
class ModelFacts:
    """What a configuration is checked against: the devices, the repeated blocks (layers),
    the attention heads (None: no attention) and the global batch (None: not known)."""

    nodes: int
    local: int
    layers: int
    heads: int | None
    batch: int | None

    @classmethod
    def of(cls, graph: Graph, nodes: int, local: int, batch: int | None) -> ModelFacts:
        heads = {int(op.attrs["heads"]) for op in graph.ops
                 if op.kind is OpKind.ATTENTION and "heads" in op.attrs}
        return cls(nodes, local, len(graph.blocks()), min(heads) if heads else None, batch)


def resolve_given(g: GivenConfig, facts: ModelFacts, where: str = "--compare",
                  source: str | None = None) -> GivenConfig:
    """``g`` with its open degrees and defaults filled in for ``facts``; refuses in one line
    what the engine would refuse or the planner cannot place: degrees whose product is not
    the device count, TP not dividing the heads, sequence parallelism without TP,
    interleaving without a pipeline, layers not divisible by ``pp · vpp``, a batch not
    divisible by data parallel × micro-batch size, interleaving with a micro-batch count
    not a multiple of ``pp`` (Megatron's rule), TP or stage meshes that do not tile the
    nodes, and HSDP (both torchtitan degrees above 1: not in the planner's space)."""

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{g.text()}: {msg}", source=source, key=where)

    devices = facts.nodes * facts.local
    known = g.tp * g.pp * (g.replicate or 1) * (g.shard or 1)
    if devices % known:
        raise fail(f"tp × pp × data parallel = {known} does not divide the {devices} devices")
    rest = devices // known
    if g.replicate is None:
        g = dataclasses.replace(g, replicate=rest)
    elif g.shard is None:
        g = dataclasses.replace(g, shard=rest)
    elif rest != 1:
        raise fail(f"tp × pp × data parallel = {known} is not the {devices} devices")
    if g.replicate > 1 and g.shard > 1:  # type: ignore[operator]
        raise fail("HSDP (ddp > 1 and fsdp > 1) is not in the planner's space: give one of them")
    if facts.heads is not None and facts.heads % g.tp:
        raise fail(f"tp={g.tp} does not divide the model's {facts.heads} attention heads")
    sp = g.sp if g.sp is not None else (g.engine == "torchtitan" and g.tp > 1)
    if sp and g.tp == 1:
        raise fail("sequence parallelism needs tp > 1")
    if g.vpp > 1 and g.pp == 1:
        raise fail(f"vpp={g.vpp} (interleaving) needs pp > 1")
    if g.pp > 1 and (facts.layers == 0 or facts.layers % (g.pp * g.vpp)):
        raise fail(f"the model's {facts.layers} layers do not split evenly into pp × vpp = "
                   f"{g.pp * g.vpp} chunks")
    g = dataclasses.replace(g, sp=sp, mbs=g.mbs or _default_mbs(g, facts))
    _check_batch(g, facts, fail)
    _check_tiling(g, facts, fail)
    return g


def _default_mbs(g: GivenConfig, facts: ModelFacts) -> int:
    if g.pp > 1 or facts.batch is None:
        return 1
    return max(1, facts.batch // g.dp)


def _check_batch(g: GivenConfig, facts: ModelFacts, fail) -> None:
    if facts.batch is None:
        if g.dp > 1 or g.mbs != 1:
            raise fail("the model has no batch size (an explicit graph): only dp = 1 with "
                       "mbs = 1 can be priced")
        return
    assert g.mbs is not None
    if facts.batch % (g.dp * g.mbs):
        raise fail(f"the global batch {facts.batch} is not divisible by data parallel × "
                   f"micro-batch size = {g.dp} × {g.mbs}")
    m = facts.batch // (g.dp * g.mbs)
    if g.vpp > 1 and m % g.pp:
        raise fail(f"interleaving needs the {m} micro-batches to be a multiple of pp={g.pp}")


def _check_tiling(g: GivenConfig, facts: ModelFacts, fail) -> None:
    per_stage = facts.nodes * facts.local // g.pp
    if not (per_stage % facts.local == 0 or facts.local % per_stage == 0):
        raise fail(f"pipeline stages of {per_stage} devices do not tile nodes of "
                   f"{facts.local} devices")
    if not (g.tp % facts.local == 0 or facts.local % g.tp == 0):
        raise fail(f"tp={g.tp} does not tile nodes of {facts.local} devices")


def microbatches(g: GivenConfig, batch: int | None) -> int:
    """Micro-batches per step (per data-parallel rank): ``batch / (dp · mbs)``."""
    assert g.mbs is not None
    return 1 if batch is None else batch // (g.dp * g.mbs)


def stage_shape(g: GivenConfig, nodes: int, local: int) -> tuple[int, int]:
    """The ``(nodes, devices)`` sub-mesh of one pipeline stage: the engines put pipeline
    stages outermost, so a stage takes whole nodes or a share of one."""
    per_stage = nodes * local // g.pp
    return (per_stage // local, local) if per_stage >= local else (1, per_stage)


def mesh_axes(g: GivenConfig, shape: tuple[int, int]) -> tuple[MeshAxis, MeshAxis]:
    """The ``(dp, tp)`` axes of a stage mesh: TP innermost (inside a node while it fits,
    as both engines order their ranks), data parallel over the rest."""
    n, d = shape
    if g.tp <= d:
        return MeshAxis(n, d // g.tp), MeshAxis(1, g.tp)
    return MeshAxis(n * d // g.tp, 1), MeshAxis(g.tp // d, d)


def recomputed_blocks(g: GivenConfig, graph: Graph) -> frozenset[tuple[str, int]]:
    """The planner's recompute units (blocks) the configuration recomputes: ``full`` every
    block (Megatron's ``--recompute-method uniform --recompute-num-layers 1``, torchtitan's
    full AC); torchtitan's ``selective`` every other block (its layer-level selective AC
    with frequency 2); Megatron's ``selective`` recomputes only the core attention inside
    each block, which is not a unit of the planner: no block (the note says so)."""
    blocks = graph.blocks()
    if g.recompute == "full":
        return frozenset(blocks)
    if g.recompute == "selective" and g.engine == "torchtitan":
        return frozenset(blocks[::2])
    return frozenset()


def engine_flags(g: GivenConfig, batch: int | None, layers: int) -> str:
    """The engine's own command-line flags reproducing ``g`` (resolved) for a global batch
    ``batch`` and ``layers`` transformer layers. Megatron-LM's names are those of its
    ``arguments.py``; torchtitan's those of its ``JobConfig`` up to the 2026 config-registry
    refactor (newer torchtitan picks activation checkpointing by config class, not a flag)."""
    assert g.mbs is not None
    if g.engine == "megatron":
        out = [f"--tensor-model-parallel-size {g.tp}", f"--pipeline-model-parallel-size {g.pp}"]
        if g.vpp > 1:
            out.append(f"--num-layers-per-virtual-pipeline-stage {layers // (g.pp * g.vpp)}")
        out.append(f"--micro-batch-size {g.mbs}")
        if batch is not None:
            out.append(f"--global-batch-size {batch}")
        if g.sp:
            out.append("--sequence-parallel")
        if g.distopt:
            out.append("--use-distributed-optimizer")
        if g.recompute == "full":
            out.append("--recompute-granularity full --recompute-method uniform "
                       "--recompute-num-layers 1")
        elif g.recompute == "selective":
            out.append("--recompute-granularity selective")
        return " ".join(out)
    out = [f"--parallelism.data_parallel_replicate_degree {g.replicate}",
           f"--parallelism.data_parallel_shard_degree {g.shard}",
           f"--parallelism.tensor_parallel_degree {g.tp}",
           f"--parallelism.pipeline_parallel_degree {g.pp}"]
    if g.pp > 1:
        out.append("--parallelism.pipeline_parallel_schedule "
                   + ("Interleaved1F1B" if g.vpp > 1 else "1F1B"))
        out.append(f"--parallelism.pipeline_parallel_microbatch_size {g.mbs}")
        if g.vpp > 1:
            out.append(f"--parallelism.pipeline_parallel_layers_per_stage "
                       f"{layers // (g.pp * g.vpp)}")
    if batch is not None:
        out.append(f"--training.local_batch_size {batch // g.dp}")
        out.append(f"--training.global_batch_size {batch}")
    out.append(f"--activation_checkpoint.mode {g.recompute}")
    if g.recompute == "selective":
        out.append("--activation_checkpoint.selective_ac_option 2")
    return " ".join(out)
