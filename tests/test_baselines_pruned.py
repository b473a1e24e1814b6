"""Skipping the solve of a baseline member whose lower bound already exceeds its family's
best (``prune``, the default) leaves every price exactly as solving every member: the same
member names, objectives, realised cost blocks and ``n/a`` reasons — on shipped configs
(dense, MoE, vision) and on a GPT under a tight budget where the torchtitan grid's FSDP
and checkpointing points are the ones that fit; the grid's best is the best of every one
of its points solved, none skipped. And the bounds are ones: no member's exact price goes
below them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.baseline_prices import MemberBuilder
from ilp_planner.intra_op.baselines import (
    AC_MODES,
    Priced,
    _Built,
    _fully_sharded,
    _member_price,
    _member_problem,
    _replicated_state,
    ac_blocks,
    lower_bound,
    megatron_filter,
    price_families,
    solve_exact,
    torchtitan_choice,
)
from ilp_planner.intra_op.moe_baselines import has_moe
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.ir.cluster import mesh_factorisations
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


def _every_grid_point_solved(config) -> tuple[float, str] | None:
    """The torchtitan grid's best by brute force: every point — DDP or FSDP × checkpointing
    mode × dp × tp mesh × sequence parallel — built and solved exactly, none skipped (no
    bound, no cutoff, no checkpointing skip): its objective and name."""
    request = MeshSolveRequest.whole_cluster(config)
    build, budget = MemberBuilder(request), request.memory_budget
    best = None
    for fsdp in (False, True):
        for mode in AC_MODES:
            for dp, tp in mesh_factorisations(request.nodes, request.local, 2):
                for sp in (False, True) if tp.size > 1 else (False,):
                    keep = megatron_filter(dp, tp, sp,
                                           _fully_sharded if fsdp else _replicated_state)
                    built = _member_problem(build, keep, dp.size, budget,
                                            (0, 3) if fsdp else (0,),
                                            ac_blocks(request.graph, mode), fsdp)
                    res = (_member_price(built, budget, config.solver.time_limit_s)
                           if isinstance(built, _Built) else None)
                    if isinstance(res, Priced) and (best is None or res.objective < best[0]):
                        best = (res.objective, f"{fsdp} {mode} {dp} {tp} {sp}")
    return best


@pytest.mark.parametrize("memory_gib", [0.0008, 0.0009, 0.00125, 0.0013, 0.002])
def test_the_grid_equals_every_point_solved(memory_gib):
    """The grid's skips — member bounds, solves stopped at the best so far, checkpointing
    skipped where a point's optimum ignores its memory row — leave its best exactly the
    best of every point solved: across budgets where nothing fits, where checkpointing or
    sequence parallelism is needed, where the memory row binds without checkpointing and
    where nothing binds."""
    config = gpt_config(1, 4, memory_gib=memory_gib, layers=3)
    request = MeshSolveRequest.whole_cluster(config)
    grid = torchtitan_choice(request.graph, MemberBuilder(request), request.nodes,
                             request.local, request.memory_budget,
                             config.solver.time_limit_s, request.microbatches)
    brute = _every_grid_point_solved(config)
    if brute is None:
        assert isinstance(grid, str) and "no torchtitan grid member fits" in grid
        return
    assert not isinstance(grid, str), grid
    assert grid.objective == pytest.approx(brute[0], rel=1e-12), (grid.name, brute)


def test_the_node_bound_read_before_the_edges_is_below_the_whole_bound():
    """A member's bound before its edges are priced (``NodeCosts.bound``: the gradient
    latencies already moved to the bucket terms) is at most the whole problem's lower
    bound, itself at most the member's exact price — with fused gradient buckets, where
    latency leaves the options' costs."""
    config = load_config(CONFIGS / "tiny-gpt-cpu.yaml")
    request = MeshSolveRequest.whole_cluster(config)
    assert config.grad_bucket_bytes > 0
    build = MemberBuilder(request)
    checked = 0
    for dp, tp in mesh_factorisations(request.nodes, request.local, 2):
        for sp in (False, True) if tp.size > 1 else (False,):
            nodes = build((0,), frozenset(), megatron_filter(dp, tp, sp), dp.size)
            before = nodes.bound()
            problem = nodes.complete().problem
            out = solve_exact(problem, config.solver.time_limit_s)
            assert not isinstance(out, str) and out is not None
            assert before <= lower_bound(problem) * (1 + 1e-12) <= out[1] * (1 + 1e-12)
            checked += 1
    assert checked >= 5
