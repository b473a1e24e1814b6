"""``ilp-planner validate CONFIG [CONFIG...]``: load each configuration and print what it
describes (model size, cluster, links, memory lower bound vs budget) without solving.

Every file is checked even when an earlier one fails; the exit status is 2 if any failed —
a configuration that parses but whose memory lower bound exceeds its budget fails too: no
plan of it fits, and a script running ``validate`` before ``solve`` must hear so.
"""

from __future__ import annotations

import argparse
import sys

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import parse_config, read_yaml
from ilp_planner.inter_op.layer_units import check_stage_count
from ilp_planner.reports.summary import fits_memory, model_summary


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check configuration files and summarise model, cluster and memory",
        description="Load each YAML configuration, report the first error with its file and "
                    "key path, or print a summary: model size and FLOPs, cluster links, and "
                    "the per-device memory lower bound against the budget.",
    )
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="YAML configuration file(s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failed = 0
    for i, path in enumerate(args.configs):
        if i:
            print()
        try:
            data = read_yaml(path)
            if isinstance(data, dict) and "base" in data and "model" not in data:
                raise ConfigError("this is a sweep file (it has a 'base' and no 'model'); run "
                                  "`ilp-planner sweep` on it, or validate its base config",
                                  source=str(path))
            config = parse_config(data, str(path))
            check_stage_count(config)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(model_summary(config))
        if not fits_memory(config):
            print(f"error: {path}: the memory lower bound exceeds the budget of "
                  f"cluster.memory_gib; no plan fits (see 'memory' above)", file=sys.stderr)
            failed += 1
    if failed:
        print(f"{failed} of {len(args.configs)} configuration(s) failed", file=sys.stderr)
    return 2 if failed else 0
