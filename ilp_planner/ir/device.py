"""Accelerator figures: what one device can do, from its vendor's datasheet.

A :class:`DeviceSpec` is the per-device half of a cluster: memory, dense peak FLOP/s per
dtype (tensor-core peak for the half types, without structured sparsity) and HBM bandwidth.
The compute model (:mod:`ilp_planner.lowering.compute_model`) turns these peaks into
achieved speeds with a few fitted parameters; a cluster built from raw numbers has no
``DeviceSpec`` and keeps the flat ``peak × efficiency`` model.

Every figure below is the datasheet's, cited beside the entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ilp_planner.errors import ConfigError

_GIB = 2**30
_T = 1e12
_GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model. ``peak_flops`` maps a dtype name (``float32``, ``bfloat16``,
    ``float16``) to dense FLOP/s; ``hbm_bytes_per_s`` is the datasheet memory bandwidth."""

    name: str
    memory_bytes: float
    peak_flops: Mapping[str, float]
    hbm_bytes_per_s: float
    aliases: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.hbm_bytes_per_s <= 0:
            raise ConfigError(f"device {self.name!r} needs positive memory and HBM bandwidth")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ConfigError(f"device {self.name!r} needs a positive peak per dtype")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a dtype the device has no fast path for
        (``bfloat16`` on a V100, ``float64``, integers) runs at fp32's peak."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


def _spec(name: str, memory_gib: float, fp32: float, half: float, hbm_gbs: float,
          bf16: bool = True, aliases: tuple[str, ...] = ()) -> DeviceSpec:
    peaks = {"float32": fp32 * _T, "float16": half * _T}
    if bf16:
        peaks["bfloat16"] = half * _T
    return DeviceSpec(name, memory_gib * _GIB, peaks, hbm_gbs * _GB, aliases)


DEVICES: tuple[DeviceSpec, ...] = (
    # V100 SXM2: 125 TFLOP/s fp16 tensor, 15.7 fp32, HBM2 900 GB/s (NVIDIA V100 datasheet);
    # no bf16 tensor cores.
    _spec("v100-16gb", 16, 15.7, 125, 900, bf16=False, aliases=("v100",)),
    _spec("v100-32gb", 32, 15.7, 125, 900, bf16=False),
    # A100 SXM4: 312 TFLOP/s bf16/fp16 dense, 19.5 fp32 (156 with TF32, not the default
    # for matmuls in PyTorch); HBM2 1,555 GB/s (40 GB), HBM2e 2,039 GB/s (80 GB)
    # (NVIDIA A100 datasheet).
    _spec("a100-40gb", 40, 19.5, 312, 1555),
    _spec("a100-80gb", 80, 19.5, 312, 2039, aliases=("a100",)),
    # H100 SXM5: 989 TFLOP/s bf16/fp16 dense, 67 fp32, HBM3 3,350 GB/s, 80 GB
    # (NVIDIA H100 datasheet).
    _spec("h100-sxm", 80, 67, 989, 3350, aliases=("h100", "h100-80gb")),
    # H200 SXM: H100's compute with 141 GB of HBM3e at 4,800 GB/s (NVIDIA H200 datasheet).
    _spec("h200", 141, 67, 989, 4800, aliases=("h200-sxm",)),
    # L4: 121 TFLOP/s bf16/fp16 dense (242 with sparsity), 30.3 fp32, GDDR6 300 GB/s, 24 GB
    # (NVIDIA L4 datasheet).
    _spec("l4", 24, 30.3, 121, 300),
)


def device_names() -> list[str]:
    """Every catalogue name, aliases included, sorted (for error messages and the docs)."""
    return sorted({n for d in DEVICES for n in (d.name, *d.aliases)})


def device_spec(name: str) -> DeviceSpec:
    """The catalogue entry called ``name`` (case-insensitive, aliases accepted)."""
    key = name.strip().lower()
    for d in DEVICES:
        if key == d.name or key in d.aliases:
            return d
    raise ConfigError(f"unknown device {name!r}; expected one of {device_names()}")
