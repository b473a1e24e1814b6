"""State sharding (ZeRO-1/2/3) as the planner lowers it
(:func:`ilp_planner.lowering.strategies.state_sharded`).

Every :class:`~ilp_planner.lowering.strategies.SyncBucket` of a layer the plan shards (``LayerPlan.zero``
> 0) becomes one :class:`ZeroBucket`: the bucket's parameter roles, each rank's local block of
each flattened in role order at the offsets of their *padded* blocks (the ``numel`` the planner
prices), the whole padded to a multiple of the group size ``p`` (FSDP's flat parameter) and
cut into ``p`` shards of ``s = ⌈n/p⌉`` elements; this rank keeps shard ``i`` (its index in the
bucket's group, the order ``reduce_scatter_single`` and ``all_gather_single`` use) as the
fp32 master the optimizer updates. Nothing here chooses a group or a size: both come from the
bucket the planner priced, and :func:`planned_collectives` restates them as the collectives
the plan lists, which the executor checks against ``LayerPlan.collectives`` before running.

============  =====================================================================
level         per micro-batch / per step (what the executor issues)
============  =====================================================================
1             full local blocks kept in the compute dtype (the planner's w bytes;
              each micro-batch's gradient is added to one flat fp32 buffer, its g
              bytes); after the step's last backward one ``reduce_scatter`` of the
              flat gradient (``shard_grad_sync``); the optimizer updates the shard; one
              ``all_gather`` of the updated shard (compute dtype, ``weight_allgather``)
              refreshes the full blocks
2             as 1, but the flat gradient is reduce-scattered after *every* micro-batch's
              backward (``shard_grad``) and accumulates in the shard
3             only the shard kept: :func:`gather` all-gathers it (compute dtype,
              ``fsdp_gather``) in the op's forward; the gathered blocks are not kept for
              the backward (:class:`released`); the flat gradient is reduce-scattered
              into the shard's gradient (``shard_grad``). The backward gathers again
              only where it reads the weights (``ZeroBucket.backward_reads``)
============  =====================================================================

ZeRO-3's backward, per bucket, as the plan prices it (:func:`planned_collectives`):

* the op's backward reads the weights — they are in
  :func:`~ilp_planner.lowering.strategies.input_grad_roles` (a linear's ``dX = dY·Wᵀ``, a norm's γ)
  and autograd reaches the op's input: each saved view of the gathered buffer becomes a
  token that gathers the buffer again (:class:`_Regather`, once, phase ``backward``) when
  the backward unpacks it;
* it does not (an embedding's tables, a bias alone, the first layer reading the data):
  nothing is gathered. Autograd may still save views of the buffer (a layer norm or a
  convolution saves its weight whatever the input needs) but reads only their shape when
  the input needs no gradient; they are kept as :class:`_Unread` tokens that unpack to a
  NaN-valued stand-in of the same shape — were a value read, the gradient would be NaN and
  the reference check would fail, not silently differ;
* a recomputed op (FSDP with checkpointing, ``ZeroBucket.recomputed``) that reads the
  weights: the views go to the checkpoint's own hooks, which drop them in the forward and
  keep the recomputation's, so the backward reads the buffer the recomputation gathered
  (phase ``recompute``) — two gathers per micro-batch, forward and recompute, not three.

Gradients are reduce-scattered in fp32 (the master dtype) and weights all-gathered in the
compute dtype, as priced; the optimizer update is elementwise, so the shard's update is
exactly the shard of the full update (padding elements have zero gradient and stay zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.cost_model import CollectiveKind
from ilp_planner.lowering.strategies import SyncBucket
from runtime.recorder import Recorder, tagged, timed

ZERO_PURPOSES = frozenset({"shard_grad_sync", "shard_grad", "weight_allgather", "fsdp_gather"})


@dataclass
class ZeroBucket:
    """One sharded flat parameter (see the module docstring)."""

    layer: str
    index: int  # of the layer's zero buckets
    level: int
    sync: SyncBucket  # the planner's bucket: roles, fact, axes, padded numel
    shapes: dict[str, tuple[int, ...]]  # role -> this rank's local block shape
    padded: dict[str, int]  # role -> padded local block numel (the priced slot)
    compute_dtype: torch.dtype
    group: object = None
    rank_in_group: int = 0
    master: torch.Tensor | None = None  # fp32 shard (s,), the optimizer's parameter
    grad_shard: torch.Tensor | None = None  # levels 1, 2: the shard's accumulated gradient
    full_grad: torch.Tensor | None = None  # levels 1, 2: flat fp32 gradient of the full blocks
    offsets: dict[str, int] = field(default_factory=dict)
    # level 3: the op's backward reads these weights (for its input's gradient), so they are
    # gathered again there, or kept from the recomputation's gather when ``recomputed``
    backward_reads: bool = True
    recomputed: bool = False

    def __post_init__(self) -> None:
        off = 0
        for role in self.sync.roles:
            self.offsets[role] = off
            off += self.padded[role]
        if off != self.sync.numel:
            raise ValueError(f"{self.layer}: padded blocks hold {off} elements, the planner's "
                             f"bucket {self.sync.numel}")

    @property
    def key(self) -> str:
        return f"{self.layer}.zero{self.index}"

    @property
    def p(self) -> int:
        return self.sync.collective.group_size

    @property
    def s(self) -> int:
        return -(-self.sync.numel // self.p)

    @property
    def padded_numel(self) -> int:
        return self.s * self.p

    # -- setup (local) -------------------------------------------------------------------------
    def init(self, blocks: dict[str, torch.Tensor], group, device: torch.device) -> None:
        """Keep this rank's shard of the flat buffer built from the full local ``blocks``."""
        self.group = group
        self.rank_in_group = dist.get_group_rank(group, dist.get_rank())
        flat = self.flatten(blocks, torch.float32, device)
        i = self.rank_in_group
        self.master = flat[i * self.s:(i + 1) * self.s].clone().requires_grad_(self.level == 3)
        if self.level < 3:
            self.grad_shard = torch.zeros(self.s, device=device, dtype=torch.float32)
            self.full_grad = torch.zeros(self.padded_numel, device=device, dtype=torch.float32)

    def flatten(self, blocks: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        flat = torch.zeros(self.padded_numel, device=device, dtype=dtype)
        for role in self.sync.roles:
            b = blocks[role].reshape(-1)
            flat[self.offsets[role]:self.offsets[role] + b.numel()] = b
        return flat

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each role's local block as a view of a full flat buffer."""
        return {role: flat[self.offsets[role]:self.offsets[role] + math.prod(shape)].view(shape)
                for role, shape in self.shapes.items()}

    # -- collectives ---------------------------------------------------------------------------
    def all_gather(self, shard: torch.Tensor, phase: str, purpose: str,
                   recorder: Recorder | None) -> torch.Tensor:
        """The full flat buffer from every rank's ``shard`` (in the shard's dtype)."""
        out = torch.empty(self.padded_numel, device=shard.device, dtype=shard.dtype)
        with tagged(phase, purpose, self.layer), timed(recorder):
            dist.all_gather_single(out, shard.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, flat_grad: torch.Tensor, purpose: str,
                       recorder: Recorder | None) -> torch.Tensor:
        """This rank's shard of the sum over the group of ``flat_grad`` (fp32)."""
        out = torch.empty(self.s, device=flat_grad.device, dtype=torch.float32)
        with tagged("backward", purpose, self.layer), timed(recorder):
            dist.reduce_scatter_single(out, flat_grad.to(torch.float32).contiguous(),
                                       group=self.group)
        return out

    def shard_grad(self) -> torch.Tensor:
        if self.level == 3:
            g = self.master.grad
            return g if g is not None else torch.zeros_like(self.master)
        return self.grad_shard

    def full_master(self) -> dict[str, torch.Tensor]:
        """The full local blocks of the fp32 masters (an untagged gather, for results)."""
        flat = torch.empty(self.padded_numel, device=self.master.device, dtype=torch.float32)
        dist.all_gather_single(flat, self.master.detach().contiguous(), group=self.group)
        return {r: v.clone() for r, v in self.views(flat).items()}


def planned_collectives(sync: SyncBucket, level: int, weight_itemsize: int,
                        recompute: bool = False, reads: bool = True,
                        ) -> list[tuple[str, str, str, float, int]]:
    """The collectives one sharded bucket issues per its level, as a plan lists them —
    (kind, purpose, phase, bytes, group size), :func:`ilp_planner.lowering.strategies.state_sharded`'s
    table restated with the runtime's own sizes: gradients reduce-scattered in the master
    dtype of the bucket, weights gathered with ``weight_itemsize`` (the compute dtype the
    runtime gathers in). At level 3 the backward gathers again where it reads the weights
    (``reads``, :func:`~ilp_planner.lowering.strategies.backward_reads`); a recomputed
    layer's forward gather runs again (``recompute``) and its buffer serves the backward,
    which then gathers nothing."""
    p = sync.collective.group_size
    padded = -(-sync.numel // p) * p
    grad_item = sync.collective.bytes / sync.numel
    rs = (CollectiveKind.REDUCE_SCATTER.value, "shard_grad_sync" if level == 1 else "shard_grad",
          "backward", padded * grad_item, p)
    ag = padded * weight_itemsize
    if level == 3:
        out = [("all_gather", "fsdp_gather", "forward", ag, p), rs]
        if recompute:
            out.append(("all_gather", "fsdp_gather", "recompute", ag, p))
        elif reads:
            out.append(("all_gather", "fsdp_gather", "backward", ag, p))
        return out
    return [rs, ("all_gather", "weight_allgather", "step", ag, p)]


# -- ZeRO-3: gather in forward, free, gather again in backward where it is read ---------------


class _Regather:
    """The gathered flat buffer of one ZeRO-3 forward, fetched again (once) for its backward."""

    def __init__(self, bucket: ZeroBucket, recorder: Recorder | None):
        self.bucket, self.recorder = bucket, recorder
        self.full: torch.Tensor | None = None
        self.done = False

    def get(self) -> torch.Tensor:
        if not self.done:
            b = self.bucket
            self.full = b.all_gather(b.master.detach().to(b.compute_dtype), "backward",
                                     "fsdp_gather", self.recorder)
            self.done = True
        assert self.full is not None
        return self.full


class _Gather(torch.autograd.Function):
    """Forward: all-gather the shard (compute dtype) into the full flat buffer. Backward:
    reduce-scatter the flat gradient (fp32) into the shard's gradient. Saves nothing: the
    gathered buffer lives only as long as the forward holds it (see :class:`released`)."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, bucket: ZeroBucket, regather: _Regather | None,
                recorder) -> torch.Tensor:
        ctx.bucket, ctx.regather, ctx.recorder = bucket, regather, recorder
        return bucket.all_gather(master.detach().to(bucket.compute_dtype), "forward",
                                 "fsdp_gather", recorder)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # the op's backward is done (its gradient flows into this one): the buffer it
        # gathered again, if it read the weights, may go
        if ctx.regather is not None:
            ctx.regather.full = None
        return ctx.bucket.reduce_scatter(g, "shard_grad", ctx.recorder), None, None, None


@dataclass
class _Token:
    regather: _Regather
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Unread:
    """A saved view of a gathered buffer the backward reads only the shape of."""

    size: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def stand_in(self) -> torch.Tensor:
        # one NaN broadcast to the shape: no memory, and any value read poisons the gradient
        return torch.full((), math.nan, dtype=self.dtype, device=self.device).expand(self.size)


@dataclass
class _Outer:
    packed: object
    unpack: Callable


_TO_CHECKPOINT = object()  # a recomputed op's buffer: the checkpoint keeps the recomputation's


class released(torch.autograd.graph.saved_tensors_hooks):
    """While active, tensors autograd saves that live in a gathered ZeRO-3 buffer are not
    kept. Per buffer (see the module docstring): a token that re-gathers it (once per
    forward, :class:`_Regather`) and takes the same view when the backward unpacks it; an
    :class:`_Unread` stand-in where the backward does not read the weights; or, for a
    recomputed op whose backward reads them, the checkpoint's hooks (outside), which drop
    the forward's and hand the backward the recomputation's. Every other saved tensor goes
    to the hooks active outside (activation checkpointing's, which drop and recompute) or
    is kept as usual. Hooks nest by replacement in PyTorch, so the outer pair is read once
    on entry and called from here."""

    def __init__(self, gathered: list[tuple[torch.Tensor, object]]):
        self.by_storage = {t.untyped_storage().data_ptr(): (t, how) for t, how in gathered}
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(x: torch.Tensor):
            hit = self.by_storage.get(x.untyped_storage().data_ptr()) if x.layout == torch.strided \
                else None
            if hit is not None and x.device == hit[0].device:
                how = hit[1]
                if isinstance(how, _Regather):
                    return _Token(how, tuple(x.shape), tuple(x.stride()), x.storage_offset())
                if how is None:
                    return _Unread(tuple(x.shape), x.dtype, x.device)
            if outer is None:
                return x
            return _Outer(outer[0](x), outer[1])

        def unpack(packed):
            if isinstance(packed, _Token):
                full = packed.regather.get()
                return full.as_strided(packed.size, packed.stride, packed.offset)
            if isinstance(packed, _Unread):
                return packed.stand_in()
            if isinstance(packed, _Outer):
                return packed.unpack(packed.packed)
            return packed

        super().__init__(pack, unpack)

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        self.by_storage = {}  # the gathered buffers may go now


def gather(bucket: ZeroBucket, recorder: Recorder | None) -> tuple[dict[str, torch.Tensor],
                                                                  tuple[torch.Tensor, object]]:
    """ZeRO-3 forward: the bucket's roles as views of the all-gathered flat buffer (autograd
    flows to the shard through :class:`_Gather`), and the (buffer, how its saved views are
    kept) pair to hand to :class:`released` around the op: a :class:`_Regather` where the
    backward reads the weights and gathers them again, the checkpoint's hooks where a
    recomputed op's backward reads them, ``None`` (:class:`_Unread`) where it does not."""
    how: object = None
    if bucket.backward_reads:
        how = _TO_CHECKPOINT if bucket.recomputed else _Regather(bucket, recorder)
    full = _Gather.apply(bucket.master, bucket, how if isinstance(how, _Regather) else None,
                         recorder)
    return bucket.views(full), (full, how)


def local_shapes(layouts: dict[str, tuple[Layout, Layout]], shapes: dict[str, tuple[int, ...]],
                 region) -> dict[str, tuple[int, ...]]:
    """This rank's block shape of each role (``region(layout, full_shape)``)."""
    return {r: tuple(b - a for a, b in region(layouts[r][0], shapes[r])) for r in layouts}
