"""What bounds each kind of op under the roofline compute model: ``explain``'s table of
seconds per micro-batch by bound (compute, memory, kernel floor, or the host issuing the
kernels where ``cluster.compute.dispatch_us`` makes that longer), forward and backward of
every layer on its local shard, summed per op kind.

Only a cluster with a device (a catalogue accelerator or a ``cluster.compute`` section)
prices by roofline; under the flat model every op is "compute" by construction and the
table is left out. Recomputation runs the forward again at the same prices and is not
counted twice here; the optimizer update (memory-bound), the passes over the master weights,
the float16 unscale, the gradient merges and what a strategy adds beside its op's kernels
(a bias's shares, SUMMA's weight casts, a vocabulary-split lookup's mask, the loss's
reductions' copies) are in the layers' compute, not in this table.
"""

from __future__ import annotations

import math

from ilp_planner.inputs.config import Config
from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec
from ilp_planner.lowering.compute_model import GemmShape, bound_by, op_work, phase_seconds
from ilp_planner.lowering.strategies import is_summa, local_gemm
from ilp_planner.plan.data import LayerPlan, Plan

BOUNDS = ("compute", "memory", "floor", "host")
MATMUL_LIKE = (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.MATMUL, OpKind.CONV2D)


def local_shard(op: Op, layer: LayerPlan, graph: Graph
                ) -> tuple[float, GemmShape | None, TensorSpec | None]:
    """(devices sharing the op, local matmul sizes, tensor read) as the strategy priced
    them (:func:`ilp_planner.lowering.strategies.local_gemm`, ``follow``)."""
    if layer.strategy.startswith("follows "):
        tensor = graph[op.inputs[0]].output
        split = math.prod(layer.inputs[0].split_degree(d) for d in range(tensor.rank))
        return split, None, tensor if op.kind is OpKind.LOSS else None
    if op.kind in MATMUL_LIKE:
        weight = graph[op.inputs[1]].output if op.kind is OpKind.MATMUL else op.weight
        assert weight is not None
        split, gemm = local_gemm(op, weight, layer.output.fact, is_summa(layer.strategy))
        return split, gemm, None
    return math.prod(layer.output.split_degree(d) for d in range(op.output.rank)), None, None


def bound_seconds(plan: Plan, config: Config) -> dict[str, dict[str, float]]:
    """Per op kind, seconds per micro-batch of its kernels by what bounds them; empty under
    the flat model."""
    device = config.cluster.device
    if device is None:
        return {}
    graph = config.microbatch_graph()
    out: dict[str, dict[str, float]] = {}
    for layer in plan.layers:
        op = graph[layer.name]
        split, gemm, read = local_shard(op, layer, graph)
        dtype = (read or op.output).dtype
        for work in op_work(op, split, gemm, read, device.fit.attention == "flash"):
            if work.kernels or work.bytes or work.flops:
                row = out.setdefault(layer.kind, dict.fromkeys(BOUNDS, 0.0))
                row[bound_by(work, device, dtype)] += phase_seconds(work, device, dtype)
    return out
