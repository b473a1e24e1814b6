"""Every key a configuration file may hold, declared once: :data:`SECTIONS` maps a section
(``cluster``, ``solver``, ``model (kind: gpt)``…) to its keys and each key to a
:class:`~ilp_planner.inputs.schema.Key` (type and bounds, default, meaning).

The parsers (:mod:`ilp_planner.inputs.config`) take the allowed keys and the plain values'
checks from it, so a key added here is parsed, rejected when misspelt and documented at
once; :func:`reference_markdown` turns it into the configuration reference the README
includes. Defaults are not restated: the builders' come from their signatures, the solver's
and the pipeline's from :class:`SolverOptions` / :class:`PipelineOptions`, and an explicit
graph's from :mod:`ilp_planner.inputs.models`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from ilp_planner.inputs import models
from ilp_planner.inputs.options import FALLBACKS, MILPS, RECOMPUTE, SCHEDULES, PipelineOptions, SolverOptions
from ilp_planner.inputs.schema import REQUIRED, Key
from ilp_planner.ir.cluster import COLLECTIVE_MODELS, SUBMESH_SPACES
from ilp_planner.ir.device import ATTENTION_KERNELS, ComputeFit, device_names
from ilp_planner.ir.graph import Graph
from ilp_planner.ir.links import link_names
from ilp_planner.lowering.cost_model import OPTIMIZER_PRESETS
from ilp_planner.lowering.grad_buckets import DDP_BUCKET_MB
from ilp_planner.lowering.strategies import ZERO_LEVELS

MODEL_KINDS = ("mlp", "gpt", "moe", "u_transformer", "vgg13", "graph", "torch")
BUILDERS: dict[str, Callable[..., Graph]] = {
    "mlp": models.mlp,
    "gpt": models.gpt,
    "moe": models.moe,
    "u_transformer": models.u_transformer,
    "vgg13": models.vgg13,
}
MODEL_DTYPES = ("float32", "float16", "bfloat16", "float64")
TORCH_INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")
# No device has 10^9 GiB, 10^9 TFLOP/s or 10^9 Gbit/s links, and no link 10^9 µs of latency:
# beyond this a figure is a typo, and it would overflow the memory row or underflow β to 0.
PHYSICAL_MAX = 1e9
# Bounds of the solver's options, each far above any use and below what the solver behind it
# can hold: SCIP counts its time limit in milliseconds in a 64-bit integer, CBC is given
# ``seed + 1`` as a C int, and a mesh within the device limit (2^16) has at most 16 axes.
MAX_SECONDS = 1e7  # about 16 weeks
MAX_SEED = 2**31 - 2
MAX_AXES = 16
MAX_THREADS = 1024
MAX_COUNT = 2**31 - 1  # any other count (a cap on replication, on layer units)
# No optimizer keeps a kilobyte per parameter (fp64 Adam keeps 32 bytes), no link waits the
# latency_us bound (10^3 s) nor moves less than a byte a second: beyond these the memory row
# or a redistribution's price overflows to infinity.
MAX_BYTES_PER_PARAM = 1024.0
MAX_ALPHA_S = PHYSICAL_MAX * 1e-6
MAX_BETA_S = 1.0

_SOLVER = {f.name: f.default for f in dataclasses.fields(SolverOptions)}
_FIT = ComputeFit()  # the parameters of a device the catalogue does not know
_PIPELINE = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}

# A builder's arguments as configuration keys; their defaults are the builder's own.
_BUILDER_ARGS = {
    "dims": Key("list", "layer widths [d0, d1, …] (at least two)"),
    "hidden": Key("integer", "hidden size (VGG13: the classifier's hidden linears)",
                  positive=True),
    "layers": Key("integer", "blocks (U-Transformer: even)", positive=True),
    "heads": Key("integer", "attention heads (dividing hidden)", positive=True),
    "seq_len": Key("integer", "sequence length", positive=True),
    "vocab": Key("integer", "vocabulary size", positive=True),
    "batch": Key("integer", "global batch size", positive=True),
    "image": Key("integer", "image side, divisible by 32", positive=True),
    "classes": Key("integer", "output classes", positive=True),
    "channels": Key("list", f"one width per convolution block ({len(models.VGG13_WIDTHS)} "
                            f"positive integers)"),
    "bias": Key("boolean", "linears carry a bias"),
    "experts": Key("integer", "routed experts per MoE layer", positive=True),
    "top_k": Key("integer", "experts each token is routed to (at most experts)", positive=True),
    "expert_ffn": Key("integer", "each expert's hidden size", positive=True),
    "capacity_factor": Key("number", "slots per expert over the balanced share "
                                     "(experts / top_k: nothing can drop)", positive=True,
                           at_most=MAX_COUNT),
    "dropless": Key("boolean", "route every token: variable-size exchanges after the token "
                               "counts, no capacity (priced at a balanced router, capacity "
                               "factor 1; capacity_factor unused)"),
    "moe_every": Key("integer", "every k-th block's MLP is an MoE (1: all)", positive=True),
    "first_dense": Key("integer", "the first k blocks keep a dense MLP (DeepSeek's "
                                  "first_k_dense_replace; at most layers)", nonneg=True),
    "router": Key("choice", "how the router scores experts: softmax, or sigmoid with a "
                            "selection-only correction bias (DeepSeek-V3)",
                  choices=models.ROUTERS, noun="router"),
    "routed_scale": Key("number", "routing weights scaled by this (DeepSeek's "
                                  "routed_scaling_factor; a multiple of 0.001)", positive=True,
                        at_most=MAX_COUNT),
    "expert_groups": Key("integer", "groups of experts the router ranks (DeepSeek's n_group)",
                          positive=True),
    "topk_groups": Key("integer", "the best groups whose experts a token may take (DeepSeek's "
                                  "topk_group; at most expert_groups)", positive=True),
    "block": Key("choice", "gpt: layernorm, GELU MLP, learned positions, tied head; llama: "
                           "RMSNorm, SwiGLU MLP, rotary positions, untied head",
                 choices=("gpt", "llama"), noun="block"),
    "kv_heads": Key("integer", "key/value heads of grouped-query attention (block: llama; "
                               "dividing heads)", positive=True, default_text="heads"),
    "dense_ffn": Key("integer", "hidden size of the dense MLPs (blocks without an MoE)",
                     positive=True, default_text="4 · hidden"),
    "shared_experts": Key("integer", "always-on shared experts per MoE layer", nonneg=True),
    "shared_ffn": Key("integer", "each shared expert's hidden size", nonneg=True),
    "activation": Key("choice", "the experts' MLP", choices=("swiglu", "gelu"),
                      noun="activation"),
    "norm_topk": Key("boolean", "renormalise the top-k routing weights to sum to 1 (Mixtral)"),
    "dtype": Key("choice", "dtype of every tensor", choices=MODEL_DTYPES, noun="dtype"),
    "dropout": Key("number", "probability of the blocks' residual and attention-probability "
                             "dropouts, below 1 (0: none, the graph has no dropout ops; "
                             "Megatron-LM trains with 0.1; the runtime's executor runs "
                             "only 0)", nonneg=True),
}


def model_section(kind: str) -> str:
    """The :data:`SECTIONS` name of a model kind's keys."""
    return f"model (kind: {kind})"


