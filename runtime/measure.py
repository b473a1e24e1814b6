"""``torchrun --nproc-per-node N -m runtime.measure --output timings.csv``: time the
collectives the cost model prices, on the backend actually used (gloo on CPU, NCCL on GPU),
and write them in the calibration format ``collective,group_size,bytes,link,seconds`` that
``ilp-planner calibrate`` fits (AutoDDL §3.2).

Grid: every collective (AllReduce, AllGather, ReduceScatter, AlltoAll, Broadcast) × every
power-of-two group size p ≥ 2 dividing the world × two group shapes — contiguous blocks
``[k·p, (k+1)·p)`` and strided sets ``{j, j + N/p, …}`` (so both link levels appear once the
world spans several "nodes" of ``--devices-per-node`` ranks) × message sizes. All groups of
one shape run at once, as a mesh axis does. Each configuration is warmed up, then timed
``--repeats`` times behind a barrier; a rank keeps its median and the row reports the slowest
rank's median (a collective ends when its last member does). ``bytes`` follows the cost
model: n = output size per device (input size for ReduceScatter); a broadcast's
``group_size`` is its number of receivers.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.measure")
    p.add_argument("--output", required=True, metavar="CSV")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="ranks per node for the intra/inter label (default: all ranks on one node)")
    p.add_argument("--sizes", default="4096,65536,1048576,4194304",
                   help="message sizes n in bytes, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--timeout", type=float, default=120.0)
    return p


def _groups(world: int, p: int, strided: bool) -> list[list[int]]:
    if strided:
        k = world // p
        return [[j + i * k for i in range(p)] for j in range(k)]
    return [list(range(b * p, (b + 1) * p)) for b in range(world // p)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: runtime.measure runs under torchrun", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    dpn = args.devices_per_node or world
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    rows = []
    p = 2
    shapes = []
    while p <= world:
        if world % p == 0:
            shapes += [(p, False)] + ([(p, True)] if p < world else [])
        p *= 2
    for p, strided in shapes:
        groups = _groups(world, p, strided)
        handles = [dist.new_group(g, timeout=datetime.timedelta(seconds=args.timeout)) for g in groups]
        mine = next(i for i, g in enumerate(groups) if rank in g)
        ranks, group = groups[mine], handles[mine]
        spans = len({r // dpn for r in ranks}) > 1
        for kind in kinds:
            for n in sizes:
                secs = _time(kind, n, ranks, group, args.repeats, device, torch, dist)
                worst = torch.tensor([secs], dtype=torch.float64, device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                size = p - 1 if kind == "broadcast" else p
                rows.append((kind, size, n, "inter" if spans else "intra", float(worst.item())))
    if rank == 0:
        with open(args.output, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(("collective", "group_size", "bytes", "link", "seconds"))
            w.writerows(rows)
        print(f"wrote {len(rows)} timings to {args.output}")
    dist.destroy_process_group()
    return 0


def _time(kind: str, n: int, ranks: list[int], group, repeats: int, device, torch, dist) -> float:
    p = len(ranks)
    elems = max(p, n // 4 // p * p)  # float32 elements, divisible by p
    if kind == "all_reduce":
        x = torch.ones(elems, device=device)

        def op():
            dist.all_reduce(x, group=group)
    elif kind == "all_gather":
        out = torch.empty(elems, device=device)
        inp = torch.ones(elems // p, device=device)

        def op():
            dist.all_gather_single(out, inp, group=group)
    elif kind == "reduce_scatter":
        inp = torch.ones(elems, device=device)
        out = torch.empty(elems // p, device=device)

        def op():
            dist.reduce_scatter_single(out, inp, group=group)
    elif kind == "all_to_all":
        inp = torch.ones(elems, device=device)
        out = torch.empty(elems, device=device)

        def op():
            dist.all_to_all_single(out, inp, group=group)
    elif kind == "broadcast":
        x = torch.ones(elems, device=device)

        def op():
            dist.broadcast(x, src=ranks[0], group=group)
    else:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    times = []
    for i in range(repeats + 2):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
