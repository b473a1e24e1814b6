"""Import time of users' models (``ilp_planner.from_module``, torch.export on the meta
device, no memory) against the target: a 1B-parameter-shaped model in < 10 s.

    python benchmarks/import_scaling.py

Prints one row per model: parameters (counted on the module and in the imported graph —
they must agree), ops, tied block classes, export + lift seconds, and the target.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.train_own_model import TinyLM  # noqa: E402
from ilp_planner.inputs.importer import from_module

MODELS = [
    ("TinyLM (example)", dict(vocab=128, dim=64, heads=4, layers=2), (2, 16)),
    ("GPT 1.2B shape", dict(vocab=50304, dim=2048, heads=16, layers=20), (4, 1024)),
    ("GPT 2.7B shape", dict(vocab=50304, dim=2560, heads=32, layers=32), (4, 2048)),
]
TARGET_S = 10.0


def main() -> None:
    print(f"{'model':<20}{'params':>16}{'graph params':>16}{'ops':>6}{'tie classes':>13}"
          f"{'import s':>10}  target")
    for name, kw, shape in MODELS:
        with torch.device("meta"):
            model = TinyLM(**kw)
            ids = torch.zeros(shape, dtype=torch.long)
        t0 = time.perf_counter()
        graph = from_module(model, (ids,))
        secs = time.perf_counter() - t0
        n = sum(p.numel() for p in model.parameters())
        classes = len({op.tie_key for op in graph.ops if op.tie_key})
        verdict = "met" if secs < TARGET_S else "MISSED"
        print(f"{name:<20}{n:>16,}{graph.total_params:>16,}{len(graph):>6}{classes:>13}"
              f"{secs:>10.2f}  < {TARGET_S:.0f} s {verdict}")


if __name__ == "__main__":
    main()
