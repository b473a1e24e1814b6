"""Zhuang et al. Table 2: the nine multi-device-to-multi-device cross-mesh resharding cases.

Setup (Zhuang et al. §5, §5.1.2): tensor (1024, 1024, 512) float32 (2 GiB); AWS p3.8xlarge hosts
with 4 V100s joined by NVLink; 10 Gb/s between hosts. Modelled here as intra 1200 Gb/s,
5 µs and inter 10 Gb/s, 10 µs (the cluster of ``configs/gpt-2.6b-2x4.yaml``). The source
mesh occupies the first hosts, the destination the next ones (the paper's meshes are on
different hosts).

Table 2 as read from the text extraction, which garbles two cells: case 1's send mesh is
printed "(2.4)" — read (2, 4) like every other 2x4 cell — and case 5's receive spec is
printed "S_0RR" — read S^0RR (the subscript is an extraction artefact; Alpa specs only use
superscripts). Meshes are (hosts, devices per host); (2, 3) and (3, 2) in case 8 use three and
two of a host's four GPUs.

    case  send spec   recv spec   send mesh  recv mesh
    1     S^0RR       S^0RR       (2, 4)     (2, 4)
    2     RRR         S^0RR       (2, 4)     (2, 4)
    3     RS^0R       S^0RR       (2, 4)     (2, 4)
    4     RS^{01}R    S^{01}RR    (2, 4)     (2, 4)
    5     S^1RR       S^0RR       (2, 4)     (2, 4)
    6     S^0RR       S^0RR       (2, 4)     (3, 4)     (1024 rows over 3 hosts: padded)
    7     S^1RR       RRR         (1, 4)     (2, 4)
    8     RRR         RRR         (2, 3)     (3, 2)
    9     RS^0R       RRS^0       (2, 4)     (2, 4)

Columns: unit tasks; makespan (ms) of each scheduling algorithm for broadcast-based
resharding — naive, load balance only (LPT), DFS with pruning, randomised greedy, CP-SAT —
and the lower bound; CP-SAT's wall time (median of ``--repeat`` runs) and status; then the
other transfer strategies under the paper's baseline scheduling (lightest sender for the
next slice, slices in Alpa's destination-major order): send/recv, send/recv + local
all-gather (the "Alpa" baseline), send/recv + global all-gather; and the speed-up of the
best broadcast schedule over "Alpa".

What to compare with the paper. §5.3.1 (Fig. 8): all methods tie in cases 1 and 8; naive
congests in case 2; naive and load-balance-only lose elsewhere while the search finds
schedules with no idle sender — reproduced: CP-SAT proves its schedule optimal in all nine
cases and DFS and randomised greedy find the same makespan; it equals the lower bound except
in case 6, where the bound is 0.1 ms (an NVLink tail) lower. In case 7 all tasks share the
single sender host, so every method ties as well.
§5.1.2 (Fig. 6): ours ≈ Alpa in cases 1, 2, 5, 6; up to 2.5x in 7, 8; 3–10x in 3, 4, 9.
This α–β host-NIC model gives 1.0x in 1 and 2, 2.0x and 3.0x in 7 and 8, and 1.5–1.9x in
3, 4, 9: the direction and the cases that gain are right, but the measured 3–10x
includes effects the model omits (per-message overhead of Alpa's many small send/recv +
all-gather calls, NCCL launch costs; case 4 has 64 tiles). Cases 5 and 6 show 1.5x and 2.0x
here where the paper measured parity: the baseline's in-order appends serialise two tasks on
a receiving host, while the real runtime lets concurrent flows share the NIC.

Run: ``python benchmarks/resharding_cases.py [--time-limit 5] [--workers 2] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from formulations.cross_mesh import SchedulerOptions
from ilp_planner.inter_op.resharding import (
    TABLE2_CASES,
    HostLinks,
    ReshardOptions,
    parse_mesh,
    plan_resharding,
)
from ilp_planner.ir.cluster import Link
from ilp_planner.ir.graph import TensorSpec

TENSOR = TensorSpec((1024, 1024, 512), "float32")
LINKS = HostLinks(intra=Link.from_bandwidth(5, 1200), inter=Link.from_bandwidth(10, 10))
DEVICES_PER_HOST = 4

CASES = TABLE2_CASES  # (send spec, recv spec, send mesh, recv mesh), Table 2 as read above
ALGOS = ("naive", "load_balance", "dfs", "randomized_greedy", "cpsat")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per solve")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    ap.add_argument("--dfs-budget", type=float, default=1.0, help="DFS seconds")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (median CP-SAT time)")
    args = ap.parse_args()
    opts = ReshardOptions(scheduler=SchedulerOptions(
        algorithms=ALGOS, time_limit_s=args.time_limit, num_workers=args.workers,
        dfs_budget_s=args.dfs_budget))

    head = (f"{'case':>4} {'send':<9} {'recv':<9} {'meshes':<9} {'tasks':>5} | "
            f"{'naive':>7} {'LB-only':>7} {'DFS':>7} {'rgreedy':>7} {'CP-SAT':>7} "
            f"{'bound':>7} | {'sat s':>6} {'status':<8} | {'sr':>7} {'sr+lAG':>7} "
            f"{'sr+gAG':>7} {'bcast':>7} | {'x Alpa':>6}")
    print("Zhuang et al. Table 2 — makespan in ms (lower is better); strategies under the "
          "paper's baseline scheduler")
    print(head)
    print("-" * len(head))
    t_all = time.perf_counter()
    for n, (a, b, ma, mb) in enumerate(CASES, start=1):
        src = parse_mesh(ma, DEVICES_PER_HOST)
        dst = parse_mesh(mb, DEVICES_PER_HOST, node0=src.nodes)
        plans = [plan_resharding(TENSOR, src, a, dst, b, LINKS, opts)
                 for _ in range(max(1, args.repeat))]
        plan = plans[0]
        runs = {r.name: r for r in plan.runs}
        sat_s = statistics.median(next(r.wall_s for r in p.runs if r.name == "cpsat")
                                  for p in plans)
        sm = plan.strategy_makespans

        def ms(x: float) -> str:
            return f"{x * 1e3:7.1f}"

        print(f"{n:>4} {a:<9} {b:<9} {ma + '>' + mb:<9} {len(plan.tasks):>5} | "
              + " ".join(ms(runs[k].makespan_s) for k in ALGOS)
              + f" {ms(plan.lower_bound_s)} | {sat_s:6.3f} {runs['cpsat'].status:<8} | "
              + " ".join(ms(sm[s]["in_order_greedy"]) for s in
                         ("send_recv", "local_allgather", "global_allgather", "broadcast"))
              + f" | {plan.speedup_vs_allgather:6.2f}")
    print("-" * len(head))
    print("sr = send/recv, sr+lAG = send/recv + local all-gather (Alpa), sr+gAG = + global "
          "all-gather, bcast = broadcast,\nall four with the baseline scheduler; 'x Alpa' = "
          "sr+lAG / best broadcast schedule. Paper (Fig. 6): ≈1x in cases 1, 2, 5, 6; up to "
          "2.5x in 7, 8;\n3–10x in 3, 4, 9 (see the module docstring for what this model "
          f"does and does not capture). Total {time.perf_counter() - t_all:.1f} s.")


if __name__ == "__main__":
    main()
