"""Sweep backends side by side: the same sweep on the local process pool and on a local Ray
instance with the same number of CPUs, with 1 and 2 workers.

The sweep is configs/sweeps/inter-bandwidth.yaml (six zipped bandwidth / latency pairs)
times two model depths on a tiny GPT over 2 × 2 devices, so a point solves in about half a
second and per-point overheads show (``--sweep FILE`` runs any sweep file instead).

Per run: start-up (``ray.init`` of a fresh local instance; the pool starts its workers
inside its sweep time), sweep wall time, points per second, and the overhead per point =
(sweep wall × workers − Σ solve wall time inside the workers) / points, i.e. the worker
time not spent solving (dispatch, transfer of the plan, worker start, idle tail). Then the
Ray / pool ratio at 2 workers and Ray's extra overhead per point. Rows of every run are
checked equal (timing columns aside). ``--repeat N`` keeps each configuration's fastest of
N runs (the machine may be shared).

Run: ``python benchmarks/sweep_backends.py [--sweep FILE] [--repeat N]`` (needs the ray
extra).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from ilp_planner.sweeps.backends import import_ray
from ilp_planner.sweeps.results import TIMING_COLUMNS
from ilp_planner.sweeps.spec import SweepSpec, load_sweep, parse_sweep
from ilp_planner.sweeps.sweep import sweep

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT_2X2 = {
    "name": "tiny-gpt-2x2",
    "model": {"kind": "gpt", "hidden": 32, "layers": 1, "heads": 2, "seq_len": 8, "vocab": 64,
              "batch": 4},
    "cluster": {"nodes": 2, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 0.05,
                "links": {"intra": {"latency_us": 30, "bandwidth_gbps": 20},
                          "inter": {"latency_us": 60, "bandwidth_gbps": 10}}},
}


def default_spec() -> SweepSpec:
    doc = yaml.safe_load((ROOT / "configs" / "sweeps" / "inter-bandwidth.yaml").read_text())
    doc.update(base=TINY_GPT_2X2, grid={"model.layers": [1, 2]}, plot=None)
    return parse_sweep(doc)


def run(spec: SweepSpec, backend: str, workers: int, folder: Path) -> dict:
    """One sweep into a fresh folder; Ray gets a fresh local instance of ``workers`` CPUs."""
    start_s = 0.0
    if backend == "ray":
        ray = import_ray()
        t0 = time.perf_counter()
        ray.init(num_cpus=workers)
        start_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        res = sweep(spec, folder, jobs=workers if backend == "local" else None, backend=backend,
                    progress=False, plots=False)
        wall = time.perf_counter() - t0
    finally:
        if backend == "ray":
            ray.shutdown()
    n = len(res.rows)
    solving = sum(r["wall_s"] for r in res.rows)
    return {"backend": backend, "workers": workers, "start_s": start_s, "wall_s": wall,
            "points": n, "solve_s": solving, "overhead_ms": (wall * workers - solving) / n * 1e3,
            "rows": [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in res.rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", metavar="FILE", help="sweep file (default: the derived tiny sweep)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="runs per configuration; the fastest is shown (default 1)")
    args = ap.parse_args()
    spec = load_sweep(args.sweep) if args.sweep else default_spec()
    import_ray()  # fail before any run when the extra is missing

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend, label in (("local", "local pool"), ("ray", "ray (local instance)")):
            for workers in (1, 2):
                r = min((run(spec, backend, workers, Path(tmp) / f"{backend}-{workers}-{i}")
                         for i in range(args.repeat)), key=lambda x: x["start_s"] + x["wall_s"])
                r["label"] = label + (" (in-process)" if backend == "local" and workers == 1 else "")
                runs.append(r)

    points = runs[0]["points"]
    print(f"sweep {spec.name}: {points} points, mean solve {runs[0]['solve_s'] / points:.2f} s/point "
          f"(in-process run)\n")
    print(f"{'backend':<28} {'workers':>7} {'start s':>8} {'sweep s':>8} {'points/s':>9} "
          f"{'overhead ms/point':>18}")
    print("-" * 83)
    for r in runs:
        start = f"{r['start_s']:.2f}" if r["backend"] == "ray" else "—"
        print(f"{r['label']:<28} {r['workers']:>7} {start:>8} {r['wall_s']:>8.2f} "
              f"{r['points'] / r['wall_s']:>9.2f} {r['overhead_ms']:>18.0f}")
    pool, ray2 = runs[1], runs[3]
    print(f"\n2 workers, ray / local pool: sweep time {ray2['wall_s'] / pool['wall_s']:.2f}×, with "
          f"Ray's start-up {(ray2['wall_s'] + ray2['start_s']) / pool['wall_s']:.2f}×; Ray's "
          f"overhead per point {ray2['overhead_ms'] - pool['overhead_ms']:+.0f} ms vs the pool")
    for backend in ("local", "ray"):
        one, two = (r for r in runs if r["backend"] == backend)
        print(f"{backend}: 1 → 2 workers, points/s × {one['wall_s'] / two['wall_s']:.2f}")
    same = all(r["rows"] == runs[0]["rows"] for r in runs)
    print(f"rows equal across all runs (timing columns aside): {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
