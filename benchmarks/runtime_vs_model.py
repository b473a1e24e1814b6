"""Measured communication of the torch runtime beside the cost model's prediction
(AutoDDL Fig. 4): is the planner's ordering of plans the ordering the machine shows?

1. Calibrate on this machine: ``runtime.measure`` times the collectives on N gloo processes
   (``--devices-per-node`` ranks per virtual node, so both link levels get fitted), and
   :func:`ilp_planner.calibration.fit_links` fits α, β per link level.
2. Build several plans of one model (default: ``configs/tiny-gpt-cpu.yaml``, 8 devices) with
   the calibrated cluster: the ILP's plan, data parallel, Megatron, SUMMA and members of
   AutoDDL's 3-D family forced on every linear. Each plan's predicted communication per step
   is its cost breakdown's ``comm_s`` (activation redistribution + weight-gradient
   synchronisation, forward and backward).
3. Train every plan for a few steps in one launch; the measured communication per step is
   the time the runtime spent in collectives (every redistribution step forward and
   backward, gradient synchronisation, loss reduction, tied-weight exchange), the median
   over steps (first step dropped) of the mean over ranks.
4. Print both side by side with their ranks and Kendall's τ between the two orderings, and
   the number of collectives per step the plan lists beside the number the runtime issued
   (rank 0, counted at dispatch level) — equal since the runtime executes the plan's
   lowered programs (``ilp-planner run --audit`` checks it per rank).

On a 2-core machine running 8 processes, absolute times are dominated by scheduling; the
ordering (τ) and ratios are what to read. Usage::

    python benchmarks/runtime_vs_model.py [--config CFG] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scipy.stats import kendalltau

from ilp_planner.baselines import data_parallel_filter, megatron_filter, summa_filter
from ilp_planner.calibration import fit_links, fit_report, read_timings_csv
from ilp_planner.cluster import MeshAxis
from ilp_planner.commands.run import torchrun_command
from ilp_planner.config import load_config
from runtime.plans import restricted_plan, three_d_filter

ROOT = Path(__file__).resolve().parent.parent


def _call(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])}… failed ({res.returncode}):\n{res.stderr[-4000:]}")


def calibrate(nproc: int, dpn: int, tmp: Path) -> dict:
    out = tmp / "measured.csv"
    cmd = torchrun_command(nproc, "runtime.measure",
                           ["--output", str(out), "--devices-per-node", str(dpn),
                            "--sizes", "4096,32768,262144,1048576", "--repeats", "5"])
    _call(cmd)
    fits = fit_links(read_timings_csv(out))
    print(fit_report(fits))
    return {k: {"alpha": f.alpha, "beta": f.beta} for k, f in fits.items()}


def plan_variants(config) -> dict:
    c = config.cluster
    n, d = c.nodes, c.devices_per_node
    whole = MeshAxis(n, d)
    out = {"ilp": None, "data_parallel": data_parallel_filter(whole)}
    if n * d >= 4:
        out[f"megatron(dp={n},tp={d})"] = megatron_filter(MeshAxis(n, 1), MeshAxis(1, d))
        out[f"summa({n}x{d})"] = summa_filter(MeshAxis(n, 1), MeshAxis(1, d))
    p = n * d
    for sizes in [(2, 2, p // 4), (1, p, 1), (1, 1, p), (p // 2, 2, 1)]:
        if min(sizes) >= 1 and sizes[0] * sizes[1] * sizes[2] == p:
            out[f"3d{sizes}"] = three_d_filter(sizes)
    return out


def table(label: str, results: list[dict], predicted: dict, planned: dict) -> None:
    measured, steps, issued = {}, {}, {}
    for r in results:
        issued[r["plan"]] = statistics.median(c["count"] for c in r["comm"])
        per_step = [statistics.fmean(ranks) for ranks in zip(*r["comm_s_by_rank"], strict=True)][1:]
        measured[r["plan"]] = statistics.median(per_step)
        steps[r["plan"]] = statistics.median(r["step_s"][1:])
    names = list(predicted)
    pr = {n: i + 1 for i, n in enumerate(sorted(names, key=lambda n: predicted[n]))}
    mr = {n: i + 1 for i, n in enumerate(sorted(names, key=lambda n: measured[n]))}
    print(f"\n{label}")
    head = (f"{'plan':<26}{'predicted comm ms':>18}{'rank':>6}{'measured comm ms':>18}{'rank':>6}"
            f"{'measured/pred':>15}{'step ms':>10}{'colls plan/run':>16}")
    print(head)
    print("-" * len(head))
    for n in sorted(names, key=lambda n: predicted[n]):
        ratio = measured[n] / predicted[n] if predicted[n] > 0 else float("nan")
        print(f"{n:<26}{predicted[n] * 1e3:>18.3f}{pr[n]:>6}{measured[n] * 1e3:>18.3f}{mr[n]:>6}"
              f"{ratio:>15.2f}{steps[n] * 1e3:>10.1f}{f'{planned[n]}/{issued[n]:.0f}':>16}")
    tau, p = kendalltau([predicted[n] for n in names], [measured[n] for n in names])
    print(f"Kendall tau (predicted vs measured ordering): {tau:.3f} (p = {p:.3g})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-gpt-cpu.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    config = load_config(args.config)
    nproc = config.cluster.num_devices
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        print(f"calibrating {nproc} gloo processes ({config.cluster.devices_per_node} per node)...")
        links = calibrate(nproc, config.cluster.devices_per_node, tmp)
        cal = config.with_overrides({f"cluster.links.{k}": v for k, v in links.items()})
        files, predicted, planned = [], {}, {}
        for name, keep in plan_variants(cal).items():
            try:
                plan = restricted_plan(cal, keep, name=name)
            except Exception as exc:  # a baseline with no strategy on this mesh
                print(f"skip {name}: {exc}")
                continue
            path = tmp / f"plan{len(files)}.json"
            plan.save(path)
            files.append(str(path))
            predicted[name] = plan.cost.comm_s
            planned[name] = sum(len(lp.collectives) for lp in plan.layers)
        res_path = tmp / "results.json"
        _call(torchrun_command(nproc, "runtime.launch",
                               [*files, "--steps", str(args.steps), "--optimizer", "sgd", "--lr",
                                "0.05", "--results", str(res_path), "--quiet"]))
        results = json.loads(res_path.read_text())
    print(f"\n{config.name}: {len(predicted)} plans on {nproc} gloo processes, {args.steps} steps each")
    table("runtime (lowered programs, recorded at dispatch level)", results, predicted, planned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
