"""A single-mesh plan's stated figures against its layouts priced again
(:mod:`ilp_planner.intra_op.reprice`): what the solver writes re-prices to exactly itself; a
file edited after solving — one layer's layouts changed to another strategy of its op, a
collective's seconds, the cost block, the config's links or optimizer — is refused by
``check`` (and ``run``, ``explain``), naming what differs, where before ``check`` passed it
and the runtime would have run one program while ``explain`` reported another."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.cli import main
from ilp_planner.errors import PlanFormatError
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.inter_op.reprice_stages import check_prices, reprice_stages
from ilp_planner.intra_op.reprice import price_differences, reprice
from ilp_planner.lowering.strategies import StrategyContext, op_strategies
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


ONE_F_ONE_B = {"pipeline.stages": 2, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}
"""``tiny-gpt-cpu+1f1b``: the tiny GPT on two stages of four devices under 1F1B."""


@functools.cache
def _solved(name: str) -> dict:
    base, _, variant = name.partition("+")
    config = load_config(CONFIGS / f"{base}.yaml")
    if variant:
        config = config.with_overrides(ONE_F_ONE_B)
    return solve(config, baselines=False).to_dict()


def _plan(name: str = "tiny-gpt-cpu") -> dict:
    return copy.deepcopy(_solved(name))


@pytest.mark.parametrize("name", ["tiny-mlp-cpu", "tiny-gpt-cpu", "tiny-gpt-bf16-cpu",
                                  "tiny-moe-cpu", "tiny-vgg-cpu", "transformer-autoddl-64"])
def test_a_solved_plan_reprices_to_exactly_its_own_figures(name) -> None:
    plan = Plan.from_dict(_plan(name))
    layers, cost = reprice(plan, parse_config(plan.config))
    assert price_differences(plan, layers, cost) == []
    assert [ly.collectives for ly in layers] == [ly.collectives for ly in plan.layers]
    assert cost == plan.cost
    check_prices(plan, name)


def _another_strategy(d: dict, name: str) -> dict:
    """``d`` with layer ``name`` on another strategy of its op (label and layouts), its
    listed figures left as they were: a hand-tuned layer."""
    plan = Plan.from_dict(d)
    config = parse_config(plan.config)
    graph = config.microbatch_graph()
    op = graph[name]
    cl = config.cluster
    ctx = StrategyContext(cl, cl.nodes, cl.devices_per_node, config.memory)
    mine = plan.layer(name)
    other = next(s for s in op_strategies(op, [graph[i].output for i in op.inputs], ctx)
                 if s.label != mine.strategy and not s.zero
                 and s.inputs[0].fact == mine.inputs[0].fact)
    i = [ly["name"] for ly in d["layers"]].index(name)
    edited = Plan.from_dict(d)
    layer = edited.layers[i]
    edited.layers[i] = dataclasses.replace(layer, strategy=other.label, inputs=other.inputs,
                                           weight=other.weight, output=other.output)
    return edited.to_dict()


def test_a_layer_moved_to_another_strategy_is_refused_naming_what_its_layouts_cost() -> None:
    d = _another_strategy(_plan(), "h.1.attn.core")
    with pytest.raises(PlanFormatError, match=r"edited\.json: .*h\.1\.attn\.core"):
        check_prices(Plan.from_dict(d), "edited.json")


@pytest.mark.parametrize("edit, says", [
    (lambda d: d["layers"][1]["collectives"][0].update(
        seconds=100 * d["layers"][1]["collectives"][0]["seconds"]), "lists collectives"),
    (lambda d: d["layers"][1].update(compute_s=1.0), "states compute"),
    (lambda d: d["cost"].update(peak_memory_bytes=0.0), "cost.peak_memory_bytes is 0"),
    (lambda d: d["config"]["cluster"]["links"]["intra"].update(bandwidth_gbps=1000),
     "lists collectives"),
    (lambda d: d["config"]["training"].update(optimizer="sgd"), "states memory"),
])
def test_an_edited_figure_is_refused_by_name(edit, says) -> None:
    d = _plan()
    assert d["layers"][1]["collectives"], "the edit needs a layer with a collective"
    edit(d)
    with pytest.raises(PlanFormatError, match=says):
        check_prices(Plan.from_dict(d), "edited.json")


def test_check_exits_2_on_an_edited_plan_and_passes_the_solved_one(tmp_path, capsys) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_plan()))
    d = _plan()
    d["layers"][1]["compute_s"] = 1.0
    bad.write_text(json.dumps(d))
    assert main(["check", "--no-for-host", str(good)]) == 0
    assert main(["check", "--no-for-host", str(bad)]) == 2
    assert "states compute" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny-gpt-interleaved-cpu", "tiny-gpt-cpu+1f1b"])
def test_a_pipelined_plan_reprices_to_exactly_itself(name) -> None:
    """Each stage (each chunk) priced again on its sub-mesh with its boundary, the
    boundary costs, stage times, cost block and simulated schedule derived again: exactly
    what the solver wrote."""
    plan = Plan.from_dict(_plan(name))
    prices = reprice_stages(plan, parse_config(plan.config))
    assert [ly.name for ly in prices.layers] == [ly.name for ly in plan.layers]
    assert prices.layers == plan.layers
    assert prices.times == [st.times for st in plan.stages]
    assert prices.cost == plan.cost and prices.simulated == plan.schedule.simulated
    check_prices(plan, name)
    with pytest.raises(ValueError):
        reprice(plan, parse_config(plan.config))


@pytest.mark.parametrize("edit, said", [
    ("layouts", "its layouts cannot be priced"),
    ("collective", "lists collectives"),
    ("stage", "stage 1 states backward_s"),
    ("makespan", "the simulated makespan_s"),
])
def test_an_edited_pipelined_plan_is_refused_naming_what_differs(edit, said) -> None:
    """A pipelined file edited after solving — a layer's layouts, a collective's seconds,
    a stage's backward time, the simulated makespan — was checked only for its structure:
    the runtime would run one program while ``explain`` and ``simulate`` reported another."""
    d = _plan("tiny-gpt-cpu+1f1b")
    if edit == "layouts":
        ly = next(ly for ly in d["layers"] if ly["strategy"]["weight"] is not None)
        ly["strategy"]["output"]["placements"] = ["B"] * len(ly["strategy"]["output"]["mesh"])
    elif edit == "collective":
        c = next(c for ly in d["layers"] for c in ly["collectives"] if c["purpose"] != "grad_sync")
        c["seconds"] *= 2
    elif edit == "stage":
        d["stages"][1]["backward_s"] *= 1.5
    else:
        d["schedule"]["makespan_s"] *= 0.5
    with pytest.raises(PlanFormatError, match=said):
        check_prices(Plan.from_dict(d), "edited.json")


def test_check_exits_2_on_a_pipelined_plan_listing_other_gradient_reductions(tmp_path,
                                                                             capsys) -> None:
    """A contradiction in the file — a gradient AllReduce's bytes doubled — is the plan's
    error, not this host's: ``check`` exits 2 (it printed "valid, but the runtime cannot
    execute it here" and exited 0 before)."""
    d = _plan("tiny-gpt-interleaved-cpu")
    layer = next(ly for ly in d["layers"]
                 if any(c["purpose"] == "grad_sync" for c in ly["collectives"]))
    sync = next(c for c in layer["collectives"] if c["purpose"] == "grad_sync")
    sync["bytes"] *= 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    assert main(["check", "--no-for-host", str(bad)]) == 2
    assert "lists collectives" in capsys.readouterr().err


