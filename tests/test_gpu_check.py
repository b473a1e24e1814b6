"""What the GPU check relies on, checked on CPU: ``benchmarks/gpu_check.py`` refuses without
CUDA in one line and maps CUDA's device names to catalogue entries; the launcher's backend
and device choice (NCCL needs a GPU per rank, gloo may share them); the fused Adam the
runtime runs equals Adam's formula; the loss's memory and bytes as the runtime's code holds
and moves them, and its gradient is softmax − one-hot; a causal flash attention's share
of its FLOPs. The device run itself is in ``benchmarks/README.md``."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ilp_planner.inputs.config import parse_config
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.device import device_spec
from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout, Split
from ilp_planner.lowering.compute_model import FLASH_TILE, causal_fraction, op_work
from ilp_planner.lowering.strategies import loss_memory
from runtime.errors import RuntimeSetupError
from runtime.launch import _backend_and_device
from runtime.optim import Optimizer, OptimizerSpec

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
assert _SPEC is not None and _SPEC.loader is not None
gpu_check = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_SPEC.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_check_refuses_without_cuda_in_one_line() -> None:
    res = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and "no CUDA device" in res.stderr


@pytest.mark.parametrize("name, entry", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA L4", "l4"), ("Tesla V100-SXM2-32GB", "v100-32gb"), ("Tesla V100-SXM2-16GB", "v100-16gb"),
])
def test_cuda_device_names_map_to_catalogue_entries(name: str, entry: str) -> None:
    assert gpu_check.catalogue_name(name) == entry
    device_spec(entry)  # every target exists


@pytest.mark.parametrize("name", ["Some Future Accelerator", "NVIDIA L40S", "NVIDIA L40",
                                  "NVIDIA H100 PCIe", "NVIDIA H100 NVL"])
def test_a_gpu_without_an_entry_asks_for_its_catalogue_name(name: str) -> None:
    """Parts the catalogue does not hold (an L40S is no L4, a PCIe H100 no SXM one) are
    refused, not priced as a neighbour."""
    with pytest.raises(SystemExit, match="--gpu NAME"):
        gpu_check.catalogue_name(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choices")
def test_without_cuda_the_launcher_takes_gloo_and_refuses_nccl() -> None:
    assert _backend_and_device("auto", 3) == ("gloo", torch.device("cpu"))
    assert _backend_and_device("gloo", 0) == ("gloo", torch.device("cpu"))
    with pytest.raises(RuntimeSetupError, match="needs CUDA"):
        _backend_and_device("nccl", 0)


def test_with_cuda_nccl_takes_a_gpu_per_rank_and_gloo_shares_them(monkeypatch) -> None:
    """Two GPUs: NCCL puts local rank r on cuda:r and refuses rank 2 before any process
    group (naming the way out); gloo shares the GPUs round-robin."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _backend_and_device("auto", 1) == ("nccl", torch.device("cuda", 1))
    with pytest.raises(RuntimeSetupError, match="--backend gloo"):
        _backend_and_device("auto", 2)
    assert _backend_and_device("gloo", 3) == ("gloo", torch.device("cuda", 1))


def test_fused_adam_is_adams_formula() -> None:
    """The runtime's Adam (PyTorch's fused kernel) against the update written out in float64,
    over three steps, with per-tensor state; a transposed (non-contiguous) tensor is refused
    (PyTorch's fused CPU kernel would update it wrongly, silently)."""
    spec = OptimizerSpec("adam", lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    p = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    ref = {k: (v.double().clone(), torch.zeros_like(v, dtype=torch.float64),
               torch.zeros_like(v, dtype=torch.float64)) for k, v in p.items()}
    opt = Optimizer(spec)
    for t in range(1, 4):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in p.items()}
        opt.step(p, g)
        for k, (w, m, v) in ref.items():
            gd = g[k].double()
            m.mul_(spec.beta1).add_((1 - spec.beta1) * gd)
            v.mul_(spec.beta2).add_((1 - spec.beta2) * gd * gd)
            w -= spec.lr * (m / (1 - spec.beta1**t)) / ((v / (1 - spec.beta2**t)).sqrt() + spec.eps)
    for k in p:
        torch.testing.assert_close(p[k].double(), ref[k][0], rtol=1e-6, atol=1e-7)
    assert all(float(opt.state[k][2]) == 3.0 for k in p)
    w = torch.randn(3, 4).t()
    with pytest.raises(RuntimeSetupError, match="contiguous"):
        Optimizer(spec).step({"w": w}, {"w": torch.randn(4, 3)})


def test_loss_memory_is_what_autograd_keeps_of_the_runtimes_loss() -> None:
    """What autograd saves for :class:`runtime.ops._CrossEntropy` (counted by a saved-tensors
    hook) is one float32 tensor of the logits' shape plus per-row statistics (Σexp, target
    index, mask) — what :func:`loss_memory` charges, on a rows-split block too."""
    from runtime.ops import _CrossEntropy

    rows, classes = 64, 1000
    for dtype in (torch.bfloat16, torch.float32):
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        logits = torch.randn(rows, classes, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, classes, (rows,))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _CrossEntropy.apply(logits, targets, torch.ones(rows, dtype=torch.bool), rows,
                                lambda m: m, lambda b: b)
        spec = TensorSpec((rows, classes), str(dtype).removeprefix("torch."))
        assert sum(saved) == loss_memory(spec, _row_split(1)) + rows * (4 + 8 + 1)
        assert loss_memory(spec, _row_split(4)) == 4 * rows * classes / 4


