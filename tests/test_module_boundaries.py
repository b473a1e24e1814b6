"""Which module runs an imported op under ``parallelize``, where the user's code around a
module does more than call it — the three shapes Qwen3.5's Gated DeltaNet layer has (its
training under ``parallelize`` is ``qwen3.5`` in ``tests/test_hf_parallelize.py``):

* a parameter of a module the forward never calls, read by the layer's own code
  (``causal_conv1d_fn(x, self.conv1d.weight, …)``): the op reading it is functional code,
  never named as that module (``parallelize`` would wait for the module's call);
* a bias the layer's code adds after a child linear (``a + self.dt_bias``): not the
  linear's under ``parallelize`` (the linear's boundary has converted its output for its
  readers before that code runs), an op of its own; the executor's plan keeps it the
  linear's;
* a norm module whose forward goes on computing with its normed value (a gate it is
  handed): it runs on DTensors, not on this rank's blocks of the norm's input, and the
  planner keeps the norm's layout for that code (no boundary could run a program there);
  a plan that cannot is refused by ``parallelize`` up front.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ilp_planner
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.ir.graph import Op, OpKind, read_inside_its_module
from ilp_planner.lowering.strategies import Strategy
from ilp_planner.plan.programs import edge_programs
from ilp_planner.testing import restricted_plan
from runtime.applied_hooks import computes_past, hook_table, runner_path
from runtime.errors import RuntimeSetupError

W = 8


class _CodeConv(nn.Module):
    """A depthwise causal convolution computed by the forward's own code on a child
    module's weight (the module is never called)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.conv1d = nn.Conv1d(W, W, 3, groups=W, padding=2, bias=False)

    def forward(self, x):
        h = self.proj(x).transpose(1, 2)
        h = F.conv1d(h, self.conv1d.weight, padding=2, groups=W)[..., : x.shape[1]]
        return h.transpose(1, 2)


def test_code_on_an_uncalled_modules_weight_is_not_named_as_that_module():
    model = _CodeConv()
    graph = from_module(model, (torch.randn(2, 5, W),))
    reader = next(op for op in graph.ops if "conv1d.weight" in op.source_params)
    assert reader.name != "conv1d"  # before: the module's path, and its call awaited
    assert runner_path(model, reader) is None  # functional code: it runs on DTensors


class _ParentBias(nn.Module):
    """A linear without a bias whose output the parent's code offsets by its own vector."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W, bias=False)
        self.dt_bias = nn.Parameter(torch.randn(W))

    def forward(self, x):
        return self.fc(x) + self.dt_bias


def test_a_bias_the_parents_code_adds_is_the_linears_only_for_the_executor():
    x = torch.randn(2, 5, W)
    applied = from_module(_ParentBias(), (x,))
    assert applied["fc"].source_params == ("fc.weight",)
    owner = next(op for op in applied.ops if "dt_bias" in op.source_params)
    assert owner.name != "fc" and owner.inputs == ("fc",)
    executed = from_module(_ParentBias(), (x,), dtensor=False)
    assert executed["fc"].source_params == ("fc.weight", "dt_bias")
    assert executed["fc"].attrs.get("bias") == 1


class _GatedNorm(nn.Module):
    """An RMS norm whose forward multiplies the normed value by ``silu(gate)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(W))

    def forward(self, x, gate):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed * F.silu(gate)


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.g, self.out = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.norm = _GatedNorm()

    def forward(self, x):
        return self.out(self.norm(self.a(x), self.g(x)))


def test_a_norm_module_computing_past_its_norm_is_recognised():
    graph = from_module(_Gated(), (torch.randn(2, 5, W),))
    norm = graph["norm"]
    assert norm.kind is OpKind.RMSNORM
    assert any(read_inside_its_module(c, "norm") for c in graph.consumers("norm"))
    assert computes_past(graph, norm)
    assert not any(computes_past(graph, graph[name]) for name in ("a", "g", "out"))


CLUSTER = {"nodes": 1, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 10,
           "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 100},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}


def _hooks(model: nn.Module, x: torch.Tensor, keep=None):
    """``parallelize``'s hook table for ``model``'s plan on 4 devices (the solver's, or the
    best among the strategies ``keep`` passes)."""
    graph = from_module(model, (x,))
    config = load_config({"model": graph, "cluster": CLUSTER})
    plan = restricted_plan(config, keep) if keep else ilp_planner.solve(config, baselines=False)
    layers = {ly.name: ly for ly in plan.layers}
    programs = {(e.consumer, e.index): e.program for e in edge_programs(plan, config, graph)
                if e.role in ("edge", "shared")}
    return graph, layers, hook_table(graph, layers, programs, model)


def test_the_solver_keeps_the_norms_layout_for_its_modules_later_code():
    """Before, the solver split the norm's rows over two devices and the gate's product
    over its columns too — a program between them, inside the module, where no boundary
    runs one. Now the planner keeps the norm's layout for that code, and the module runs
    on DTensors (its gate is one)."""
    graph, layers, (hooks, post) = _hooks(_Gated(), torch.randn(4, 5, W))
    mul = next(graph[c] for c in graph.consumers("norm") if read_inside_its_module(c, "norm"))
    assert layers[mul.name].inputs[mul.inputs.index("norm")] == layers["norm"].output
    assert post.get("norm", (None, None))[1] is None
    assert not hooks["norm"].local  # before: local blocks, its gate still a DTensor
    assert hooks["out"].local


class _Cumulated(nn.Module):
    """An RMS norm whose forward goes on to a running sum over the batch."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(W))

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return torch.cumsum(normed, dim=0)


class _Summing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(W, W), nn.Linear(W, W)
        self.norm = _Cumulated()

    def forward(self, x):
        return self.out(self.norm(self.a(x)))


def test_a_program_for_code_its_module_runs_after_the_op_is_refused():
    """A plan with no other choice (the norm held split over the batch, the running sum —
    an opaque op, whole tensors — reading it inside the module): the program gathering the
    norm's output would run at the module's boundary, on the sum the module returns, not
    on the norm's value. ``parallelize`` refuses it up front."""
    def batch_split_norm(op: Op, s: Strategy) -> bool:
        return op.kind is not OpKind.RMSNORM or s.output.split_degree(0) == 4

    with pytest.raises(RuntimeSetupError, match=r"changes the layout of 'norm'.*for code its "
                                                r"own module runs after it"):
        _hooks(_Summing(), torch.randn(4, 5, W), batch_split_norm)
