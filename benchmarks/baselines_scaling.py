"""Baselines at scale: the plan's own solve time beside the time pricing every baseline
family, and each family's price (or the memory it lacks), on GPT-175B's shape on 128 × 8
H100 (pipeline off and on) and on VGG13 at batch 256 on 8 × 8 H100 (a branching-free but
conv-heavy graph the families used to take minutes on).

GPT-175B: 96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200, bf16 with Adam mixed
precision, GPT-3's batch of 1536 sequences in 96 micro-batches (16 sequences each — no
data-parallel degree above 16 splits that, so the families run on fewer, larger
micro-batches and say so). One mesh: state sharding (ZeRO 0–3) and recomputation in the
space; pipelined (``stages: auto``, 1F1B): the plain space, as ``pipeline_scaling``. Target:
with baselines the solve takes at most twice the plan's own solve time.

Run: ``python benchmarks/baselines_scaling.py [--rows gpt175-off gpt175-pp vgg13]``.
"""

from __future__ import annotations

import argparse
import time

from ilp_planner.api import solve
from ilp_planner.inputs.config import parse_config
from ilp_planner.intra_op.request import PhaseTimes
from ilp_planner.plan.data import baseline_seconds
from ilp_planner.reports.explain import step_seconds

H100 = {"memory_gib": 80, "peak_tflops": 989, "efficiency": 0.5,  # H100 SXM bf16 dense peak
        "links": {"intra": {"latency_us": 3, "bandwidth_gbps": 7200},  # NVLink 4
                  "inter": {"latency_us": 10, "bandwidth_gbps": 3200}}}  # 8 × 400 Gb/s IB
FAMILIES = ("data_parallel", "megatron", "megatron_sp", "summa", "torchtitan")
SOLVER = {"tie_layers": True, "gap": 0.001, "time_limit_s": 60,
          "state_sharding": [0, 1, 2, 3], "recompute": "auto"}


def gpt175(pipeline: bool) -> dict:
    """GPT-175B's shape on 128 × 8 H100, one mesh or ``stages: auto``."""
    return {
        "name": f"gpt175-128x8-{'pp' if pipeline else 'off'}",
        "model": {"kind": "gpt", "hidden": 12288, "layers": 96, "heads": 96, "seq_len": 2048,
                  "vocab": 51200, "batch": 1536, "dtype": "bfloat16"},
        "cluster": {"nodes": 128, "devices_per_node": 8, **H100},
        "training": {"optimizer": "adam_mixed"},
        # pipelined: the plain space of pipeline_scaling (state sharding and recomputation
        # make every one of the DP's stage solves a search of its own)
        "solver": {k: SOLVER[k] for k in ("tie_layers", "gap", "time_limit_s")} if pipeline
        else SOLVER,
        "pipeline": {"stages": "auto" if pipeline else 1, "microbatches": 96,
                     "submesh_space": "power_of_two"},
    }


def vgg13() -> dict:
    """VGG13 at batch 256 on 8 × 8 H100."""
    return {"name": "vgg13-8x8", "model": {"kind": "vgg13", "batch": 256, "dtype": "bfloat16"},
            "cluster": {"nodes": 8, "devices_per_node": 8, **H100},
            "training": {"optimizer": "adam_mixed"}, "solver": SOLVER}


ROWS = {"gpt175-off": lambda: gpt175(False), "gpt175-pp": lambda: gpt175(True), "vgg13": vgg13}


def _family_cells(plan) -> tuple[list[str], list[str]]:
    """Per family: its ratio to the plan (baseline step / plan step) or n/a, with the
    member's name or the reason as a note."""
    mine, cells, notes = step_seconds(plan), [], []
    for family in FAMILIES:
        hits = [(k, v) for k, v in plan.baselines.items()
                if k.split("(", 1)[0] == family and "pp=" not in k]
        if not hits:
            cells.append("—")
            continue
        name, block = hits[0]
        if "error" in block:
            cells.append("n/a")
            notes.append(f"  {plan.name} {family}: {block['error']}")
        else:
            cells.append(f"{baseline_seconds(block) / mine:.2f}×")
            notes.append(f"  {plan.name} {family}: {name}")
    return cells, notes


def main(rows: list[str]) -> None:
    head = (f"{'case':<18}{'plan s':>9}{'baselines s':>12}{'ratio':>7}{'step s':>10}"
            + "".join(f"{f:>15}" for f in FAMILIES))
    print(head)
    print("-" * len(head))
    notes: list[str] = []
    for row in rows:
        config = parse_config(ROWS[row]())
        times = PhaseTimes()
        t0 = time.perf_counter()
        plan = solve(config, times=times)
        wall = time.perf_counter() - t0
        cells, why = _family_cells(plan)
        why += [f"  {plan.name} pipelined grid {k}: "
                f"{v['error'] if 'error' in v else f'{baseline_seconds(v) / step_seconds(plan):.2f}×'}"
                for k, v in plan.baselines.items() if "pp=" in k or k == "torchtitan_pp"]
        notes += why + [f"  {plan.name}: wall {wall:.1f} s, plan status {plan.solver.status}"]
        print(f"{row:<18}{times.solve_s:>9.1f}{times.baselines_s:>12.1f}"
              f"{times.baselines_s / times.solve_s:>7.2f}{step_seconds(plan):>10.4g}"
              + "".join(f"{c:>15}" for c in cells), flush=True)
    print("\nratio = baselines s / plan s (target ≤ 1: the solve with baselines within twice the "
          "plan's own); family cells: baseline step / plan step")
    for line in notes:
        print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    main(parser.parse_args().rows)
