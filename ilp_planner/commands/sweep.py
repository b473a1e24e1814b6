"""``ilp-planner sweep SWEEP.yaml [-o DIR] [-j N] [--backend local|ray [--address A]]
[--resume]``: solve a grid of configurations in worker processes (or as Ray tasks on a
cluster) with a progress bar, write ``results.csv`` / ``results.jsonl`` / ``results.md``,
every point's plan and the PNG plots, and print the results table.

A failing point (bad override value, infeasible, time-out) is recorded in its row and the
sweep goes on; the exit status is 0 unless the sweep file itself is wrong (2), which
includes a sweep whose every point failed with a configuration error: its results hold no
answer, only the same mistake once per point. The sweep file format is documented in
:mod:`ilp_planner.sweeps.spec`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ilp_planner.errors import ConfigError
from ilp_planner.sweeps.backends import BACKENDS
from ilp_planner.sweeps.results import RESULTS_JSONL
from ilp_planner.sweeps.spec import PlotSpec, check_metric, load_sweep
from ilp_planner.sweeps.sweep import default_output, sweep


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="solve a grid of configurations in parallel and tabulate the results",
        description="Expand a sweep file (a base config plus a grid and/or zipped lists of "
                    "dotted-key overrides), solve every point in worker processes or on a Ray "
                    "cluster, and write results.csv, results.jsonl, results.md, plans/*.json "
                    "and plots.",
    )
    p.add_argument("sweep", metavar="SWEEP", help="sweep YAML file")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="results folder (default: sweep-results/<sweep name>)")
    p.add_argument("-j", "--jobs", type=int, metavar="N",
                   help=f"worker processes (default: cores = {os.cpu_count()}; 1 = in-process); "
                        f"with --backend ray and no --address, the local Ray instance's CPUs")
    p.add_argument("--backend", choices=BACKENDS, default="local",
                   help="where points are solved: local worker processes (default) or one Ray "
                        "task per point (needs the ray extra)")
    p.add_argument("--address", metavar="ADDR",
                   help="with --backend ray: the cluster to join (auto, HOST:PORT, ray://HOST:PORT); "
                        "default: start a local Ray instance")
    p.add_argument("--max-points", type=int, default=None, metavar="N",
                   help="allow up to N points (default 10,000; ILP_PLANNER_MAX_POINTS)")
    p.add_argument("--resume", action="store_true",
                   help="skip points already in DIR/results.jsonl (same base config)")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume, solve recorded failures again")
    p.add_argument("--plot", action="append", metavar="METRIC:X[:SERIES]", default=[],
                   help="draw METRIC against swept key X (one line per SERIES value); "
                        "replaces the sweep file's plots; repeatable")
    p.add_argument("--no-plots", action="store_true", help="draw no plots")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _plot_specs(items: list[str], keys: tuple[str, ...]):
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"--plot {item!r}: expected METRIC:X or METRIC:X:SERIES")
        check_metric(parts[0], key="--plot")
        for k in parts[1:]:
            if k not in keys:
                raise ConfigError(f"--plot {item!r}: {k!r} is not a swept key; swept keys: "
                                  f"{', '.join(keys)}")
        out.append(PlotSpec(parts[0], parts[1], parts[2] if len(parts) == 3 else None))
    return out


def run(args: argparse.Namespace) -> int:
    spec = load_sweep(args.sweep, args.max_points)
    plots = False if args.no_plots else (_plot_specs(args.plot, spec.keys) if args.plot else True)
    points = len(spec.points())
    print(f"sweep {spec.name}: {points} point(s) over {', '.join(spec.keys) or 'no keys'}",
          file=sys.stderr)
    out = Path(args.output) if args.output else default_output(spec)
    try:
        result = sweep(spec, out, jobs=args.jobs, backend=args.backend, address=args.address,
                       resume=args.resume, retry_failed=args.retry_failed, progress=not args.quiet,
                       plots=plots)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the points finished so far are in {out / RESULTS_JSONL}; run the "
              f"same command with --resume to solve only the others", file=sys.stderr)
        return 130
    print(result.table())
    failed = len(result.failed)
    print(f"\n{len(result.rows)} point(s): {result.solved} solved now, {result.skipped} kept from "
          f"earlier results, {failed} failed")
    print(f"wrote {result.csv_path}, {result.jsonl_path}, {result.output / 'results.md'}, "
          f"{result.output / 'plans'}/")
    for path in result.plots:
        print(f"wrote {path}")
    _refuse_all_config_errors(args.sweep, result.rows)
    return 0


def _refuse_all_config_errors(source: str, rows: list[dict]) -> None:
    """A sweep whose every point failed with a configuration error ends as an error (its
    rows are written first, for reading): exit 0 would tell a script that it ran."""
    if rows and all(r.get("status") == "config_error" for r in rows):
        raise ConfigError(f"all {len(rows)} point(s) failed with configuration errors; the "
                          f"first: {rows[0].get('error')}", source=source)
