"""Skipping the solve of a baseline member whose lower bound already exceeds its family's
best (``prune``, the default) leaves every price exactly as solving every member: the same
member names, objectives, realised cost blocks and ``n/a`` reasons — on shipped configs
(dense, MoE, vision) and on a GPT under a tight budget where the torchtitan grid's FSDP
and checkpointing points are the ones that fit. And the bound is one: no member's exact
price goes below it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.baseline_prices import MemberBuilder
from ilp_planner.intra_op.baselines import (
    Priced,
    lower_bound,
    price_families,
    solve_exact,
    torchtitan_choice,
)
from ilp_planner.intra_op.moe_baselines import has_moe
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from tests.test_baselines_at_scale import gpt_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _block(priced) -> dict:
    return realise(priced.gp, priced.choice)[1].to_dict()


def _assert_pruning_keeps_prices(config) -> None:
    request = MeshSolveRequest.whole_cluster(config)
    args = (request.nodes, request.local, request.microbatches, request.memory_budget,
            config.solver.time_limit_s)
    moe = has_moe(request.graph)
    fast = price_families(MemberBuilder(request), *args, moe=moe)
    slow = price_families(MemberBuilder(request), *args, moe=moe, prune=False)
    assert fast.keys() == slow.keys()
    for name, priced in fast.items():
        if isinstance(priced, Priced):
            assert isinstance(slow[name], Priced), name
            assert priced.objective == slow[name].objective, name
            assert _block(priced) == _block(slow[name]), name
        else:
            assert priced == slow[name], name
    grid = [torchtitan_choice(request.graph, MemberBuilder(request), request.nodes,
                              request.local, request.memory_budget,
                              config.solver.time_limit_s, request.microbatches, prune=prune)
            for prune in (True, False)]
    if isinstance(grid[0], str) or isinstance(grid[1], str):
        assert grid[0] == grid[1]
        return
    assert (grid[0].name, grid[0].objective, grid[0].reserve) == (
        grid[1].name, grid[1].objective, grid[1].reserve)
    assert _block(grid[0]) == _block(grid[1])


@pytest.mark.parametrize("name", ["tiny-gpt-cpu", "tiny-moe-cpu", "tiny-vgg-cpu",
                                  "tiny-mlp-cpu"])
def test_pruned_members_leave_every_shipped_price_unchanged(name):
    _assert_pruning_keeps_prices(load_config(CONFIGS / f"{name}.yaml"))


def test_pruning_keeps_the_grids_fsdp_and_checkpointed_points():
    _assert_pruning_keeps_prices(gpt_config(1, 4, memory_gib=0.001, layers=3))


def test_the_lower_bound_is_below_every_members_exact_price():
    config = load_config(CONFIGS / "tiny-gpt-cpu.yaml")
    request = MeshSolveRequest.whole_cluster(config)
    slow = price_families(MemberBuilder(request), request.nodes, request.local,
                          request.microbatches, None, config.solver.time_limit_s,
                          prune=False)
    checked = 0
    for priced in slow.values():
        if isinstance(priced, Priced):
            out = solve_exact(priced.gp.problem, config.solver.time_limit_s)
            assert not isinstance(out, str)
            assert lower_bound(priced.gp.problem) <= out[1] * (1 + 1e-12)
            checked += 1
    assert checked >= 3
