"""``recompute: auto``'s search over the counts of recomputed blocks, timed per config.

``python benchmarks/recompute_counts.py [CONFIG ...]`` solves each config's whole cluster as
one mesh (``solve_mesh``, no baselines) and prints the CPU seconds of the solve
(``time.thread_time``), its step time, status and gap, the blocks kept, and what the counts
search says (the counts solved; every count covered, or the counts left). Without arguments:
the shipped one-mesh configs with ``solver.recompute: auto``. It imports the package from
``PYTHONPATH``, so the same command times an older checkout
(``PYTHONPATH=/path/to/old python benchmarks/recompute_counts.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_mesh

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["gpt-13b-2x8", "gpt-13b-a100-2x8", "deepseek-v2-lite-2x8", "mixtral-8x7b-8x8",
           "published/megatron-1.7b-32", "llama-70b-16x8", "tiny-utf-zero-cpu"]


def row(path: Path) -> str:
    """One config's line: CPU s, step s, status, gap, blocks kept, the counts' note."""
    config = load_config(path)
    t0 = time.thread_time()
    gp, res = solve_mesh(MeshSolveRequest.whole_cluster(config))
    cpu = time.thread_time() - t0
    note = res.message[res.message.find("recomputed blocks tried"):]
    return (f"{path.stem:<24}{cpu:8.2f} s  step {res.objective:.6g} s  {res.status} "
            f"(gap {res.gap or 0:.2g})  kept {len(gp.recompute_units)}  {note}")


def main(args: list[str]) -> None:
    paths = [Path(a) for a in args] or [ROOT / "configs" / f"{n}.yaml" for n in DEFAULT]
    for path in paths:
        print(row(path), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
