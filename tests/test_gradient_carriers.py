"""Which reads take a gradient (:meth:`Graph.gradient_carriers`) decides three prices and
one runtime choice alike: an op reading what the model's data gives alone (an image padded
in code, MobileNetV2's) computes no input gradient, so under ZeRO-3 its backward gathers
no weights (the plan lists none; the runtime's bucket does not regather, :mod:`runtime.zero`),
and a second read of such a value adds no gradients (no merge priced). Before, the rule
was "reads a graph input directly", and a padded image's convolution was planned with a
backward gather autograd never asks for."""

from __future__ import annotations

import torch
from torch import nn

import ilp_planner
from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.problem import gradient_merges
from ilp_planner.plan.data import Stage
from ilp_planner.testing import sharded_plan
from runtime.compiled import _input_reached


class PaddedTwice(nn.Module):
    """The data padded in code (an opaque op the importer keeps), read by two linears:
    neither read takes a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(18, 32), nn.Linear(18, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = nn.functional.pad(x, (1, 1))
        return self.c(torch.relu(self.a(p) + self.b(p)))


def _graph():
    return ilp_planner.from_module(PaddedTwice(), (torch.randn(8, 16),))


def _config(graph):
    return load_config({"model": graph, "cluster": {
        "nodes": 1, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 1,
        "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                  "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}})


def _linears(graph) -> list[str]:
    return [op.name for op in graph.ops if op.kind.value == "linear"]


def test_data_computed_in_code_takes_no_gradient() -> None:
    graph = _graph()
    carriers = graph.gradient_carriers()
    a, b, c = _linears(graph)
    assert graph[a].inputs == graph[b].inputs == ("pad",)
    assert "pad" not in carriers and {a, b, c} <= carriers
    # the second read of the padded image adds no gradient (there is none)
    assert gradient_merges(graph, b) == ()
    stage = Stage(0, (0, 1, 2, 3), (1, 4), tuple(op.name for op in graph.ops))
    reached = _input_reached(graph, [stage])
    assert c in reached and a not in reached and b not in reached


def test_zero3_lists_no_backward_gather_where_no_gradient_reaches_the_input() -> None:
    graph = _graph()
    plan = sharded_plan(_config(graph), 3)
    a, b, c = _linears(graph)
    phases = {lp.name: sorted(c.phase for c in lp.collectives if c.purpose == "fsdp_gather")
              for lp in plan.layers if lp.zero == 3}
    assert phases[a] == phases[b] == ["forward"]  # their input: the data padded in code
    assert phases[c] == ["backward", "forward"]
