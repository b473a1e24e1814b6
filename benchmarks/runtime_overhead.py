"""The runtime's overhead: a pure data-parallel plan through :mod:`runtime` against
``torch.nn.parallel.DistributedDataParallel`` on the same model, data, processes and
backend, as a step-time ratio.

Both sides run the same graph code (:func:`runtime.reference.forward`), the same
initialisation and data, SGD, and the same step boundary (a barrier before the step, the
loss reduced to every rank at its end). DDP gets the batch rows of its rank and averages
gradients in buckets overlapped with the backward; the runtime executes the plan — its lowered
programs on local blocks, one AllReduce per op's gradient bucket after the backward, its step
bookkeeping. Per
model the table shows the median step time (first two steps dropped) of each and their
ratio. Usage::

    python benchmarks/runtime_overhead.py [--nproc 8] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ilp_planner.baselines import data_parallel_filter
from ilp_planner.cluster import MeshAxis
from ilp_planner.commands.run import torchrun_command
from ilp_planner.config import load_config, parse_config
from runtime.plans import restricted_plan

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny-gpt": ("tiny-gpt-cpu.yaml", {}),
    "tiny-mlp": ("tiny-mlp-cpu.yaml", {}),
    "mlp-1024": ("tiny-mlp-cpu.yaml", {"model.dims": [256, 1024, 1024, 256], "model.batch": 256}),
}
LR = 0.05
WARMUP = 2


def ddp_worker(plan_path: str, steps: int, out: str) -> None:
    """One DDP rank (run under torchrun): the plan's model, this rank's rows of the batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ilp_planner.plan import Plan
    from runtime import model
    from runtime.reference import forward

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = parse_config(Plan.load(plan_path).config)
    graph = config.graph
    local_graph = config.with_overrides({"model.batch": config.model["batch"] // world}).graph

    class GraphModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.names = {k: k.replace(".", "__") for k in model.init_params(graph, 0)}
            self.p = torch.nn.ParameterDict({v: torch.nn.Parameter(model.init_params(graph, 0)[k])
                                             for k, v in self.names.items()})

        def forward(self, data):
            return forward(local_graph, {k: self.p[v] for k, v in self.names.items()}, data)

    ddp = DistributedDataParallel(GraphModule())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    data = {k: v.chunk(world)[rank] for k, v in model.make_batch(graph, 0).items()}
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ddp(data)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": times, "loss": float(value) / world}))
    dist.barrier()
    del ddp, opt
    dist.destroy_process_group()


def _call(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])}… failed ({res.returncode}):\n{res.stderr[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ddp-worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ddp_worker:
        ddp_worker(args.ddp_worker[0], args.steps, args.ddp_worker[1])
        sys.stdout.flush()
        os._exit(0)  # skip interpreter finalisation (see runtime.launch)
    n = args.nproc
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for label, (cfg, overrides) in MODELS.items():
            config = load_config(ROOT / "configs" / cfg).with_overrides(
                {**overrides, "cluster.nodes": 1, "cluster.devices_per_node": n})
            plan = restricted_plan(config, data_parallel_filter(MeshAxis(1, n)), name=f"{label}-dp")
            path = tmp / f"{label}.json"
            plan.save(path)
            res = tmp / f"{label}-runtime.json"
            _call(torchrun_command(n, "runtime.launch",
                                   [str(path), "--steps", str(args.steps), "--optimizer", "sgd",
                                    "--lr", str(LR), "--results", str(res), "--quiet"]))
            ours = json.loads(res.read_text())[0]
            ddp_out = tmp / f"{label}-ddp.json"
            _call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(n), os.path.abspath(__file__), "--steps",
                   str(args.steps), "--ddp-worker", str(path), str(ddp_out)])
            ddp = json.loads(ddp_out.read_text())
            t_ours = statistics.median(ours["step_s"][WARMUP:])
            t_ddp = statistics.median(ddp["step_s"][WARMUP:])
            comm = statistics.median(c["total_s"] for c in ours["comm"][WARMUP:])
            params = sum(p.numel for p in [op.weight for op in config.graph.ops if op.weight])
            rows.append((label, params, t_ours, comm, t_ddp, ours["losses"][-1], ddp["loss"]))
    print(f"pure data parallel on {n} gloo processes, {args.steps} SGD steps (median of the last "
          f"{args.steps - WARMUP})")
    head = (f"{'model':<10}{'weights':>10}{'runtime ms':>12}{'(comm ms)':>11}{'DDP ms':>10}"
            f"{'runtime/DDP':>13}{'last loss runtime':>19}{'DDP':>10}")
    print(head)
    print("-" * len(head))
    for label, params, t_ours, comm, t_ddp, l_ours, l_ddp in rows:
        print(f"{label:<10}{params:>10,}{t_ours * 1e3:>12.1f}{comm * 1e3:>11.1f}{t_ddp * 1e3:>10.1f}"
              f"{t_ours / t_ddp:>13.2f}{l_ours:>19.5f}{l_ddp:>10.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
