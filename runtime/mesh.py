"""Process groups of the stages' mesh axes, created once, in one order, on every rank.

``new_group`` is a collective over the whole world: every rank must call it for every group,
in the same order, even for groups it is not in. The executor therefore first *registers*
everything it will need while compiling the plan (identical on all ranks, since all read the
same plan), then :meth:`MeshRegistry.create` makes the groups in registration order.

Mesh convention (:mod:`ilp_planner.ir.cluster`): a layout's factorisation ``fact`` over a
stage's devices ``D`` is the n-d array ``mesh[coords(i)] = D[i]`` with
``coords = axis_coordinates(fact)``. Each mesh axis needs one group per line of the array
along that axis. Groups are shared between meshes by rank set (a gloo/NCCL group may carry
the collectives of several meshes because the ranks of one stage issue them in the same
program order). ``new_group`` sorts its ranks, and a gather or scatter orders pieces by a
rank's position in the axis group, so every axis line must list ranks in ascending order — true
for the convention above when ``D`` ascends; anything else is refused with a clear error.

Groups for cross-mesh transfers are keyed apart from mesh groups and apart by direction
(forward activations, backward gradients): collectives of one group must be issued in the
same order by all its members, and under 1F1B a stage interleaves the two directions
differently from its neighbour.

A process that applies plans again (a sweep, a notebook, a test harness training one model
after another) reuses the groups it made for the same key and ranks while its default group
lives (:func:`world_cache`): each gloo group keeps its threads and sockets until the process
ends, and a new set per plan had grown to a thousand threads per rank over 69 models,
slowing everything threefold.
"""

from __future__ import annotations

import datetime
from collections.abc import Hashable, Sequence

import numpy as np
import torch.distributed as dist

from ilp_planner.ir.cluster import Factorisation, axis_coordinates, fact_str
from runtime.errors import RuntimeSetupError


def mesh_array(devices: Sequence[int], fact: Factorisation) -> np.ndarray:
    """The rank array of ``fact`` over ``devices`` (device i at its axis coordinates)."""
    coords = axis_coordinates(fact)
    if coords.shape[0] != len(devices):
        raise RuntimeSetupError(f"mesh {fact_str(fact)} has {coords.shape[0]} devices, the stage "
                                f"has {len(devices)}")
    arr = np.empty(tuple(a.size for a in fact), dtype=np.int64)
    for i, c in enumerate(coords):
        arr[tuple(c)] = devices[i]
    return arr


def axis_lines(arr: np.ndarray, axis: int) -> list[tuple[int, ...]]:
    """The rank lists along ``axis`` (one per position on the other axes)."""
    moved = np.moveaxis(arr, axis, -1).reshape(-1, arr.shape[axis])
    return [tuple(int(r) for r in row) for row in moved]


def _axes_lines(arr: np.ndarray, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Sorted rank tuples of the groups spanning ``axes`` (the other axes fixed)."""
    rest = [a for a in range(arr.ndim) if a not in axes]
    moved = np.transpose(arr, rest + list(axes)).reshape(-1, int(np.prod([arr.shape[a] for a in axes])))
    return [tuple(sorted(int(r) for r in row)) for row in moved]


_WORLD_CACHES: dict[str, dict] = {}
_CACHES_OF: list = [None]  # the default group the caches belong to


def world_cache(name: str) -> dict:
    """The process-wide cache ``name`` of objects made from the current default process
    group (sub-groups, DeviceMeshes), emptied when that group is replaced (destroyed and
    initialised again). Every rank fills it in the same order, so a hit on one rank is a hit
    on all, and no rank skips a collective ``new_group`` the others make."""
    world = dist.group.WORLD
    if _CACHES_OF[0] is not world:
        _WORLD_CACHES.clear()
        _CACHES_OF[0] = world
    return _WORLD_CACHES.setdefault(name, {})


class MeshRegistry:
    """Registers rank sets and meshes, creates all groups at once, hands out axis groups."""

    def __init__(self, timeout_s: float):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._sets: dict[Hashable, tuple[int, ...]] = {}
        self._groups: dict[Hashable, object] = {}
        self._arrays: dict[tuple, np.ndarray] = {}
        self.created = False

    # -- registration (identical on every rank) ----------------------------------------------
    def need_group(self, key: Hashable, ranks: Sequence[int]) -> None:
        if self.created:
            raise RuntimeError(f"group {key!r} registered after the groups were created")
        ranks = tuple(sorted(set(int(r) for r in ranks)))
        old = self._sets.setdefault(key, ranks)
        if old != ranks:
            raise RuntimeError(f"group key {key!r} registered with {old} and {ranks}")

    def need_mesh(self, devices: Sequence[int], fact: Factorisation) -> None:
        key = (tuple(devices), fact)
        if key in self._arrays:
            return
        arr = mesh_array(devices, fact)
        for axis in range(arr.ndim):
            for line in axis_lines(arr, axis):
                if list(line) != sorted(line):
                    raise RuntimeSetupError(
                        f"mesh {fact_str(fact)} over devices {list(devices)}: axis {axis} runs over "
                        f"ranks {list(line)}, not in ascending order; list stage devices ascending")
                self.need_group(("mesh", line), line)
        self._arrays[key] = arr

    def need_axes(self, devices: Sequence[int], fact: Factorisation, axes: tuple[int, ...]) -> None:
        """Register the groups of a collective over mesh ``axes`` of ``fact`` (one per
        combination of the other axes' coordinates)."""
        self.need_mesh(devices, fact)
        if len(axes) == 1:
            return
        for line in _axes_lines(self._arrays[(tuple(devices), fact)], axes):
            self.need_group(("mesh", line), line)

    # -- creation ----------------------------------------------------------------------------
    def create(self) -> None:
        """``new_group`` for every registered set, in registration order (all ranks) — or
        the group an earlier registry of this process made for the same key and ranks."""
        world = dist.get_world_size()
        made = world_cache("groups")
        for key, ranks in self._sets.items():
            if ranks == tuple(range(world)):
                self._groups[key] = dist.group.WORLD
                continue
            if (key, ranks, self.timeout) not in made:
                made[(key, ranks, self.timeout)] = dist.new_group(list(ranks),
                                                                  timeout=self.timeout)
            self._groups[key] = made[(key, ranks, self.timeout)]
        self.created = True

    @property
    def num_groups(self) -> int:
        return len(self._sets)

    def group(self, key: Hashable):
        if key not in self._groups:
            raise RuntimeError(f"group {key!r} was not registered before create()")
        return self._groups[key]

    def axes_group(self, devices: Sequence[int], fact: Factorisation, axes: tuple[int, ...]):
        """This rank's group along mesh ``axes`` of ``fact`` over ``devices``."""
        key = (tuple(devices), fact)
        if key not in self._arrays:
            raise RuntimeError(f"mesh {fact_str(fact)} over {list(devices)} was not registered")
        me = dist.get_rank()
        for line in _axes_lines(self._arrays[key], axes):
            if me in line:
                return self.group(("mesh", line))
        raise RuntimeError(f"rank {me} is not on mesh {fact_str(fact)} over {list(devices)}")
