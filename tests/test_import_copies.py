"""Copies the importer folds outside attention inputs are priced by the bytes they move:
each on the op reading the copied value (a linear, a norm, an output), forward by torch's
count of its tensors and backward by closed form — checked here against hand-computed
bytes and against what autograd really runs — and named by ``explain``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import MappingProxyType

import pytest
import torch
import transformers as T
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ilp_planner
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.lowering.compute_model import folded_work, op_work
from tests.helpers.hf_tiny import folded_seconds, tiny_hf

B, S, H = 2, 8, 16
N = B * S * H  # elements of the first linear's output


class _Between(nn.Module):
    """``first`` (16 → 16), then ``copy(pre(...))`` on its output — ``pre`` re-views it,
    ``copy`` moves bytes — then ``second`` reading the result."""

    def __init__(self, pre: Callable, copy: Callable, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.pre, self.copy = pre, copy
        self.first = nn.Linear(H, H, bias=False)
        self.second = nn.Linear(H, H, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.copy(self.pre(self.first(x))))


def _same(h: torch.Tensor) -> torch.Tensor:
    return h


def _heads(h: torch.Tensor) -> torch.Tensor:
    return h.view(B, S, 4, 4).transpose(1, 2)  # (b, heads, s, d), strided: a view


def _written_back(h: torch.Tensor) -> torch.Tensor:
    # attention's output written back as an eager attention's is before o_proj: made
    # contiguous, then re-viewed (b, s, heads·d) — two layout copies
    return h.contiguous().transpose(1, 2).reshape(B, S, H)


FOLDS = {  # name: (pre, copy, second's dtype, forward bytes, the copies' own backward bytes,
    # (kernels, bytes, FLOPs) of the whole backward as autograd runs it, views between)
    # a cast: reads n float32, writes n float64; backward casts the gradient back
    "cast": (_same, lambda h: h.double(), torch.float64, N * (4 + 8), N * (4 + 8),
             (1, N * (4 + 8), 0)),
    # each layout copy reads and writes n float32; backward passes the gradient as a view
    # (the two transposes cancel: no copy back either)
    "layout": (_heads, _written_back, torch.float32, 2 * (2 * N * 4), 0, (0, 0, 0)),
    # rotate-half's swap of two halves: reads both, writes n; backward: views of dY — but
    # each half's slice writes its gradient into a zero-filled n (reads n/2, writes n) and
    # the two are summed (reads 2n, writes n, n adds)
    "concat": (lambda h: (h[..., 8:], h[..., :8]), lambda hs: torch.cat(hs, -1),
               torch.float32, 2 * N * 4, 0, (3, 2 * (N // 2 + N) * 4 + 3 * N * 4, N)),
    # GQA's head repeats, of the first of two heads: reads n/2, writes n; backward sums
    # the repeats (reads n, writes n/2, n/2 adds), then the slice of the first head writes
    # its gradient into a zero-filled n (reads n/2, writes n)
    "repeat": (lambda h: h.view(B, S, 2, 8)[:, :, :1],
               lambda h: h.repeat_interleave(2, dim=2).reshape(B, S, H), torch.float32,
               3 * N // 2 * 4, 3 * N // 2 * 4, (2, 3 * N * 4, N // 2)),
}


def _imported(name: str):
    pre, copy, dtype = FOLDS[name][:3]
    model = _Between(pre, copy, dtype)
    return model, from_module(model, (torch.randn(B, S, H),), loss_fn=lambda y: y.sum())


@pytest.mark.parametrize("name", sorted(FOLDS))
def test_a_copy_folded_between_two_linears_is_priced_on_the_second(name):
    _, graph = _imported(name)
    fwd_bytes, bwd_bytes, (bwd_kernels, bwd_all, bwd_flops) = FOLDS[name][3:]
    copies = 2 if name == "layout" else 1
    second = graph["second"]
    assert second.kind is OpKind.LINEAR and second.inputs == ("first",)
    a = second.attrs
    assert (a["input_copies"], a[f"input_copies_{name}"], a["input_copies_bytes"],
            a["input_copies_bwd_bytes"]) == (copies, copies, fwd_bytes, bwd_bytes)
    # only copies: no element-wise FLOPs forward; backward, what autograd runs from the
    # second's input back to the first's output (a repeat's sum adds, slices scatter)
    assert (a["input_steps"], a["input_steps_bytes"], a["input_steps_flops"]) == \
        (copies, fwd_bytes, 0)
    assert (a["input_steps_bwd"], a["input_steps_bwd_bytes"], a["input_steps_bwd_flops"]) \
        == (bwd_kernels, bwd_all, bwd_flops)
    assert not any(k.startswith("input_") for k in graph["first"].attrs)
    # priced with the second linear as separate memory-bound kernels, each with its floor;
    # on 4 devices splitting the tokens, a quarter of the bytes each phase
    m, k = B * S, second.weight.shape[0]
    fwd, bwd = op_work(second, 4.0, (m / 4, H, k))
    plain_fwd, plain_bwd = op_work(_without_copies(second), 4.0, (m / 4, H, k))
    assert (fwd.stream_bytes, fwd.kernels - plain_fwd.kernels) == (fwd_bytes / 4, copies)
    assert bwd.stream_bytes == bwd_all / 4
    assert bwd.kernels - plain_bwd.kernels == bwd_kernels
    # a column-parallel linear's input is whole on each device splitting its columns
    assert op_work(second, 4.0, (m, H / 4, k))[0].stream_bytes == fwd_bytes


def _without_copies(op):
    return dataclasses.replace(op, attrs=MappingProxyType(
        {k: v for k, v in op.attrs.items() if not k.startswith("input_")}))


class _Record(TorchDispatchMode):
    """The bytes of every kernel that writes new memory (views are free), as torch runs
    them: stride-0 dims of a broadcast read once."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in ins}
        if not any(o.untyped_storage().data_ptr() in storages for o in outs):
            self.bytes += sum(_stored_bytes(t) for t in ins + outs)
        return out


