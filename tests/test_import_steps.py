"""Element-wise steps the importer folds are priced by their bytes, never free: a
hand-written tanh GELU between two linears, an RMSNorm written out, hand-written
attention's score scale and mask — each step a memory-bound kernel on the op reading the
value, forward by torch's bytes and backward as autograd runs it. Checked against
hand-computed closed forms and against the kernels a dispatch recorder sees in eager
forward and backward; a value read by two ops is priced once; ``explain`` names them;
imported Hugging Face models' predicted step grows by exactly their price."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import MappingProxyType

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ilp_planner
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.lowering.compute_model import op_work
from tests.helpers.hf_tiny import folded_seconds, tiny_hf

B, S, H = 2, 8, 16
N = B * S * 4 * H  # elements of the GELU's input (the first linear's 4H-wide output)
GPU = {"gpu": "a100-80gb", "nodes": 1, "devices_per_node": 1, "intra": "nvlink3",
       "inter": "8x-ib-hdr200"}


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's NewGELU as Hugging Face writes it: eight eager kernels."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GeluMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, 4 * H, bias=False)
        self.proj = nn.Linear(4 * H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(tanh_gelu(self.fc(x)))


class Kernels(TorchDispatchMode):
    """Every kernel eager torch runs — an op whose output is not a view of an input
    (in-place ops included) — with the stored bytes of the tensors it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in ins}
        in_place = func._schema.name.endswith("_")
        if outs and (in_place or not any(o.untyped_storage().data_ptr() in storages
                                         for o in outs)):
            self.kernels += 1
            self.bytes += sum(_stored(t) for t in ins + outs)
        return out


def _stored(t: torch.Tensor) -> int:
    return torch.Size([d for d, st in zip(t.shape, t.stride(), strict=True) if st]).numel() \
        * t.element_size()


def eager(fn: Callable, *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32
          ) -> tuple[tuple[int, int], tuple[int, int]]:
    """((kernels, bytes) forward, (kernels, bytes) backward) of ``fn`` run eagerly on leaves
    of ``shapes``, the backward from a gradient of its output."""
    xs = [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]
    with Kernels() as fwd:
        y = fn(*xs)
    dy = torch.randn_like(y)
    with Kernels() as bwd:
        torch.autograd.grad(y, xs, dy)
    return (fwd.kernels, fwd.bytes), (bwd.kernels, bwd.bytes)


def _folded(op) -> tuple[int, ...]:
    a = op.attrs
    return (a["input_steps"], a["input_steps_bytes"], a["input_steps_flops"],
            a["input_steps_bwd"], a["input_steps_bwd_bytes"], a["input_steps_bwd_flops"])


def _bare(op):
    return dataclasses.replace(op, attrs=MappingProxyType(
        {k: v for k, v in op.attrs.items() if not k.startswith("input_")}))


def test_a_hand_written_tanh_gelu_is_priced_on_the_linear_reading_it():
    """Forward, 8 kernels over n elements: pow, the 0.044715 product, tanh, + 1, the two
    constant products read n and write n (2n each); x + … and the last product read two
    (3n each): 18n × 4 bytes, n FLOPs each. Backward, 11: the last product's two
    gradients (3n each), tanh's (reads its output and the gradient: 3n), the two constant
    products' (2n each), pow's (x², × 3, × the gradient: 2n + 2n + 3n), the 0.5 product's
    (2n) and the two sums of x's three gradients (3n each): 28n × 4 bytes."""
    graph = from_module(GeluMlp(), (torch.randn(B, S, H),), loss_fn=lambda y: y.sum())
    proj = graph["proj"]
    assert proj.kind is OpKind.LINEAR and proj.inputs == ("fc",)
    assert _folded(proj) == (8, 18 * N * 4, 8 * N, 11, 28 * N * 4, 11 * N)
    assert "input_copies" not in proj.attrs
    assert not any(k.startswith("input_") for k in graph["fc"].attrs)
    assert eager(tanh_gelu, (B, S, 4 * H)) == ((8, 18 * N * 4), (11, 28 * N * 4))
    # memory-bound kernels beside the matmul; a row-parallel projection reads a quarter
    # of the GELU's elements on each of 4 devices, a data-parallel one a quarter of the rows
    plain_fwd, plain_bwd = op_work(_bare(proj), 4.0, (B * S, H, 4 * H / 4))
    fwd, bwd = op_work(proj, 4.0, (B * S, H, 4 * H / 4))
    assert (fwd.stream_bytes, fwd.stream_flops, fwd.kernels - plain_fwd.kernels) == \
        (18 * N * 4 / 4, 8 * N / 4, 8)
    assert (bwd.stream_bytes, bwd.stream_flops, bwd.kernels - plain_bwd.kernels) == \
        (28 * N * 4 / 4, 11 * N / 4, 11)
    assert op_work(proj, 4.0, (B * S / 4, H, 4 * H))[0].stream_bytes == 18 * N * 4 / 4


class WrittenRmsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(H, H, bias=False)
        self.weight = nn.Parameter(torch.ones(H))
        self.second = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_normed(self.first(x)) * self.weight)


def _normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_an_rmsnorm_written_out_prices_its_eager_kernels_beside_the_norm():
    """The norm op's own price is a fused norm's (reads x, writes y: 2n) — what the gain's
    product runs —; the steps before it are the extra kernels eager runs, over n elements
    and r rows. Forward, 5: pow (2n), mean (n + r), + eps and rsqrt (2r each), x · rsqrt
    (2n + r): (5n + 6r) × 4 bytes. Backward, 11: x · dy and dy · rsqrt (3n, 2n + r), the
    row sum (n + r), rsqrt's (r³, × −0.5, × the gradient: 2r + 2r + 3r), mean's (r in, n
    out), pow's (2n + 2n + 3n) and the sum of x's two gradients (3n)."""
    graph = from_module(WrittenRmsNorm(), (torch.randn(B, S, H),), loss_fn=lambda y: y.sum())
    n, r = B * S * H, B * S
    norm = next(op for op in graph.ops if op.kind is OpKind.RMSNORM)
    assert norm.inputs == ("first",) and norm.params == H
    assert _folded(norm) == (5, (5 * n + 6 * r) * 4, 2 * n + 3 * r,
                             11, (17 * n + 10 * r) * 4, 7 * n + 4 * r)
    assert not any(k.startswith("input_") for k in graph["second"].attrs)
    assert eager(_normed, (B, S, H)) == ((5, (5 * n + 6 * r) * 4), (11, (17 * n + 10 * r) * 4))
    # the gain's product is what the norm op prices forward: reads n and the gain, writes n
    gain = torch.ones(H)
    (kernels, moved), _ = eager(lambda x: x * gain, (B, S, H))
    assert (kernels, moved) == (1, 2 * n * 4 + H * 4)
    fwd = op_work(_bare(norm), 1.0)[0]
    assert (fwd.kernels, fwd.bytes) == (1, 2 * n * 4)


