"""Does a plan fit this host's memory? Asked by ``ilp-planner run`` and ``check`` before any
process starts, so that a plan the host cannot hold ends with one line instead of every rank
dying in the allocator.

The plan prices each device's peak memory (``cost.peak_memory_bytes``; per stage for a
pipelined plan). On CPU all ranks of this host share its RAM, so their peaks add up and are
compared with ``MemAvailable`` of ``/proc/meminfo``; on GPU each rank owns one device and its
peak is compared with that device's free memory. ``--host-memory-gib`` (or the environment
variable :data:`HOST_MEMORY_ENV`) replaces the measured figure: for tests, and for hosts whose
limit is a container's, not ``/proc/meminfo``'s.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import torch

from ilp_planner.errors import ConfigError
from ilp_planner.plan.data import Plan
from runtime.errors import RuntimeSetupError

HOST_MEMORY_ENV = "ILP_PLANNER_HOST_MEMORY_GIB"
GIB = 2**30


def peak_bytes_per_rank(plan: Plan) -> list[float]:
    """Each device's planned peak memory: its stage's in a pipelined plan, the plan's
    otherwise."""
    peaks = [plan.cost.peak_memory_bytes] * plan.num_devices
    for stage in plan.stages:
        if stage.times is not None:
            for device in stage.devices:
                peaks[device] = stage.times.cost.peak_memory_bytes
    return peaks


def available_host_bytes(limit_gib: float | None = None) -> float | None:
    """The memory ranks of this host may use: the given limit, else :data:`HOST_MEMORY_ENV`,
    else ``MemAvailable``; None where none is known (not Linux)."""
    if limit_gib is None and os.environ.get(HOST_MEMORY_ENV):
        text = os.environ[HOST_MEMORY_ENV]
        try:
            limit_gib = float(text)
        except ValueError:
            limit_gib = math.nan
        if not math.isfinite(limit_gib) or limit_gib <= 0:
            raise ConfigError(f"${HOST_MEMORY_ENV}: expected a positive number of GiB, got "
                              f"{text!r}")
    if limit_gib is not None:
        return limit_gib * GIB
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return None


def check_fits_host(plan: Plan, nproc: int, limit_gib: float | None = None) -> None:
    """Raise :class:`RuntimeSetupError` naming both figures where the plan's ranks on this
    host need more memory than it has (GPU: per device; CPU: all ranks together)."""
    peaks = peak_bytes_per_rank(plan)[:nproc]
    if torch.cuda.is_available() and limit_gib is None:
        _check_devices(peaks)
        return
    have = available_host_bytes(limit_gib)
    need = sum(peaks)
    if have is not None and need > have:
        raise RuntimeSetupError(
            f"plan {plan.name} needs {_size(need)} on this host ({nproc} ranks, up to "
            f"{_size(max(peaks))} each) but {_size(have)} is available; run it across more "
            f"hosts, or re-solve it for this one (cluster.memory_gib at most "
            f"{have / nproc / GIB:.2g}, or a smaller model)")


def _check_devices(peaks: list[float]) -> None:
    """Each rank's peak against the free memory of the GPU it will use (local rank i on
    visible device i)."""
    free = free_gpu_bytes()
    for rank, need in enumerate(peaks):
        if free and need > free[rank % len(free)]:
            raise RuntimeSetupError(
                f"rank {rank} needs {_size(need)} but its GPU has {_size(free[rank % len(free)])} "
                f"free; free the device or re-solve the plan with a smaller cluster.memory_gib")


def free_gpu_bytes() -> list[float]:
    """Free memory of each visible GPU, from ``nvidia-smi`` — asking torch would create a
    CUDA context in this launching process and hold part of rank 0's device for the whole
    run. Empty where ``nvidia-smi`` is missing or fails (the check is then left out)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    free = [float(x) * 2**20 for x in out.split()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        free = [free[int(v)] for v in visible.split(",") if int(v) < len(free)]
    return free


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"
