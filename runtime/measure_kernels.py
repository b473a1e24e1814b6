"""``python -m runtime.measure_kernels --output kernels.csv``: time matmuls of several
shapes and a streaming elementwise kernel of several sizes on this device (the first GPU
when there is one, else the CPU), in the format ``kernel,m,n,k,bytes,seconds`` that
``ilp-planner calibrate`` fits to the roofline's parameters
(:mod:`ilp_planner.inputs.compute_calibration`); ``calibrate --measure`` calls
:func:`measure_kernels` itself.

The runtime's host time a kernel, the format's ``dispatch`` row, is measured apart
(:mod:`runtime.measure_dispatch`: it loads the executor).

Shapes: square matmuls from small to large (the size curve's knee and its asymptote) and
skinny ones with one small dimension each (the curve's per-dimension factor; on a GPU the
small dimension stays ≥ 256 so that the matmul is still compute-bound — a memory-bound
matmul's time says nothing of the curve), and streams from cache-sized to memory-sized
(bandwidth and the per-launch floor; on a GPU, around its L2 cache's sizes). Each timing is the
fastest of ``repeats`` loops of launches long enough to read a clock (≥ 1 ms), divided by
its length: a launch's whole cost, what eager training pays per kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ilp_planner.inputs.compute_calibration import KernelTiming, write_kernel_csv

# (squares, skinny triples, stream element counts) per device kind and run length
_CPU_QUICK = ((32, 64, 128, 256, 384), ((8, 256, 256), (256, 8, 256), (256, 256, 8)),
              tuple(4**p for p in range(5, 11)))
_CPU_FULL = ((32, 64, 128, 256, 512, 768, 1024),
             ((8, 512, 512), (512, 8, 512), (512, 512, 8), (32, 1024, 1024)),
             tuple(4**p for p in range(5, 13)))
# A GPU's streams skip the sizes its L2 cache holds (tens of MB: 50 MB on an H100, 60 on an
# H200): there a stream runs at the cache's bandwidth, neither the launch floor (the small
# sizes) nor HBM's bandwidth (the large ones), and a fit through them overstates the
# bandwidth (an H200's came out at 5.1 TB/s of a 4.8 TB/s datasheet).
_GPU_QUICK = ((256, 512, 1024, 2048, 4096), ((4096, 4096, 256), (4096, 256, 4096), (256, 4096, 4096)),
              (4**5, 4**6, 4**13, 4**14))
_GPU_FULL = ((128, 256, 512, 1024, 2048, 4096, 6144, 8192),
             ((16, 8192, 8192), (8192, 8192, 256), (8192, 256, 8192), (256, 8192, 8192),
              (8192, 8192, 512), (8192, 512, 8192)),
             (4**5, 4**6, 4**7, 4**13, 4**14, 4**15))
MIN_SAMPLE_S = 1e-3


def _timer(torch: Any, device: Any) -> Any:
    """A clock that waits for the device: CUDA synchronises before reading."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def _loop(fn: Any, now: Any, count: int) -> float:
    t0 = now()
    for _ in range(count):
        fn()
    return (now() - t0) / count


def _per_launch(fn: Any, now: Any, repeats: int) -> float:
    """Seconds per launch of ``fn``: the fastest of ``repeats`` loops, each doubled until
    it lasts MIN_SAMPLE_S (at most 1,024 launches). The fastest, not the median: on a
    shared machine contention only ever adds time."""
    fn()  # warm-up: allocation, kernel selection
    count = 1
    while count < 1024 and _loop(fn, now, count) * count < MIN_SAMPLE_S:
        count *= 2
    return min(_loop(fn, now, count) for _ in range(repeats))


def measure_kernels(quick: bool = True, dtype: str | None = None,
                    repeats: int = 5) -> tuple[list[KernelTiming], str]:
    """Kernel timings on this device, and the device's name (``cpu`` or the GPU's)."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dt = getattr(torch, dtype or ("bfloat16" if cuda else "float32"))
    squares, skinny, streams = (_GPU_QUICK if quick else _GPU_FULL) if cuda else \
        (_CPU_QUICK if quick else _CPU_FULL)
    now = _timer(torch, device)
    threads = torch.get_num_threads()
    if not cuda:  # one thread, as torchrun's ranks run (OMP_NUM_THREADS=1)
        torch.set_num_threads(1)
    try:
        rows = _measure(torch, device, dt, (squares, skinny, streams), now, repeats)
    finally:
        torch.set_num_threads(threads)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return rows, name


def _measure(torch: Any, device: Any, dt: Any, shapes: tuple, now: Any,
             repeats: int) -> list[KernelTiming]:
    squares, skinny, streams = shapes
    item = torch.empty((), dtype=dt).element_size()
    rows = []
    with torch.no_grad():
        for m, n, k in [(s, s, s) for s in squares] + list(skinny):
            a = torch.randn(m, k, device=device, dtype=dt)
            b = torch.randn(k, n, device=device, dtype=dt)
            out = torch.empty(m, n, device=device, dtype=dt)
            secs = _per_launch(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), now, repeats)
            rows.append(KernelTiming("matmul", m, n, k, float((m * k + k * n + m * n) * item), secs))
        for elems in streams:
            x = torch.randn(elems, device=device, dtype=dt)
            y = torch.empty_like(x)
            secs = _per_launch(lambda x=x, y=y: torch.mul(x, 2.0, out=y), now, repeats)
            rows.append(KernelTiming("stream", 0, 0, 0, float(2 * elems * item), secs))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.measure_kernels")
    p.add_argument("--output", required=True, metavar="CSV")
    p.add_argument("--full", action="store_true", help="more and larger shapes")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    rows, name = measure_kernels(not args.full, args.dtype, args.repeats)
    write_kernel_csv(rows, args.output)
    print(f"wrote {len(rows)} kernel timings on {name} to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
