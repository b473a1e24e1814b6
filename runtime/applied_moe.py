"""Imported mixture-of-experts blocks under ``parallelize`` (:mod:`runtime.apply`).

The importer lifts a Hugging Face routed block (Mixtral, Qwen2-MoE, GraniteMoE,
DeepSeek-V2/V3, GPT-OSS) as one ``moe`` op named ``<experts module>.moe`` that owns the
router's weight (``gate`` or ``router``: :func:`~ilp_planner.inputs.lift_moe.hf_router`) and
the experts' ``gate_up_proj`` and ``down_proj`` (GPT-OSS's with their biases, the router's
too) in the module's own orientation
(:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`). The block's own forward
routes with the whole router and loops over every expert — nothing a token block and this
rank's experts can run — so, as during the export, the router becomes a pass-through and
the experts module runs the runtime's MoE kernel (:func:`runtime.moe.local_moe`) on this
rank's blocks: its boundary hooks (:mod:`runtime.applied_hooks`) hand it its token block and
its parameter blocks as local tensors, it issues the planned dispatch and combine AllToAlls
through the runtime's :class:`~runtime.comm.Comm` (tagged, so the audit counts them), and
its output block is wrapped back into a DTensor in the planned layout. A sigmoid router's
correction bias (``e_score_correction_bias``) is a buffer of the router (DeepSeek-V3's) or
of the block (MiniMax-M2's, HY-V3's), the same on every rank: the kernel reads it there.
The swap is made on the module's instances; the block's other code (Qwen2-MoE's shared
expert and its gate) runs as it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ilp_planner.inputs.lift_moe import correction_bias, hf_router, router_weight
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.lowering.moe_strategies import HF_INTERLEAVED, hf_experts, hf_form, moe_programs
from ilp_planner.plan.data import LayerPlan
from runtime.comm import Comm
from runtime.errors import RuntimeSetupError
from runtime.moe import hf_roles, local_moe

SUFFIX = ".moe"  # the importer names the op after the experts module that runs it


def moe_path(module: nn.Module, op: Op) -> str | None:
    """The path of the experts module running imported MoE op ``op``, if it has one."""
    if op.kind is not OpKind.MOE or not hf_experts(op) or not op.name.endswith(SUFFIX):
        return None
    path = op.name[: -len(SUFFIX)]
    try:
        experts = module.get_submodule(path)
    except AttributeError:
        return None
    return path if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") else None


def install_moe(graph: Graph, layers: dict[str, LayerPlan], module: nn.Module,
                comm: Comm) -> None:
    """Register every MoE op's AllToAll groups and swap its block's router and experts
    forwards for the runtime's kernel (module docstring); refuses a MoE op with no
    Hugging Face experts module to run it."""
    for op in graph.ops:
        if op.kind is not OpKind.MOE:
            continue
        path = moe_path(module, op)
        if path is None:
            raise RuntimeSetupError(
                f"op {op.name!r} is a mixture of experts that parallelize cannot find in the "
                f"module: it runs blocks imported from Hugging Face's nn.Modules (a router "
                f"'gate' or 'router' beside 'experts' holding gate_up_proj and down_proj)")
        lp = layers[op.name]
        for red in moe_programs(op, lp.inputs[0], comm.cluster) or ():
            comm.register(red)
        experts = module.get_submodule(path)
        parent, _, _ = path.rpartition(".")
        block = module.get_submodule(parent) if parent else module
        gate = hf_router(block)
        gate.forward = _pass_through
        experts.forward = _kernel(comm, op, lp, block, gate, experts)


def module_roles(op: Op, gate: nn.Module, experts: nn.Module) -> dict[str, Any]:
    """The block's tensors by the op's roles
    (:func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes`): the router's weight
    (:func:`~ilp_planner.inputs.lift_moe.router_weight`) and the experts' ``gate_up_proj``
    and ``down_proj``, with GPT-OSS's biases."""
    out = {"router": router_weight(gate), "gate_up": experts.gate_up_proj,
           "down": experts.down_proj}
    if hf_form(op) == HF_INTERLEAVED:
        out.update(router_bias=gate.bias, gate_up_bias=experts.gate_up_proj_bias,
                   down_bias=experts.down_proj_bias)
    return out


def _pass_through(x: Any, *_: Any) -> tuple[Any, Any, Any]:
    """The router's place in the block's forward (MiniMax-M2's is handed the correction
    bias too): the experts' kernel routes."""
    return x, x, x


def _kernel(comm: Comm, op: Op, lp: LayerPlan, block: nn.Module, gate: nn.Module,
            experts: nn.Module):
    """The experts module's forward: the kernel on the local blocks its hooks hand it
    (the router's and experts' parameters are read at call time, when they are blocks)."""
    def forward(x: Any, *_routing: Any) -> Any:
        params = hf_roles(op, module_roles(op, gate, experts))
        bias = correction_bias(block, gate)  # a sigmoid router's: a buffer
        if bias is not None:
            params["score_bias"] = bias
        return local_moe(comm, op, lp, x, lp.inputs[0], params)

    return forward
