"""Ops DTensor has no sharding rule for: found at import from the model's own forward and
backward (:mod:`ilp_planner.inputs.dtensor_gaps`), carried by the plan, named by
``explain``, and given a replicated rule by the runtime (:mod:`runtime.replicated_ops`) — a
weight-normed linear trains under ``parallelize`` (``tests/test_parallelize.py``'s
``weight_norm`` case) where it failed in the first backward."""

from __future__ import annotations

import pytest
import torch

import ilp_planner
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.dtensor_gaps import lacks_rule
from ilp_planner.inputs.models import graph_from_spec, graph_to_spec
from ilp_planner.plan.data import Plan
from runtime.errors import RuntimeSetupError
from runtime.replicated_ops import run_replicated
from tests.helpers.user_models import Llama, ReLU6MLP, WeightNormed

BACKWARD = "aten._weight_norm_interface_backward.default"
FOUND = ("aten._weight_norm_interface.default", BACKWARD)  # the forward: a decomposition only
CLUSTER = {"nodes": 1, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 1,
           "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                     "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}


def _weight_normed_graph():
    torch.manual_seed(0)
    return ilp_planner.from_module(WeightNormed(16, 32), (torch.randn(8, 16),))


def test_weight_norms_backward_is_found_and_nothing_in_a_covered_model() -> None:
    """The weight norm's backward — an op only autograd dispatches, absent from the
    exported forward — is found; a Llama stack (SDPA, RMSNorm, rotary, SwiGLU: all ops
    DTensor runs or the runtime runs on local blocks) has none; the runtime's own executor
    (``dtensor=False``) needs none."""
    assert _weight_normed_graph().replicated_ops == FOUND
    ids = torch.randint(0, 64, (2, 8))
    assert ilp_planner.from_module(Llama(vocab=64, dim=32, n_layers=1, seq_len=8),
                                   (ids,)).replicated_ops == ()
    torch.manual_seed(0)
    bare = ilp_planner.from_module(WeightNormed(16, 32), (torch.randn(8, 16),), dtensor=False)
    assert bare.replicated_ops == ()


def test_the_gaps_travel_with_the_plan_and_explain_names_them() -> None:
    graph = _weight_normed_graph()
    assert graph_from_spec(graph_to_spec(graph)).replicated_ops == FOUND
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    again = Plan.from_dict(plan.to_dict())
    text = ilp_planner.explain(again, collectives=False)
    assert "run by the runtime's own rules under parallelize (DTensor has none for them; " \
           f"element-wise ones on their operands' blocks, the rest replicated): " \
           f"{', '.join(FOUND)}" in text


def test_a_graph_listing_something_else_is_refused_by_key() -> None:
    spec = graph_to_spec(_weight_normed_graph())
    spec["replicated_ops"] = [3]
    with pytest.raises(ConfigError, match=r"model\.replicated_ops\[0\]"):
        graph_from_spec(spec)


def test_the_runtime_registers_only_what_dtensor_lacks_and_refuses_unknown_ops() -> None:
    """Registering gives the op a rule (so a second call registers nothing); an op DTensor
    has (``mm``) is left alone, and a name this torch lacks is refused by name."""
    op = torch.ops.aten._weight_norm_interface_backward.default
    registered = run_replicated([BACKWARD, "aten.mm.default"])
    assert "aten.mm.default" not in registered  # DTensor's own rule stays
    assert not lacks_rule(torch, op)  # weight norm's backward has one now
    assert run_replicated([BACKWARD]) == ()  # once a process
    assert run_replicated([BACKWARD, "aten.mm.default"]) == ()
    with pytest.raises(RuntimeSetupError, match="aten.no_such_op.default"):
        run_replicated(["aten.no_such_op.default"])


def test_an_op_dtensor_runs_only_by_decomposition_counts_as_a_gap() -> None:
    """ReLU6's backward (``aten.hardtanh_backward``) has no DTensor rule, only a
    decomposition DTensor's propagator fails on: it is found (the audit of a user's
    MobileNetV2 crashed in the first backward), and its rule is element-wise."""
    graph = ilp_planner.from_module(ReLU6MLP(), (torch.randint(0, 64, (4, 8)),))
    assert graph.replicated_ops == ("aten.hardtanh_backward.default",)


class _PooledTokens(torch.nn.Module):
    """FocalNet's head: tokens ``(b, s, c)`` averaged by ``nn.AdaptiveAvgPool1d(1)`` over
    their transpose, whose strides suggest channels-last: the pooling restrides its
    output with ``as_strided_``, and its backward calls ``as_strided``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.pool = torch.nn.AdaptiveAvgPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.fc(x).transpose(1, 2)).flatten(1)


def test_as_strided_on_replicated_values_runs_on_the_whole_value() -> None:
    """DTensor's own ``as_strided`` handler runs only the restride that changes nothing:
    the pooling's backward failed mid-step. Registered, it runs on a replicated value as
    one process does (the same gradient); on a split one it still refuses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model, x = _PooledTokens(), torch.randn(2, 4, 8)
    graph = ilp_planner.from_module(model, (x,))
    assert {"aten.as_strided.default", "aten.as_strided_.default"} <= set(graph.replicated_ops)
    run_replicated(graph.replicated_ops)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = torch.randn(2, 8, 4)
        whole = t.clone().requires_grad_()
        torch.nn.functional.adaptive_avg_pool1d(whole.transpose(1, 2).contiguous()
                                                .transpose(1, 2), 1).square().sum().backward()
        d = distribute_tensor(t, mesh, [Replicate()]).requires_grad_()
        out = torch.nn.functional.adaptive_avg_pool1d(d.transpose(1, 2).contiguous()
                                                      .transpose(1, 2), 1)
        out.square().sum().backward()
        assert torch.allclose(d.grad.full_tensor(), whole.grad)
        split = distribute_tensor(t, mesh, [Shard(0)])
        with pytest.raises(RuntimeError, match="as_strided not supported"):
            torch.ops.aten.as_strided.default(split, (2, 8, 2), (32, 4, 1))
    finally:
        dist.destroy_process_group()
