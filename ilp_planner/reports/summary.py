"""Human summaries of a configuration and a memory lower bound that needs no solve.

Memory lower bound of a single-stage plan over all p devices: every byte of training state
(``bytes_per_param`` per parameter) and every op's output activation (all are kept for the
backward pass) must live somewhere, and the best any sharding can do is spread them evenly::

    M_lb = ( Σ_v params_v · bytes_per_param  +  Σ_v bytes(out_v) ) / p

If ``M_lb`` exceeds the per-device budget, no single-stage plan over the full batch fits:
micro-batching or pipelining (fewer activations in flight) is needed. The term with the
largest ``params_v · bytes_per_param + bytes(out_v)`` — a repeated op summed over its blocks
where the solver ties layers (:func:`~ilp_planner.lowering.cost_model.dominant_memory_term`)
— is reported as the dominant one, the term the solver's infeasibility message names too.
"""

from __future__ import annotations

from collections import defaultdict

from ilp_planner.inputs.config import Config
from ilp_planner.ir.cluster import Cluster, Link, proper_factorisations
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.lowering.cost_model import MemorySpec, MemoryTerm, dominant_memory_term

_GIB = 2**30


def _op_bytes(graph: Graph, memory: MemorySpec) -> dict[str, tuple[float, float]]:
    """Per op: (training-state bytes, output activation bytes), unsharded."""
    return {op.name: (op.params * memory.held_per_param(op), op.held_output_bytes)
            for op in graph.ops}


def memory_lower_bound(graph: Graph, cluster: Cluster, memory: MemorySpec,
                       tie_layers: bool = True) -> tuple[float, MemoryTerm]:
    """``(M_lb in bytes per device, the term with the largest state + activation)``."""
    total = sum(s + a for s, a in _op_bytes(graph, memory).values())
    return total / cluster.num_devices, dominant_memory_term(graph, memory, tie_layers)


def fits_memory(config: Config) -> bool:
    """Whether the memory lower bound is within the budget (else no plan fits)."""
    bound, _ = memory_lower_bound(config.microbatch_graph(), config.cluster, config.memory)
    return bound <= config.cluster.memory_bytes


def _count(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:g}"


def _bytes(x: float) -> str:
    if x == 0:
        return "0 B"
    if x >= _GIB / 8:
        return f"{x / _GIB:.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _link(link: Link) -> str:
    launch = f", launch {link.launch * 1e6:g} µs per call" if link.launch else ""
    return (f"α = {link.alpha * 1e6:g} µs, β = {link.beta:.3g} s/B "
            f"({link.bandwidth_gbps:g} Gb/s){launch}")


def graph_summary(graph: Graph) -> list[str]:
    """Ops, repeated blocks, weighted layers, parameters and FLOPs per training step."""
    blocks: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for op in graph.ops:
        if op.block is not None and op.block_index is not None:
            blocks[op.block][op.block_index] += 1
    weighted = sum(1 for op in graph.ops if op.weight is not None or op.params > 0)
    parts = [f"{len(graph)} ops", f"{weighted} with parameters"]
    for block, counts in blocks.items():
        lo, hi = min(counts.values()), max(counts.values())
        each = f"{lo}" if lo == hi else f"{lo}-{hi}"
        parts.append(f"{len(counts)} blocks '{block}.*' ({each} ops each)")
    return [
        f"graph     {graph.name}: " + ", ".join(parts),
        f"params    {graph.total_params:,} ({_count(graph.total_params)})",
        f"flops     {graph.step_flops:.3e} per training step (forward + backward ≈ 3 × forward)",
    ]


def cluster_summary(cluster: Cluster) -> list[str]:
    """The cluster's sizes, device, links and (where not the textbook ring) its collective
    model."""
    device = f" ({cluster.device.name})" if cluster.device is not None else ""
    model = [] if cluster.collectives == "ring" else [
        f"collectives {cluster.collectives}: the algorithm NCCL picks (ring or tree by size "
        f"and group), a launch cost per call"]
    return [
        f"cluster   {cluster.name}: {_plural(cluster.nodes, 'node')} × "
        f"{_plural(cluster.devices_per_node, 'device')}{device} = "
        f"{cluster.num_devices}; {_bytes(cluster.memory_bytes)} and "
        f"{cluster.peak_flops / 1e12:g} TFLOP/s each (efficiency {cluster.efficiency:g})",
        f"intra     {_link(cluster.intra)}",
        f"inter     {_link(cluster.inter)}",
        *model,
        *_compute_summary(cluster),
    ]


def _compute_summary(cluster: Cluster) -> list[str]:
    """The roofline's figures where the cluster prices compute by it (else the flat
    efficiency above holds)."""
    dev = cluster.device
    if dev is None:
        return []
    f = dev.fit
    return [f"compute   roofline ({dev.name}): matmul e_max {f.matmul_efficiency:.3g}, "
            f"d½ {f.matmul_half_dim:g}; memory {dev.hbm_bytes_per_s / 1e9:g} GB/s × "
            f"{f.memory_efficiency:g}; kernel floor {f.kernel_floor_s * 1e6:g} µs "
            f"(the flat efficiency is not used)"]