class ScaledMasked(nn.Module):
    """Hand-written attention: q kᵀ scaled by 1/√d and masked causally by hand."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.out = nn.Linear(H, H, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(S, S, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, S, 3, 4, 4).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(_scale_mask(q @ k.transpose(-1, -2), ~self.tril), dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(B, S, H))


def _scale_mask(scores: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
    return (scores / math.sqrt(4)).masked_fill(above, float("-inf"))


@pytest.mark.parametrize("dtensor", [True, False])
def test_hand_written_scores_scale_and_mask_are_priced_where_attention_runs_as_written(
        dtensor):
    """The unfused formula prices the scores' matmuls, softmax and dropout, not a scale or
    a mask: where the attention runs as written (``unfused``, a plan on the user's module)
    each is a kernel on the E = b·heads·s² scores — the scale reads and writes E (2E × 4
    bytes), the mask reads E and the s² boolean mask and writes E — and backward the
    same (a product by the scale; the mask's fill of the gradient). Imported bare (the
    runtime's kernel, which scales and masks inside), they are not added."""
    graph = from_module(ScaledMasked(), (torch.randn(B, S, H),), loss_fn=lambda y: y.sum(),
                        dtensor=dtensor)
    attn = next(op for op in graph.ops if op.kind is OpKind.ATTENTION)
    assert "not_plain_causal" not in attn.attrs  # the mask is still proven causal
    if not dtensor:
        assert not any(k.startswith("input_") for k in attn.attrs)
        return
    e = B * 4 * S * S
    moved = 4 * e * 4 + S * S
    assert attn.attrs["unfused"] == 1
    assert _folded(attn) == (2, moved, 2 * e, 2, moved, 2 * e)
    above = ~torch.tril(torch.ones(S, S, dtype=torch.bool))
    assert eager(lambda s: _scale_mask(s, above), (B, 4, S, S)) == ((2, moved), (2, moved))
    plain = op_work(_bare(attn), 2.0, flash=False)
    fwd, bwd = op_work(attn, 2.0, flash=False)
    assert (fwd.stream_bytes - plain[0].stream_bytes, bwd.stream_bytes - plain[1].stream_bytes) \
        == (moved / 2, moved / 2)


def test_steps_read_by_two_ops_are_priced_once_and_a_pure_view_is_free():
    """One GELU read by two linears ran once: the first reader prices its 8 kernels. Views
    alone (a transpose and back, a reshape torch can view) move nothing."""

    class Fan(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(H, 4 * H, bias=False)
            self.left = nn.Linear(4 * H, H, bias=False)
            self.right = nn.Linear(4 * H, H, bias=False)

        def forward(self, x):
            h = tanh_gelu(self.fc(x))
            v = self.fc(x).view(B, S, 4, H).transpose(1, 2).transpose(1, 2).reshape(B, S, 4 * H)
            return self.left(h) + self.right(h) + self.left(v)

    graph = from_module(Fan(), (torch.randn(B, S, H),))
    left, right = graph["left"], graph["right"]
    assert _folded(left)[:3] == (8, 18 * N * 4, 8 * N)
    assert not any(k.startswith("input_") for k in right.attrs)
    viewed = graph["left.linear"]  # left's second call, on fc's second call re-viewed
    assert viewed.inputs == ("fc.linear",)
    assert not any(k.startswith("input_") for k in viewed.attrs)


def test_explain_names_the_steps_folded_outside_attention():
    graph = from_module(GeluMlp(), (torch.randn(B, S, H),), loss_fn=lambda y: y.sum())
    text = ilp_planner.explain(ilp_planner.solve(graph, cluster=GPU, baselines=False))
    steps = (f"8 kernels, {18 * N * 4 / 1024:.2f} KiB, {8 * N:.3g} FLOPs; backward 11 "
             f"kernels, {28 * N * 4 / 1024:.2f} KiB")
    assert "folded into the values 1 other op(s) read" in text
    assert f"proj: {steps}" in text
    assert f"folded steps it reads, in its compute: {steps}" in text


def test_hf_gpt2s_new_gelu_and_eager_scores_are_priced_in_closed_form():
    """GPT-2's MLP runs NewGELU by hand on c_fc's (16 tokens, 128) output: c_proj prices
    its 8 kernels (18n × 4 bytes) and 11 backward (28n × 4); its eager attention scales
    the E = 2·4·8·8 scores (2E × 4 bytes) and adds the (2, 1, 8, 8) float mask (2E + 128
    elements × 4), backward only the scale's product (the add passes its gradient on)."""
    graph = from_module(tiny_hf("gpt2"), (torch.zeros(2, 8, dtype=torch.long),))
    n, e = 2 * 8 * 128, 2 * 4 * 8 * 8
    for i in range(2):
        assert _folded(graph[f"transformer.h.{i}.mlp.c_proj"]) == \
            (8, 18 * n * 4, 8 * n, 11, 28 * n * 4, 11 * n)
        attn = graph[f"transformer.h.{i}.attn.attention"]
        assert _folded(attn) == (2, (4 * e + 2 * 64) * 4, 2 * e, 1, 2 * e * 4, e)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_imported_hf_models_step_grows_by_exactly_their_folded_steps(name):
    """On one device the predicted step of an imported Hugging Face model is the step
    without any folded step plus, per op, its steps' bytes at the device's achieved memory
    bandwidth and a kernel floor per kernel, forward and backward; every element-wise
    step of GPT-2's NewGELU, Llama's and Mixtral's RMSNorms is on some op."""
    graph = from_module(tiny_hf(name), (torch.zeros(2, 8, dtype=torch.long),))
    stepped = [op for op in graph.ops if op.attrs.get("input_steps")]
    kinds = {op.kind for op in stepped}
    assert (OpKind.LINEAR if name == "gpt2" else OpKind.RMSNORM) in kinds
    assert all(op.attrs["input_steps"] > op.attrs.get("input_copies", 0) for op in stepped
               if op.kind is not OpKind.LINEAR)
    bare = Graph(graph.name, [_bare(op) for op in graph.ops])
    extra = folded_seconds(stepped, load_config({"model": graph, "cluster": GPU})
                           .cluster.device)
    with_, without = (ilp_planner.solve(g, cluster=GPU, baselines=False).cost.compute_s
                      for g in (graph, bare))
    assert with_ - without == pytest.approx(extra, rel=1e-9)


def test_a_step_on_the_models_input_runs_no_backward():
    """tanh of the input itself, read by a linear: one kernel forward (reads and writes n),
    none backward — no gradient flows to the model's inputs (the replay takes the
    gradient only to values derived from some op past them)."""

    class Squashed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(H, H, bias=False)

        def forward(self, x):
            return self.fc(torch.tanh(x))

    graph = from_module(Squashed(), (torch.randn(B, S, H),), loss_fn=lambda y: y.sum())
    n = B * S * H
    assert _folded(graph["fc"]) == (1, 2 * n * 4, n, 0, 0, 0)


def test_a_step_whose_backward_cannot_be_replayed_is_named_in_one_line(monkeypatch):
    """Where torch cannot run a folded step again on its fake tensors (an op the replay
    does not support), the import stops naming the step, in one line — it is never priced
    by a guess."""
    import ilp_planner.inputs.importer as importer
    from ilp_planner.errors import ConfigError

    def unreplayable(torch_, steps, trained):
        raise RuntimeError("no fake kernel for this op\nsecond line")

    monkeypatch.setattr(importer, "replay_backward", unreplayable)
    with pytest.raises(ConfigError, match=r"cannot import GeluMlp: op '\w+' \(\w+\): its "
                       r"backward, with the steps folded before it, could not be replayed to "
                       r"count it \(RuntimeError: no fake kernel for this op\)$"):
        from_module(GeluMlp(), (torch.randn(B, S, H),))


class IdsScaled(nn.Module):
    """A float scale computed from the ids alone (a position count, as RoBERTa's), applied
    to the looked-up embeddings: no gradient flows into it."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, H), nn.Linear(H, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = (ids != 0).float().cumsum(-1)
        return self.head(self.emb(ids) * (1.0 - m / 8.0).unsqueeze(-1))


def test_steps_on_a_value_computed_from_the_ids_alone_run_no_backward():
    """A float value derived from the inputs through ops owning no parameters (``ne``,
    ``cumsum``) carries no gradient: the steps folded into it (``1 - m/8``) run forward
    only — priced with no backward kernels."""
    graph = from_module(IdsScaled(), (torch.randint(0, 32, (B, S)),))
    stepped = [op for op in graph.ops if op.attrs.get("input_steps")]
    assert stepped and all(op.attrs["input_steps_bwd"] == 0
                           and op.attrs["input_steps_bwd_bytes"] == 0 for op in stepped)
    assert any(op.attrs["input_steps"] == 2 for op in stepped)  # the sub and the div
