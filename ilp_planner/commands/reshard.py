"""``ilp-planner reshard``: plan one cross-mesh resharding (Zhuang et al. §3) and print the unit
tasks, the chosen sender and start of each, the makespan, the lower bound and every
scheduling algorithm's makespan (or the plan as JSON with ``--json``).

Example (Zhuang et al. Table 2, case 3)::

    ilp-planner reshard --shape 1024,1024,512 --src-mesh 2x4 --src-spec 'RS^0R' \\
        --dst-mesh 2x4 --dst-spec 'S^0RR'

Meshes are NODESxDEVICES. The source starts at host ``--src-node0`` (0), the destination
right after the source's hosts unless ``--dst-node0`` says otherwise. Link parameters come
from ``--cluster FILE`` (any YAML with a ``cluster:`` section holding ``links: {intra,
inter}`` or catalogue ``intra:`` / ``inter:`` names — a planner config or a ``calibrate``
fragment — and optionally ``devices_per_node``) and/or the link flags, which win; without
either, Zhuang et al.'s cluster: 4 GPUs per host, NVLink 1200 Gb/s and 5 µs inside a host,
10 Gb/s and 10 µs between hosts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from formulations.cross_mesh import ALGORITHMS, SchedulerOptions
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import parse_links
from ilp_planner.inputs.config_keys import MAX_SECONDS, MAX_SEED, MAX_THREADS, PHYSICAL_MAX
from ilp_planner.inputs.files import prepare_output
from ilp_planner.inputs.limits import limit
from ilp_planner.inter_op.resharding import STRATEGIES, HostLinks, ReshardOptions, parse_mesh, plan_resharding
from ilp_planner.ir.cluster import Link
from ilp_planner.ir.graph import DTYPE_BYTES, TensorSpec

_DEFAULTS = {"devices_per_node": 4, "intra": Link.from_bandwidth(5, 1200),
             "inter": Link.from_bandwidth(10, 10)}
_DEFAULT_ALGOS = "naive,load_balance,dfs,randomized_greedy,cpsat"
MAX_CHUNKS = 2**16  # pipelining a broadcast finer than 64 Ki chunks only adds latency
MIN_GBPS = 1e-9  # one bit a second


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "reshard",
        help="plan a cross-mesh resharding: unit tasks, senders, order (CP-SAT + heuristics)",
        description="Split a tensor's move from one mesh/spec to another into unit tasks, "
                    "price them as broadcasts and schedule them (sender host and order) with "
                    "CP-SAT and Zhuang et al.'s heuristics; print every algorithm's makespan "
                    "beside the lower bound.",
    )
    p.add_argument("--shape", required=True, help="tensor shape, e.g. 1024,1024,512")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                   help="element type, for the bytes each unit task moves (float32)")
    p.add_argument("--src-mesh", required=True, metavar="NxD", help="source mesh, e.g. 2x4")
    p.add_argument("--src-spec", required=True, help="source spec, e.g. S0RR or 'S^{01}RR'")
    p.add_argument("--dst-mesh", required=True, metavar="NxD", help="destination mesh")
    p.add_argument("--dst-spec", required=True, help="destination spec")
    p.add_argument("--src-node0", type=int, default=0, help="first host of the source (0)")
    p.add_argument("--dst-node0", type=int, default=None,
                   help="first host of the destination (default: after the source)")
    p.add_argument("--src-local0", type=int, default=0, help="first local device of the source")
    p.add_argument("--dst-local0", type=int, default=0, help="first local device of the dest.")
    p.add_argument("--cluster", metavar="FILE", help="YAML with cluster.links (and "
                   "optionally cluster.devices_per_node)")
    p.add_argument("--devices-per-node", type=int, default=None, help="GPUs per host (4)")
    p.add_argument("--intra-gbps", type=float, default=None, help="NVLink Gbit/s (1200)")
    p.add_argument("--intra-latency-us", type=float, default=None, help="NVLink µs (5)")
    p.add_argument("--inter-gbps", type=float, default=None, help="between hosts Gbit/s (10)")
    p.add_argument("--inter-latency-us", type=float, default=None, help="between hosts µs (10)")
    p.add_argument("--strategy", default="broadcast", choices=STRATEGIES,
                   help="how a unit task's data reaches its receivers (broadcast)")
    p.add_argument("--chunks", type=int, default=None,
                   help="broadcast pipelining K (default: optimal per task, at most 256)")
    p.add_argument("--algo", default=_DEFAULT_ALGOS,
                   help=f"comma-separated subset of {','.join(a for a in ALGORITHMS)} "
                        f"(default {_DEFAULT_ALGOS})")
    p.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds (5)")
    p.add_argument("--workers", type=int, default=2, help="CP-SAT workers (2)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of CP-SAT and the randomized greedy scheduler (0)")
    p.add_argument("--dfs-budget", type=float, default=1.0, help="DFS seconds (1)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip pricing the other transfer strategies")
    p.add_argument("--dump-model", metavar="FILE",
                   help="write the CP-SAT model (text proto); needs cpsat in --algo")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _cluster_file(path: str) -> dict[str, Any]:
    """``devices_per_node``, ``intra``, ``inter`` found under ``cluster:`` in ``path`` (links
    as numbers, catalogue names or both, read as a config's are)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=path) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", source=path) from None
    cluster = (data or {}).get("cluster") if isinstance(data, dict) else None
    if not isinstance(cluster, dict):
        raise ConfigError("expected a cluster: section with links: {intra, inter} or named "
                          "intra: and inter: links", source=path, key="cluster")
    out: dict[str, Any] = dict(zip(("intra", "inter"), parse_links(cluster, path), strict=True))
    if "devices_per_node" in cluster:
        out["devices_per_node"] = int(cluster["devices_per_node"])
    return out


def _links(args: argparse.Namespace) -> tuple[HostLinks, int]:
    base = dict(_DEFAULTS)
    if args.cluster:
        base.update(_cluster_file(args.cluster))
    intra, inter = base["intra"], base["inter"]
    if args.intra_gbps is not None or args.intra_latency_us is not None:
        intra = Link.from_bandwidth(
            args.intra_latency_us if args.intra_latency_us is not None else intra.alpha * 1e6,
            args.intra_gbps if args.intra_gbps is not None else intra.bandwidth_gbps)
    if args.inter_gbps is not None or args.inter_latency_us is not None:
        inter = Link.from_bandwidth(
            args.inter_latency_us if args.inter_latency_us is not None else inter.alpha * 1e6,
            args.inter_gbps if args.inter_gbps is not None else inter.bandwidth_gbps)
    dpn = args.devices_per_node if args.devices_per_node is not None else base["devices_per_node"]
    return HostLinks(intra, inter), dpn


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--shape {text!r}: expected comma-separated integers") from None
    if not shape:
        raise ConfigError(f"--shape {text!r}: empty")
    return shape


def _prepare_model_dump(args: argparse.Namespace, algos: tuple[str, ...]) -> int | None:
    """``--dump-model``'s file ready before anything is solved (its folders created), and
    refused where no CP-SAT model will be built to fill it; returns the file's modification
    time now (None: absent), to tell afterwards whether the solve wrote it."""
    if args.dump_model is None:
        return None
    if "cpsat" not in algos:
        raise ConfigError(f"--dump-model writes the CP-SAT model, but --algo {args.algo!r} "
                          f"does not run cpsat")
    path = prepare_output(args.dump_model)
    return path.stat().st_mtime_ns if path.is_file() else None


def _report_model_dump(path: str | None, before: int | None, json_out: bool) -> None:
    """Say whether the model was written: a resharding without unit tasks builds none
    (and a file left from an earlier run is not this run's model)."""
    if path is None:
        return
    stream = sys.stderr if json_out else sys.stdout
    if Path(path).is_file() and Path(path).stat().st_mtime_ns != before:
        print(f"wrote {path}", file=stream)
    else:
        print(f"no CP-SAT model written to {path}: the resharding has no unit tasks to "
              f"schedule", file=stream)


def _check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag within the bounds the configuration keys use (a seed CP-SAT can
    hold, host offsets inside the device limit, a link no faster than a typo): a huge or
    non-finite value is one error naming the flag, not an overflow deep in the scheduler."""
    devices = limit("devices")
    bounds = [("--src-node0", args.src_node0, 0, devices), ("--dst-node0", args.dst_node0, 0, devices),
              ("--src-local0", args.src_local0, 0, devices),
              ("--dst-local0", args.dst_local0, 0, devices),
              ("--devices-per-node", args.devices_per_node, 1, devices),
              ("--chunks", args.chunks, 1, MAX_CHUNKS), ("--workers", args.workers, 1, MAX_THREADS),
              ("--seed", args.seed, 0, MAX_SEED), ("--time-limit", args.time_limit, 0, MAX_SECONDS),
              ("--dfs-budget", args.dfs_budget, 0, MAX_SECONDS),
              ("--intra-gbps", args.intra_gbps, MIN_GBPS, PHYSICAL_MAX),
              ("--inter-gbps", args.inter_gbps, MIN_GBPS, PHYSICAL_MAX),
              ("--intra-latency-us", args.intra_latency_us, 0, PHYSICAL_MAX),
              ("--inter-latency-us", args.inter_latency_us, 0, PHYSICAL_MAX)]
    for flag, value, low, high in bounds:
        if value is not None and not low <= value <= high:  # NaN fails both comparisons
            raise ConfigError(f"{flag}: expected a value from {_number(low)} to {_number(high)}, "
                              f"got {_number(value)}")


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def run(args: argparse.Namespace) -> int:
    _check_ranges(args)
    algos = tuple(a.strip() for a in args.algo.split(",") if a.strip())
    dump_before = _prepare_model_dump(args, algos)
    links, dpn = _links(args)
    tensor = TensorSpec(_shape(args.shape), args.dtype)
    src = parse_mesh(args.src_mesh, dpn, args.src_node0, args.src_local0)
    dst_node0 = args.dst_node0 if args.dst_node0 is not None else src.node0 + src.nodes
    dst = parse_mesh(args.dst_mesh, dpn, dst_node0, args.dst_local0)
    sched = SchedulerOptions(algorithms=algos, time_limit_s=args.time_limit,
                             num_workers=args.workers, seed=args.seed,
                             dfs_budget_s=args.dfs_budget, model_dump=args.dump_model)
    options = ReshardOptions(strategy=args.strategy, chunks=args.chunks, scheduler=sched,
                             compare_strategies=not args.no_compare)
    plan = plan_resharding(tensor, src, args.src_spec, dst, args.dst_spec, links, options)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.table())
    _report_model_dump(args.dump_model, dump_before, args.json)
    return 0
