"""What really runs for one layout change, recorded on torch's fake process group: the
runtime's execution of a lowered program, and ``DTensor.redistribute``'s own.

The plan is only worth its price if the program it prices is the program that runs.
A fake process group (``torch.testing._internal.distributed.fake_pg``) lets one
process play any rank of any world without communicating: collectives return at once with
tensors of the right shape, so the :class:`~runtime.recorder.Recorder` sees exactly the
calls — kind, group, bytes — that a real run on that rank issues. Values are meaningless
(the gloo check in ``tests/helpers/redistribute_check.py`` covers them).

Two programs per ``(src, dst, shape)``:

* :func:`record_runtime` — the runtime's :meth:`runtime.comm.Comm.edge` (forward steps, then
  autograd's backward through the edge) on this rank's block;
* :func:`record_dtensor` — ``DTensor.redistribute(dst)`` forward, then autograd's backward
  through it with the gradient in ``grad_layout(dst)`` (what ``to_local``'s backward hands
  over by default: partial sums read as replicas), so both programs move the value between
  the same endpoints in both directions.

DTensor's mesh is labelled ``cuda``: DTensor's ``S(i)→S(j)`` takes its all-to-all path on
accelerator meshes and falls back to AllGather + chunk on ``cpu`` meshes only because gloo
has no all-to-all; the reference that matters is the accelerator path. Local tensors stay on
the CPU (DTensors are built directly from their spec, never moved).

Bytes follow the α–β convention of :mod:`ilp_planner.lowering.cost_model` on both sides (the
recorder's *n*): DTensor pads a gathered or exchanged shard to the largest chunk of its
group, the runtime to the layout's largest block, so on ranks holding the smaller chunks
DTensor may move fewer bytes. Rank 0 holds the first (largest) chunk on every axis, so its
record is the slowest group's; :func:`critical` takes the per-collective maximum over the
ranks recorded.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ilp_planner.ir.cluster import Cluster, Factorisation
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, P, Placement, S, grad_layout
from ilp_planner.lowering.cost_model import CollectiveKind, collective_time
from ilp_planner.lowering.redistribution import Redistribution
from runtime.comm import Comm, LVal
from runtime.mesh import mesh_array
from runtime.recorder import CommEvent, Recorder, tagged

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

Key = tuple[str, int, float, str]
"""A collective as the α–β formula sees it: (kind, group size, bytes n, link)."""


@dataclass(frozen=True)
class Recorded:
    """The collectives of one redistribution, in issue order, per direction."""

    forward: tuple[Key, ...]
    backward: tuple[Key, ...]

    def seconds(self, cluster: Cluster) -> float:
        """α–β time of every collective, forward plus backward."""
        return sum(key_seconds(k, cluster) for k in self.forward + self.backward)


def key_seconds(key: Key, cluster: Cluster) -> float:
    kind, p, nbytes, link = key
    return collective_time(CollectiveKind(kind), p, nbytes, cluster.link(link == "inter"))


def _keys(events: Sequence[CommEvent]) -> tuple[Key, ...]:
    return tuple((e.kind, e.group_size, e.bytes, e.link) for e in events)


def program_keys(red: Redistribution) -> Recorded:
    """The lowered program in the recorder's terms."""
    return Recorded(
        tuple((c.kind.value, c.group_size, c.bytes, c.link) for c in red.forward),
        tuple((c.kind.value, c.group_size, c.bytes, c.link) for c in red.backward),
    )


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process plays ``rank`` of a ``world``-rank fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def device_mesh(fact: Factorisation, devices: Sequence[int]) -> DeviceMesh:
    """The DTensor mesh of ``fact`` over ``devices`` with the runtime's rank array (so both
    sides group the same ranks on every axis), labelled ``cuda`` (module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh

    arr = torch.as_tensor(mesh_array(devices, fact))
    return DeviceMesh("cuda", arr)


def _region_shape(comm: Comm, layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in comm.region(layout, shape))


def record_runtime(comm: Comm, red: Redistribution, recorder: Recorder) -> Recorded:
    """Run the edge program as the executor does (:meth:`Comm.edge`, autograd for the
    backward) on this rank's block and return what the recorder saw. ``comm``'s groups must
    already exist (``register`` then ``registry.create``)."""
    shape, dtype = red.tensor.shape, getattr(torch, red.tensor.dtype)
    x = torch.zeros(_region_shape(comm, red.src, shape), dtype=dtype, requires_grad=True)
    recorder.take()
    with recorder, tagged("forward", "fidelity"):
        y = comm.edge(LVal(x, red.src), red, "fidelity").t
    fwd = recorder.take()
    g = torch.zeros(_region_shape(comm, red.grad_dst, shape), dtype=dtype)
    with recorder, tagged("backward", "fidelity"):
        if y.requires_grad:
            torch.autograd.backward([y], [g])
    return Recorded(_keys(fwd), _keys(recorder.take()))


def _dtensor_spec(mesh: DeviceMesh, placements: list, tensor: TensorSpec,
                  ) -> tuple[DTensorSpec, tuple[int, ...]]:
    """DTensor's spec and this rank's local shape (computed outside any fake mode: DTensor
    reads offsets back as Python ints)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = torch.Size(tensor.shape)
    meta = TensorMeta(shape, _contiguous_stride(tensor.shape), getattr(torch, tensor.dtype))
    local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta), tuple(local)