def test_a_schedule_in_another_order_than_its_name_is_refused() -> None:
    """Interleaved 1F1B's actions reordered to run every forward first (a valid, deadlock-
    free order holding every micro-batch at once): refused, the stages' memory having been
    solved for the named order's micro-batches in flight — ``check`` accepted it before."""
    d = _plan("tiny-gpt-interleaved-cpu")
    rows = d["schedule"]["actions"]
    for k, row in rows.items():
        rows[k] = [a for a in row if "F" in a] + [a for a in row if "F" not in a]
    with pytest.raises(PlanFormatError, match=r"schedule\.actions\.0: not the "
                                              r"interleaved-1f1b order .* action \d+ is"):
        check_plan(Plan.from_dict(d), "reordered.json")


def _swap_devices(d: dict) -> None:
    """Stages on devices [0, 1, 4, 5] and [2, 3, 6, 7]: a 1 × 4 mesh spanning two nodes."""
    d["stages"][0]["devices"], d["stages"][1]["devices"] = [0, 1, 4, 5], [2, 3, 6, 7]


@pytest.mark.parametrize("edit, says", [
    (_swap_devices, r"stages\[0\]\.devices: \[0, 1, 4, 5\] are not a 1x4 mesh"),
    (lambda d: d["resharding"][0].update(dtype="bfloat16"),
     r"resharding entry 0 .*dtype bfloat16 but the op's output is float32"),
])
def test_what_the_runtime_reads_elsewhere_must_agree_with_the_file(edit, says) -> None:
    """Fields the runtime takes from another source than the one edited: stage devices
    (the plan's links are its mesh's), a transfer's dtype (the graph's) — each accepted by
    ``check`` before."""
    d = _plan("tiny-gpt-interleaved-cpu")
    edit(d)
    if edit is _swap_devices:  # chunks 2 and 3 sit on chunk 0's and 1's meshes
        for s in d["stages"][2:]:
            s["devices"] = d["stages"][int(s["index"]) % 2]["devices"]
    with pytest.raises(PlanFormatError, match=says):
        check_plan(Plan.from_dict(d), "edited.json")
