"""A plan applied to the user's own module (``ilp_planner.parallelize``, :mod:`runtime.apply`).

Multi-process (slow): the user-style example trains 5 steps on 8 gloo ranks with a plan
that mixes five mesh shapes; the runtime's MLP module (biases on partial sums) and a Llama
stack (RMSNorm, rotary, grouped-query SDPA, SwiGLU) on 4 ranks. Each run compares every
step's loss with a single-process run of the same module and the collectives issued
(counted at dispatch level, DTensor's included) with the plan's. In-process: how layouts
become DTensor placements, and what parallelize refuses, with a clear error, before running.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import ilp_planner
from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.layouts import B, Layout, P, S
from runtime.apply import parallelize
from runtime.dtensors import DimMap, placements, rank_grid
from runtime.errors import RuntimeSetupError
from runtime.modules import GPT, MLP
from runtime.tp_styles import to_parallelize_plan
from tests.helpers.procs import run


def _torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(n), *args]


@pytest.mark.slow
def test_sdpa_split_over_batch_and_heads_runs_on_local_blocks_like_whole_tensors():
    """``runtime.local_attention`` on 8 gloo ranks (a 2 × 4 mesh: 2 sequences over 2 ranks
    and 4 heads over 4, the pair DTensor's own 4-D matmul refuses): output and gradients
    equal whole-tensor SDPA, masks sliced to each rank's block, no forward collective; a
    mask held whole as a DTensor on another mesh of the same devices (an opaque op's, as
    DeepSeek-V3.2's indexer builds it) is read by SDPA and added to scores like a plain one."""
    res = run(_torchrun(8, "tests/helpers/local_attention_check.py"), 300)
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert res.stdout.count("OK ") >= 12 and "FAIL" not in res.stdout


@pytest.mark.slow
def test_user_example_trains_on_eight_ranks_like_one_process():
    res = run(_torchrun(8, "examples/train_own_model.py", "--steps", "5", "--audit"), 420)
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert "all ranks: losses match and executed = planned" in res.stdout
    assert res.stdout.count("match") >= 5 and "MISMATCH" not in res.stdout
    assert "Warning" not in res.stderr  # neither the example's code nor the collectives warn
    plan_line = next(line for line in res.stdout.splitlines() if line.startswith("plan:"))
    assert plan_line.count("3d(") >= 3  # the plan mixes mesh shapes, not plain data parallel


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "llama", "twin", "coded", "head_T", "encoder",
                                   "odd_batch", "weight_norm", "relu6", "seq_image", "padded",
                                   "frozen", "residual_columns"])
def test_applied_modules_match_one_process_and_the_plan(model):
    """``twin``: two followers in functional code read one row-parallel linear's partial
    sums, resolved once at its boundary — listed once in the plan, run once (the audit
    would count a second listing as a collective never run). ``coded``: the solver's plan
    of a ReLU following a functional linear (whose optimum once resolved partial sums
    between the two, a plan ``parallelize`` refused) runs. ``head_T``: a head on a
    parameter's ``.T`` in the module's code, imported as the linear it is, trains.
    ``encoder``: ``nn.TransformerEncoderLayer``, whose attention's functional linear and
    residual add read the block's input on meshes that differ by a unit axis (refused as
    two layouts before), trains. ``odd_batch``: a batch of 3 on 4 ranks, whose plan split
    it 2 ways before (refused at the first forward), trains. ``weight_norm``: a
    weight-normed linear, whose backward op DTensor has no rule for (it failed in the first
    backward), runs replicated as its opaque op is planned. ``relu6``: ReLU6's backward
    (``hardtanh_backward``, which DTensor's decomposition path fails on) runs on the
    blocks of the split activation, nothing gathered (the audit). ``seq_image``: tokens
    turned into an image by ``transpose(1, 2).reshape`` for a convolution (Segformer's), which
    the importer read as rows of the image's width and the runtime split wrongly.
    ``padded``: an image padded in code before the first convolution (MobileNetV2's): no
    gradient comes back through that edge, so its backward program is neither run nor
    priced (the plan listed gathers autograd never ran: the audit's mismatch). ``frozen``:
    a frozen embedding and projection under a trained adapter and head (a fine-tuning):
    no gradient synchronised for the frozen ones, their values unchanged, the rest trained
    as in one process. ``residual_columns``: a residual add split over its columns reads
    the module's own ``(b, t, c)`` input split on its features (before, the input's block
    was reshaped to whole features and the first forward crashed)."""
    res = run(_torchrun(4, "tests/helpers/apply_check.py", model), 300)
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    ok = next(line for line in res.stdout.splitlines() if line.startswith("OK"))
    if model in ("mlp", "twin"):  # weights split, so biases are added to partial sums (shares)
        assert "p2=4" in ok or "p2=2" in ok


