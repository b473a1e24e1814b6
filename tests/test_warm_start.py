"""An untied solve starts from the tied optimum, so it is never worse than tying, even when
CBC has almost no time."""

from __future__ import annotations

from pathlib import Path

import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_mesh

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-cpu.yaml"


def test_untied_is_never_worse_than_tied_even_with_a_tiny_time_limit():
    base = load_config(TINY).with_overrides({"model.layers": 4, "solver.time_limit_s": 1e-3})
    tied = base.with_overrides({"solver.tie_layers": True})
    untied = base.with_overrides({"solver.tie_layers": False})
    _, t = solve_mesh(MeshSolveRequest.whole_model(tied, 2, 4, tied.cluster.memory_bytes))
    gp, u = solve_mesh(MeshSolveRequest.whole_model(untied, 2, 4, untied.cluster.memory_bytes))
    assert len(gp.groups) > len(set(op.tie_key for op in gp.graph.ops if op.tie_key))
    assert u.objective <= t.objective * (1 + 1e-9)
    assert gp.problem.objective(list(u.choice)) == pytest.approx(u.objective, rel=1e-12)
