"""``ilp-planner calibrate TIMINGS.csv [-o FRAGMENT.yaml]``: fit α–β per link level from
measured collective timings (AutoDDL §3.2), print the fit report and emit a cluster-config
fragment ``cluster: {links: {intra: {alpha, beta}, inter: {alpha, beta}}}``.

The timings come from a CSV (``collective,group_size,bytes,link,seconds``), or, with
``--measure --nproc-per-node N``, from :mod:`runtime.measure` run under torchrun on the
backend actually used. Measured timings are kept (a measurement is the costly part, and
``runtime.measure`` says where it wrote them): in the CSV argument if given, else in
``timings.csv`` beside the fragment (``-o``), else in the working folder. Every output is
checked writable, its folders created, before anything is measured.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ilp_planner.commands.run import torchrun_command
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.calibration import (
    CSV_COLUMNS,
    TimingRow,
    cluster_fragment,
    fit_links,
    fit_report,
    read_timings_csv,
)
from ilp_planner.inputs.files import prepare_output, write_output


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
        "timings", metavar="TIMINGS.csv", nargs="?",
        help=f"CSV with header {','.join(CSV_COLUMNS)} (with --measure: where to keep them; "
             f"default timings.csv beside -o's fragment, else in the working folder)",
    )
    p.add_argument("--measure", action="store_true",
                   help="measure the collectives now with torchrun (runtime.measure), then fit")
    p.add_argument("--nproc-per-node", type=int, default=2, help="processes for --measure")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="ranks per node for the intra/inter labels of --measure "
                        "(default: all on one node)")
    p.add_argument("--sizes", default=None, help="--measure message sizes in bytes, comma list")
    p.add_argument("--repeats", type=int, default=None, help="--measure repetitions per size")
    p.add_argument("-o", "--output", metavar="FRAGMENT.yaml",
                   help="write the cluster fragment here (default: stdout)")
    p.add_argument("--weighting", choices=("relative", "absolute"), default="relative",
                   help="minimise relative (default) or absolute residuals")
    p.add_argument("--allow-negative-alpha", action="store_true",
                   help="keep a negative fitted latency instead of refitting with α = 0")
    p.set_defaults(func=run)


def _load_rows(args: argparse.Namespace) -> list[TimingRow]:
    """Where the timings come from: the CSV named on the command line, or a measurement."""
    if not args.measure:
        if args.timings is None:
            raise ConfigError("give a timings CSV, or --measure --nproc-per-node N")
        return read_timings_csv(args.timings)


    out = str(prepare_output(measured_timings_path(args)))
    extra = ["--output", out]
    for flag, value in (("--devices-per-node", args.devices_per_node), ("--sizes", args.sizes),
                        ("--repeats", args.repeats)):
        if value is not None:
            extra += [flag, str(value)]
    rc = subprocess.call(torchrun_command(args.nproc_per_node, "runtime.measure", extra),
                         stdout=sys.stderr)
    if rc != 0:
        raise ConfigError(f"measuring collectives failed (torchrun exit status {rc})")
    return read_timings_csv(out)


def measured_timings_path(args: argparse.Namespace) -> Path:
    """Where ``--measure`` keeps its timings: the CSV argument, else ``timings.csv`` beside
    the fragment, else in the working folder — never a temporary file deleted on exit, whose
    path ``runtime.measure`` would print as if it were kept."""
    if args.timings:
        return Path(args.timings)
    return (Path(args.output).parent if args.output else Path(".")) / "timings.csv"


def run(args: argparse.Namespace) -> int:
    if args.output:
        prepare_output(args.output)  # before measuring: a measurement is the costly part
    rows = _load_rows(args)
    fits = fit_links(rows, weighting=args.weighting, nonnegative=not args.allow_negative_alpha)
    fragment = cluster_fragment(fits)
    if args.output:
        write_output(args.output, fragment)
        # Report on stdout, fragment in the file.
        print(fit_report(fits))
        print(f"wrote {args.output}")
    else:
        # Fragment on stdout (pipe-able), report on stderr.
        print(fit_report(fits), file=sys.stderr)
        sys.stdout.write(fragment)
    return 0
