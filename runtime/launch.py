"""``torchrun --nproc-per-node N -m runtime.launch PLAN.json [PLAN2.json …] [options]``.

Trains each plan in turn for ``--steps`` optimizer steps and prints, on rank 0, the loss and
wall time of every step. Several plans share one launch (and one process start-up).

Order of checks, so that bad input fails fast and never hangs: the plan files are read and
validated and the world size (``WORLD_SIZE`` from torchrun) is compared with each plan's
device count *before* the process group exists; then the backend is initialised — NCCL
when CUDA is available, gloo otherwise (``--backend``) — with a collective timeout (``--timeout``, default
60 s), so a rank that dies mid-step ends the job with an error (torchrun also tears the
other workers down as soon as one exits non-zero), and a heartbeat (``--heartbeat-s``,
:mod:`runtime.heartbeat`) ends it within a few beats when a rank stops. Under
``ilp-planner run`` each rank's stderr goes to its log in the run folder and a failure
leaves the rank's account there (:mod:`runtime.failures`) for the run's one error line.

Outputs (rank 0): ``--timings CSV`` — every single collective issued, in the calibration
format (``collective,group_size,bytes,link,seconds``) that ``ilp-planner calibrate`` fits;
``--results JSON`` — per plan: losses, step seconds, communication seconds per step and per
purpose, the reference comparison and, on CUDA, rank 0's peak allocated memory over the
plan's setup and steps (``torch.cuda.max_memory_allocated``, less what was allocated
before) and with ``--profile-last-step`` its last step's GPU kernel seconds;
``--save-params DIR`` — final full parameters (``DIR/<plan stem>.pt``);
``--check-reference`` — run the single-process reference on rank 0 and fail (exit 1)
unless every step's loss and every final parameter agree within ``--rtol`` (relative,
norm-wise per tensor; default per compute dtype, :data:`runtime.reference.RTOL`).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import faulthandler
import functools
import gc
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ilp_planner.errors import ConfigError, PlannerError
from ilp_planner.plan import audit
from ilp_planner.plan.data import Plan
from runtime import failures, heartbeat
from runtime.errors import RuntimeSetupError
from runtime.executor import Executor, RunOptions
from runtime.optim import OptimizerSpec
from runtime.reference import DRIFT_MULTIPLE, compare, run_reference, tolerance

T = TypeVar("T")
BACKENDS = ("auto", "nccl", "gloo")
CALIBRATION_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def positive(cast: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type: ``cast`` of the text, refused unless finite and > 0 (a count or
    a tolerance of 0 or less either does nothing or divides by zero)."""
    return _bounded(cast, lambda v: v > 0, "a positive")


