"""Baseline members built in the plan's build cache (the options the plan's build priced,
shared per base strategy) price exactly as members built with no cache at all: the same
objective and the same realised cost block, member for member — on two shipped configs
and on a GPT under a tight budget, where the torchtitan grid's FSDP and checkpointing
points (state sharding levels, recomputed options) are the ones that fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.baseline_prices import MemberBuilder
from ilp_planner.intra_op.baselines import (
    _BUILT,
    Priced,
    price_families,
    torchtitan_choice,
    two_axis_meshes,
)
from ilp_planner.intra_op.problem import BuildCache, GraphProblem, NodeCosts, build_nodes
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_mesh
from tests.test_baselines_at_scale import gpt_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _uncached(request: MeshSolveRequest):
    """The members' :data:`~ilp_planner.intra_op.baselines.Build` with no build cache:
    every option priced afresh for every member."""
    config = request.config

    def build(levels: tuple[int, ...], blocks: frozenset, keep, dp: int) -> NodeCosts:
        return build_nodes(request.graph, config.cluster, request.nodes, request.local,
                           config.memory, tie_layers=config.solver.tie_layers,
                           memory_budget=request.memory_budget,
                           microbatches=request.microbatches,
                           grad_bucket_bytes=config.grad_bucket_bytes, zero_levels=levels,
                           recompute=blocks, keep=keep)
    return build


def _block(gp: GraphProblem, choice: list[int]) -> dict:
    return realise(gp, choice)[1].to_dict()


def _assert_same_prices(config) -> None:
    request = dataclasses.replace(MeshSolveRequest.whole_cluster(config), cache=BuildCache())
    # the plan's build (unbudgeted: under the budget it may not fit) fills the cache the
    # members then share
    solve_mesh(dataclasses.replace(request, memory_budget=None))
    assert request.cache.base_options
    args = (request.nodes, request.local, request.microbatches, request.memory_budget,
            config.solver.time_limit_s)
    warm = price_families(MemberBuilder(request), *args)
    cold = price_families(_uncached(request), *args)
    assert warm.keys() == cold.keys()
    for name, priced in warm.items():
        assert isinstance(priced, Priced) == isinstance(cold[name], Priced), name
        if isinstance(priced, Priced):
            assert priced.objective == cold[name].objective, name
            assert _block(priced.gp, priced.choice) == _block(cold[name].gp, cold[name].choice)
        else:
            assert priced == cold[name]
    grid = [torchtitan_choice(request.graph, build, request.nodes, request.local,
                              request.memory_budget, config.solver.time_limit_s,
                              request.microbatches)
            for build in (MemberBuilder(request), _uncached(request))]
    assert isinstance(grid[0], str) == isinstance(grid[1], str)
    if isinstance(grid[0], str):
        assert grid[0] == grid[1]
        return
    assert (grid[0].name, grid[0].objective, grid[0].reserve) == (
        grid[1].name, grid[1].objective, grid[1].reserve)
    assert _block(grid[0].gp, grid[0].choice) == _block(grid[1].gp, grid[1].choice)


@pytest.mark.parametrize("name", ["tiny-gpt-cpu", "tiny-vgg-cpu"])
def test_members_in_the_plans_cache_price_as_built_alone(name):
    _assert_same_prices(load_config(CONFIGS / f"{name}.yaml"))


def test_grid_points_with_state_sharding_and_recomputation_price_as_built_alone():
    config = gpt_config(1, 4, memory_gib=0.001, layers=3)  # the grid's best: ac=full
    _assert_same_prices(config)


def test_families_after_the_grid_price_only_their_own_members():
    """Megatron's and Megatron-SP's members are the torchtitan grid's DDP points without
    checkpointing: priced after the grid by the same builder, the families build only data
    parallel's and SUMMA's members anew, and every family prices as on a builder of its
    own."""
    config = load_config(CONFIGS / "tiny-gpt-cpu.yaml")
    request = dataclasses.replace(MeshSolveRequest.whole_cluster(config), cache=BuildCache())
    args = (request.nodes, request.local, request.microbatches, request.memory_budget,
            config.solver.time_limit_s)
    shared = MemberBuilder(request)
    torchtitan_choice(request.graph, shared, request.nodes, request.local,
                      request.memory_budget, config.solver.time_limit_s, request.microbatches)
    built_by_grid = len(_BUILT[shared])
    after_grid = price_families(shared, *args)
    meshes = two_axis_meshes(request.nodes, request.local)
    assert len(_BUILT[shared]) - built_by_grid == 1 + len(meshes)  # data parallel, SUMMA
    alone = price_families(MemberBuilder(request), *args)
    assert after_grid.keys() == alone.keys()
    for name, priced in after_grid.items():
        assert isinstance(priced, Priced), name
        assert priced.objective == alone[name].objective, name
        assert _block(priced.gp, priced.choice) == _block(alone[name].gp, alone[name].choice)
