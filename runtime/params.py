"""This stage's parameters, as local leaf blocks in their planned layouts.

Every rank draws the same full tensor from the deterministic initialisation and keeps its
block — no communication. A tied head starts from its embedding's table, transposed. A
layer that shards its state hands its blocks to :class:`runtime.zero_state.ZeroState`
first (ZeRO-3 keeps only the shard; ZeRO-1/2 keep the full blocks in the compute dtype).
"""

from __future__ import annotations

import torch

from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.strategies import param_layouts
from ilp_planner.plan.data import Stage
from runtime import model
from runtime.comm import Comm, LVal
from runtime.compiled import CompiledPlan
from runtime.zero_state import ZeroState


def init_params(compiled: CompiledPlan, stage: Stage, comm: Comm, zero: ZeroState, seed: int,
                device: torch.device) -> tuple[dict[str, LVal], dict[str, Layout]]:
    """The stage's parameter blocks this rank holds between steps (``layer.role`` → leaf
    that requires its gradient), and every parameter's planned layout (a ZeRO-3 shard's
    too, which the op's forward gathers into that layout)."""
    params: dict[str, LVal] = {}
    layout_of: dict[str, Layout] = {}
    for name in stage.layers:
        blocks, layouts = _initial_blocks(compiled, name, comm, seed, device)
        layout_of.update({f"{name}.{role}": lay for role, (lay, _) in layouts.items()})
        shard_only = zero.shard_layer(name, blocks, layouts)
        for role, local in blocks.items():
            if role not in shard_only:
                params[f"{name}.{role}"] = LVal(local.requires_grad_(True), layouts[role][0])
    zero.hook(params)
    return params, layout_of


def _initial_blocks(compiled: CompiledPlan, name: str, comm: Comm, seed: int,
                    device: torch.device
                    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[Layout, Layout]]]:
    """Layer ``name``'s blocks of its deterministically initialised parameters, and each
    role's (stored, gradient) layouts."""
    op, lp = compiled.graph[name], compiled.layers[name]
    layouts = param_layouts(op, lp.strategy, lp.inputs, lp.weight, lp.output)
    specs = {p.role: p for p in model.param_specs(op)}
    blocks: dict[str, torch.Tensor] = {}
    for role, (lay, _) in layouts.items():
        if name in compiled.tied:
            emb = compiled.graph[compiled.tied[name]]
            full = model.init_param(model.param_specs(emb)[0], seed).t()
        else:
            full = model.init_param(specs[role], seed)
        blocks[role] = comm.block(full.to(device), lay)
    return blocks, layouts