def _dtensor(spec_local: tuple[DTensorSpec, tuple[int, ...]], requires_grad: bool) -> DTensor:
    from torch.distributed.tensor import DTensor

    spec, local = spec_local
    return DTensor(torch.zeros(local, dtype=spec.tensor_meta.dtype), spec, requires_grad=requires_grad)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def record_dtensor(mesh: DeviceMesh, src: Layout, dst: Layout, tensor: TensorSpec, recorder: Recorder,
                   fake_tensors: bool = False) -> Recorded:
    """``DTensor.redistribute(src → dst)`` forward and its autograd backward (gradient in
    ``grad_layout(dst)``), as recorded on this rank. ``fake_tensors`` runs it under
    ``FakeTensorMode`` (shapes only, no memory): the collectives issued are the same, and
    large shapes cost nothing. Raises whatever DTensor raises for a pair it cannot run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x_spec = _dtensor_spec(mesh, src.to_dtensor(), tensor)
    g_spec = _dtensor_spec(mesh, grad_layout(dst).to_dtensor(), tensor)
    with FakeTensorMode() if fake_tensors else nullcontext():
        x = _dtensor(x_spec, requires_grad=True)
        g = _dtensor(g_spec, requires_grad=False)
        recorder.take()
        with recorder, tagged("forward", "dtensor"):
            y = x.redistribute(mesh, dst.to_dtensor())
        fwd = recorder.take()
        with recorder, tagged("backward", "dtensor"):
            torch.autograd.backward([y], [g])
        return Recorded(_keys(fwd), _keys(recorder.take()))


def critical(records: Sequence[Recorded]) -> Recorded:
    """Per-collective maximum of bytes over ranks that issued the same sequence (the
    slowest group of each step); records of different lengths are refused."""
    first = records[0]
    for r in records[1:]:
        if [k[:2] for k in r.forward] != [k[:2] for k in first.forward] or \
                [k[:2] for k in r.backward] != [k[:2] for k in first.backward]:
            raise ValueError(f"ranks issued different collectives: {first} vs {r}")

    def merge(seqs: list[tuple[Key, ...]]) -> tuple[Key, ...]:
        return tuple(max(ks, key=lambda k: k[2]) for ks in zip(*seqs, strict=True))

    return Recorded(merge([r.forward for r in records]), merge([r.backward for r in records]))


def placements(num_axes: int, rank: int) -> list[tuple[Placement, ...]]:
    """Every placement tuple (``B``, ``P``, ``S(d)`` per axis) of a rank-``rank`` tensor."""
    opts = [B, P] + [S(d) for d in range(rank)]
    return list(itertools.product(opts, repeat=num_axes))


def placement_pairs(num_axes: int, rank: int, budget: int | None = None,
                    ) -> list[tuple[tuple[Placement, ...], tuple[Placement, ...]]]:
    """(source, destination) placement pairs: all of them when they fit ``budget``, else a
    deterministic stratified sample of about ``budget`` — every source keeps the same number
    of destinations, and (the stride being coprime with 7) every destination the same
    number of sources, so no placement class is left out."""
    pls = placements(num_axes, rank)
    n = len(pls)
    if budget is None or n * n <= budget:
        return [(a, b) for a in pls for b in pls]
    step = max(2, -(-n * n // budget))
    while step % 7 == 0:
        step += 1
    return [(pls[i], pls[j]) for i in range(n) for j in range(n) if (j - 7 * i) % step == 0]