def non_negative(cast: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type: ``cast`` of the text, refused unless finite and ≥ 0."""
    return _bounded(cast, lambda v: v >= 0, "a non-negative")


def _bounded(cast: Callable[[str], T], ok: Callable[[T], bool], what: str
             ) -> Callable[[str], T]:
    kind = "integer" if cast is int else "number"

    def parse(text: str) -> T:
        try:
            value = cast(text)
            fine = math.isfinite(value) and ok(value)
        except (ValueError, OverflowError):  # not a number; an integer too large for a float
            fine = False
        if not fine:
            raise argparse.ArgumentTypeError(f"expected {what} {kind}, got {text!r}")
        return value

    parse.__name__ = f"{what.split()[-1]} {kind}"
    return parse


def check_training_options(args: argparse.Namespace, plans: int) -> None:
    """The per-plan lists (``--optimizer``, ``--lr``) checked as every rank would read them,
    before any rank starts: raises :class:`ConfigError` naming the option."""
    for o, lr in zip(_per_plan(args.optimizer, plans, "--optimizer", str),
                     _per_plan(args.lr, plans, "--lr", float), strict=True):
        try:
            OptimizerSpec(o, lr)
        except ConfigError as exc:
            raise ConfigError(f"--optimizer / --lr: {exc}") from None


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The training options, shared by this launcher and ``ilp-planner run`` (which
    forwards them with :func:`forward_options`)."""
    p.add_argument("--steps", type=positive(int), default=3, help="optimizer steps to train (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial parameters and the synthetic data (default 0)")
    p.add_argument("--optimizer", default="adam",
                   help="sgd or adam; a comma-separated list gives one per plan")
    p.add_argument("--lr", default="1e-2", help="learning rate; a comma list gives one per plan")
    p.add_argument("--microbatches", type=positive(int), default=None,
                   help="gradient accumulation for single-stage plans (default: the config's)")
    p.add_argument("--timeout", type=positive(float), default=60.0, help="collective timeout, seconds")
    p.add_argument("--audit", action="store_true",
                   help="per rank, the collectives the plan prices beside those the recorder saw "
                        "executed (count and bytes per kind and purpose); exit 1 where they differ")
    p.add_argument("--timings", metavar="CSV", help="write per-collective timings here")
    p.add_argument("--no-overlap", action="store_true",
                   help="reduce gradients after the backward instead of during it")
    p.add_argument("--record", action="store_true",
                   help="record every collective at dispatch level and report communication "
                        "per step (implied by --audit and --timings; slows the step)")
    p.add_argument("--results", metavar="JSON", help="write per-plan results here")
    p.add_argument("--save-params", metavar="DIR", help="save final full parameters here")
    p.add_argument("--check-reference", action="store_true",
                   help="compare with the single-process reference on rank 0")
    p.add_argument("--rtol", type=positive(float), default=None,
                   help="relative tolerance of --check-reference (default: per compute dtype, "
                        "runtime.reference.RTOL: 1e-4 float32, 1e-2 bfloat16, 2e-3 float16)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--profile-last-step", action="store_true",
                   help="on CUDA, run the last step under the profiler and report its GPU "
                        "kernel seconds (--results: last_step_kernel_s; the step's own time "
                        "includes the profiler's overhead)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto (default): NCCL on CUDA, gloo on CPU; gloo on CUDA lets more ranks "
                        "than GPUs share them (a check on one GPU; NCCL needs a GPU per rank)")
    p.add_argument("--heartbeat-s", type=non_negative(float), default=10.0,
                   help="each rank beats through torchrun's store this often; a rank silent for "
                        f"{heartbeat.MISSED_BEATS} beats (stopped, hung) ends the run naming it "
                        "(0: off)")


def forward_options(args: argparse.Namespace) -> list[str]:
    """The command-line form of the options :func:`add_training_options` declares, as
    parsed into ``args`` — what ``ilp-planner run`` hands to this launcher."""
    probe = argparse.ArgumentParser(add_help=False)
    add_training_options(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            out += [action.option_strings[0]] if value else []
        elif value is not None:
            out += [action.option_strings[0], str(value)]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.launch",
                                description="Train solved plans under torchrun.")
    p.add_argument("plans", nargs="+", metavar="PLAN.json", help="solved plan files, trained in turn")
    add_training_options(p)
    p.add_argument("--crash-rank", type=int, default=None,
                   help="testing: this rank exits abruptly at --crash-step")
    p.add_argument("--crash-step", type=int, default=1,
                   help="the step at which --crash-rank raises (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("error: runtime.launch runs under torchrun (RANK/WORLD_SIZE unset); use "
              "`torchrun --nproc-per-node N -m runtime.launch PLAN` or `ilp-planner run`",
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    failures.redirect_stderr_to_log(rank)
    try:
        rc = _run(args, rank, world, local_rank)
    except PlannerError as exc:
        failures.report_exception(rank, exc)
        print(f"[rank {rank}] error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the traceback goes on to this rank's log; the account, to the run's line
        failures.report_exception(rank, exc)
        raise
    # Leave without interpreter finalisation: gloo worker threads torn down there abort the
    # process now and then ("terminate called without an active exception") after all work
    # is done; the process groups are destroyed and every output is flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _run(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> int:
    """Compile every plan (fails before any process group), start the backend, train each
    plan in turn, write the outputs; 1 when an audit or reference check failed."""
    backend, device = _backend_and_device(args.backend, local_rank)
    executors = _executors(args, rank, world, device)
    faulthandler.enable()  # a rank killed by a signal prints where it was
    _init_backend(backend, device, args.timeout)
    beat = heartbeat.start(rank, world, args.heartbeat_s)
    try:
        runs = [_train(ex, path, args, rank, world, backend)
                for path, ex in zip(args.plans, executors, strict=True)]
        _write_outputs(args, runs, rank, world)
        dist.barrier()
        if beat is not None:
            beat.stop()
    finally:
        executors.clear()
        gc.collect()
        dist.destroy_process_group()
    return 1 if any(r.failed for r in runs) else 0


def _executors(args: argparse.Namespace, rank: int, world: int,
               device: torch.device) -> list[Executor]:
    """Every plan read, validated and compiled, with its own optimizer and learning rate
    (PlanFormatError and RuntimeSetupError here, before any process group)."""
    plans = [Plan.load(p) for p in args.plans]
    opts = _per_plan(args.optimizer, len(plans), "--optimizer", str)
    lrs = _per_plan(args.lr, len(plans), "--lr", float)
    options = [RunOptions(args.steps, args.seed, OptimizerSpec(o, lr), args.timeout,
                          args.microbatches, _recording(args), not args.no_overlap)
               for o, lr in zip(opts, lrs, strict=True)]
    return [Executor(p, o, rank=rank, world=world, device=device)
            for p, o in zip(plans, options, strict=True)]


def _recording(args: argparse.Namespace) -> bool:
    return args.record or args.audit or bool(args.timings)


def _backend_and_device(choice: str, local_rank: int) -> tuple[str, torch.device]:
    """The backend and this rank's device: NCCL on ``cuda:LOCAL_RANK`` where CUDA is
    available, else gloo on the CPU. gloo on CUDA shares the node's GPUs round-robin (ranks
    beyond the GPU count: a multi-rank check on one GPU); NCCL refuses two ranks on one GPU,
    so that case is refused here, before any process group, with what to do instead."""
    if not torch.cuda.is_available():
        if choice == "nccl":
            raise RuntimeSetupError("--backend nccl needs CUDA, and torch sees no GPU here")
        return "gloo", torch.device("cpu")
    gpus = torch.cuda.device_count()
    backend = "nccl" if choice == "auto" else choice
    if backend == "nccl" and local_rank >= gpus:
        raise RuntimeSetupError(f"local rank {local_rank} has no GPU of its own ({gpus} on this node) "
                                f"and NCCL needs one per rank: start at most {gpus} processes per "
                                f"node, or pass --backend gloo to share the GPUs")
    return backend, torch.device("cuda", local_rank % gpus)


def _init_backend(backend: str, device: torch.device, timeout_s: float) -> None:
    """The default process group, with the collective timeout (a rank that dies mid-step
    ends the job with an error)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class _PlanRun:
    """One plan's outcome: its results entry, this rank's calibration rows, and whether a
    check failed."""

    entry: dict
    timing_rows: list[tuple] = field(default_factory=list)
    failed: bool = False


def _train(ex: Executor, path: str, args: argparse.Namespace, rank: int, world: int,
           backend: str) -> _PlanRun:
    """Set one plan up, train it for ``--steps`` steps, gather its parameters and results."""
    held = _start_peak(ex.device)
    ex.setup()
    c = ex.compiled
    if rank == 0:
        print(f"plan {ex.plan.name} ({path}): {world} {backend} processes, "
              f"{len(c.stages)} stage(s), {c.microbatches} micro-batch(es), "
              f"{ex.registry.num_groups} process groups", flush=True)
    run = _PlanRun({})
    record = _recording(args)
    losses, secs, comm, audited, order = [], [], [], [], None
    kernel_s = None
    for step in range(args.steps):
        _maybe_crash(args, rank, step)
        if args.profile_last_step and step == args.steps - 1 and ex.device.type == "cuda":
            r, kernel_s = kernel_seconds(functools.partial(ex.train_step, step))
        else:
            r = ex.train_step(step)
        if args.audit:
            audited.append(_audit(ex, r.events, rank, world, step))
        losses.append(r.loss)
        order = order or r.order
        secs.append(r.seconds)
        comm.append(_comm_summary(r.events) if record else None)
        run.timing_rows += _calibration_rows(r.events)
        if rank == 0 and not args.quiet:
            said = f"  comm {comm[-1]['total_s'] * 1e3:.1f} ms" if record else ""
            print(f"  step {step}: loss {r.loss:.6f}  time {r.seconds * 1e3:.1f} ms{said}",
                  flush=True)
    peak = _peak_since(ex.device, held)
    params = ex.gather_params()
    by_rank = [None] * world if rank == 0 else None
    dist.gather_object([s["total_s"] for s in comm] if record else None, by_rank, dst=0)
    run.failed = not all(audited)
    run.entry = {"plan": ex.plan.name, "file": str(path), "losses": losses, "step_s": secs,
                 "comm": comm, "comm_s_by_rank": by_rank, "world": world, "backend": backend,
                 "microbatches": c.microbatches, "stages": len(c.stages),
                 "audit_ok": all(audited) if args.audit else None,
                 "peak_memory_bytes": peak, "last_step_kernel_s": kernel_s,
                 "order": order,  # rank 0's first step: collectives and marks, if recorded
                 # rank 0's parameter blocks as held between steps: dtype, elements
                 "held": {k: [str(v.t.dtype).removeprefix("torch."), v.t.numel()]
                          for k, v in ex.params.items()}}
    if rank == 0:
        if args.save_params:
            out = Path(args.save_params)
            out.mkdir(parents=True, exist_ok=True)
            torch.save(params, out / f"{Path(path).stem}.pt")
        if args.check_reference:
            run.failed |= not _check_reference(ex, args, losses, params, run.entry)
    return run


def kernel_seconds(run: Callable[[], T]) -> tuple[T, float]:
    """``run()`` under the profiler (CUDA activity only): its result and the seconds this
    rank's GPU spent in kernels — a step much longer than its kernels waits on the host."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = run()
    return r, sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def _start_peak(device: torch.device) -> int | None:
    """On CUDA: what is allocated now (earlier plans' state), and the peak counter reset."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_since(device: torch.device, held: int | None) -> int | None:
    """This plan's own peak: the most allocated since :func:`_start_peak`, less what was
    allocated then (None on CPU)."""
    if held is None:
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - held


def _maybe_crash(args: argparse.Namespace, rank: int, step: int) -> None:
    """Testing hooks: ``--crash-rank`` exits abruptly at ``--crash-step``; at its first step
    the rank named by ``ILP_PLANNER_FAIL_RANK`` raises, as a rank out of memory would, and the
    one named by ``ILP_PLANNER_STOP_RANK`` stops itself, as a hung rank would
    (:mod:`runtime.failures`)."""
    if args.crash_rank == rank and step == args.crash_step:
        print(f"[rank {rank}] crashing on purpose at step {step}", file=sys.stderr, flush=True)
        os._exit(13)
    if os.environ.get(failures.FAIL_RANK_ENV) == str(rank) and step == 0:
        raise RuntimeError(f"injected failure ({failures.FAIL_RANK_ENV}={rank})")
    if os.environ.get(failures.STOP_RANK_ENV) == str(rank) and step == 0:
        os.kill(os.getpid(), signal.SIGSTOP)


def _calibration_rows(events) -> list[tuple]:
    """The step's single, exposed collectives in the calibration format."""
    return [(e.kind, e.group_size, e.bytes, e.link, e.seconds) for e in events
            if e.kind in CALIBRATION_KINDS
            and e.group_size >= (1 if e.kind == "broadcast" else 2)
            and e.seconds > 0 and not e.overlapped]


def _check_reference(ex: Executor, args: argparse.Namespace, losses: list[float],
                     params: dict[str, torch.Tensor], entry: dict) -> bool:
    """Rank 0: the single-process reference's losses and final parameters against this
    run's, within ``--rtol``; the comparison joins the results ``entry``."""
    c = ex.compiled
    ref = run_reference(c.full_graph, steps=args.steps, seed=args.seed,
                        optimizer=ex.options.optimizer, microbatches=c.microbatches)
    cmp = compare(losses, params, ref)
    entry["reference"] = {**cmp.to_dict(), "reference_losses": ref.losses}
    rtol = args.rtol if args.rtol is not None else tolerance(c.full_graph)
    by_drift = args.rtol is None and bool(cmp.drift)  # a tolerance given is taken as it is
    ok = cmp.ok(rtol, by_drift)
    skipped = (f" ({cmp.undetermined_elements} elements with rounding-noise "
               f"gradients under Adam left out)" if cmp.undetermined_elements else "")
    near = cmp.nearest(rtol, by_drift)
    drift = (f"; under Adam in a half dtype each parameter within {DRIFT_MULTIPLE:g}× the "
             f"reference's own drift from float32 (nearest its bound: {near}, rel err "
             f"{cmp.param_rel_errs[near]:.2e} against {cmp.allowed(near, rtol):.2e})"
             if by_drift else "")
    print(f"  reference: loss rel err {cmp.loss_rel_err:.2e}, worst param "
          f"{cmp.worst_param} rel err {cmp.param_rel_err:.2e}{skipped} -> "
          f"{'OK' if ok else 'MISMATCH'} at rtol {rtol:g}{drift}", flush=True)
    return ok


def _write_outputs(args: argparse.Namespace, runs: list[_PlanRun], rank: int,
                   world: int) -> None:
    """Rank 0 writes every rank's calibration rows (``--timings``) and the per-plan results
    (``--results``)."""
    gathered = [None] * world if rank == 0 else None
    dist.gather_object([row for r in runs for row in r.timing_rows], gathered, dst=0)
    if rank != 0:
        return
    if args.timings:
        with open(args.timings, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(("collective", "group_size", "bytes", "link", "seconds"))
            for rows in gathered:
                for row in rows:
                    w.writerow(row)
    if args.results:
        Path(args.results).write_text(json.dumps([r.entry for r in runs], indent=1))


def _audit(ex: Executor, events, rank: int, world: int, step: int) -> bool:
    """Compare this rank's executed collectives with the plan's; rank 0 prints every
    rank's table. True when every rank matches."""
    rows = audit.compare(audit.predicted(ex.plan, rank, ex.compiled.microbatches), audit.executed(events))
    ok = all(r.ok for r in rows)
    tables = [None] * world if rank == 0 else None
    dist.gather_object((ok, audit.format_rows(rank, rows)), tables, dst=0)
    flags = [ok]
    if rank == 0:
        flags = [t[0] for t in tables]
        print(f"  audit step {step}: planned vs executed collectives per rank "
              f"({'OK' if all(flags) else 'MISMATCH'})", flush=True)
        for good, text in tables:
            if not good or step == 0:
                print(text, flush=True)
    verdict = [all(flags)]
    dist.broadcast_object_list(verdict, src=0)
    return bool(verdict[0])


def _per_plan(text: str, n: int, flag: str, cast) -> list:
    parts = [x.strip() for x in str(text).split(",")]
    if len(parts) not in (1, n):
        raise ConfigError(f"{flag} lists {len(parts)} values for {n} plans; give one or {n}")
    try:
        vals = [cast(x) for x in parts]
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from exc
    return vals * n if len(vals) == 1 else vals


def _comm_summary(events) -> dict:
    """Seconds per purpose and count of the plan's collectives (the loss report aside)."""
    events = [e for e in events if e.phase != "report"]
    by: dict[str, float] = {}
    for e in events:
        by[e.purpose] = by.get(e.purpose, 0.0) + e.seconds
    return {"total_s": sum(by.values()), "by_purpose": by, "count": len(events)}


if __name__ == "__main__":
    sys.exit(main())
