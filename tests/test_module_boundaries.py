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
  handed): it runs on DTensors, not on this rank's blocks of the norm's input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ilp_planner.inputs.importer import from_module
from ilp_planner.ir.graph import OpKind
from runtime.applied_hooks import computes_past, runner_path

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


def test_a_norm_module_computing_past_its_norm_is_known_to():
    graph = from_module(_Gated(), (torch.randn(2, 5, W),))
    norm = graph["norm"]
    assert norm.kind is OpKind.RMSNORM
    assert any(op.name.startswith("norm.") and "norm" in op.inputs for op in graph.ops)
    assert computes_past(graph, norm)
    assert not any(computes_past(graph, graph[name]) for name in ("a", "g", "out"))