def _builder_section(builder: Callable[..., Graph]) -> dict[str, Key]:
    """The keys of a builder kind: its arguments, in order, with its defaults."""
    out = {}
    for name, p in inspect.signature(builder).parameters.items():
        default = REQUIRED if p.default is inspect.Parameter.empty else p.default
        out[name] = dataclasses.replace(_BUILDER_ARGS[name], default=default)
    return out


SECTIONS: dict[str, dict[str, Key]] = {
    "top level": {
        "model": Key("mapping", "the model: a builder, an explicit layer graph or a torch module"),
        "cluster": Key("mapping", "the devices and their links"),
        "name": Key("string", "the problem's name", None, default_text="the file stem"),
        "training": Key("mapping", "the memory model", None, default_text="all defaults"),
        "solver": Key("mapping", "intra-op solver options (SolverOptions)", None,
                      default_text="all defaults"),
        "pipeline": Key("mapping", "inter-op options (PipelineOptions)", None,
                        default_text="all defaults"),
        "compare": Key("string or list", "configurations you run, priced beside the plan "
                                         "(and kept as the plan where faster): "
                                         "'megatron: tp=8 pp=2 dp=4 vpp=2 mbs=1 "
                                         "recompute=full sp=true' or 'torchtitan: fsdp=8 tp=4 "
                                         "pp=1 ddp=1 mbs=2 ac=selective' (keys left out: "
                                         "defaults, data parallel fills the devices)", None,
                       null=True, default_text="none"),
    },
    "model": {
        "kind": Key("choice", "which model: a builder, an explicit graph or a torch module",
                    choices=MODEL_KINDS, noun="model kind"),
    },
    **{model_section(kind): _builder_section(builder) for kind, builder in BUILDERS.items()},
    model_section("graph"): models.GRAPH_KEYS,
    "model.ops[i]": models.GRAPH_OP_KEYS,
    model_section("torch"): {
        "module": Key("string", "an importable 'package.module:Class' (or factory), built on "
                                "the meta device and imported through torch.export"),
        "example_inputs": Key("mapping or list", "a mapping of name → input spec, or a list of input "
                                         "specs (see model.example_inputs[i])"),
        "kwargs": Key("mapping", "constructor arguments (a Hugging Face model class: its "
                                 "configuration's fields, use_cache false unless given)", None,
                      default_text="none"),
        "name": Key("string", "the graph's name", None, default_text="the class name"),
    },
    "model.example_inputs[i]": {
        "shape": Key("list", "the input's shape (positive integers)"),
        "dtype": Key("choice", "its dtype", "float32", choices=TORCH_INPUT_DTYPES, noun="dtype"),
        "high": Key("integer", "integer inputs draw ids in [0, high)", 2, positive=True,
                    at_most=MAX_COUNT),
    },
    "cluster": {
        "nodes": Key("integer", "machines", positive=True),
        "devices_per_node": Key("integer", "devices per machine", positive=True),
        "gpu": Key("string", "a catalogue accelerator (case-insensitive): "
                             f"{', '.join(device_names())}; sets memory_gib and peak_tflops "
                             "(the half-precision peak for a float16 / bfloat16 model, else "
                             "fp32's)", None, default_text="none"),
        "intra": Key("string", "a catalogue link between devices of one node: "
                               f"{', '.join(link_names())}", None, default_text="none"),
        "inter": Key("string", "a catalogue link between nodes (same names; <N>x- = N NICs "
                               "per node, e.g. 8x-ib-hdr200)", None, default_text="none"),
        "memory_gib": Key("number", "memory per device, GiB = 2^30 bytes; overrides the gpu's",
                          None, positive=True, at_most=PHYSICAL_MAX,
                          default_text="the gpu's (required without gpu)"),
        "peak_tflops": Key("number", "peak TFLOP/s per device; overrides the gpu's", None,
                           positive=True, at_most=PHYSICAL_MAX,
                           default_text="the gpu's (required without gpu)"),
        "links": Key("mapping", "intra- and inter-node links as numbers (both, even on "
                                "one-device nodes); a level also named by intra / inter "
                                "overrides the named link's figures it gives", None,
                     default_text="the named links (required without them)"),
        "collectives": Key("choice", "collective model: nccl (NCCL's ring or tree by size and "
                                     "group, per-call launch cost) or ring (textbook ring "
                                     "formulas)", None, choices=COLLECTIVE_MODELS,
                           noun="collective model",
                           default_text="nccl where intra or inter names a link, else ring"),
        "efficiency": Key("number", "achieved / peak FLOP/s", 0.5, positive=True, at_most=1.0),
        "name": Key("string", "the cluster's name", None,
                    default_text="<nodes>x<devices_per_node>[-<gpu>]"),
        "compute": Key("mapping", "the roofline compute model's parameters (cluster.compute); "
                                  "without it a cluster of raw numbers keeps the flat "
                                  "3 × FLOPs / (peak × efficiency)", None,
                       default_text="none: flat model"),
    },
    "cluster.compute": {
        "hbm_gbps": Key("number", "memory bandwidth per device, GB/s (required without a "
                                  "catalogue device)", None, positive=True, at_most=PHYSICAL_MAX,
                        default_text="the device's datasheet figure"),
        "peak_tflops": Key("number", "the peak the efficiencies below are fractions of, every "
                                     "dtype", None, positive=True, at_most=PHYSICAL_MAX,
                           default_text="the device's per dtype, else cluster.peak_tflops"),
        "matmul_efficiency": Key("number", "e_max: achieved / peak FLOP/s of a large matmul",
                                 None, positive=True, at_most=1.0,
                                 default_text=f"the device's, else {_FIT.matmul_efficiency:g}"),
        "matmul_half_dim": Key("number", "d½: a matmul dimension this small halves the "
                                         "efficiency, eff = e_max · Π d/(d + d½)", None,
                               nonneg=True, at_most=PHYSICAL_MAX,
                               default_text=f"the device's, else {_FIT.matmul_half_dim:g}"),
        "memory_efficiency": Key("number", "achieved / datasheet memory bandwidth", None,
                                 positive=True, at_most=1.0,
                                 default_text=f"the device's, else {_FIT.memory_efficiency:g}"),
        "kernel_floor_us": Key("number", "µs every kernel costs however small", None,
                               nonneg=True, at_most=PHYSICAL_MAX,
                               default_text=f"the device's, else {_FIT.kernel_floor_s * 1e6:g}"),
        "dispatch_us": Key("number", "µs of host time the runtime spends issuing each kernel "
                                     "(a phase takes the longer of its device time and its "
                                     "kernels' host time; calibrate --measure measures it)",
                           None, nonneg=True, at_most=PHYSICAL_MAX,
                           default_text=f"the device's, else {_FIT.dispatch_s * 1e6:g} (not "
                                        f"modelled)"),
        "replay_us": Key("number", "µs of host time each kernel a recomputation replays costs "
                                   "beyond its dispatch (torch.utils.checkpoint's saved-tensor "
                                   "hooks and replay; calibrate --measure measures it)",
                         None, nonneg=True, at_most=PHYSICAL_MAX,
                         default_text=f"the device's, else {_FIT.replay_s * 1e6:g} (not "
                                      f"modelled)"),
        "attention": Key("choice", "attention's kernels: one fused flash kernel, or unfused "
                                   "(matmuls, softmax and a dropout where it drops, over the s × s "
                                   "scores)",
                         None, choices=ATTENTION_KERNELS, noun="attention kernel",
                         default_text=f"the device's, else {_FIT.attention}"),
    },
    "cluster.links": {
        "intra": Key("mapping", "the link between devices of one node", None,
                     default_text="cluster.intra's (required without it)"),
        "inter": Key("mapping", "the link between nodes", None,
                     default_text="cluster.inter's (required without it)"),
    },
    "cluster.links.<intra|inter>": {
        "latency_us": Key("number", "latency in µs (with bandwidth_gbps)", nonneg=True,
                          at_most=PHYSICAL_MAX, default=None, default_text="—"),
        "bandwidth_gbps": Key("number", "bandwidth in Gbit/s (with latency_us)", positive=True,
                              at_most=PHYSICAL_MAX, default=None, default_text="—"),
        "alpha": Key("number", "fitted latency in s (with beta, instead of the two above)",
                     nonneg=True, at_most=MAX_ALPHA_S, default=None, default_text="—"),
        "beta": Key("number", "fitted seconds per byte (with alpha)", positive=True,
                    at_most=MAX_BETA_S, default=None, default_text="—"),
        "launch_us": Key("number", "per-call launch cost in µs, paid once by every collective",
                         nonneg=True, at_most=PHYSICAL_MAX, default=None,
                         default_text="0, or the named link's"),
        "launch": Key("number", "the same in s (the fitted form, beside alpha and beta)",
                      nonneg=True, at_most=MAX_ALPHA_S, default=None,
                      default_text="0, or the named link's"),
    },
    "training": {
        "optimizer": Key("choice", "the optimizer preset of bytes per parameter",
                         default=None,
                         default_text="adam_half for imported float16 / bfloat16 modules, "
                                      "adam_mixed for other float16 / bfloat16 models, else adam",
                         choices=tuple(OPTIMIZER_PRESETS), noun="optimizer"),
        "bytes_per_param": Key("mapping", "overrides the preset's bytes per parameter",
                               None, null=True, default_text="the preset's"),
        "grad_bucket_mb": Key("number", "MiB per fused gradient AllReduce (DDP's default); "
                                        "0: one AllReduce per op and set of partial axes",
                              DDP_BUCKET_MB, nonneg=True, null=True),
    },
    "training.bytes_per_param": {
        "weight": Key("number", "bytes per weight", None, default_text="the preset's",
                      positive=True, at_most=MAX_BYTES_PER_PARAM),
        "grad": Key("number", "bytes per gradient", None, default_text="the preset's",
                    positive=True, at_most=MAX_BYTES_PER_PARAM),
        "optimizer": Key("number", "bytes of optimizer state per parameter",
                         None, default_text="the preset's", nonneg=True,
                         at_most=MAX_BYTES_PER_PARAM),
    },
    "solver": {
        "time_limit_s": Key("number", "wall-clock limit of the intra-op solve",
                            _SOLVER["time_limit_s"], positive=True, at_most=MAX_SECONDS),
        "tie_layers": Key("boolean", "every repetition of a block gets one strategy",
                          _SOLVER["tie_layers"]),
        "max_weight_replication": Key("integer", "cap on a linear's weight replication (p0)",
                                      _SOLVER["max_weight_replication"], positive=True, null=True,
                                      at_most=MAX_COUNT),
        "max_axes": Key("integer", "mesh axes a factorisation may have",
                        _SOLVER["max_axes"], positive=True, at_most=MAX_AXES),
        "threads": Key("integer", "CBC's threads", _SOLVER["threads"], positive=True,
                       at_most=MAX_THREADS),
        "seed": Key("integer", "seed of the solvers and fallback searches", _SOLVER["seed"],
                    nonneg=True, at_most=MAX_SEED),
        "fallback": Key("choice", "heuristic search when the ILP gives up", _SOLVER["fallback"],
                        choices=FALLBACKS, noun="fallback"),
        "elimination": Key("boolean", "exact variable elimination first; false: the ILP alone",
                           _SOLVER["elimination"]),
        "gap": Key("number", "relative optimality gap accepted as optimal (0.001 = 0.1 %)",
                   _SOLVER["gap"], nonneg=True, at_most=1),
        "milp": Key("choice", "the ILP's solver: SCIP in-process (OR-Tools) or PuLP's CBC in a "
                              "subprocess (the reference)", _SOLVER["milp"], choices=MILPS,
                    noun="MILP solver"),
        "state_sharding": Key("list", "ZeRO levels the ILP may pick per weighted op: 0 none, "
                                      "1 optimizer state, 2 + gradients, 3 + weights (FSDP), "
                                      f"from {list(ZERO_LEVELS)}", _SOLVER["state_sharding"]),
        "recompute": Key("choice", "activation recomputation: never, auto (the planner picks "
                                   "how many blocks) or always", _SOLVER["recompute"],
                         choices=RECOMPUTE, noun="recomputation policy"),
    },
    "pipeline": {
        "stages": Key("integer or auto", "pipeline stages: 1 (none), N or auto",
                      _PIPELINE["stages"]),
        "microbatches": Key("integer", "micro-batches (divide model.batch)",
                            _PIPELINE["microbatches"], positive=True),
        "schedule": Key("choice", "the pipeline schedule", _PIPELINE["schedule"],
                        choices=SCHEDULES, noun="schedule"),
        "virtual_stages": Key("integer or auto", "model chunks per stage mesh (interleaved "
                                                 "1F1B): N ≥ 2 with schedule interleaved-1f1b, "
                                                 "auto: the planner picks, also beside another "
                                                 "schedule", _PIPELINE["virtual_stages"]),
        "submeshes": Key("list", "[nodes, devices] per stage, one per stage",
                         _PIPELINE["submeshes"], null=True),
        "imbalance_tolerance": Key("number", "stage imbalance the DP tolerates",
                                   _PIPELINE["imbalance_tolerance"], nonneg=True, null=True),
        "overlap": Key("boolean", "overlap gradient synchronisation with the backward pass",
                       _PIPELINE["overlap"]),
        "submesh_space": Key("choice", "the shapes a stage may take (Alpa's spaces; "
                             "divisors: node counts dividing the cluster's)",
                             _PIPELINE["submesh_space"], choices=SUBMESH_SPACES,
                             noun="sub-mesh space"),
        "max_units": Key("integer", "null: one layer unit per block; N: coarsen to ≤ N units",
                         _PIPELINE["max_units"], positive=True, null=True, at_most=MAX_COUNT),
        "stage_time_limit_s": Key("number", "per stage ILP limit",
                                  _PIPELINE["stage_time_limit_s"], positive=True, null=True,
                                  at_most=MAX_SECONDS,
                                  default_text="min(solver.time_limit_s, 10)"),
        "stage_bound": Key("boolean", "skip or stop stage solves proven slower than a plan in "
                                      "hand (exact)", _PIPELINE["stage_bound"]),
    },
}


def reference_markdown() -> str:
    """The configuration reference as a Markdown table (section, key, type, default,
    description), one row per key of :data:`SECTIONS`: what the README includes."""
    rows = ["| section | key | type | default | description |", "|---|---|---|---|---|"]
    for section, keys in SECTIONS.items():
        for name, key in keys.items():
            cells = (section, f"`{name}`", key.type_text(), key.default_str(), key.description)
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
