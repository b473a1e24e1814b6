"""torchrun script: SDPA on DTensors split over the batch and the heads, run on each rank's
blocks by :class:`runtime.local_attention.LocalAttention`, equals SDPA on the whole tensors —
output and the gradients of q, k, v — with no collective in the forward, for the split pair
DTensor's own 4-D matmul refuses (2 sequences over 2 ranks, 4 heads over 4: 8 ranks) or any
pair on 4 ranks, with no mask, a causal mask, and additive masks per sequence or per head;
and a mask that is a replicated DTensor on another mesh of the same devices (an opaque op's
flattened one, as DeepSeek-V3.2's indexer builds it) read by SDPA on split q, k, v, by SDPA
on q split and k replicated (DTensor's own SDPA), and added to split scores.

    torchrun --nproc-per-node 4 tests/helpers/local_attention_check.py

Prints ``OK <case>`` per case on rank 0, ``FAIL <case>: <why>`` otherwise; exits 1 on any
failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime.local_attention import LocalAttention  # noqa: E402

SEQ, DIM = 6, 4


def check(mesh, placements, batch: int, heads: int, mask_shape, causal: bool) -> str | None:
    """One case's difference from whole-tensor SDPA, or None."""
    torch.manual_seed(0)  # the same whole tensors on every rank
    full = [torch.randn(batch, heads, SEQ, DIM, requires_grad=True) for _ in range(3)]
    mask = torch.randn(*mask_shape) if mask_shape else None
    want = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal)
    want.pow(2).sum().backward()
    parts = [distribute_tensor(x.detach(), mesh, placements).requires_grad_() for x in full]
    counts = CommDebugMode()
    with counts, implicit_replication(), LocalAttention():
        got = F.scaled_dot_product_attention(*parts, attn_mask=mask, is_causal=causal)
    if counts.get_total_counts():
        return f"the forward issued {dict(counts.get_comm_counts())}"
    if tuple(got.placements) != tuple(placements):
        return f"output placements {got.placements}, q's {placements}"
    got.pow(2).sum().backward()
    if not torch.allclose(got.full_tensor(), want, atol=1e-5):
        return "output differs"
    for name, p, x in zip("qkv", parts, full, strict=True):
        if not torch.allclose(p.grad.full_tensor(), x.grad, atol=1e-5):
            return f"gradient of {name} differs"
    return None


def check_flat_mask(mesh, flat, placements, batch: int, heads: int, k_placements) -> str | None:
    """A boolean mask held whole on every rank as a DTensor on ``flat`` (a 1-D mesh of the
    same devices), read by SDPA on q, v in ``placements`` and k in ``k_placements``, and an
    additive one added to scores in ``placements``: the whole-tensor results."""
    torch.manual_seed(0)
    # values wider than keys (as MLA's): SDPA's math path, which DTensor propagates in
    # seconds (its CPU flash decomposition takes minutes on split and replicated inputs)
    full = [torch.randn(batch, heads, SEQ, d, requires_grad=True) for d in (DIM, DIM, DIM + 2)]
    keep = torch.rand(batch, 1, SEQ, SEQ) > 0.3
    keep |= torch.eye(SEQ, dtype=torch.bool)  # every query keeps a key
    whole = torch.randn(batch, heads, SEQ, SEQ)  # hand-written attention's scores
    want = F.scaled_dot_product_attention(*full, attn_mask=keep)
    want.pow(2).sum().backward()
    parts = [distribute_tensor(x.detach(), mesh, pl).requires_grad_()
             for x, pl in zip(full, (placements, k_placements, placements), strict=True)]
    mask = distribute_tensor(keep, flat, [Replicate()])
    with implicit_replication(), LocalAttention():
        got = F.scaled_dot_product_attention(*parts, attn_mask=mask)
        scores = distribute_tensor(whole, mesh, placements) + distribute_tensor(
            keep.float(), flat, [Replicate()])
        with torch.no_grad():  # mask first, scores replicated: the flat mask still moves
            left = distribute_tensor(keep.float(), flat, [Replicate()]) + distribute_tensor(
                whole, mesh, [Replicate()] * mesh.ndim)
    got.pow(2).sum().backward()
    if not torch.allclose(got.full_tensor(), want, atol=1e-5):
        return "output differs"
    for name, p, x in zip("qkv", parts, full, strict=True):
        if not torch.allclose(p.grad.full_tensor(), x.grad, atol=1e-5):
            return f"gradient of {name} differs"
    if not torch.allclose(scores.full_tensor(), whole + keep.float()):
        return "scores + mask differ"
    if left.device_mesh != mesh or not torch.allclose(left.full_tensor(), whole + keep.float()):
        return f"mask + replicated scores on {left.device_mesh}, not the scores' mesh"
    return None


def fits(placements: tuple, shape: tuple[int, ...], sizes: tuple[int, int]) -> bool:
    """Whether every split divides its dim (batch or heads) evenly."""
    return all(sizes[pl.dim] % n == 0 for pl, n in zip(placements, shape, strict=True)
               if isinstance(pl, Shard))


def report(name: str, why: str | None) -> int:
    """Print a case's line (``OK`` on rank 0, ``FAIL`` on every failing rank); 1 if it
    failed."""
    if why is not None:
        print(f"FAIL {name}: {why}", flush=True)
    elif dist.get_rank() == 0:
        print(f"OK {name}", flush=True)
    return int(why is not None)


def main() -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shape = (2, world // 2)
    mesh = init_device_mesh("cpu", shape)
    batch, heads = (2, 4) if world == 8 else (4, 4)
    failed = 0
    for placements in ((Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Replicate())):
        for mask_shape, causal in ((None, False), (None, True), ((batch, 1, SEQ, SEQ), False),
                                   ((1, heads, SEQ, SEQ), False), ((SEQ, SEQ), False)):
            if not fits(placements, shape, (batch, heads)):
                continue
            failed += report(f"{shape} {placements} mask={mask_shape} causal={causal}",
                             check(mesh, placements, batch, heads, mask_shape, causal))
    flat = init_device_mesh("cpu", (world,))
    for placements, k_pls in (((Shard(0), Shard(1)), (Shard(0), Shard(1))),
                              ((Shard(0), Replicate()), (Replicate(), Replicate()))):
        if not fits(placements, shape, (batch, heads)):
            continue
        failed += report(f"{shape} q {placements} k {k_pls} mask on a flat mesh",
                         check_flat_mask(mesh, flat, placements, batch, heads, k_pls))
    flag = torch.tensor([failed])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    return 1 if int(flag) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's threads can abort a finalising interpreter
