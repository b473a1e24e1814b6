"""Dropout is priced as the program runs it: a built-in model's ``dropout`` probability puts
dropout ops (and the attention's dropped probabilities) in its graph only where p > 0, an
import folds a dropout that drops nothing, and the runtime's executor, which runs no dropout,
refuses a graph that drops instead of running another model than the one priced. Under
``parallelize`` every rank draws each mask whole, as one process does, and keeps its block:
an import's dropouts are priced so, and training matches one process."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

import ilp_planner
from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.compute_model import MASK_BYTES, op_work
from runtime.errors import RuntimeSetupError
from runtime.model import check_supported
from tests.helpers.procs import run

SHAPE = dict(hidden=16, layers=2, heads=2, seq_len=8, vocab=64, batch=2)


def _dropouts(graph) -> list[str]:
    return [op.name for op in graph.ops if op.kind is OpKind.DROPOUT]


@pytest.mark.parametrize("build", [
    lambda p: models.gpt(**SHAPE, dropout=p),
    lambda p: models.moe(**SHAPE, experts=4, top_k=2, expert_ffn=8, moe_every=2, dropout=p),
    lambda p: models.u_transformer(16, 2, 2, 8, 2, dropout=p),
])
def test_a_builtin_model_has_dropout_ops_only_where_it_drops(build) -> None:
    """p = 0 (the default): no dropout op, no dropped probabilities, each residual add
    reads its projection; p > 0: a dropout after every attention projection and every MLP
    (dense or MoE), and every attention drops its probabilities — the same graph
    otherwise."""
    plain, dropping = build(0.0), build(0.1)
    assert _dropouts(plain) == []
    assert not any(op.attrs.get("probs_dropout") for op in plain.ops)
    attn = [op for op in dropping.ops if op.kind is OpKind.ATTENTION]
    assert attn and all(op.attrs["probs_dropout"] == 1 for op in attn)
    assert len(_dropouts(dropping)) == 2 * len(attn)  # one attention, one MLP a block
    for name in _dropouts(dropping):
        (reader,) = dropping.consumers(name)
        assert dropping[reader].kind is OpKind.ADD
        # without the dropout, the add reads the dropout's input
        source = dropping[name].inputs[0]
        assert source in plain[reader].inputs
    assert len(plain.ops) == len(dropping.ops) - len(_dropouts(dropping))


@pytest.mark.parametrize("value,text", [
    (-0.1, r"model\.dropout.*non-negative number"),
    (1.5, r"model\.dropout.*\[0, 1\)"),
    (1.0, r"model\.dropout.*\[0, 1\)"),
    ("high", r"model\.dropout.*number"),
])
def test_a_bad_dropout_names_its_key(tmp_path, value, text) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"model: {{kind: gpt, hidden: 16, layers: 1, heads: 2, seq_len: 8, "
                    f"vocab: 64, batch: 2, dropout: {value}}}\n"
                    f"cluster: {{nodes: 1, devices_per_node: 2, memory_gib: 1, "
                    f"peak_tflops: 1, links: {{intra: {{latency_us: 1, bandwidth_gbps: 1}}, "
                    f"inter: {{latency_us: 1, bandwidth_gbps: 1}}}}}}\n")
    with pytest.raises(ConfigError, match=text):
        load_config(path).graph  # noqa: B018 — building the model reads the key


def test_llama_blocks_refuse_a_dropout() -> None:
    with pytest.raises(ConfigError, match=r"model\.dropout.*llama"):
        models.moe(**SHAPE, experts=4, top_k=2, expert_ffn=8, block="llama", dropout=0.1)


def test_the_dropouts_price_their_bytes_and_the_scores_theirs() -> None:
    """The residual dropouts cost what the compute model's table says (2N + N mask bytes
    each phase); an unfused attention that drops its probabilities moves 2E bytes and E
    mask bytes more in each phase and runs one kernel more (E = tokens · heads · seq)."""
    plain, dropping = models.gpt(**SHAPE), models.gpt(**SHAPE, dropout=0.1)
    for name in _dropouts(dropping):
        op = dropping[name]
        n = op.output.numel * 4
        fwd, bwd = op_work(op, 1.0)
        assert fwd.bytes == bwd.bytes == 2 * n + op.output.numel * MASK_BYTES
    a0, a1 = plain["h.0.attn.core"], dropping["h.0.attn.core"]
    (f0, b0), (f1, b1) = op_work(a0, 1.0, flash=False), op_work(a1, 1.0, flash=False)
    scores = SHAPE["batch"] * SHAPE["seq_len"] * SHAPE["heads"] * SHAPE["seq_len"]
    assert f1.stream_bytes - f0.stream_bytes == 2 * scores * 4 + scores * MASK_BYTES
    assert b1.stream_bytes - b0.stream_bytes == 2 * scores * 4 + scores * MASK_BYTES
    assert (f1.kernels, b1.kernels) == (f0.kernels + 1, b0.kernels + 1)


CLUSTER = {"nodes": 1, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 1,
           "links": {"intra": {"latency_us": 10, "bandwidth_gbps": 10},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}


def test_a_plan_with_dropout_costs_more_and_holds_its_masks() -> None:
    """Pricing follows the graph: the dropping model's step and activation memory are
    strictly above the plain one's on the same cluster."""
    model = dict(kind="gpt", **SHAPE)
    plain = ilp_planner.solve(model, cluster=CLUSTER, baselines=False)
    dropping = ilp_planner.solve({**model, "dropout": 0.1}, cluster=CLUSTER, baselines=False)
    assert dropping.cost.compute_s > plain.cost.compute_s
    assert dropping.cost.peak_memory_bytes > plain.cost.peak_memory_bytes


