"""The VGG family on the torch runtime: conv2d, max pooling, flatten and the dense head.

Fast tests check the local kernels against plain ``torch.nn`` modules, the single-process
reference against an ``nn.Sequential`` VGG13, and the conv family's geometry (every device's
local convolution, pool and flatten of its block, summed over the partial axis, is its
block of the full result) without any process group. One slow launch trains three plans of
``configs/tiny-vgg-cpu.yaml`` on 8 gloo processes — the planner's own (single mesh, and
2-stage eager-1F1B with feature maps crossing the cut), one with batch-split convolutions
(AutoDDL's VGG13 layouts) and one with output- and input-channel-split convolutions
(partial-sum outputs) — and checks ``--audit`` (executed == planned) and the
single-process reference within 1e-4.
"""

from __future__ import annotations

import json
import math
import re
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from test_runtime import RTOL, STEPS
from torch import nn

from ilp_planner.api import solve
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.models import graph_from_spec
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import Op, OpKind
from ilp_planner.ir.layouts import B, Layout, P, S
from ilp_planner.lowering.strategies import Strategy, conv_layouts
from ilp_planner.plan.data import Plan
from ilp_planner.testing import restricted_plan
from runtime import model
from runtime.errors import RuntimeSetupError
from runtime.executor import Executor, RunOptions
from runtime.optim import OptimizerSpec
from runtime.reference import compare, forward, run_reference
from tests.helpers.procs import run as _run

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-vgg-cpu.yaml"
OPT = ("adam", 0.001)  # the tiny VGG's loss falls every step at this rate


def _sizes(s: Strategy) -> tuple[int, ...]:
    return tuple(a.size for a in s.fact)


def batch_split(op: Op, s: Strategy) -> bool:
    """AutoDDL's VGG13 layouts: convolutions split over the batch only (data parallel),
    dense layers in the 3-D family on 2 × 2 × 2."""
    if op.kind is OpKind.CONV2D:
        return _sizes(s) == (8, 1, 1)
    if op.kind is OpKind.LINEAR:
        return s.label.startswith("3d") and _sizes(s) == (2, 2, 2)
    return True


def channel_split(op: Op, s: Strategy) -> bool:
    """Convolutions on 2 × 2 × 2: batch, output channels and input channels split, the
    output a partial sum over the input-channel axis (the first conv, with 3 input
    channels, on 2 × 4 × 1)."""
    if op.kind is OpKind.CONV2D:
        assert op.weight is not None
        return _sizes(s) == ((2, 2, 2) if op.weight.shape[1] % 2 == 0 else (2, 4, 1))
    return True


PIPELINE = {"stages": 2, "microbatches": 2, "schedule": "eager-1f1b", "submeshes": [[1, 4], [1, 4]]}


def build_plans() -> dict[str, Plan]:
    """The planner's plans (single mesh; 2 stages, feature maps crossing the cut) and the
    batch- and channel-split single-mesh plans."""
    config = load_config(TINY)
    solved = solve(config, baselines=False)
    solved.name = "vgg8-solved"
    solved_pp = solve(config.with_overrides({"pipeline": PIPELINE}), baselines=False)
    solved_pp.name = "vgg8-solved-pp"
    return {"vgg8-solved": solved, "vgg8-solved-pp": solved_pp,
            "vgg8-batch-split": restricted_plan(config, batch_split, name="vgg8-batch-split"),
            "vgg8-channel-split": restricted_plan(config, channel_split, name="vgg8-channel-split")}


# -- configuration -----------------------------------------------------------------------------


def test_tiny_vgg_is_vgg13_scaled_down() -> None:
    graph = load_config(TINY).graph
    kinds = [op.kind for op in graph.ops]
    assert kinds.count(OpKind.CONV2D) == 10 and kinds.count(OpKind.POOL) == 5
    assert kinds.count(OpKind.LINEAR) == 3 and kinds.count(OpKind.FLATTEN) == 1
    assert graph["conv10"].weight.shape == (32, 32, 3, 3) and graph["fc2"].weight.shape == (64, 64)
    assert graph.total_params == 48_632


