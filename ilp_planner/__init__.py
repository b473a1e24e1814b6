"""ilp_planner: auto-parallel planning (SBP ILP, stage DP, cross-mesh resharding) and a
torch.distributed runtime for the plans.

Public API: :func:`solve` (:mod:`ilp_planner.api`), :func:`load_config`, :class:`Config`,
:class:`Plan`, :func:`explain` and :func:`summary` (reports of a plan), :func:`sweep` and
:func:`load_sweep` (batch solves), :func:`from_module` (a user's ``nn.Module`` → :class:`Graph`),
:func:`parallelize` (a plan applied to that module under ``torchrun``, :mod:`runtime.apply`;
``apply`` is the same function; :func:`full_value` reads a loss computed from its output,
:func:`full_state_dict` and :func:`load_full_state_dict` its whole state in the module's own
order, :func:`clip_grad_norm_` clips its gradients, which lie on several device meshes),
and :func:`to_parallelize_plan` with :func:`tensor_parallel_mesh` (the plan as PyTorch
tensor-parallel styles and their mesh, :mod:`runtime.tp_styles`). They are resolved lazily
so that importing an IR module (``ilp_planner.ir.graph``) pulls in neither the solvers nor
torch.
"""

from __future__ import annotations

import importlib

_API = {
    "solve": "ilp_planner.api",
    "explain": "ilp_planner.reports.explain",
    "summary": "ilp_planner.reports.explain",
    "parallelize": "runtime.apply",
    "to_parallelize_plan": "runtime.tp_styles",
    "tensor_parallel_mesh": "runtime.tp_styles",
    "load_config": "ilp_planner.inputs.config",
    "Config": "ilp_planner.inputs.config",
    "Plan": "ilp_planner.plan.data",
    "sweep": "ilp_planner.sweeps.sweep",
    "load_sweep": "ilp_planner.sweeps.spec",
    "from_module": "ilp_planner.inputs.importer",
    "apply": "runtime.apply",
    "full_value": "runtime.apply",
    "full_state_dict": "runtime.apply",
    "load_full_state_dict": "runtime.apply",
    "clip_grad_norm_": "runtime.grad_clip",
    "Graph": "ilp_planner.ir.graph",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ilp_planner' has no attribute {name!r}")
