"""AutoDDL Fig. 8: search quality and search time on the 4-layer MLP.

MLP 32768 → 16384 → 4096 → 2048 → 512, batch 1024, fp32, on 128 and on 4096 single-GPU
Piz Daint nodes (configs/mlp-autoddl-128.yaml; 4096 via ``cluster.nodes``). Every method
works on the same :class:`~formulations.sbp_problem.Problem` (same strategies, same α–β
costs, memory budget = the device memory). For each method: its cost relative to the
proven optimum and its wall time relative to the ILP (build + solve of the ILP model; the
shared problem construction is reported once per setting). Seeded methods run ``--seeds``
times: median and worst ratio, median time.

    python benchmarks/search_quality.py [--seeds 10] [--max-points 1e8]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from formulations.elimination import solve_elimination
from formulations.sbp_ilp import SbpIlp
from formulations.sbp_problem import build_problem
from formulations.sbp_search import (
    chain_dp,
    coordinate_descent,
    exhaustive,
    metropolis_hastings,
    random_search,
)
from ilp_planner.config import load_config

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "mlp-autoddl-128.yaml"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_setting(nodes: int, seeds: int, max_points: float) -> None:
    config = load_config(CONFIG).with_overrides({"cluster.nodes": nodes})
    cluster = config.cluster
    gp, build_s = _timed(lambda: build_problem(
        config.graph, cluster, cluster.nodes, cluster.devices_per_node, config.memory,
        tie_layers=False, memory_budget=cluster.memory_bytes))
    p = gp.problem
    sizes = [len(c) for c in p.cost]
    space = math.prod(sizes)
    print(f"\n== MLP on {nodes} nodes: {p.num_groups} groups {sizes}, space {space:.3g}, "
          f"chain: {p.is_chain()}, problem build {build_s:.2f} s")

    def ilp():
        model = SbpIlp(p)
        return model.solve(time_limit_s=600)

    res, ilp_s = _timed(ilp)
    assert res is not None and res.status == "optimal"
    opt = res.objective
    rows: list[tuple[str, str, str, str, str]] = []

    def add(name: str, objs: list[float], times: list[float], note: str = "") -> None:
        ratios = [o / opt for o in objs]
        rows.append((name, f"{statistics.median(ratios):.4f}", f"{max(ratios):.4f}",
                     f"{statistics.median(times):.3g}", f"{statistics.median(times) / ilp_s:.3g}"
                     + (f"  {note}" if note else "")))

    add("ilp (SCIP)", [opt], [ilp_s], f"status {res.status}, gap {res.gap}")
    el, el_s = _timed(lambda: solve_elimination(p))
    add("elimination DP", [el.result.objective], [el_s], f"status {el.result.status}")
    dp, dp_s = _timed(lambda: chain_dp(p))
    add("chain DP", [dp.objective], [dp_s])
    if space <= max_points:
        ex, ex_s = _timed(lambda: exhaustive(p, max_points=int(max_points)))
        add("exhaustive", [ex.objective], [ex_s])
    else:
        rows.append(("exhaustive", "n/a", "n/a", "n/a", f"n/a  space {space:.3g} > {max_points:.3g}"))
    for name, fn in (("random (2000)", lambda s: random_search(p, samples=2000, seed=s)),
                     ("metropolis-hastings (20000)", lambda s: metropolis_hastings(p, seed=s)),
                     ("coordinate descent (8 restarts)", lambda s: coordinate_descent(p, seed=s))):
        objs, times = [], []
        for seed in range(seeds):
            out, secs = _timed(lambda fn=fn, seed=seed: fn(seed))
            assert p.feasible(out.choice), name
            objs.append(out.objective)
            times.append(secs)
        add(name, objs, times)
    head = ("method", "cost/opt (median)", "cost/opt (worst)", "time s", "time / ILP")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*head))
    for r in rows:
        print(fmt.format(*r))
    print(f"optimum {opt:.6g} s per step; ILP wall time {ilp_s:.3g} s "
          f"(model build {res.build_s:.3g} s, solver {res.solve_s:.3g} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--max-points", type=float, default=1e8,
                    help="skip exhaustive search above this many points")
    ap.add_argument("--nodes", type=int, nargs="*", default=[128, 4096])
    args = ap.parse_args()
    for nodes in args.nodes:
        run_setting(nodes, args.seeds, args.max_points)


if __name__ == "__main__":
    main()