@pytest.mark.parametrize("key,value,message", [
    ("model.channels", [8, 16], "model.channels: expected 5 widths (one per VGG13 block), got 2"),
    ("model.channels", [8, 16, 0, 32, 32], "model.channels[2]: expected a positive integer"),
    ("model.hidden", "wide", "model.hidden: expected a positive integer"),
])
def test_vgg_width_errors_name_the_key(key: str, value, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"tiny-vgg-cpu.yaml: {message}")):
        load_config(TINY).with_overrides({key: value})


# -- kernels and the reference against torch.nn ------------------------------------------------


def test_kernels_match_torch_nn() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=g)
    conv = nn.Conv2d(3, 5, 3, padding=1)
    with torch.no_grad():
        want = conv(x)
        got = model.conv2d(x, conv.weight, conv.bias)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(model.max_pool(want, 2), nn.MaxPool2d(2)(want))
    assert torch.equal(model.flatten(want), nn.Flatten()(want))


def _torch_vgg(graph, params: dict[str, torch.Tensor]) -> nn.Sequential:
    """The graph as a plain ``nn.Sequential`` (Linear stores its weight as (out, in))."""
    layers: list[nn.Module] = []
    for op in graph.ops:
        if op.kind is OpKind.CONV2D:
            w = params[f"{op.name}.weight"]
            m = nn.Conv2d(w.shape[1], w.shape[0], w.shape[-1], padding=1)
            m.weight.data, m.bias.data = w.clone(), params[f"{op.name}.bias"].clone()
        elif op.kind is OpKind.LINEAR:
            w = params[f"{op.name}.weight"]
            m = nn.Linear(*w.shape)
            m.weight.data, m.bias.data = w.t().clone(), params[f"{op.name}.bias"].clone()
        elif op.kind is OpKind.POOL:
            m = nn.MaxPool2d(op.attr("kernel"))
        else:
            m = {OpKind.RELU: nn.ReLU(), OpKind.FLATTEN: nn.Flatten()}.get(op.kind)
        if m is not None:
            layers.append(m)
    return nn.Sequential(*layers)


def test_reference_is_torchs_vgg() -> None:
    """The single-process reference (the distributed runs' oracle) gives nn.Sequential's
    loss and gradients."""
    graph = load_config(TINY).graph
    params = {k: v.requires_grad_(True) for k, v in model.init_params(graph, 0).items()}
    batch = model.make_batch(graph, 0)
    loss = forward(graph, params, batch)
    loss.backward()
    net = _torch_vgg(graph, params)
    want = nn.functional.cross_entropy(net(batch["input"]), batch["loss.targets"])
    want.backward()
    assert math.isclose(float(loss.detach()), float(want.detach()), rel_tol=1e-6)
    modules = [m for m in net if isinstance(m, nn.Conv2d | nn.Linear)]
    names = [op.name for op in graph.ops if op.kind in (OpKind.CONV2D, OpKind.LINEAR)]
    for name, m in zip(names, modules, strict=True):
        gw = m.weight.grad if isinstance(m, nn.Conv2d) else m.weight.grad.t()
        assert torch.allclose(params[f"{name}.weight"].grad, gw, rtol=1e-4, atol=1e-7), name
        assert torch.allclose(params[f"{name}.bias"].grad, m.bias.grad, rtol=1e-4, atol=1e-7), name


# -- the conv family's geometry, device by device ------------------------------------------------


def _fact(*sizes: int):
    return tuple(MeshAxis(1, s) for s in sizes)


def _block(full: torch.Tensor, layout: Layout, device: int) -> torch.Tensor:
    """Device ``device``'s block of a partial-free layout (or the summed value's region)."""
    rep = Layout(layout.fact, tuple(B if pl == P else pl for pl in layout.placements))
    region = rep.regions(tuple(full.shape))[device]
    return full[tuple(slice(int(lo), int(hi)) for lo, hi in region)]