def memory_summary(graph: Graph, cluster: Cluster, memory: MemorySpec,
                   tie_layers: bool = True) -> list[str]:
    per_op = _op_bytes(graph, memory)
    state = sum(s for s, _ in per_op.values())
    acts = sum(a for _, a in per_op.values())
    bound, dominant = memory_lower_bound(graph, cluster, memory, tie_layers)
    ratio = bound / cluster.memory_bytes
    verdict = ("fits" if ratio <= 1 else
               "EXCEEDS the budget:\n            no single-stage plan fits at this micro-batch "
               "size (more micro-batches or pipeline stages needed)")
    s, a = dominant.state_bytes, dominant.activation_bytes
    p = cluster.num_devices
    return [
        f"training  {memory.bytes_per_param:g} B/param (weight {memory.weight_bytes:g} + "
        f"grad {memory.grad_bytes:g} + optimizer {memory.optimizer_bytes:g})",
        f"memory    lower bound {_bytes(bound)}/device (state {_bytes(state / p)} + "
        f"activations {_bytes(acts / p)}) vs budget {_bytes(cluster.memory_bytes)}: "
        f"{ratio:.1%} — {verdict}",
        f"dominant  {dominant.label}: state {_bytes(s / p)} + activation {_bytes(a / p)} "
        f"per device",
    ]


def model_summary(config: Config) -> str:
    """The multi-line report ``ilp-planner validate`` prints for one configuration."""
    pipe = config.pipeline
    sub = f", submeshes {[list(s) for s in pipe.submeshes]}" if pipe.submeshes else ""
    head = f"{config.name}" + (f"  ({config.source})" if config.source else "")
    lines = [
        f"model     kind {config.model.get('kind')}, dtype {config.model.get('dtype', 'float32')}",
        *graph_summary(config.graph),
        *cluster_summary(config.cluster),
        *memory_summary(config.microbatch_graph(), config.cluster, config.memory,
                        config.solver.tie_layers),
        f"pipeline  stages {pipe.stages}, microbatches {pipe.microbatches}, "
        f"schedule {pipe.schedule}{sub}",
        solve_size(config),
        *unsharded_summary(config.graph),
    ]
    return head + "\n" + "\n".join("  " + line for line in lines)


def unsharded_summary(graph: Graph, shown: int = 8) -> list[str]:
    """Ops the planner cannot shard (``opaque``: what an imported model did not map onto
    the IR), kept replicated on every device — named with the FLOPs and bytes torch counted
    for them, the costliest first, so the user sees what replicating them costs."""
    opaque = sorted((op for op in graph.ops if op.kind is OpKind.OPAQUE),
                    key=lambda op: -op.flops)
    if not opaque:
        return []
    forward = sum(op.flops for op in graph.ops)
    flops = sum(op.flops for op in opaque)
    share = f" ({flops / forward:.1%})" if forward else ""
    lines = [f"unsharded {len(opaque)} op(s) kept replicated (opaque): {_count(flops)} of "
             f"{_count(forward)} forward FLOPs{share}"]
    lines += [f"  {op.name}: {_count(op.flops)} FLOPs, "
              f"{_bytes(op.attrs.get('bytes_read', 0))} read, "
              f"{_bytes(op.attrs.get('bytes_written', 0))} written" for op in opaque[:shown]]
    if len(opaque) > shown:
        lines.append(f"  … {len(opaque) - shown} more")
    return lines


# Measured on the shipped GPT configs: a linear op has about 1.6 strategies per proper
# factorisation of its mesh (114 on 8 × 8's 70 factorisations, 15 on 1 × 8's 4 + replicas).
_STRATEGIES_PER_FACTORISATION = 1.6
_SLOW_EDGE_VARIABLES = 2e6  # beyond this CBC takes minutes on one core (solve_scaling)


def solve_size(config: Config) -> str:
    """A no-solve estimate of the single-mesh ILP: decision groups after tying repeated
    blocks, strategies per matmul and edge variables, with a warning when out of reach."""

    graph = config.microbatch_graph()
    tie = config.solver.tie_layers
    groups = {(op.tie_key if tie and op.tie_key else op.name) for op in graph.ops
              if op.kind is not OpKind.INPUT}
    edges = {(a, b) for a, b in graph.edges() if graph[a].kind is not OpKind.INPUT}
    if tie:
        edges = {(graph[a].tie_key or a, graph[b].tie_key or b) for a, b in edges}
    facts = len(proper_factorisations(config.cluster.nodes, config.cluster.devices_per_node, 3))
    k = max(1, round(_STRATEGIES_PER_FACTORISATION * facts))
    edge_vars = len(edges) * k * k
    verdict = ("likely minutes or more to solve; tie layers or use fewer devices"
               if edge_vars > _SLOW_EDGE_VARIABLES else "within reach")
    return (f"ILP size  ~{len(groups)} decision groups, up to ~{k} strategies per matmul, "
            f"≤ {edge_vars:.2g} edge variables (estimate) — {verdict}")