def test_every_option_of_a_gpt_charges_its_loss_memory() -> None:
    """The built-in GPT's loss node on 1 × 2: each option's activation bytes are its ops'
    outputs plus what :func:`loss_memory` says of the logits in the layout the loss reads."""
    raw = {"name": "g", "model": {"kind": "gpt", "hidden": 64, "layers": 1, "heads": 4,
                                  "seq_len": 16, "vocab": 128, "batch": 8, "dtype": "bfloat16"},
           "cluster": {"gpu": "h100", "nodes": 1, "devices_per_node": 2, "intra": "nvlink4",
                       "inter": "8x-ib-ndr400"}}
    config = parse_config(raw, "g.yaml")
    graph = config.graph
    gp = build_problem(graph, config.cluster, 1, 2, config.memory)
    loss = next(op for op in graph.ops if op.kind is OpKind.LOSS)
    node, at = gp.owner[loss.name], gp.position[loss.name]
    logits = graph[loss.inputs[0]].output
    reads = set()
    for opt in gp.options[node]:
        outputs = sum(out.local_bytes(graph[m].output)
                      for m, out in zip(gp.members[node], opt.outputs, strict=True))
        read = opt.inputs[at][0]
        reads.add(read)
        assert math.isclose(opt.activation_bytes, outputs + loss_memory(logits, read),
                            rel_tol=1e-12)
    assert len(reads) >= 2  # rows split and replicated, at least


def test_causal_flash_attention_runs_the_diagonal_tiles_and_below() -> None:
    """A causal attention's fused kernels compute (1 + tile/s)/2 of the full FLOPs (forward
    and backward alike); one marked not plain causal (an encoder's) computes them all."""
    t, h, heads, seq = 8 * 1024, 768, 12, 1024
    op = Op("a", OpKind.ATTENTION, ("qkv",), TensorSpec((t, h), "bfloat16"),
            flops=4.0 * t * seq * h, attrs={"heads": heads, "seq_len": seq})
    share = (1 + FLASH_TILE / seq) / 2
    assert causal_fraction(op, seq) == share == 0.5625
    fwd, bwd = op_work(op, 1.0)
    assert (fwd.flops, bwd.flops) == (op.flops * share, 2.5 * op.flops * share)
    full = Op("b", OpKind.ATTENTION, ("qkv",), op.output, flops=op.flops,
              attrs={**op.attrs, "not_plain_causal": 1})
    assert op_work(full, 1.0)[0].flops == op.flops
    short = Op("c", OpKind.ATTENTION, ("qkv",), op.output, flops=op.flops,
               attrs={**op.attrs, "seq_len": FLASH_TILE})
    assert causal_fraction(short, FLASH_TILE) == 1.0


def test_the_loss_moves_what_the_runtimes_passes_move() -> None:
    """Forward 28 bytes a float32 logit plus the copy's read; backward the scaled softmax (8)
    and, for half-precision logits, the cast back (4 + 2)."""
    rows, classes = 512, 4096
    for dtype, fwd_b, bwd_b in (("bfloat16", 30, 14), ("float32", 32, 8)):
        logits = TensorSpec((rows, classes), dtype)
        loss = Op("loss", OpKind.LOSS, ("logits",), TensorSpec((1,), "float32"),
                  flops=3.0 * rows * classes)
        fwd, bwd = op_work(loss, 2.0, read=logits)
        assert (fwd.bytes, bwd.bytes) == (fwd_b * rows * classes / 2, bwd_b * rows * classes / 2)


def _row_split(p: int) -> Layout:
    return Layout((MeshAxis(1, p),), (Split(0),))


def test_the_runtimes_cross_entropy_is_torchs_value_and_gradient() -> None:
    """:class:`runtime.ops._CrossEntropy` on one block of bf16 and fp32 logits (no vocabulary
    split) against ``F.cross_entropy`` in float64: the same value and the same gradient, and
    the float32 input is left as it was (the in-place passes work on a copy)."""
    from runtime.ops import _CrossEntropy

    gen = torch.Generator().manual_seed(1)
    rows, classes = 12, 37
    targets = torch.randint(0, classes, (rows,), generator=gen)
    inside = torch.ones(rows, dtype=torch.bool)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = (3 * torch.randn(rows, classes, generator=gen)).to(dtype).requires_grad_(True)
        kept = logits.detach().clone()
        part = _CrossEntropy.apply(logits, targets, inside, rows, lambda m: m, lambda b: b)
        part.backward(torch.tensor([2.0]))
        ref_in = logits.detach().double().requires_grad_(True)
        ref = torch.nn.functional.cross_entropy(ref_in, targets) * 2.0
        ref.backward()
        assert torch.equal(logits.detach(), kept)
        assert math.isclose(float(part.detach()) * 2.0, float(ref.detach()), rel_tol=tol)
        torch.testing.assert_close(logits.grad.double(), ref_in.grad, rtol=tol, atol=tol * 1e-2)
