"""Accelerator figures: what one device can do, from its vendor's datasheet.

A :class:`DeviceSpec` is the per-device half of a cluster: memory, dense peak FLOP/s per
dtype (tensor-core peak for the half types, without structured sparsity) and HBM bandwidth.
The compute model (:mod:`ilp_planner.lowering.compute_model`) turns these peaks into
achieved speeds with four fitted parameters and the attention kernel (:class:`ComputeFit`);
a cluster built from raw numbers has no ``DeviceSpec`` and keeps the flat
``peak × efficiency`` model unless its config gives a ``cluster.compute`` section.

Peaks and bandwidths are the datasheets', cited beside each entry. The fitted parameters'
sources are cited beside :data:`DEVICES`; a value chosen rather than measured says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ilp_planner.errors import ConfigError

_GIB = 2**30
_T = 1e12
_GB = 1e9
ATTENTION_KERNELS = ("flash", "unfused")


@dataclass(frozen=True)
class ComputeFit:
    """What turns datasheet peaks into achieved speeds (the roofline's few parameters):

    * ``matmul_efficiency`` e_max — achieved / peak FLOP/s of a large, well-shaped matmul;
    * ``matmul_half_dim`` d½ — the size of a matmul dimension at which that dimension alone
      halves the efficiency: ``eff(m, n, k) = e_max · Π_{d ∈ m,n,k} d / (d + d½)``;
    * ``memory_efficiency`` — achieved / datasheet memory bandwidth of a streaming kernel;
    * ``kernel_floor_s`` — seconds every kernel costs however small (launch, a wave's ramp);
    * ``dispatch_s`` — host seconds the runtime spends on each kernel it issues (eager
      PyTorch: Python, the dispatcher, autograd's bookkeeping). The host issues kernels
      ahead of the device, so a phase takes the longer of its device time and its kernels'
      host time. 0 (every catalogue entry): not modelled — the host is no part of a GPU's
      datasheet; ``calibrate --measure`` measures the runtime's own on its machine;
    * ``replay_s`` — host seconds each kernel a recomputation replays costs beyond its
      dispatch: ``torch.utils.checkpoint``'s bookkeeping (a saved-tensor hook packing and
      unpacking each tensor the region saves, the region's set-up and replay). Charged per
      replayed kernel on the replay's host time; checkpoint's cost has a per-region part
      too, which this spreads over the region's kernels — exact for regions the size of
      the calibrating GPT's blocks. 0 (every catalogue entry): not modelled;

    and one choice of the software stack, not fitted: ``attention`` runs as one fused
    ``flash`` kernel (FlashAttention, PyTorch's SDPA) or ``unfused`` (batched matmuls, a
    softmax and, where the probabilities are dropped, a dropout writing and reading the
    s × s scores: Megatron-LM before 2022).
    """

    matmul_efficiency: float = 0.8
    matmul_half_dim: float = 128.0
    memory_efficiency: float = 0.9
    kernel_floor_s: float = 5e-6
    attention: str = "flash"
    dispatch_s: float = 0.0
    replay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.matmul_efficiency <= 1 or not 0 < self.memory_efficiency <= 1:
            raise ConfigError("matmul_efficiency and memory_efficiency must be in (0, 1], got "
                              f"{self.matmul_efficiency} and {self.memory_efficiency}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"attention kernel must be one of {list(ATTENTION_KERNELS)}, "
                              f"got {self.attention!r}")
        if min(self.matmul_half_dim, self.kernel_floor_s, self.dispatch_s, self.replay_s) < 0:
            raise ConfigError("matmul_half_dim, kernel_floor_s, dispatch_s and replay_s must be "
                              f">= 0, got {self.matmul_half_dim}, {self.kernel_floor_s}, "
                              f"{self.dispatch_s} and {self.replay_s}")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model. ``peak_flops`` maps a dtype name (``float32``, ``bfloat16``,
    ``float16``) to dense FLOP/s; ``hbm_bytes_per_s`` is the datasheet memory bandwidth;
    ``fit`` the roofline's parameters (:class:`ComputeFit`)."""

    name: str
    memory_bytes: float
    peak_flops: Mapping[str, float]
    hbm_bytes_per_s: float
    aliases: tuple[str, ...] = field(default=())
    fit: ComputeFit = field(default_factory=ComputeFit)

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.hbm_bytes_per_s <= 0:
            raise ConfigError(f"device {self.name!r} needs positive memory and HBM bandwidth")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ConfigError(f"device {self.name!r} needs a positive peak per dtype")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def __hash__(self) -> int:
        # a cluster holding this spec keys the lowering's caches: hash the peaks' items
        return hash((self.name, self.memory_bytes, tuple(sorted(self.peak_flops.items())),
                     self.hbm_bytes_per_s, self.aliases, self.fit))

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a dtype the device has no fast path for
        (``bfloat16`` on a V100, ``float64``, integers) runs at fp32's peak."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


def _spec(name: str, memory_gib: float, fp32: float, half: float, hbm_gbs: float,
          fit: ComputeFit, bf16: bool = True, aliases: tuple[str, ...] = ()) -> DeviceSpec:
    peaks = {"float32": fp32 * _T, "float16": half * _T}
    if bf16:
        peaks["bfloat16"] = half * _T
    return DeviceSpec(name, memory_gib * _GIB, peaks, hbm_gbs * _GB, aliases, fit)


def _through(mamf: float, m: int, n: int, k: int, half_dim: float) -> float:
    """e_max such that the size curve passes through a published best-shape matmul
    efficiency ``mamf`` at shape ``(m, n, k)``: ``mamf / Π d/(d + d½)``."""
    return mamf / ((m / (m + half_dim)) * (n / (n + half_dim)) * (k / (k + half_dim)))


# The fitted parameters.
# * e_max: Stas Bekman's "Maximum Achievable Matmul FLOPS" table (ml-engineering,
#   compute/accelerator/README.md, bf16, CUDA 12.1): A100 SXM 267.9 of 312 TFLOP/s (85.9 %)
#   at 6912x16384x2048, H100 SXM 792.1 of 989 (80.1 %) at 6144x17920x2816; e_max makes the
#   curve pass through that point. V100 and L4 are not in that table: CHOSEN 0.80 and 0.75
#   (V100: the fraction cuBLAS fp16 GEMM commonly reaches; L4: a 72 W card that cannot hold
#   its boost clock under tensor-core load).
# * d½ = 128: CHOSEN — the CTA tile edge of cuBLAS/CUTLASS tensor-core kernels on Ampere and
#   Hopper (128 × 128 or 128 × 256): a dimension of one tile keeps half of a full tile's
#   throughput in this curve. 64 on V100 (its smaller tiles). `calibrate --measure` fits it.
# * memory efficiency 0.9: CHOSEN — the upper range of published STREAM/BabelStream results
#   on HBM2/HBM2e/HBM3 (≈ 85–92 % of the datasheet); 0.85 on L4's GDDR6.
# * kernel floor 5 µs: CHOSEN — a PyTorch eager op's launch and dispatch (≈ 4–10 µs); the
#   device's own minimum kernel time is lower, but eager training pays the launch.
_AMPERE = ComputeFit(_through(267.9 / 312, 6912, 16384, 2048, 128), 128, 0.9, 5e-6)
_HOPPER = ComputeFit(_through(792.1 / 989, 6144, 17920, 2816, 128), 128, 0.9, 5e-6)
_VOLTA = ComputeFit(0.80, 64, 0.9, 5e-6)
_ADA_L4 = ComputeFit(0.75, 128, 0.85, 5e-6)


DEVICES: tuple[DeviceSpec, ...] = (
    # V100 SXM2: 125 TFLOP/s fp16 tensor, 15.7 fp32, HBM2 900 GB/s (NVIDIA V100 datasheet);
    # no bf16 tensor cores.
    _spec("v100-16gb", 16, 15.7, 125, 900, _VOLTA, bf16=False, aliases=("v100",)),
    _spec("v100-32gb", 32, 15.7, 125, 900, _VOLTA, bf16=False),
    # A100 SXM4: 312 TFLOP/s bf16/fp16 dense, 19.5 fp32 (156 with TF32, not the default
    # for matmuls in PyTorch); HBM2 1,555 GB/s (40 GB), HBM2e 2,039 GB/s (80 GB)
    # (NVIDIA A100 datasheet).
    _spec("a100-40gb", 40, 19.5, 312, 1555, _AMPERE),
    _spec("a100-80gb", 80, 19.5, 312, 2039, _AMPERE, aliases=("a100",)),
    # H100 SXM5: 989 TFLOP/s bf16/fp16 dense, 67 fp32, HBM3 3,350 GB/s, 80 GB
    # (NVIDIA H100 datasheet).
    _spec("h100-sxm", 80, 67, 989, 3350, _HOPPER, aliases=("h100", "h100-80gb")),
    # H200 SXM: H100's compute with 141 GB of HBM3e at 4,800 GB/s (NVIDIA H200 datasheet).
    _spec("h200", 141, 67, 989, 4800, _HOPPER, aliases=("h200-sxm",)),
    # L4: 121 TFLOP/s bf16/fp16 dense (242 with sparsity), 30.3 fp32, GDDR6 300 GB/s, 24 GB
    # (NVIDIA L4 datasheet).
    _spec("l4", 24, 30.3, 121, 300, _ADA_L4),
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
