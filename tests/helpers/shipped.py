"""Shipped configs solved once per test session.

Several modules assert different things about the same solve of a shipped config (it
explains and compiles, it beats the torchtitan grid, it uses ZeRO where memory binds,
eager-1F1B is no slower than 1F1B on it); the large ones take up to a minute each, so the
suite solves each (config, baselines) pair once and hands every test its own deep copy — a
test that changes its plan cannot change what another test reads.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

from ilp_planner.api import solve
from ilp_planner.plan.data import Plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@functools.cache
def _solved(name: str, baselines: bool) -> Plan:
    return solve(CONFIGS / f"{name}.yaml", baselines=baselines)


def shipped_plan(name: str, *, baselines: bool) -> Plan:
    """``solve(configs/<name>.yaml, baselines=baselines)``, solved once per session; the
    caller's own copy."""
    return copy.deepcopy(_solved(name, baselines))
