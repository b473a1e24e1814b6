"""AutoDDL Fig. 8: search quality and search time on the 4-layer MLP.

MLP 32768 → 16384 → 4096 → 2048 → 512, batch 1024, fp32, on 128 and on 4096 single-GPU
Piz Daint nodes (configs/mlp-autoddl-128.yaml; 4096 via ``cluster.nodes``). Every method
works on the same :class:`~formulations.problem.Problem` (same strategies, same α–β
costs, memory budget = the device memory). For each method: its cost relative to the
proven optimum and its wall time relative to the ILP (build + solve of the ILP model; the
shared problem construction is reported once per setting). Seeded methods run ``--seeds``
times: median and worst ratio, median time.

    python benchmarks/search_quality.py [--seeds 10] [--max-points 1e8] [--joint-only]

A second table (the joint space): a two-block network (linear, ReLU, linear per
block, 32 → 64 → 32, 48 tokens) on 2 devices, where strategies × ZeRO levels × counts of
recomputed blocks can be enumerated. Per memory budget (spread from the smallest peak of
the joint space to above the smallest peak of the plain space): the planner
(``state_sharding: [0,1,2,3]``, ``recompute: auto``), the torchtitan-style grid, and the
plain space (no sharding, no recomputation), each relative to the exhaustive optimum.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from formulations.elimination import solve_elimination
from formulations.sbp_ilp import SbpIlp
from formulations.sbp_search import (
    chain_dp,
    coordinate_descent,
    exhaustive,
    metropolis_hastings,
    random_search,
)
from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.problem import build_problem

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


TOKENS = 48


def _two_blocks():
    from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec

    t = lambda *shape: TensorSpec(tuple(shape), "float32")  # noqa: E731
    ops = [Op("input", OpKind.INPUT, (), t(TOKENS, 32))]
    x = "input"
    for i in range(2):
        for name, kind, ins, out, w in (
                ("fc1", OpKind.LINEAR, [x], t(TOKENS, 64), t(32, 64)),
                ("relu", OpKind.RELU, [f"blk.{i}.fc1"], t(TOKENS, 64), None),
                ("fc2", OpKind.LINEAR, [f"blk.{i}.relu"], t(TOKENS, 32), t(64, 32))):
            ops.append(Op(f"blk.{i}.{name}", kind, tuple(ins), out, w,
                          0 if w is None else w.numel, 2.0 * TOKENS * out.shape[1] * (
                              w.shape[0] if w is not None else 0.5), "blk", i))
        x = f"blk.{i}.fc2"
    ops.append(Op("loss", OpKind.LOSS, (x,), t(1), None, 0, 3.0 * TOKENS * 32))
    return Graph("two-blocks", ops)


def run_joint() -> None:
    import itertools

    from ilp_planner.errors import InfeasibleError
    from ilp_planner.intra_op.baseline_prices import grid_baseline
    from ilp_planner.intra_op.problem import peak_memory
    from ilp_planner.intra_op.request import MeshSolveRequest
    from ilp_planner.intra_op.solve_mesh import solve_mesh

    def config(budget: float, levels, recompute: str):
        return load_config({
            "model": _two_blocks(),
            "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gib": budget / 2**30,
                        "peak_tflops": 1,
                        "links": {"intra": {"alpha": 1e-5, "beta": 1e-9},
                                  "inter": {"alpha": 2e-5, "beta": 2e-9}}},
            "training": {"optimizer": "adam", "grad_bucket_mb": 0},
            "solver": {"state_sharding": list(levels), "recompute": recompute,
                       "tie_layers": False}})

    units = (("blk", 0), ("blk", 1))

    def points(cfg, levels, ks):
        for k in ks:
            gp = build_problem(cfg.graph, cfg.cluster, 1, 2, cfg.memory, tie_layers=False,
                               zero_levels=levels, recompute=frozenset(units[:k]))
            for choice in itertools.product(*(range(len(c)) for c in gp.problem.cost)):
                yield gp.problem.objective(choice), peak_memory(gp, choice)

    probe = config(2**30, (0, 1, 2, 3), "auto")
    joint = list(points(probe, (0, 1, 2, 3), range(3)))
    plain_low = min(m for _, m in points(probe, (0,), [0]))
    joint_low = min(m for _, m in joint)
    print(f"\n== joint space (strategies × ZeRO levels × recomputed blocks): two blocks on 2 "
          f"devices, {len(joint)} points; smallest peak {joint_low:.0f} B "
          f"(plain space {plain_low:.0f} B)")
    head = ("budget B", "optimum s", "planner/opt", "grid/opt", "grid point", "plain/opt",
            "planner s")
    rows = []
    for where in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5):
        budget = joint_low + where * (plain_low - joint_low)
        opt = min(o for o, m in joint if m <= budget * (1 + 1e-9))
        (gp, res), secs = _timed(lambda b=budget: solve_mesh(MeshSolveRequest.whole_model(
            config(b, (0, 1, 2, 3), "auto"), 1, 2, b)))
        grid = grid_baseline(MeshSolveRequest.whole_model(config(budget, (0, 1, 2, 3), "auto"),
                                                         1, 2, budget))
        try:
            plain = solve_mesh(MeshSolveRequest.whole_model(config(budget, (0,), "never"), 1, 2,
                                                             budget))[1].objective
            plain_txt = f"{plain / opt:.4f}"
        except InfeasibleError:
            plain_txt = "infeasible"
        grid_txt = ("infeasible", "-") if isinstance(grid, str) else (
            f"{grid.objective / opt:.4f}", grid.name)
        rows.append((f"{budget:.0f}", f"{opt:.6g}", f"{res.objective / opt:.4f}", *grid_txt,
                     plain_txt, f"{secs:.2f}"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--max-points", type=float, default=1e8,
                    help="skip exhaustive search above this many points")
    ap.add_argument("--nodes", type=int, nargs="*", default=[128, 4096])
    ap.add_argument("--joint-only", action="store_true", help="only the joint-space table")
    args = ap.parse_args()
    if not args.joint_only:
        for nodes in args.nodes:
            run_setting(nodes, args.seeds, args.max_points)
    run_joint()


if __name__ == "__main__":
    main()