def _stored_bytes(t: torch.Tensor) -> int:
    return torch.Size([d for d, st in zip(t.shape, t.stride(), strict=True) if st]).numel() \
        * t.element_size()


@pytest.mark.parametrize("name", sorted(FOLDS))
def test_folded_copies_backward_is_what_autograd_runs(name):
    """The closed-form backward of each folded copy is what autograd runs for it: the
    gradient's kernels between the second linear's input and the first's output."""
    model, graph = _imported(name)
    # the copy alone, its input a leaf: the views before it have backward kernels of their
    # own (a slice's scatters into the sliced tensor's gradient), not the copy's
    pre = model.pre(model.first(torch.randn(B, S, H)))
    leaves = [x.detach().requires_grad_() for x in (pre if name == "concat" else [pre])]
    y = model.copy(leaves if name == "concat" else leaves[0])
    dy = torch.randn_like(y)
    with _Record() as rec:
        torch.autograd.grad(y, leaves, dy)
    assert graph["second"].attrs["input_copies_bwd_bytes"] == rec.bytes


def test_a_float32_cast_before_a_norm_is_the_norms_and_the_cast_back_the_next_linears():
    """A bf16 model casting to float32 for its layer norm (as HF's RMSNorm does) and back:
    the norm reads the cast (2 + 4 bytes an element), the linear after it the cast back
    (4 + 2); each backward casts its gradient back, the same bytes."""

    class Upcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
            self.norm = nn.LayerNorm(H)
            self.second = nn.Linear(H, H, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            return self.second(self.norm(self.first(x).float()).to(torch.bfloat16))

    graph = from_module(Upcast(), (torch.randn(B, S, H, dtype=torch.bfloat16),))
    for name in ("norm", "second"):
        a = graph[name].attrs
        assert (a["input_copies"], a["input_copies_cast"], a["input_copies_bytes"],
                a["input_copies_bwd_bytes"]) == (1, 1, N * 6, N * 6), name
    assert graph["norm"].kind is OpKind.LAYERNORM


def test_a_view_of_contiguous_data_and_a_same_dtype_cast_stay_free():
    _, graph = _imported("cast")
    assert "input_copies" in graph["second"].attrs
    free = _Between(lambda h: h.view(B, S, 2, 8), lambda h: h.float().reshape(B, S, H).contiguous())
    graph = from_module(free, (torch.randn(B, S, H),), loss_fn=lambda y: y.sum())
    assert not any(k.startswith("input_") for op in graph.ops for k in op.attrs)
    assert folded_work(graph["second"], 1.0)[0].kernels == 0


def test_a_same_dtype_cast_asked_to_copy_is_priced():
    """``to(float32, copy=True)`` of float32 data copies (reads and writes n float32);
    its backward passes the gradient on: nothing."""
    model = _Between(_same, lambda h: h.to(torch.float32, copy=True))
    a = from_module(model, (torch.randn(B, S, H),))["second"].attrs
    assert (a["input_copies"], a["input_copies_layout"], a["input_copies_bytes"],
            a["input_copies_bwd_bytes"]) == (1, 1, 2 * N * 4, 0)


def test_a_copy_read_by_two_ops_is_priced_once():
    """One ``contiguous`` read by two linears ran once: the first reader prices it."""

    class Fan(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(H, H, bias=False)
            self.left = nn.Linear(H, H, bias=False)
            self.right = nn.Linear(H, H, bias=False)

        def forward(self, x):
            h = _written_back(_heads(self.first(x)))
            return self.left(h) + self.right(h)

    graph = from_module(Fan(), (torch.randn(B, S, H),))
    assert graph["left"].attrs["input_copies_bytes"] == 2 * (2 * N * 4)
    assert "input_copies" not in graph["right"].attrs


def test_explain_names_every_folded_copy_of_a_layer():
    _, graph = _imported("repeat")
    cluster = {"gpu": "a100-80gb", "nodes": 1, "devices_per_node": 2, "intra": "nvlink3",
               "inter": "8x-ib-hdr200"}
    text = ilp_planner.explain(ilp_planner.solve(graph, cluster=cluster, baselines=False))
    kib = 3 * N // 2 * 4 / 1024
    # the sum over the repeats and the slice's scatter: 2 kernels, 3n × 4 bytes backward
    steps = f"1 kernels, {kib:.2f} KiB, 0 FLOPs; backward 2 kernels, {3 * N * 4 / 1024:.2f} KiB"
    copies = f"(of which 1 copies (1 repeat): {kib:.2f} KiB forward, {kib:.2f} KiB backward)"
    assert "folded into the values 1 other op(s) read" in text
    assert f"second: {steps} {copies}" in text
    assert f"folded steps it reads, in its compute: {steps} {copies}" in text
    assert "NOT priced" not in text


@pytest.mark.parametrize("p, train, dropping", [(0.1, True, True), (0.1, False, False),
                                                (0.0, True, False)])
def test_hand_written_attention_prices_its_dropout_only_where_it_drops(p, train, dropping):
    """GPT-2's eager attention drops its probabilities with ``attn_pdrop`` in training:
    the attention carries ``probs_dropout`` (its unfused price counts the dropout) only
    where p > 0 and the model trains."""
    model = T.GPT2LMHeadModel(T.GPT2Config(
        n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16, attn_pdrop=p,
        resid_pdrop=0, embd_pdrop=0, use_cache=False, attn_implementation="eager"))
    model.train(train)
    graph = from_module(model, (torch.zeros(2, 8, dtype=torch.long),))
    attn = graph["transformer.h.0.attn.attention"]
    assert attn.attrs["unfused"] == 1
    assert attn.attrs.get("probs_dropout", 0) == int(dropping)
    # and its output, made contiguous before c_proj, is a layout copy priced there
    assert graph["transformer.h.0.attn.c_proj"].attrs["input_copies_layout"] == 1


@pytest.mark.parametrize("name, kind, reader, readers, each", [
    # its eager attention's output made contiguous before c_proj, in each of 2 layers
    ("gpt2", "layout", OpKind.LINEAR, 2, 1),
    # each RMSNorm's casts to float32 and back (a bf16 model): 2 a layer and the final one
    ("llama", "cast", OpKind.RMSNORM, 5, 2),
    ("mixtral", "cast", OpKind.RMSNORM, 5, 2),
])
def test_imported_hf_models_step_grows_by_their_folded_copies(name, kind, reader, readers,
                                                               each):
    """On one device, the predicted step of an imported Hugging Face model is the step
    without its folded copies outside attention plus, per copy, its bytes at the device's
    achieved memory bandwidth and a kernel floor per kernel, forward and backward."""
    graph = from_module(tiny_hf(name), (torch.zeros(2, 8, dtype=torch.long),))
    cluster = {"gpu": "a100-80gb", "nodes": 1, "devices_per_node": 1, "intra": "nvlink3",
               "inter": "8x-ib-hdr200"}
    copied = [op for op in graph.ops if op.kind is not OpKind.ATTENTION
              and op.attrs.get("input_copies")]
    assert [(op.kind, op.attrs["input_copies"], op.attrs[f"input_copies_{kind}"])
            for op in copied] == [(reader, each, each)] * readers
    bare = Graph(graph.name, [op if op not in copied else _without_copies(op)
                              for op in graph.ops])
    extra = folded_seconds(copied, load_config({"model": graph, "cluster": cluster})
                           .cluster.device)
    with_, without = (ilp_planner.solve(g, cluster=cluster, baselines=False).cost.compute_s
                      for g in (graph, bare))
    assert with_ - without == pytest.approx(extra, rel=1e-9)


def test_sdpas_output_made_contiguous_tokens_major_is_free():
    """SDPA's fused kernels (flash, memory-efficient: what a GPU runs) write their output
    (b, s, heads, d) in memory, so ``transpose(1, 2).contiguous()`` before the output
    projection moves nothing — even where the export traced the math fallback (a dropout
    on the CPU), whose meta says it would copy."""

    class Sdpa(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(H, 3 * H, bias=False)
            self.out = nn.Linear(H, H, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).view(B, S, 3, 4, 4).permute(2, 0, 3, 1, 4)
            y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1,
                                                           is_causal=True)
            return self.out(y.transpose(1, 2).contiguous().view(B, S, H))

    graph = from_module(Sdpa(), (torch.randn(B, S, H),))
    assert not any(k.startswith("input_copies") for op in graph.ops for k in op.attrs)