def test_layouts_become_placements_on_their_own_mesh():
    fact = (MeshAxis(1, 2), MeshAxis(1, 1), MeshAxis(1, 4))
    lay = Layout(fact, (S(0), B, P))
    assert rank_grid(lay.fact, 8).shape == (2, 4)
    tokens_major = DimMap((2, 16, 64), 2)  # IR (tokens, features) is the real (b, t, c)
    assert placements(lay, tokens_major, "x") == (Shard(0), Partial())
    col = Layout(fact, (B, B, S(1)))
    assert placements(col, tokens_major, "x") == (Replicate(), Shard(2))
    weight_t = DimMap((64, 32), 2, transposed=True)  # nn.Linear stores (out, in)
    assert placements(col, weight_t, "w") == (Replicate(), Shard(0))
    with pytest.raises(RuntimeSetupError, match="even splits"):
        placements(Layout(fact, (S(0), B, S(0))), DimMap((2, 16, 64), 2), "x")


def test_meshes_of_any_factorisation_place_each_rank_at_its_coordinates():
    nodes_major = rank_grid((MeshAxis(2, 1), MeshAxis(1, 2)), 4)
    assert nodes_major.tolist() == [[0, 1], [2, 3]]  # rows of ranks: DeviceMesh's default
    devices_major = rank_grid((MeshAxis(1, 2), MeshAxis(2, 1)), 4)
    assert devices_major.tolist() == [[0, 2], [1, 3]]  # axis 0 walks the devices of a node
    assert rank_grid((MeshAxis(1, 1), MeshAxis(2, 2)), 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeSetupError, match="covers 2 ranks"):
        rank_grid((MeshAxis(1, 2),), 4)


@pytest.fixture
def one_rank():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


CLUSTER = {"nodes": 1, "devices_per_node": 1, "memory_gib": 16, "peak_tflops": 1,
           "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                     "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}


def test_refusals_name_the_reason(one_rank):
    tied = GPT(16, 1, 2, 8, 64)
    plan = ilp_planner.solve(ilp_planner.from_module(tied, (torch.zeros(16, dtype=torch.long),)),
                             cluster=CLUSTER, baselines=False)
    with pytest.raises(RuntimeSetupError, match="ties its weight to an embedding in functional"):
        parallelize(plan, tied)
    mlp = MLP([8, 8])
    graph = ilp_planner.from_module(mlp, (torch.zeros(4, 8),))
    two = dict(CLUSTER, devices_per_node=2)
    with pytest.raises(RuntimeSetupError, match="for 2 devices, the job has 1"):
        parallelize(ilp_planner.solve(graph, cluster=two, baselines=False), mlp)


