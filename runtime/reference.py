"""The single-process, unsharded run a distributed run must reproduce: the same graph,
initial parameters, data, micro-batching (the loss of each micro-batch scaled by 1/M and
gradients accumulated) and optimizer. Returns the loss of every step and the final
parameters, keyed like :func:`runtime.model.graph_param_specs`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilp_planner.graph import Graph, OpKind
from runtime import model
from runtime.optim import Optimizer, OptimizerSpec


@dataclass(frozen=True)
class ReferenceResult:
    losses: list[float]
    params: dict[str, torch.Tensor]


def forward(graph: Graph, params: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> torch.Tensor:
    """Loss of one (micro-)batch: the graph's ops run on full tensors in order."""
    vals: dict[str, torch.Tensor] = {}
    loss = None
    for op in graph.ops:
        k = op.kind
        xs = [vals[i] for i in op.inputs]
        if k is OpKind.INPUT:
            y = data[op.name]
        elif k is OpKind.LINEAR:
            if op.attrs.get("tied"):
                w = params[f"{model.tied_source(graph, op).name}.weight"].t()
            else:
                w = params[f"{op.name}.weight"]
            y = model.linear(xs[0], w, params.get(f"{op.name}.bias"))
        elif k is OpKind.EMBEDDING:
            ids = xs[0]
            pos = model.positions(0, ids.shape[0], op.attr("seq_len"))
            y = model.embedding(ids, params[f"{op.name}.weight"]) + params[f"{op.name}.pos"][pos]
        elif k is OpKind.LAYERNORM:
            y = model.layer_norm(xs[0], params[f"{op.name}.weight"], params[f"{op.name}.bias"])
        elif k is OpKind.ATTENTION:
            y = model.attention(xs[0], op.attr("heads"), op.attr("seq_len"))
        elif k is OpKind.ADD:
            y = xs[0] + xs[1]
        elif k in model.ELEMENTWISE:
            y = model.ELEMENTWISE[k](xs[0])
        elif k is OpKind.LOSS:
            y = model.cross_entropy(xs[0], data[model.targets_key(op.name)])
            loss = y if loss is None else loss + y
        else:  # check_supported ran first
            raise AssertionError(k)
        vals[op.name] = y
    assert loss is not None, "graph has no loss op"
    return loss


def run_reference(graph: Graph, *, steps: int, seed: int, optimizer: OptimizerSpec,
                  microbatches: int = 1) -> ReferenceResult:
    """Train ``steps`` optimizer steps of the full-batch ``graph`` on one process."""
    model.check_supported(graph)
    params = {k: v.clone().requires_grad_(True) for k, v in model.init_params(graph, seed).items()}
    opt = Optimizer(optimizer)
    losses = []
    for _ in range(steps):
        for p in params.values():
            p.grad = None
        total = 0.0
        for mb in model.split_microbatches(model.make_batch(graph, seed), microbatches):
            loss = forward(graph, params, mb) / microbatches
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        opt.step({k: p.data for k, p in params.items()}, {k: p.grad for k, p in params.items()})
    return ReferenceResult(losses, {k: p.detach().clone() for k, p in params.items()})
