"""ilp_planner: auto-parallel planning (SBP ILP, stage DP, cross-mesh resharding) and a
torch.distributed runtime for the plans.

Public API: :func:`solve`, :func:`load_config`, :class:`Config`, :class:`Plan`,
:func:`sweep` and :func:`load_sweep` (batch solves, :mod:`ilp_planner.sweeps`),
:func:`from_module` (a user's ``nn.Module`` → :class:`Graph`, :mod:`ilp_planner.importer`)
and :func:`apply` (a plan applied to that module, :mod:`runtime.apply`; also
``plan.parallelize``). They are
resolved lazily so that importing an IR module (``ilp_planner.graph``) does not pull in the
solvers.
"""

from __future__ import annotations

import importlib

_API = {
    "solve": "ilp_planner.planner",
    "load_config": "ilp_planner.config",
    "Config": "ilp_planner.config",
    "Plan": "ilp_planner.plan",
    "sweep": "ilp_planner.sweeps",
    "load_sweep": "ilp_planner.sweeps",
    "from_module": "ilp_planner.importer",
    "apply": "runtime.apply",
    "Graph": "ilp_planner.graph",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ilp_planner' has no attribute {name!r}")
