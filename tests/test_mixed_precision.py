"""Mixed precision: half-precision activations and collectives, fp32 master weights and fp32
gradient reduction — priced that way by the planner and run that way by the runtime (the
multi-rank equivalence and audit of a bfloat16 GPT ride in tests/test_runtime.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, S
from ilp_planner.lowering.cost_model import MemorySpec
from ilp_planner.lowering.redistribution import plan_redistribution
from ilp_planner.lowering.strategies import grad_sync, tied_exchange_collectives
from runtime import model
from runtime.errors import RuntimeSetupError
from runtime.optim import OptimizerSpec
from runtime.reference import compare, run_reference, tolerance

CLUSTER = Cluster(2, 2, memory_bytes=16 * 2**30, peak_flops=1e13,
                  intra=Link.from_bandwidth(5, 800), inter=Link.from_bandwidth(10, 50))
SHAPE = dict(hidden=32, layers=2, heads=4, seq_len=8, vocab=64, batch=4)


def _syncs(dtype: str, choice: list[int]) -> list[tuple[float, int]]:
    gp = build_problem(models.gpt(**SHAPE, dtype=dtype), CLUSTER, 2, 2,
                       MemorySpec.preset("adam_mixed"), tie_layers=False)
    chosen = gp.node_choice(choice)
    out = []
    for op in gp.graph.ops:
        if op.name in gp.members:
            o = chosen[op.name]
            out += [(b.collective.bytes, b.numel) for b in
                    grad_sync(op, o.base.label, o.inputs[0], o.base.weight, o.outputs[0], gp.ctx)]
    return out


def test_gradients_are_reduced_at_four_bytes_whatever_the_compute_dtype():
    gp = build_problem(models.gpt(**SHAPE), CLUSTER, 2, 2, MemorySpec.preset("adam"),
                       tie_layers=False)
    rng = np.random.default_rng(0)
    for _ in range(5):
        choice = [int(rng.integers(len(c))) for c in gp.problem.cost]
        half, full = _syncs("bfloat16", choice), _syncs("float32", choice)
        assert half == full and half
        assert all(nbytes == 4 * numel for nbytes, numel in half)


def test_activations_move_in_the_compute_dtype():
    """An edge's program moves half the bytes in bfloat16; the tied table's gradient
    exchange moves its master's (:attr:`Op.master_spec`): fp32 under mixed precision."""
    fact = (MeshAxis(2, 1), MeshAxis(1, 2))
    src, dst = Layout(fact, (S(0), S(1))), Layout(fact, (B, S(0)))
    full = plan_redistribution(src, dst, TensorSpec((16, 32)), CLUSTER)
    half = plan_redistribution(src, dst, TensorSpec((16, 32), "bfloat16"), CLUSTER)
    steps = full.forward + full.backward
    assert steps and [c.bytes / 2 for c in steps] == [c.bytes for c in half.forward + half.backward]
    emb, head = Layout(fact, (S(0), B)), Layout(fact, (B, S(0)))
    assert [c.bytes for c in tied_exchange_collectives(emb, head, TensorSpec((64, 32)),
                                                       CLUSTER)[0]] \
        == [c.bytes for c in tied_exchange_collectives(
            emb, head, TensorSpec((64, 32), "bfloat16").master, CLUSTER)[0]]


def test_adam_mixed_counts_the_fp32_gradient():
    assert MemorySpec.preset("adam_mixed").bytes_per_param == 2 + 4 + 12


SGD = OptimizerSpec("sgd", 0.1)


@pytest.fixture(scope="module")
def gpt32():
    return load_config("configs/tiny-gpt-cpu.yaml").graph


def _reference(dtype: str, steps: int = 2):
    graph = load_config("configs/tiny-gpt-cpu.yaml").with_overrides({"model.dtype": dtype}).graph
    return graph, run_reference(graph, steps=steps, seed=0, optimizer=SGD)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_reference_keeps_fp32_masters_and_tracks_fp32(gpt32, dtype):
    """The single-process half-precision run: parameters stay fp32, the compute really is
    in the half type (the losses differ from fp32's), and it stays within the dtype's
    tolerance of the fp32 run."""
    graph, half = _reference(dtype)
    full = run_reference(gpt32, steps=2, seed=0, optimizer=SGD)
    assert model.compute_dtype(graph) == getattr(torch, dtype)
    assert all(p.dtype == torch.float32 for p in half.params.values())
    assert half.losses != full.losses
    cmp = compare(half.losses, half.params, full)
    assert cmp.ok(tolerance(graph)), cmp.to_dict()
    assert half.losses[-1] < half.losses[0]


