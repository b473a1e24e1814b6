"""``ilp-planner calibrate TIMINGS.csv [-o FRAGMENT.yaml]``: fit α–β per link level from
measured collective timings (AutoDDL §3.2), print the fit report and emit a cluster-config
fragment ``cluster: {links: {intra: {alpha, beta}, inter: {alpha, beta}}}``.

The timings come from a CSV (``collective,group_size,bytes,link,seconds``); a source that
measures them on the spot can plug in beside :func:`_load_rows`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ilp_planner.calibration import (
    CSV_COLUMNS,
    TimingRow,
    cluster_fragment,
    fit_links,
    fit_report,
    read_timings_csv,
)
from ilp_planner.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit α–β link parameters from measured collective timings",
        description=(
            "Fit latency α and inverse bandwidth β per link level (intra/inter) by least "
            "squares from collective timings, print the fit and write a cluster YAML fragment."
        ),
    )
    p.add_argument(
        "timings", metavar="TIMINGS.csv",
        help=f"CSV with header {','.join(CSV_COLUMNS)}",
    )
    p.add_argument("-o", "--output", metavar="FRAGMENT.yaml",
                   help="write the cluster fragment here (default: stdout)")
    p.add_argument("--weighting", choices=("relative", "absolute"), default="relative",
                   help="minimise relative (default) or absolute residuals")
    p.add_argument("--allow-negative-alpha", action="store_true",
                   help="keep a negative fitted latency instead of refitting with α = 0")
    p.set_defaults(func=run)


def _load_rows(args: argparse.Namespace) -> list[TimingRow]:
    """Where the timings come from (today: the CSV named on the command line)."""
    return read_timings_csv(args.timings)


def run(args: argparse.Namespace) -> int:
    rows = _load_rows(args)
    fits = fit_links(rows, weighting=args.weighting, nonnegative=not args.allow_negative_alpha)
    fragment = cluster_fragment(fits)
    if args.output:
        out = Path(args.output)
        try:
            out.write_text(fragment)
        except OSError as exc:
            raise ConfigError(f"cannot write fragment: {exc.strerror}", source=str(out)) from exc
        # Report on stdout, fragment in the file.
        print(fit_report(fits))
        print(f"wrote {out}")
    else:
        # Fragment on stdout (pipe-able), report on stderr.
        print(fit_report(fits), file=sys.stderr)
        sys.stdout.write(fragment)
    return 0
