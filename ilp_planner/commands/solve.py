"""``ilp-planner solve CONFIG [-o plan.json]``: solve a configuration, print the solver
report and the cost beside every baseline, and write the plan file."""

from __future__ import annotations

import argparse
import time

from ilp_planner.api import solve
from ilp_planner.inputs.config import Config, apply_overrides, load_config, parse_config
from ilp_planner.inputs.files import prepare_output
from ilp_planner.inputs.given_config import ModelFacts, parse_given, resolve_given
from ilp_planner.intra_op.request import PhaseTimes
from ilp_planner.reports.explain import summary


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "solve",
        help="solve a configuration and write a plan",
        description="Choose per-layer SBP strategies with the ILP (and stages, when the "
                    "config asks for a pipeline), compare with data-parallel, Megatron and "
                    "SUMMA baselines under the same cost model, and write the plan JSON.",
    )
    p.add_argument("config", metavar="CONFIG", help="YAML configuration file")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan JSON here")
    p.add_argument("--time-limit", type=float, metavar="S",
                   help="override solver.time_limit_s (the limit of each exact solve; a "
                        "search over recomputed blocks or transient caps runs several)")
    p.add_argument("--no-baselines", action="store_true", help="skip pricing the baselines")
    p.add_argument("--compare", action="append", default=[], metavar="CONFIGURATION",
                   help="price a configuration you run beside the plan, e.g. 'megatron: tp=8 "
                        "pp=8 dp=16 vpp=2 mbs=1 recompute=full sp=true' or 'torchtitan: "
                        "fsdp=32 tp=8 ac=selective' (repeatable; adds to the config's compare:)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    started = getattr(args, "started", t0)  # set by ilp_planner.cli.main
    if args.output:
        prepare_output(args.output)  # a folder given for the plan is refused before solving
    config = load_config(args.config)
    overrides: dict = {}
    if args.time_limit is not None:
        overrides["solver.time_limit_s"] = args.time_limit
    if args.compare:
        overrides["compare"] = compare_list(config, args.compare)
    if overrides:
        config = parse_config(apply_overrides(config.raw, overrides), args.config)
    reading_s = time.perf_counter() - t0
    times = PhaseTimes()
    plan = solve(config, baselines=not args.no_baselines, times=times)
    print(summary(plan))
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    now = time.perf_counter()
    print(time_line(now - started, t0 - started, reading_s, times))
    return 0


def compare_list(config: Config, given: list[str]) -> list[str]:
    """The config's ``compare:`` list with the ``--compare`` configurations added, each
    checked first so that a bad one is refused naming the option, not a key of the file."""
    facts = ModelFacts.of(config.graph, config.cluster.nodes, config.cluster.devices_per_node,
                          config.model.get("batch"))
    for text in given:
        resolve_given(parse_given(text, "--compare"), facts, "--compare")
    raw = config.raw.get("compare") or []
    return [*([raw] if isinstance(raw, str) else raw), *given]


def time_line(wall_s: float, loading_s: float, reading_s: float, times: PhaseTimes) -> str:
    """The command's wall time and where it went, the parts adding up to the whole (the
    solver report's build and solve are only the chosen solve's)."""
    rest = max(0.0, wall_s - loading_s - reading_s - times.solve_s - times.baselines_s)
    return (f"took {wall_s:.2f} s: loading the planner {loading_s:.2f} s, config and graph "
            f"{reading_s:.2f} s, solving {times.solve_s:.2f} s, baselines "
            f"{times.baselines_s:.2f} s, plan and report {rest:.2f} s")