ADAM = OptimizerSpec("adam", 1e-2)


def test_adam_in_bfloat16_is_compared_against_its_own_drift_from_float32():
    """Adam in bfloat16 (tiny GPT, lr 1e-2, the shipped config's): the same training with
    another summation order (two micro-batches for one) sits a few 1e-2 of a parameter's
    norm away — beyond the dtype's tolerance, as far as bfloat16 itself is from float32 — and
    is equivalent within twice the reference's measured drift; a run whose last step missed
    one parameter's update (a gradient never synchronised) is not. Float32 and SGD measure
    no drift: their tolerance is the dtype's alone."""
    graph = load_config("configs/tiny-gpt-bf16-cpu.yaml").graph
    one = run_reference(graph, steps=2, seed=0, optimizer=ADAM)
    two = run_reference(graph, steps=2, seed=0, optimizer=ADAM, microbatches=2)
    rtol = tolerance(graph)
    assert set(one.drift) == set(one.params) and max(one.drift.values()) > rtol
    same = compare(two.losses, two.params, one)
    assert same.param_rel_err > rtol and same.ok(rtol), same.to_dict()
    assert not same.ok(rtol, drift=False)  # a tolerance the user names is taken as it is
    # the drift hides no missed update the dtype's tolerance would catch, on any parameter
    first = run_reference(graph, steps=1, seed=0, optimizer=ADAM)
    caught = 0
    for name in one.params:
        stale = compare(two.losses, {**two.params, name: first.params[name]}, one)
        if stale.param_rel_errs[name] > rtol:
            assert not stale.ok(rtol), (name, stale.param_rel_errs[name])
            caught += 1
    assert caught >= len(one.params) - 5  # all but the norms' gains (a step is 0.7 % of 1)
    assert not run_reference(load_config("configs/tiny-gpt-cpu.yaml").graph, steps=1, seed=0,
                             optimizer=ADAM).drift
    assert not run_reference(graph, steps=1, seed=0, optimizer=SGD).drift


def test_the_float32_twin_casts_float_inputs_too():
    """A model whose input is floating point (an MLP's features) trains its float32 twin on
    the same data in float32, and measures a drift."""
    graph = load_config("configs/tiny-mlp-cpu.yaml").with_overrides(
        {"model.dtype": "bfloat16"}).graph
    ref = run_reference(graph, steps=2, seed=0, optimizer=ADAM)
    assert ref.drift and all(d >= 0 for d in ref.drift.values())


def test_loss_scale_only_for_float16():
    assert model.loss_scale(_reference("float16", 1)[0]) == model.FP16_LOSS_SCALE
    assert model.loss_scale(_reference("bfloat16", 1)[0]) == 1.0


def test_overflowing_float16_gradients_stop_the_run():
    grads = {"fc1.weight": torch.tensor([1.0, float("inf")])}
    with pytest.raises(FloatingPointError, match="fc1.weight.*not finite.*bfloat16"):
        model.unscale(grads, 1024.0)
    ok = {"fc1.weight": torch.tensor([2048.0])}
    model.unscale(ok, 1024.0)
    assert float(ok["fc1.weight"]) == 2.0


@pytest.mark.parametrize("dtypes", [("float64", None), ("float32", "bfloat16")])
def test_runtime_refuses_float64_and_mixed_graphs(dtypes):
    main, other = dtypes
    ops = [{"name": "x", "kind": "input", "shape": [8, 16]},
           {"name": "fc", "kind": "linear", "inputs": ["x"], "shape": [8, 4], "weight": [16, 4]},
           {"name": "loss", "kind": "loss", "inputs": ["fc"], "shape": [1]}]
    if other:
        ops[1]["dtype"] = other
    graph = models.graph_from_spec({"kind": "graph", "dtype": main, "ops": ops})
    with pytest.raises(RuntimeSetupError, match="computes in exactly one of"):
        model.check_supported(graph)


