"""``ilp-planner calibrate TIMINGS.csv [-o FRAGMENT.yaml]``: fit α–β per link level from
measured collective timings (AutoDDL §3.2), print the fit report and emit a cluster-config
fragment ``cluster: {links: {intra: {alpha, beta}, inter: {alpha, beta}}}``.

With ``--measure`` (or ``--kernel-timings KERNELS.csv``) it also fits the roofline compute
model's parameters (:mod:`ilp_planner.inputs.compute_calibration`) from matmuls and
streaming kernels timed on this device (:mod:`runtime.measure_kernels`: the GPU if there is
one, else the CPU) and writes them as the fragment's ``cluster.compute`` section; measured
kernel timings are kept beside the collectives' (``kernels.csv``).

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

from ilp_planner.api import solve
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
from ilp_planner.inputs.compute_calibration import (
    KernelTiming,
    compute_report,
    compute_section,
    fit_compute,
    read_kernel_csv,
    write_kernel_csv,
)
from ilp_planner.inputs.files import prepare_output, write_output
from ilp_planner.plan.data import Plan
from runtime.measure_kernels import measure_kernels


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
    _kernel_options(p)
    p.set_defaults(func=run)


def _kernel_options(p: argparse.ArgumentParser) -> None:
    """The compute model's calibration: kernels timed by --measure, or read from a CSV."""
    p.add_argument("--kernel-timings", metavar="KERNELS.csv", default=None,
                   help="kernel timings (kernel,m,n,k,bytes,seconds) to fit the compute model "
                        "from; with --measure: where to keep them (default kernels.csv beside "
                        "the collectives' timings)")
    p.add_argument("--quick", action="store_true",
                   help="--measure: fewer, smaller kernels (seconds on a CPU)")
    p.add_argument("--dtype", default=None,
                   help="--measure: kernels' dtype (default bfloat16 on a GPU, float32 on CPU)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the datasheet peak the fitted matmul efficiency is a fraction of "
                        "(default: the fitted asymptote, efficiency 1)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="the datasheet memory bandwidth, GB/s, the fitted memory efficiency "
                        "is a fraction of (default: the fitted bandwidth, efficiency 1)")


def _load_rows(args: argparse.Namespace) -> list[TimingRow]:
    """Where the timings come from: the CSV named on the command line, or a measurement
    (none where only kernel timings are given)."""
    if not args.measure:
        if args.timings is None:
            if args.kernel_timings is not None:
                return []
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


def measured_kernels_path(args: argparse.Namespace) -> Path:
    """Where ``--measure`` keeps its kernel timings: ``--kernel-timings``, else
    ``kernels.csv`` beside the collectives' timings."""
    if args.kernel_timings:
        return Path(args.kernel_timings)
    return measured_timings_path(args).parent / "kernels.csv"


# The model whose one-device training step measures the runtime's host time a kernel
# (runtime.measure_dispatch): its kernels take microseconds, so the step's
# time is the runtime's issuing them (Python, the dispatcher, autograd), not the device's
DISPATCH_GPT = {"kind": "gpt", "hidden": 64, "layers": 2, "heads": 4, "seq_len": 16,
                "vocab": 128, "batch": 8}
_ONE_DEVICE = {"name": "one-device", "nodes": 1, "devices_per_node": 1, "memory_gib": 2,
               "peak_tflops": 1.0, "efficiency": 0.5,
               "links": {"intra": {"latency_us": 10, "bandwidth_gbps": 10},
                         "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}


def dispatch_plan(dtype: str, recompute: str = "never") -> Plan:
    """The one-device plan of :data:`DISPATCH_GPT` in ``dtype`` whose step
    ``calibrate --measure`` times for the host's time a kernel (``recompute``: ``always``,
    every block recomputed, for a replayed kernel's)."""
    return solve({"model": {**DISPATCH_GPT, "dtype": dtype}, "cluster": _ONE_DEVICE,
                  "solver": {"recompute": recompute}}, baselines=False)


def measure_host_time(kernels_csv: Path, dtype: str) -> list[KernelTiming]:
    """The runtime's host time a kernel (:mod:`runtime.measure_dispatch`) on
    :func:`dispatch_plan`'s plan — a ``dispatch`` row — and on its twin recomputing every
    block — a ``replay`` row, its replayed kernels those its step issues beyond the
    plain one's. Each plan is kept beside the kernels' CSV (``dispatch-plan.json``,
    ``replay-plan.json``) and timed in a process of its own, as a training rank runs: it
    loads the executor, and a process that solved holds the build caches, whose garbage
    collections would be timed with it."""
    steps = {}
    for recompute, name in (("never", "dispatch"), ("always", "replay")):
        plan_path = kernels_csv.parent / f"{name}-plan.json"
        dispatch_plan(dtype, recompute).save(plan_path)
        row_csv = kernels_csv.parent / f"{name}.csv"
        rc = subprocess.call([sys.executable, "-m", "runtime.measure_dispatch", str(plan_path),
                              "--output", str(row_csv)], stdout=sys.stderr)
        if rc != 0:
            raise ConfigError(f"measuring the runtime's host time failed (exit status {rc})")
        (steps[name],) = read_kernel_csv(row_csv)
        row_csv.unlink()
    plain, again = steps["dispatch"], steps["replay"]
    if again.m <= plain.m:
        raise ConfigError(f"the recomputed step issued {again.m} kernels, the plain one "
                          f"{plain.m}: no replayed kernel to time")
    return [plain, KernelTiming("replay", again.m, again.m - plain.m, 0, 0.0, again.seconds)]


def _load_kernels(args: argparse.Namespace) -> list[KernelTiming] | None:
    """Kernel timings: measured now (``--measure``), read (``--kernel-timings``), or none."""
    if not args.measure:
        return None if args.kernel_timings is None else read_kernel_csv(args.kernel_timings)
    out = prepare_output(measured_kernels_path(args))
    rows, name = measure_kernels(quick=args.quick, dtype=args.dtype)
    rows += measure_host_time(out, args.dtype or ("float32" if name == "cpu" else "bfloat16"))
    write_kernel_csv(rows, out)
    print(f"wrote {len(rows)} kernel timings on {name} to {out}", file=sys.stderr)
    return rows


def run(args: argparse.Namespace) -> int:
    if args.output:
        prepare_output(args.output)  # before measuring: a measurement is the costly part
    rows = _load_rows(args)
    kernels = _load_kernels(args)
    fits = (fit_links(rows, weighting=args.weighting, nonnegative=not args.allow_negative_alpha)
            if rows else {})
    reports = [fit_report(fits)] if fits else []
    compute = None
    if kernels is not None:
        cal = fit_compute(kernels)
        compute = compute_section(cal, args.peak_tflops, args.hbm_gbps)
        reports.append(compute_report(cal))
    fragment = cluster_fragment(fits, compute)
    if args.output:
        write_output(args.output, fragment)
        # Report on stdout, fragment in the file.
        print("\n".join(reports))
        print(f"wrote {args.output}")
    else:
        # Fragment on stdout (pipe-able), report on stderr.
        print("\n".join(reports), file=sys.stderr)
        sys.stdout.write(fragment)
    return 0
