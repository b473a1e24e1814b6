"""Behaviour check for refactors: solve every shipped config with the CLI and diff the plan JSON.

``python benchmarks/plans_unchanged.py write DIR`` solves each ``configs/*.yaml`` through
``python -m ilp_planner.cli solve`` (so it runs against any layout of the package) and writes
``DIR/<config>.json``; ``python benchmarks/plans_unchanged.py compare OLD NEW`` prints, per config,
``identical`` or each differing JSON path with both values. Timing fields (wall times, solver
statistics measured in seconds of solving) are left out of the comparison: they differ on every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMING_KEYS = {"wall_s", "build_s", "solve_s", "time_s", "elapsed_s", "baseline_s", "solve_wall_s",
               "stats", "timings", "dp_s", "profile_s", "stage_solve_s", "incumbent_s"}


def write(out: Path) -> None:
    """Solve every shipped config into ``out``, one plan JSON each, printing wall times."""
    out.mkdir(parents=True, exist_ok=True)
    for cfg in sorted((ROOT / "configs").glob("*.yaml")):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ilp_planner.cli", "solve", str(cfg), "-o",
                               str(out / f"{cfg.stem}.json")], capture_output=True, text=True, cwd=ROOT)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
        print(f"{cfg.stem:<28}{time.perf_counter() - t0:8.1f} s  {status}", flush=True)


def _diffs(a, b, path: str = "") -> list[str]:
    """Every JSON path where ``a`` and ``b`` differ, timing keys aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        rows = []
        for k in sorted(set(a) | set(b)):
            if k in TIMING_KEYS:
                continue
            if k not in a or k not in b:
                rows.append(f"{path}/{k}: {'missing' if k not in a else 'present'} → "
                            f"{'missing' if k not in b else 'present'}")
            else:
                rows += _diffs(a[k], b[k], f"{path}/{k}")
        return rows
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [r for i, (x, y) in enumerate(zip(a, b, strict=True)) for r in _diffs(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1e-300):
        return []
    return [] if a == b else [f"{path}: {json.dumps(a)[:120]} → {json.dumps(b)[:120]}"]


def compare(old: Path, new: Path) -> int:
    """Print the differences between two snapshot folders; the number of differing configs."""
    bad = 0
    for a in sorted(old.glob("*.json")):
        b = new / a.name
        if not b.exists():
            print(f"{a.stem}: missing in {new}")
            bad += 1
            continue
        rows = _diffs(json.loads(a.read_text()), json.loads(b.read_text()))
        print(f"{a.stem}: {'identical' if not rows else f'{len(rows)} differences'}")
        for r in rows[:40]:
            print(f"    {r}")
        bad += bool(rows)
    return bad


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(1 if compare(Path(sys.argv[2]), Path(sys.argv[3])) else 0)
    else:
        sys.exit(__doc__)