def test_summa_gathers_the_fp32_master_weight():
    """SUMMA's weight gather (and its backward reduce-scatter of weight gradients) moves the
    master (:attr:`Op.master_spec`: fp32 under mixed precision) whatever the compute dtype;
    the activation gather moves the half type."""
    from ilp_planner.lowering.strategies import summa_programs

    fact = (MeshAxis(1, 2), MeshAxis(1, 2))
    half = summa_programs(fact, TensorSpec((16, 32), "bfloat16"),
                          TensorSpec((32, 8), "bfloat16").master, CLUSTER)
    full = summa_programs(fact, TensorSpec((16, 32)), TensorSpec((32, 8)), CLUSTER)
    w_half, w_full = (p[1].forward + p[1].backward for p in (half, full))
    x_half, x_full = (p[0].forward + p[0].backward for p in (half, full))
    assert w_half and [c.bytes for c in w_half] == [c.bytes for c in w_full]
    assert x_half and [c.bytes for c in x_half] == [c.bytes / 2 for c in x_full]


def test_an_imported_half_precision_module_trains_its_parameters_as_they_are():
    """``parallelize`` leaves a bfloat16 module's parameters to the user's optimizer — no
    float32 copy — so the import for it marks them ``attrs.own_precision``: gradients
    reduced in bfloat16 (half the bytes the mixed-precision executor's fp32 reduction
    moves), no master casts, Adam's state in bfloat16 (``adam_half``, 8 bytes a
    parameter); the bare import (``dtensor=False``, the executor's) keeps mixed precision.
    The plan's record of the module reads back with the same dtype and bytes."""
    import ilp_planner
    from ilp_planner.lowering.compute_model import master_weight_seconds, update_seconds
    from ilp_planner.lowering.strategies import StrategyContext, op_strategies
    from tests.helpers.user_models import NanoGPT

    module = NanoGPT(vocab=64, block_size=8, n_embd=16, n_head=2, n_layer=2).to(torch.bfloat16)
    ids = torch.randint(0, 64, (4, 8))
    own = ilp_planner.from_module(module, (ids,))
    bare = ilp_planner.from_module(module, (ids,), dtensor=False)
    owners = [op.name for op in own.ops if op.source_params]
    assert owners and all(own[n].attrs.get("own_precision") for n in owners)
    assert not any(op.attrs.get("own_precision") for op in bare.ops)
    flat = {"gpu": "a100-80gb", "nodes": 1, "devices_per_node": 4, "intra": "nvlink3",
            "inter": "8x-ib-hdr200"}
    config, mixed = (load_config({"model": g, "cluster": flat}) for g in (own, bare))
    assert config.memory == MemorySpec.preset("adam_half") == MemorySpec(2.0, 2.0, 4.0)
    assert mixed.memory == MemorySpec.preset("adam_mixed")
    fc = next(n for n in owners if own[n].kind.value == "linear" and own[n].params > 1000)
    for graph, cfg, item, casts in ((own, config, 2, False), (bare, mixed, 4, True)):
        op = graph[fc]
        assert op.master_spec.dtype == ("float32" if casts else "bfloat16")
        assert op.mixed_precision is casts
        ctx = StrategyContext(cfg.cluster, 1, 4, cfg.memory)
        dp = next(s for s in op_strategies(op, [graph[i].output for i in op.inputs], ctx)
                  if s.output.split_degree(0) == 4)
        (bucket,) = grad_sync(op, dp.label, dp.inputs, dp.weight, dp.output, ctx)
        assert bucket.collective.bytes == op.params * item
        # one micro-batch, nothing accumulated: the casts between master and copy alone
        assert (master_weight_seconds(op, op.params, 2, cfg.memory, 1, False, cfg.cluster)
                > 0) is casts
    assert update_seconds(1e6, config.memory, own[fc], config.cluster) < update_seconds(
        1e6, mixed.memory, bare[fc], mixed.cluster)
    plan = ilp_planner.solve(own, cluster=flat, baselines=False)
    back = load_config(plan.config)
    assert back.memory == config.memory and back.cluster == config.cluster
