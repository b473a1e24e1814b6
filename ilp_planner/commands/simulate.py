"""``ilp-planner simulate PLAN [--schedule NAME] [--microbatches M] [--no-overlap]
[--plot out.png]``: replay a pipelined plan's stages under a schedule with the cost
model's durations, print makespan, bubble fraction and peak in-flight activations per stage,
and optionally draw the Gantt chart."""

from __future__ import annotations

import argparse

from formulations.schedules import INTERLEAVED, SCHEDULE_NAMES, make_schedule
from formulations.simulator import can_plot, plot_formats, plot_timeline, simulate
from ilp_planner.errors import ConfigError, PlanFormatError
from ilp_planner.inputs.files import prepare_output
from ilp_planner.inputs.limits import check_limit
from ilp_planner.inputs.options import SCHEDULES
from ilp_planner.inter_op.assembly import stage_durations
from ilp_planner.plan.check import load_checked


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a pipelined plan's schedule and draw its timeline",
        description="Simulate the stages of a pipelined plan under GPipe, 1F1B or eager-1F1B "
                    "(default: the plan's schedule; an interleaved plan under interleaved "
                    "1F1B) with compute and cross-mesh transfer times from the cost model.",
    )
    p.add_argument("plan", metavar="PLAN", help="plan JSON written by `ilp-planner solve`")
    p.add_argument("--schedule", choices=SCHEDULES, help="schedule to simulate")
    p.add_argument("--microbatches", type=int, metavar="M", help="override the micro-batches")
    p.add_argument("--no-overlap", action="store_true",
                   help="transfers occupy the stage (no separate communication stream)")
    p.add_argument("--plot", metavar="PNG", help="write a Gantt chart of the timeline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.plot and not can_plot(args.plot):  # before the work, not at its end
        raise ConfigError(f"--plot {args.plot}: expected a file ending in one of "
                          f"{', '.join('.' + k for k in plot_formats())}")
    plan = load_checked(args.plan)
    if not plan.stages or plan.schedule is None:
        raise PlanFormatError(f"{args.plan}: plan {plan.name!r} has no pipeline stages; solve a "
                              f"config with pipeline.stages > 1 or auto")
    name = args.schedule or plan.schedule.name
    m = plan.schedule.num_microbatches if args.microbatches is None else args.microbatches
    if m < 1:
        raise ConfigError(f"--microbatches: expected a positive integer, got {m}")
    check_limit("microbatches", m, "the number of micro-batches", key="--microbatches")
    times = [s.times for s in plan.stages if s.times is not None]
    if len(times) < len(plan.stages) or any(e.transfer is None for e in plan.resharding):
        raise PlanFormatError(f"{args.plan}: plan {plan.name!r} has no priced stage or transfer "
                              f"times; simulate needs a plan the planner solved")
    durations = stage_durations(times, plan.resharding)
    overlap = not args.no_overlap
    v = plan.schedule.virtual_stages
    p = len(plan.stages) // v
    if (name == INTERLEAVED) != (v > 1):
        raise ConfigError(f"--schedule {name}: plan {plan.name!r} has "
                          f"{f'{v} chunks per stage mesh' if v > 1 else 'one chunk per stage'}; "
                          f"{INTERLEAVED} simulates only (and only it) a plan solved with "
                          f"interleaving")
    print(f"{plan.name}: {p} stages{f' × {v} chunks' if v > 1 else ''}, {m} micro-batches, "
          f"overlap {overlap}")
    print(f"  {'schedule':<16}{'makespan s':>12}{'bubble':>9}  peak in-flight per stage")
    result = None
    # an interleaved plan's chunks share meshes: only its own schedule runs them
    for sched_name in [INTERLEAVED] if v > 1 else SCHEDULE_NAMES:
        res = simulate(make_schedule(sched_name, p, m, virtual_stages=v), durations,
                       overlap=overlap)
        mark = " *" if sched_name == name else ""
        print(f"  {sched_name:<16}{res.makespan_s:>12.5g}{res.bubble_fraction:>9.1%}  "
              f"{list(res.peak_inflight)}{mark}")
        if sched_name == name:
            result = res
    if args.plot and result is not None:
        prepare_output(args.plot)
        plot_timeline(result, args.plot, title=f"{plan.name}: {name}, {m} micro-batches")
        print(f"wrote {args.plot}")
    return 0

