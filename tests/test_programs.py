"""Edge programs (what ``explain`` prints per input) are the lowered programs the plan
prices: every program's collectives are among its layer's listed collectives."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.inputs.config import load_config
from ilp_planner.plan.programs import edge_programs
from ilp_planner.reports.explain import explain
from ilp_planner.testing import pipelined_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _plans():
    gpt = load_config(CONFIGS / "tiny-gpt-cpu.yaml")
    mlp = load_config(CONFIGS / "tiny-mlp-cpu.yaml")
    pp = {"pipeline": {"stages": 2, "microbatches": 4, "schedule": "1f1b"}}
    return {
        "gpt": lambda: solve(gpt, baselines=False),
        "gpt-pp-solved": lambda: solve(gpt.with_overrides(pp), baselines=False),
        "mlp-pp-hand": lambda: pipelined_plan(mlp, stages=2, schedule="1f1b", microbatches=4),
    }


@pytest.mark.parametrize("name", list(_plans()))
def test_edge_programs_are_priced_on_their_layers(name):
    plan = _plans()[name]()
    layers = {ly.name: ly for ly in plan.layers}
    programs = edge_programs(plan)
    assert programs
    by_layer: dict[str, Counter] = {}
    for ep in (ep for ep in programs if ep.role != "shared"):  # priced on another reader
        by_layer.setdefault(ep.consumer, Counter()).update(
            ep.program.forward + ep.program.backward)
    for layer, needed in by_layer.items():
        listed = Counter(layers[layer].collectives)
        assert not needed - listed, f"{layer}: program collectives not priced: {needed - listed}"
    roles = {ep.role for ep in programs}
    assert ("import" in roles and "export" in roles) == bool(plan.stages)
    text = explain(plan)
    assert "in0 edge from" in text and " fwd " in text