@pytest.mark.parametrize("sizes", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)])
def test_local_convolutions_sum_to_the_output_block(sizes) -> None:
    """Each device's convolution of its (batch, input-channel) block with its weight block,
    summed over the devices that differ only on the partial axis, is its output block."""
    fact = _fact(*sizes)
    i_lay, w_lay, o_lay = conv_layouts(fact)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 6, 5, 5, generator=g), torch.randn(4, 6, 3, 3, generator=g)
    full = model.conv2d(x, w)
    coords = [(a, b, c) for a in range(sizes[0]) for b in range(sizes[1]) for c in range(sizes[2])]
    partial: dict[tuple[int, int], torch.Tensor] = {}
    for dev, (a, b, _) in enumerate(coords):
        y = model.conv2d(_block(x, i_lay, dev), _block(w, w_lay, dev))
        partial[(a, b)] = partial.get((a, b), 0) + y
    for dev, (a, b, _) in enumerate(coords):
        assert torch.allclose(partial[(a, b)], _block(full, o_lay, dev), atol=1e-5)


@pytest.mark.parametrize("placements", [(S(0), S(1)), (S(1), S(1)), (B, S(1)), (S(1), S(0))])
def test_pool_and_flatten_of_a_block_are_blocks(placements) -> None:
    """Batch and channel blocks (one dim split by two axes included) pool and flatten
    locally into the same layout's blocks of the full results."""
    lay = Layout(_fact(2, 2), placements)
    x = torch.randn(4, 8, 4, 4, generator=torch.Generator().manual_seed(2))
    pooled, flat = model.max_pool(x, 2), model.flatten(x)
    for dev in range(4):
        assert torch.equal(model.max_pool(_block(x, lay, dev), 2), _block(pooled, lay, dev))
        assert torch.equal(model.flatten(_block(x, lay, dev)), _block(flat, lay, dev))


# -- what the runtime refuses, before any process group --------------------------------------------


def _graph(conv_weight: list[int], conv_shape: list[int], pool_shape: list[int]):
    return graph_from_spec({"kind": "graph", "ops": [
        {"name": "x", "kind": "input", "shape": [4, 3, 8, 8]},
        {"name": "conv", "kind": "conv2d", "inputs": ["x"], "shape": conv_shape,
         "weight": conv_weight},
        {"name": "pool", "kind": "pool", "inputs": ["conv"], "shape": pool_shape,
         "attrs": {"kernel": 2}},
        {"name": "flat", "kind": "flatten", "inputs": ["pool"], "shape": [4, 4 * 16]},
        {"name": "fc", "kind": "linear", "inputs": ["flat"], "shape": [4, 4], "weight": [64, 4]},
        {"name": "loss", "kind": "loss", "inputs": ["fc"], "shape": [1]},
    ]})


def test_runtime_accepts_an_explicit_convnet() -> None:
    model.check_supported(_graph([4, 3, 3, 3], [4, 4, 8, 8], [4, 4, 4, 4]))


@pytest.mark.parametrize("weight,conv_shape,pool_shape,message", [
    ([4, 3, 2, 2], [4, 4, 8, 8], [4, 4, 4, 4], "odd square kernels"),
    ([4, 3, 3, 3], [4, 4, 6, 6], [4, 4, 3, 3], "with padding 1"),
    ([4, 3, 3, 3], [4, 4, 8, 8], [4, 4, 2, 2], "max-pools .* to \\(N, C, H // k, W // k\\)"),
])
def test_runtime_refuses_convolutions_it_cannot_run(weight, conv_shape, pool_shape, message) -> None:
    with pytest.raises(RuntimeSetupError, match=message):
        model.check_supported(_graph(weight, conv_shape, pool_shape))


def test_runtime_refuses_batch_norm_naming_the_op() -> None:
    """The executor has no batch-norm kernel (``parallelize`` runs a user's batch norms,
    synchronised where the plan splits their batch): a plan with one is refused up front,
    naming it, before any process group."""
    g = graph_from_spec({"kind": "graph", "ops": [
        {"name": "x", "kind": "input", "shape": [4, 3, 8, 8]},
        {"name": "conv", "kind": "conv2d", "inputs": ["x"], "shape": [4, 4, 8, 8],
         "weight": [4, 3, 3, 3]},
        {"name": "bn", "kind": "batchnorm", "inputs": ["conv"], "shape": [4, 4, 8, 8]},
        {"name": "flat", "kind": "flatten", "inputs": ["bn"], "shape": [4, 256]},
        {"name": "fc", "kind": "linear", "inputs": ["flat"], "shape": [4, 4], "weight": [256, 4]},
        {"name": "loss", "kind": "loss", "inputs": ["fc"], "shape": [1]},
    ]})
    with pytest.raises(RuntimeSetupError, match="op 'bn' is a batchnorm"):
        model.check_supported(g)