class _SharedLayer(torch.nn.Module):
    """ALBERT's shared layer, reduced: one linear applied twice in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + torch.relu(self.mix(x))
        return self.head(x + torch.relu(self.mix(x)))


def test_a_module_called_twice_with_its_weights_is_refused_before_anything_changes(one_rank):
    """It failed mid-forward, after the parameters were placed, saying the plan had one op
    for the module (it has two); now ``parallelize`` refuses first, naming the module and
    its second call, and leaves the module as it was."""
    model = _SharedLayer()
    ids = torch.randint(0, 64, (4, 8))
    plan = ilp_planner.solve(ilp_planner.from_module(model, (ids,)), cluster=CLUSTER,
                             baselines=False)
    with pytest.raises(RuntimeSetupError, match=r"module 'mix' is called again in the forward "
                                                r"\(op 'mix\.linear'\) with its parameters"):
        parallelize(plan, model)
    assert not hasattr(model, "ilp_plan")
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_frozen_parameters_must_be_the_plans_and_other_shapes_are_refused_by_name(one_rank):
    """A layer frozen in the module but trained in the plan (or the reverse) would run
    other gradient collectives than the plan prices: refused by parallelize, naming the op
    and parameter. An op with some parameters frozen and others not is refused at import
    (the plan freezes an op whole). An input of another shape than the plan's example:
    refused naming both shapes (its layouts and prices are for those)."""
    mlp = MLP([8, 8, 4])
    plan = ilp_planner.solve(ilp_planner.from_module(mlp, (torch.zeros(4, 8),)),
                             cluster=CLUSTER, baselines=False)
    mlp.fc[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeSetupError, match=r"op 'fc\.0' is planned to train but "
                                                r"fc\.0\.weight are frozen"):
        parallelize(plan, mlp)
    frozen_plan = ilp_planner.solve(ilp_planner.from_module(mlp, (torch.zeros(4, 8),)),
                                    cluster=CLUSTER, baselines=False)
    mlp.fc[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeSetupError, match=r"op 'fc\.0' is planned frozen but "
                                                r"fc\.0\.weight train"):
        parallelize(frozen_plan, mlp)
    biased = MLP([8, 8, 4], bias=True)
    biased.fc[0].bias.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"op 'fc\.0': some of its parameters are "
                                          r"frozen and others not \(fc\.0\.bias of fc\.0\.weight, "
                                          r"fc\.0\.bias\)"):
        ilp_planner.from_module(biased, (torch.zeros(4, 8),))
    mlp.fc[0].weight.requires_grad_(True)
    applied = parallelize(plan, mlp)
    with pytest.raises(RuntimeSetupError, match=r"has shape \(8, 8\); the plan was solved "
                                                r"for a batch of 4, 32 elements"):
        applied(torch.zeros(8, 8))
    with pytest.raises(RuntimeSetupError, match=r"has shape \(2, 16\)"):  # as many elements
        applied(torch.zeros(2, 16))


def test_a_module_computing_its_own_loss_is_refused_for_parallelize() -> None:
    """parallelize runs the module's code on sharded values, where a loss its forward
    computes from its targets does not run (Hugging Face's ``labels``): refused at import,
    saying what to do; the runtime's own executor's bare graph imports it."""

    class OwnLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.fc(x), y)

    args = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="a loss its own forward computes"):
        ilp_planner.from_module(OwnLoss(), args)
    assert ilp_planner.from_module(OwnLoss(), args, dtensor=False).ops


def test_one_rank_applies_and_trains_like_the_module(one_rank):
    torch.manual_seed(0)
    mlp, ref = MLP([8, 16, 4], bias=True), MLP([8, 16, 4], bias=True)
    ref.load_state_dict(mlp.state_dict())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    plan = ilp_planner.solve(ilp_planner.from_module(mlp, (x,)), cluster=CLUSTER,
                             baselines=False)
    applied = ilp_planner.apply(plan, mlp)
    out = applied(x)
    assert type(out) is torch.Tensor  # replicated: what the module returns in one process
    loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()
    ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
    ref_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    grad = applied.fc[0].weight.grad.full_tensor()
    assert torch.allclose(grad, ref.fc[0].weight.grad, atol=1e-6)


def test_megatron_plans_map_onto_pytorch_tensor_parallel_styles():
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ilp_planner.inputs.config import load_config
    from ilp_planner.intra_op.baselines import megatron_filter
    from ilp_planner.testing import restricted_plan, three_d_filter

    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    graph = ilp_planner.from_module(model, (torch.zeros(8, 32),))
    config = load_config({"model": graph, "cluster": dict(CLUSTER, devices_per_node=4)})
    dp, tp = MeshAxis(1, 2), MeshAxis(1, 2)
    plan = restricted_plan(config, megatron_filter(dp, tp))
    styles = to_parallelize_plan(plan)
    kinds = {name: type(style) for name, style in styles.items()}
    assert kinds == {"0": ColwiseParallel, "2": RowwiseParallel}
    three_d = restricted_plan(config, three_d_filter((1, 2, 2)))
    with pytest.raises(ValueError, match="splits its weight over 2 mesh axes"):
        to_parallelize_plan(three_d)