class _Dropper(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("p,train,drops", [(0.1, True, True), (0.0, True, False),
                                           (0.1, False, False)])
def test_an_imported_dropout_that_drops_nothing_costs_and_holds_nothing(p, train, drops) -> None:
    """torch runs a dropout of p = 0, or any dropout of an evaluated module, as the
    identity: the import keeps it as an op (a module boundary ``parallelize`` may run a
    program at) marked ``identity``, which the compute model prices at no work and the
    memory model at no bytes, and which the executor runs; one that drops is priced and
    refused."""
    module = _Dropper(p).train(train)
    graph = from_module(module, (torch.randn(4, 8),))
    (name,) = _dropouts(graph)
    op = graph[name]
    assert op.attrs.get("identity", 0) == int(not drops)
    fwd, bwd = op_work(op, 1.0)
    assert (fwd.bytes + bwd.bytes > 0) == drops
    assert (fwd.kernels + bwd.kernels > 0) == drops
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    layer = next(ly for ly in plan.layers if ly.name == name)
    assert (layer.memory_bytes > 0) == drops
    if drops:
        with pytest.raises(RuntimeSetupError, match="drops"):
            check_supported(graph)
    else:
        check_supported(graph)


class _SdpaDropper(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p, self.qkv = p, nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p,
                                                       is_causal=True)
        return y.transpose(1, 2).reshape(8, 8)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_fused_attention_that_drops_its_probabilities_is_marked(p) -> None:
    """SDPA's ``dropout_p`` > 0 drops the probabilities: the import marks the attention
    ``probs_dropout`` (priced; the executor refuses it), at 0 it does not."""
    graph = from_module(_SdpaDropper(p), (torch.randn(8, 8),))
    (attn,) = [op for op in graph.ops if op.kind is OpKind.ATTENTION]
    assert attn.attrs.get("probs_dropout", 0) == int(p > 0)


@pytest.mark.parametrize("dtensor", [True, False])
def test_an_import_for_parallelize_prices_each_mask_drawn_whole(dtensor) -> None:
    """Under ``parallelize`` (an import with ``dtensor``) every rank draws a dropout's whole
    mask and keeps its block (:mod:`runtime.local_dropout`): the import marks the dropouts
    and the dropping SDPA ``whole_mask`` (the SDPA ``unfused`` too: it runs the math kernel
    on its blocks); for the executor's plans (``dtensor=False``) neither."""
    graph = from_module(_Dropper(0.1).train(), (torch.randn(4, 8),), dtensor=dtensor)
    (name,) = _dropouts(graph)
    assert graph[name].attrs.get("whole_mask", 0) == int(dtensor)
    graph = from_module(_SdpaDropper(0.1), (torch.randn(8, 8),), dtensor=dtensor)
    (attn,) = [op for op in graph.ops if op.kind is OpKind.ATTENTION]
    assert attn.attrs.get("whole_mask", 0) == attn.attrs.get("unfused", 0) == int(dtensor)


def test_a_mask_drawn_whole_costs_the_whole_draw_and_the_block_copy() -> None:
    """Split d ways, a ``whole_mask`` dropout's forward writes the whole mask (d × its
    block's mask bytes) and copies its block (read and written), 2 kernels more; its
    backward is a plain dropout's; unsplit it costs what a plain one does. The same for an
    attention's dropped probabilities (E mask bytes a device)."""
    dropping = models.gpt(**SHAPE, dropout=0.1)
    op = dropping[_dropouts(dropping)[0]]
    whole = dataclasses.replace(op, attrs={**op.attrs, "whole_mask": 1})
    for d in (2.0, 4.0):
        (f0, b0), (f1, b1) = op_work(op, d), op_work(whole, d)
        mask = op.output.numel / d * MASK_BYTES
        assert f1.bytes - f0.bytes == (d + 2) * mask
        assert f1.kernels - f0.kernels == 2
        assert (b1.bytes, b1.kernels) == (b0.bytes, b0.kernels)
    assert op_work(whole, 1.0) == op_work(op, 1.0)
    attn = dropping["h.0.attn.core"]
    whole = dataclasses.replace(attn, attrs={**attn.attrs, "whole_mask": 1})
    (f0, b0), (f1, b1) = op_work(attn, 2.0, flash=False), op_work(whole, 2.0, flash=False)
    scores = SHAPE["batch"] * SHAPE["seq_len"] * SHAPE["heads"] * SHAPE["seq_len"] / 2
    assert f1.stream_bytes - f0.stream_bytes == 4 * scores * MASK_BYTES
    assert (f1.kernels, b1) == (f0.kernels + 2, b0)


@pytest.mark.slow
def test_dropout_under_parallelize_draws_what_one_process_draws() -> None:
    """4 gloo ranks (:mod:`tests.helpers.dropout_check`): a block with ``nn.Dropout`` on a
    column-split activation and on a row-parallel output and SDPA dropping probabilities
    split over batch and heads, in Megatron's 2 × 2 layouts, trains 3 steps like one
    process drawing from the same generator (losses, parameters; audited). Before, each
    rank drew its block's mask from its own generator: the losses differed from the first
    step. Ranks seeded apart are refused, naming them — their generators, or their modules
    built apart (:mod:`runtime.rank_agreement`; each rank kept its own block before);
    ``rand_like`` on a DTensor is refused at the forward, naming it."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "tests/helpers/dropout_check.py"], timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert lines == ["OK trains_like_one_process", "OK refuses_generators_apart",
                     "OK refuses_modules_apart", "OK refuses_other_random_ops"], \
        out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0


def test_the_memory_lower_bound_holds_no_identity_dropout() -> None:
    """``validate``'s memory lower bound charges an op's output unless the op is an
    identity dropout (its output is its input): the same model with and without one
    has the same bound."""
    from ilp_planner.lowering.cost_model import MemorySpec, memory_terms

    plain = from_module(_Dropper(0.0).train(), (torch.randn(4, 8),))
    absent = from_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                         (torch.randn(4, 8),))
    memory = MemorySpec.preset("adam")
    assert sum(t.activation_bytes for t in memory_terms(plain, memory)) == \
        sum(t.activation_bytes for t in memory_terms(absent, memory))


def test_the_executor_refuses_a_graph_that_drops() -> None:
    """The executor runs no dropout: a built-in model with dropout > 0, or an imported
    attention that drops its probabilities, is refused before any rank starts, naming the
    op and the way out."""
    check_supported(models.gpt(**SHAPE))
    with pytest.raises(RuntimeSetupError, match=r"attention 'h\.0\.attn\.core' drops its "
                                                r"probabilities.*model\.dropout: 0"):
        check_supported(models.gpt(**SHAPE, dropout=0.1))
    mlp_only = models.gpt(**SHAPE, dropout=0.1)
    no_probs = type(mlp_only)(mlp_only.name, [
        dataclasses.replace(op, attrs={k: v for k, v in op.attrs.items() if k != "probs_dropout"})
        for op in mlp_only.ops])
    with pytest.raises(RuntimeSetupError, match=r"dropout 'h\.0\.attn\.dropout' drops.*"
                                                r"plan\.parallelize"):
        check_supported(no_probs)


def test_local_dropout_in_place_and_aten_dropouts_in_evaluation() -> None:
    """Under :class:`runtime.local_dropout.LocalDropout` (one process, a 1-device mesh):
    ``F.dropout(..., inplace=True)`` and ``torch.dropout_`` drop the caller's tensor itself,
    with the mask one process draws (before, they returned a new tensor and left the
    caller's undropped); aten's ``feature_dropout`` / ``alpha_dropout`` in evaluation draw
    nothing and return their input (before, refused), and in training are refused."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from runtime.errors import FidelityError
    from runtime.local_dropout import LocalDropout

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = torch.randn(8, 16)
        torch.manual_seed(0)
        want = F.dropout(t, 0.5, True)
        for drop in (lambda d: F.dropout(d, 0.5, True, inplace=True),
                     lambda d: F.dropout(d, p=0.5, inplace=True),
                     lambda d: torch.dropout_(d, 0.5, True)):
            d = distribute_tensor(t.clone(), mesh, [Shard(0)])
            torch.manual_seed(0)
            with LocalDropout():
                drop(d)  # the result unused: the caller's tensor is the dropped one
            assert torch.equal(d.full_tensor(), want)
        d = distribute_tensor(t.clone(), mesh, [Shard(0)])
        with LocalDropout():
            for f in (torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout):
                assert torch.equal(f(d, 0.5, False).full_tensor(), t)
                with pytest.raises(FidelityError, match="draws random values on a DTensor"):
                    f(d, 0.5, True)
    finally:
        dist.destroy_process_group()