# -- the plans are what they claim ------------------------------------------------------------------


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return build_plans()


def test_plans_split_the_convolutions_as_claimed(plans) -> None:
    convs = {k: [ly for ly in p.layers if ly.kind == "conv2d"] for k, p in plans.items()}
    assert all(ly.strategy == "conv3d(p0=2x4,p1=1,p2=1)" and ly.output.split_degree(0) == 8
               for ly in convs["vgg8-batch-split"])
    assert all(ly.strategy.startswith("3d") for ly in plans["vgg8-batch-split"].layers
               if ly.kind == "linear")
    chan = convs["vgg8-channel-split"]
    partial = [ly.name for ly in chan if any(ly.output.fact[a].size > 1 for a in ly.output.partial_axes)]
    assert partial == [f"conv{i}" for i in range(2, 11)]  # conv1 has 3 input channels
    assert all(ly.weight.split_degree(0) > 1 for ly in chan)
    crossing = plans["vgg8-solved-pp"].resharding
    assert len(plans["vgg8-solved-pp"].stages) == 2 and any(len(e.shape) == 4 for e in crossing)
    for p in plans.values():  # every conv's gradients go through the priced buckets
        ex = Executor(p, RunOptions(), rank=0, world=8)
        synced = {(m.layer, r) for chunks in ex.compiled.grad_chunks.values() for c in chunks
                  for m in c.members for r in m.roles}
        assert all({(ly.name, "weight"), (ly.name, "bias")} <= synced
                   for ly in p.layers if ly.kind == "conv2d")


# -- 8 gloo processes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(plans, tmp_path_factory) -> dict:
    """All plans trained in one 8-process launch (process start-up is the slow part)."""
    tmp = tmp_path_factory.mktemp("vgg8")
    files = []
    for name, plan in plans.items():
        plan.save(tmp / f"{name}.json")
        files.append(str(tmp / f"{name}.json"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
           "-m", "runtime.launch", *files, "--steps", str(STEPS), "--optimizer", OPT[0],
           "--lr", str(OPT[1]), "--results", str(tmp / "results.json"),
           "--save-params", str(tmp / "params"), "--quiet", "--audit", "--check-reference"]
    res = _run(cmd, timeout=420)
    assert res.returncode == 0, f"launch failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    out = {Path(r["file"]).stem: r for r in json.loads((tmp / "results.json").read_text())}
    for stem in out:
        out[stem]["params"] = torch.load(tmp / "params" / f"{stem}.pt")
    out["__stdout__"] = res.stdout
    return out


@pytest.mark.slow
def test_vgg_plans_run_as_planned_and_match_one_process(plans, runs) -> None:
    """On every rank and step the collectives executed equal the planned ones, and the
    losses and final parameters match one process within 1e-4 — for the planner's plans
    (single mesh and pipelined) and for batch- and channel-split convolutions."""
    assert "MISMATCH" not in runs["__stdout__"]
    graph = load_config(TINY).graph
    for name, plan in plans.items():
        ref = run_reference(graph, steps=STEPS, seed=0, optimizer=OptimizerSpec(*OPT),
                            microbatches=Executor(plan, RunOptions(), rank=0, world=8).compiled.microbatches)
        assert all(b < a for a, b in pairwise(ref.losses))  # it trains
        r = runs[name]
        assert r["audit_ok"] is True, name
        for got, want in zip(r["losses"], ref.losses, strict=True):
            assert math.isclose(got, want, rel_tol=RTOL), (name, r["losses"], ref.losses)
        cmp = compare(r["losses"], r["params"], ref)
        assert cmp.ok(RTOL), f"{name}: {cmp.worst_param} rel err {cmp.param_rel_err:.2e}"
