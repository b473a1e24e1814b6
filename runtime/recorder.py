"""The collective recorder: a ``TorchDispatchMode`` that sees every c10d and functional
collective (and DTensor's composite ``shard_dim_alltoall``) at dispatch level — issued by
the runtime's own steps, inside autograd's backward, by the optimizer, by DTensor, by
anything — so nothing can bypass it.

Each recorded :class:`CommEvent` carries what the α–β formula needs (kind, group size,
bytes *n*: the tensor for AllReduce and broadcast, the gathered output for AllGather, the
input for ReduceScatter and AlltoAll) and the tags the runtime sets around its steps with
:func:`tagged` (phase, purpose, where). A collective issued outside any tag is recorded as
``untagged`` — the audit then reports it as unplanned. Seconds come from :func:`timed`,
which wraps a blocking call and stamps the events it recorded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class CommEvent:
    """One collective that ran. ``group_size`` is the number of receivers for a broadcast
    (the cost model's A), the group size otherwise."""

    kind: str
    group_size: int
    bytes: float
    link: str
    seconds: float
    phase: str  # forward | backward | recompute | step | report
    purpose: str  # activation | weight | grad_sync | loss | tied_weight | resharding | report
    where: str = ""
    overlapped: bool = False  # asynchronous: ``seconds`` is the time the step waited for it


@dataclass
class _Tag:
    phase: str = "untagged"
    purpose: str = "untagged"
    where: str = ""


_TAGS: list[_Tag] = [_Tag()]
_REPLAY: list[bool] = [False]


@contextmanager
def tagged(phase: str, purpose: str, where: str = "") -> Iterator[None]:
    """Collectives issued inside are recorded with these tags (a ``forward`` one issued
    while :func:`replaying` is recorded as ``recompute``)."""
    if phase == "forward" and _REPLAY[-1]:
        phase = "recompute"
    _TAGS.append(_Tag(phase, purpose, where))
    try:
        yield
    finally:
        _TAGS.pop()


@contextmanager
def replaying() -> Iterator[None]:
    """Activation recomputation: the forward of a checkpointed block runs again inside the
    backward, and its collectives are the plan's ``recompute`` phase, not its forward."""
    _REPLAY.append(True)
    try:
        yield
    finally:
        _REPLAY.pop()


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


# op name -> (kind, index of the argument whose bytes are the formula's n)
_OPS: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("p2p", 0),
    "recv_": ("p2p", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "reduce_": ("reduce", 0),
    "barrier": ("barrier", 0),
    # functional collectives (their group is named, not passed as an object), also the
    # ``_c10d_functional_autograd`` variants of the same names
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", -1),
    "all_gather_into_tensor_out": ("all_gather", -1),
    "all_gather_into_tensor_coalesced": ("all_gather", -1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
    # DTensor's S(i)→S(j): a composite op whose inner all_to_all_single runs below this mode
    "shard_dim_alltoall": ("all_to_all", 0),
}

# namespaces whose ops are collectives (the mode sees a composite op, never its insides)
_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})


def _group_ranks(args) -> list[int] | None:
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return dist.get_process_group_ranks(a)
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
                return dist.get_process_group_ranks(pg)
            except Exception:  # not a process group
                continue
        if isinstance(a, str):  # functional collectives name their group
            try:
                return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(a))
            except Exception:
                continue
    return None


class Recorder(TorchDispatchMode):
    """Records every collective dispatched while active (see the module docstring)."""

    def __init__(self, devices_per_node: int):
        super().__init__()
        self.devices_per_node = devices_per_node
        self.events: list[CommEvent] = []
        self.marks: list[tuple[int, str]] = []  # (events recorded before it, label)

    def mark(self, label: str) -> None:
        """Note a point of the step (e.g. the end of a backward) among the collectives."""
        self.marks.append((len(self.events), label))

    def order(self) -> list[str]:
        """Collectives (``phase/purpose:where``) and marks in the order they happened."""
        out: list[str] = []
        j = 0
        for i in range(len(self.events) + 1):
            while j < len(self.marks) and self.marks[j][0] <= i:
                out.append(self.marks[j][1])
                j += 1
            if i < len(self.events):
                ev = self.events[i]
                out.append(f"{ev.phase}/{ev.purpose}:{ev.where}")
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in _NAMESPACES:
            name = func._schema.name.split("::")[-1]
            spec = _OPS.get(name)
            if spec is not None:
                self._record(spec, name, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, spec: tuple[str, int], name: str, args, kwargs) -> None:
        kind, idx = spec
        if idx == -1:  # functional all_gather: n = output = input × group size
            ranks = _group_ranks(args) or [0]
            n = _nbytes(args[0]) * len(ranks)
        else:
            ranks = _group_ranks(args) or []
            n = _nbytes(args[idx])
        p = len(ranks)
        nodes = {r // self.devices_per_node for r in ranks}
        tag = _TAGS[-1]
        self.events.append(CommEvent(kind, p - 1 if kind == "broadcast" else p, float(n),
                                     "inter" if len(nodes) > 1 else "intra", 0.0, tag.phase,
                                     tag.purpose, tag.where))

    def take(self) -> list[CommEvent]:
        out, self.events, self.marks = self.events, [], []
        return out


@contextmanager
def timed(recorder: Recorder | None) -> Iterator[None]:
    """Time a blocking collective call and stamp the events it recorded."""
    first = len(recorder.events) if recorder is not None else 0
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # NCCL returns once enqueued; time the transfer itself
    secs = time.perf_counter() - t0
    if recorder is not None:
        new = recorder.events[first:]
        for ev in new:
            ev.seconds = secs / len(new)
