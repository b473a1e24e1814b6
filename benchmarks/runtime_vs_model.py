"""Measured communication of the torch runtime beside the cost model's prediction
(AutoDDL Fig. 4): is the planner's ordering of plans the ordering the machine shows?

1. Calibrate on this machine: ``runtime.measure`` times the collectives on N gloo processes
   (``--devices-per-node`` ranks per virtual node, so both link levels get fitted), and
   :func:`ilp_planner.inputs.calibration.fit_links` fits α, β per link level.
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
   the number of collectives per step the plan prices for rank 0
   (:func:`ilp_planner.plan.audit.predicted`, micro-batches counted) beside the number the
   runtime issued there (counted at dispatch level) — equal since the runtime executes the
   plan's lowered programs (``--audit`` checks it on every rank, and this run uses it).
5. Per collective: every collective the recorder timed (``--timings``), grouped by (kind,
   group size, bytes, link), its median measured seconds beside the calibrated α–β
   prediction, with the rank correlation over groups and the calibration fit's R².

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

from scipy.stats import kendalltau, spearmanr

from ilp_planner.commands.run import torchrun_command
from ilp_planner.inputs.calibration import fit_links, fit_report, read_timings_csv
from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.baselines import data_parallel_filter, megatron_filter, summa_filter
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.lowering.cost_model import collective_time
from ilp_planner.plan.audit import predicted as predicted_collectives
from ilp_planner.testing import restricted_plan, three_d_filter

ROOT = Path(__file__).resolve().parent.parent


def _call(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])}… failed ({res.returncode}):\n{res.stderr[-4000:]}")


def calibrate(nproc: int, dpn: int, tmp: Path) -> tuple[dict, dict]:
    out = tmp / "measured.csv"
    cmd = torchrun_command(nproc, "runtime.measure",
                           ["--output", str(out), "--devices-per-node", str(dpn),
                            "--sizes", "4096,32768,262144,1048576", "--repeats", "5"])
    _call(cmd)
    fits = fit_links(read_timings_csv(out))
    print(fit_report(fits))
    return {k: {"alpha": f.alpha, "beta": f.beta} for k, f in fits.items()}, fits


def per_collective(timings: Path, cluster, fits: dict) -> None:
    """Every timed collective grouped by (kind, group size, bytes, link): median measured
    seconds beside the calibrated prediction."""
    groups: dict[tuple, list[float]] = {}
    for row in read_timings_csv(timings):
        groups.setdefault((row.kind, row.group_size, row.bytes, row.link), []).append(row.seconds)
    print("\nper collective (recorded by the runtime, median over occurrences and ranks):")
    head = (f"{'kind':<16}{'p':>4}{'bytes':>10}{'link':>7}{'n':>6}{'predicted µs':>14}"
            f"{'measured µs':>13}{'meas/pred':>11}")
    print(head)
    print("-" * len(head))
    pred, meas = [], []
    for (kind, p, nbytes, link), secs in sorted(groups.items(), key=lambda kv: (kv[0][0].value, *kv[0][1:])):
        want = collective_time(kind, p, nbytes, cluster.link(link == "inter"))
        got = statistics.median(secs)
        pred.append(want)
        meas.append(got)
        print(f"{kind.value:<16}{p:>4}{nbytes:>10.0f}{link:>7}{len(secs):>6}{want * 1e6:>14.1f}"
              f"{got * 1e6:>13.1f}{got / want:>11.2f}")
    rho, pval = spearmanr(pred, meas)
    fit_r2 = ", ".join(f"{k} {f.r2:.3f}" for k, f in fits.items())
    print(f"{len(groups)} collective classes; Spearman ρ predicted vs measured {rho:.3f} "
          f"(p = {pval:.3g}); calibration fit R²: {fit_r2}")


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
        links, fits = calibrate(nproc, config.cluster.devices_per_node, tmp)
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
            m = cal.pipeline.microbatches
            planned[name] = sum(n for n, _ in predicted_collectives(plan, 0, m).values())
        res_path = tmp / "results.json"
        _call(torchrun_command(nproc, "runtime.launch",
                               [*files, "--steps", str(args.steps), "--optimizer", "sgd", "--lr",
                                "0.05", "--results", str(res_path), "--quiet", "--audit",
                                "--timings", str(tmp / "timings.csv")]))
        results = json.loads(res_path.read_text())
        print(f"\n{config.name}: {len(predicted)} plans on {nproc} gloo processes, {args.steps} "
              f"steps each")
        table("runtime (lowered programs, recorded at dispatch level)", results, predicted, planned)
        per_collective(tmp / "timings.csv", cal.cluster, fits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
