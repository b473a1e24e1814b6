"""Frozen parameters (``requires_grad=False``: a fine-tuning's frozen embeddings, base or
vision tower) are planned as they run: the importer marks each op whose parameters are all
frozen (:attr:`Op.frozen`), and its strategies hold the weights alone — no gradient
synchronisation, optimizer state, update or ZeRO variant — its backward computes the input
gradient only (a linear's dX, an embedding nothing), and what it computes from data alone
takes no gradient (:meth:`Graph.gradient_carriers`). An op frozen in part, or a frozen tied
table, is refused by name. (Training under ``parallelize`` against one process, audited:
``test_parallelize``'s ``frozen`` case.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ilp_planner
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import load_config
from ilp_planner.lowering.compute_model import least_seconds, op_times
from ilp_planner.lowering.cost_model import memory_terms
from ilp_planner.lowering.grad_buckets import fill_buckets
from ilp_planner.lowering.strategies import StrategyContext, grad_sync, op_strategies
from ilp_planner.reports.explain import explain
from tests.helpers.user_models import FrozenBase, NanoGPT

IDS = torch.randint(0, 64, (4, 8))
CLUSTER = {"gpu": "a100-80gb", "nodes": 1, "devices_per_node": 4, "intra": "nvlink3",
           "inter": "8x-ib-hdr200"}
FLAT = {"nodes": 1, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 1,
        "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                  "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}


def _graphs():
    """FrozenBase imported frozen, and the same module trained whole."""
    frozen, trained = FrozenBase(), FrozenBase()
    for p in trained.parameters():
        p.requires_grad_(True)
    return (ilp_planner.from_module(frozen, (IDS,)), ilp_planner.from_module(trained, (IDS,)))


def test_import_marks_ops_whose_parameters_are_all_frozen() -> None:
    frozen, trained = _graphs()
    assert [op.name for op in frozen.ops if op.frozen] == ["embed", "base"]
    assert not any(op.frozen for op in trained.ops)
    # nothing below the adapter takes a gradient: the frozen base reads frozen lookups
    assert frozen.gradient_carriers() == {"adapter", "head", "loss"}
    assert {"embed", "base", "act"} <= trained.gradient_carriers()


@pytest.mark.parametrize("optimizer", ["adam", "adam_mixed", "sgd"])
def test_a_frozen_op_holds_its_weights_only(optimizer) -> None:
    frozen, trained = _graphs()
    config = load_config({"model": trained, "cluster": CLUSTER,
                          "training": {"optimizer": optimizer}})
    memory = config.memory
    ctx = StrategyContext(config.cluster, 1, 4, memory, zero_levels=(0, 1, 2, 3))
    for name in ("embed", "base"):
        ins = [frozen[i].output for i in frozen[name].inputs]
        mine = op_strategies(frozen[name], ins, ctx)
        theirs = [s for s in op_strategies(trained[name], ins, ctx) if not s.zero]
        assert [s.label for s in mine] == [s.label for s in theirs]  # no ZeRO variant
        for s, t in zip(mine, theirs, strict=True):
            local = t.update_params
            assert s.state_bytes == pytest.approx(local * memory.weight_bytes)
            assert t.state_bytes == pytest.approx(local * memory.bytes_per_param)
            assert s.update_params == 0.0
            assert not grad_sync(frozen[name], s.label, s.inputs, s.weight, s.output, ctx)
            assert not any(c.purpose == "grad_sync" for c in s.collectives)


def test_the_memory_lower_bound_counts_a_frozen_weight_alone() -> None:
    frozen, trained = _graphs()
    memory = load_config({"model": trained, "cluster": CLUSTER}).memory
    terms = {t.name: t for t in memory_terms(frozen, memory)}
    theirs = {t.name: t for t in memory_terms(trained, memory)}
    for name in ("embed", "base"):
        assert terms[name].state_bytes == frozen[name].params * memory.weight_bytes
        assert theirs[name].state_bytes == frozen[name].params * memory.bytes_per_param
    assert terms["head"].state_bytes == theirs["head"].state_bytes


def _reached(op):
    """``op`` as if its output took a gradient (a later trained layer reading it)."""
    return dataclasses.replace(op, attrs={k: v for k, v in op.attrs.items() if k != "no_grad"})


def test_a_frozen_op_computes_no_weight_gradient() -> None:
    frozen, trained = _graphs()
    cluster = load_config({"model": trained, "cluster": CLUSTER}).cluster
    base = _reached(frozen["base"])
    fwd, bwd = op_times(base, 1.0, cluster)
    tf, tb = op_times(trained["base"], 1.0, cluster)
    assert fwd == tf and bwd == fwd  # dX = dY·Wᵀ: one product the forward's size
    assert tb > 1.9 * tf  # dX and dW (and the bias's rows summed)
    embed = _reached(frozen["embed"])
    assert op_times(embed, 1.0, cluster)[1] == 0.0  # no scatter into the table
    assert op_times(trained["embed"], 1.0, cluster)[1] > 0.0


def test_the_plan_prices_no_gradient_for_frozen_layers_and_explain_names_them() -> None:
    frozen, trained = _graphs()
    mine = ilp_planner.solve(frozen, cluster=CLUSTER, baselines=False)
    theirs = ilp_planner.solve(trained, cluster=CLUSTER, baselines=False)
    layers = {lp.name: lp for lp in mine.layers}
    for name in ("embed", "base"):
        assert not any(c.purpose == "grad_sync" for c in layers[name].collectives)
    assert mine.cost.total_s < theirs.cost.total_s
    assert mine.cost.peak_memory_bytes < theirs.cost.peak_memory_bytes
    assert "frozen (requires_grad=False: weights held, no gradient, synchronisation or " \
           "optimizer state): embed, base" in explain(mine)


def test_a_frozen_tied_table_is_refused_by_name() -> None:
    model = NanoGPT(vocab=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model.lm_head.weight.requires_grad_(False)  # the table wte shares
    model.transformer.wpe.weight.requires_grad_(False)  # looked up by the same op
    with pytest.raises(ConfigError, match=r"op '[\w.]+': its table is frozen and tied to "
                                          r"another op, whose gradient exchange needs both "
                                          r"copies trained — unfreeze it or untie the copies"):
        ilp_planner.from_module(model, (IDS,))


@pytest.mark.parametrize("flat", [False, True])
def test_what_takes_no_gradient_runs_no_backward(flat) -> None:
    """The frozen base reads frozen lookups, and the GELU reads the base: none of their
    outputs takes a gradient (``attrs.no_grad``), so autograd runs none of their backward
    — priced so, on the roofline and the flat model alike, and the stage bound's least
    seconds stay below."""
    frozen, trained = _graphs()
    assert [op.name for op in frozen.ops if op.no_grad] == ["embed", "base", "act"]
    assert not any(op.no_grad for op in trained.ops)
    cluster = load_config({"model": trained, "cluster": FLAT if flat else CLUSTER}).cluster
    for name in ("embed", "base", "act"):
        fwd, bwd = op_times(frozen[name], 1.0, cluster)
        assert bwd == 0.0 and fwd == op_times(trained[name], 1.0, cluster)[0]
        assert least_seconds(frozen[name], cluster) <= fwd
    assert op_times(frozen["adapter"], 1.0, cluster) == op_times(trained["adapter"], 1.0, cluster)


@pytest.mark.parametrize("frozen_block", [0, 1])
def test_a_frozen_copy_of_a_repeated_block_is_planned_apart_from_its_trained_copies(
        frozen_block) -> None:
    """A fine-tuning that freezes one of a model's repeated blocks: the frozen copy is not
    tied to the trained ones (one decision, one options list, would price every copy as
    the first: no gradient synchronisation for the trained blocks, or one for the frozen).
    The gradient AllReduces the plan lists are the ones its layers issue at run time
    (``runtime.apply``'s check: :func:`grad_sync` of each layer's layouts, bucketed by
    :func:`fill_buckets`), and each trained block synchronises its weights."""
    model = NanoGPT(vocab=64, block_size=8, n_embd=16, n_head=2, n_layer=3)
    for p in model.transformer.h[frozen_block].parameters():
        p.requires_grad_(False)
    graph = ilp_planner.from_module(model, (IDS,))
    plan = ilp_planner.solve(graph, cluster=FLAT, baselines=False)
    config = load_config(plan.config)
    cl = config.cluster
    ctx = StrategyContext(cl, cl.nodes, cl.devices_per_node, config.memory)
    layers = {ly.name: ly for ly in plan.layers}
    syncs = [(op.name, b) for op in graph.ops if op.name in layers
             for b in grad_sync(op, layers[op.name].strategy, layers[op.name].inputs,
                                layers[op.name].weight, layers[op.name].output, ctx)]
    issued = sorted((c.launcher, c.collective.bytes, c.collective.group_size)
                    for c in fill_buckets(syncs, config.grad_bucket_bytes, ctx))
    listed = sorted((ly.name, c.bytes, c.group_size) for ly in plan.layers
                    for c in ly.collectives if c.purpose == "grad_sync")
    assert listed == issued
    synced = {name.split(".")[2] for name, _ in syncs if name.startswith("transformer.h.")}
    assert synced == {str(i) for i in range(3)} - {str(frozen_block)}
