"""The runtime's overhead, as step-time ratios in one run on the same model, data,
processes and backend:

* a pure data-parallel plan through :mod:`runtime` against
  ``torch.nn.parallel.DistributedDataParallel`` (SGD, DDP's own buckets and overlap;
  the runtime reduces its planned gradient chunks from autograd hooks, overlapped too);
* a tensor-parallel plan (Megatron's MLP: ``fc1`` column-parallel, ``fc2`` row-parallel,
  the logits AllReduced to every rank, :func:`colwise_rowwise_filter`) against the same
  layouts written by hand with
  ``torch.distributed.tensor.parallel.parallelize_module`` (``ColwiseParallel`` /
  ``RowwiseParallel``).

Every side has the same step boundary: no barrier between steps (rank 0's step time is
the steady-state period) and the step's loss known to every rank at its end. Per
model the table shows the median step time (first two steps dropped) of each, their ratio
and the last losses (which must agree). Usage::

    python benchmarks/runtime_overhead.py [--nproc 8] [--steps 20] [--repeat 3] [--profile]
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

from ilp_planner.commands.run import torchrun_command
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.intra_op.baselines import Filter, data_parallel_filter
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import Op, OpKind
from ilp_planner.lowering.strategies import Strategy
from ilp_planner.testing import restricted_plan

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # label -> (config, overrides, parallelism, hand-written side)
    "tiny-gpt": ("tiny-gpt-cpu.yaml", {}, "dp", "ddp"),
    "tiny-mlp": ("tiny-mlp-cpu.yaml", {}, "dp", "ddp"),
    "mlp-1024": ("tiny-mlp-cpu.yaml", {"model.dims": [256, 1024, 1024, 256], "model.batch": 256},
                 "dp", "ddp"),
    "mlp-tp": ("tiny-mlp-cpu.yaml", {"model.dims": [256, 2048, 256], "model.batch": 64},
               "tp", "tp"),
}
LR = 0.05
THEIRS = {"ddp": "DistributedDataParallel", "tp": "parallelize_module"}
WARMUP = 2
PROFILE_ROWS = 10


def colwise_rowwise_filter(n: int) -> Filter:
    """What ``parallelize_module`` builds from ``{"fc1": ColwiseParallel(), "fc2":
    RowwiseParallel()}`` on ``n`` ranks: fc1's weight split by output columns on all ranks
    (3-D strategy (1, n, 1)), fc2's by input rows ((1, 1, n), partial-sum output), the loss
    reading replicated logits (fc2's partial sums AllReduced)."""
    one, tp = MeshAxis(1, 1), MeshAxis(1, n)
    facts = {"fc1": (one, tp, one), "fc2": (one, one, tp)}

    def keep(op: Op, s: Strategy) -> bool:
        if op.name in facts:
            return s.label.startswith("3d") and s.fact == facts[op.name]
        if op.kind is OpKind.LOSS:
            return not s.inputs[0].split_axes(0) and not s.inputs[0].split_axes(1)
        return True
    return keep


def ddp_worker(plan_path: str, steps: int, out: str) -> None:
    """One DDP rank (run under torchrun): the plan's model, this rank's rows of the batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ilp_planner.plan.data import Plan
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


def tp_worker(plan_path: str, steps: int, out: str) -> None:
    """One rank of the hand-written tensor-parallel MLP: ``fc1`` column-parallel, ``fc2``
    row-parallel, via ``parallelize_module``; the full batch on every rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from ilp_planner.plan.data import Plan
    from runtime import model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    graph = parse_config(Plan.load(plan_path).config).graph
    params = model.init_params(graph, 0)
    (k, n), m = params["fc1.weight"].shape, params["fc2.weight"].shape[1]

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(k, n), torch.nn.Linear(n, m)
            with torch.no_grad():
                for name in ("fc1", "fc2"):
                    getattr(self, name).weight.copy_(params[f"{name}.weight"].t())
                    getattr(self, name).bias.copy_(params[f"{name}.bias"])

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    mesh = init_device_mesh("cpu", (world,))
    net = parallelize_module(Mlp(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    batch = model.make_batch(graph, 0)
    x, targets = batch["input"], batch[model.targets_key("loss")]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), targets)  # replicated logits: every rank has the loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": times, "loss": float(loss)}))
    dist.barrier()
    del net, opt
    dist.destroy_process_group()


def profile_worker(plan_path: str, steps: int, out: str) -> None:
    """The runtime side again with rank 0's steady steps under ``cProfile``: where its
    step time goes."""
    import cProfile
    import io
    import pstats

    from runtime import launch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args = launch.build_parser().parse_args(
        [plan_path, "--steps", str(steps), "--optimizer", "sgd", "--lr", str(LR), "--quiet"])
    from runtime.executor import Executor

    prof = cProfile.Profile()
    step = Executor.train_step

    def profiled(self, i: int):  # the steady steps only, as timed in the table
        if rank == 0 and i >= WARMUP:
            prof.enable()
        try:
            return step(self, i)
        finally:
            prof.disable()

    Executor.train_step = profiled
    launch._run(args, rank, world, int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(PROFILE_ROWS)
        Path(out).write_text(text.getvalue())


def _call(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])}… failed ({res.returncode}):\n{res.stderr[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3, help="launches per side, alternating")
    ap.add_argument("--only", choices=list(MODELS), action="append", help="these models only")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the runtime's rank 0 and print its top functions by own time")
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "PLAN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, plan_path, out = args.worker
        {"ddp": ddp_worker, "tp": tp_worker, "profile": profile_worker}[kind](
            plan_path, args.steps, out)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter finalisation (see runtime.launch)
    n = args.nproc
    rows = []
    profiles: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for label, (cfg, overrides, parallel, theirs) in MODELS.items():
            if args.only and label not in args.only:
                continue
            config = load_config(ROOT / "configs" / cfg).with_overrides(
                {**overrides, "cluster.nodes": 1, "cluster.devices_per_node": n})
            keep = data_parallel_filter(MeshAxis(1, n)) if parallel == "dp" else \
                colwise_rowwise_filter(n)
            plan = restricted_plan(config, keep, name=f"{label}-{parallel}")
            path = tmp / f"{label}.json"
            plan.save(path)
            t_ours, t_other = [], []
            for _ in range(args.repeat):  # alternate the sides: both see the same load
                res = tmp / f"{label}-runtime.json"
                _call(torchrun_command(n, "runtime.launch",
                                       [str(path), "--steps", str(args.steps), "--optimizer", "sgd",
                                        "--lr", str(LR), "--results", str(res), "--quiet"]))
                ours = json.loads(res.read_text())[0]
                their_out = tmp / f"{label}-{theirs}.json"
                _call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", str(n), os.path.abspath(__file__), "--steps",
                       str(args.steps), "--worker", theirs, str(path), str(their_out)])
                other = json.loads(their_out.read_text())
                t_ours.append(statistics.median(ours["step_s"][WARMUP:]))
                t_other.append(statistics.median(other["step_s"][WARMUP:]))
            if args.profile:
                prof_out = tmp / f"{label}-profile.txt"
                _call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", str(n), os.path.abspath(__file__), "--steps",
                       str(args.steps), "--worker", "profile", str(path), str(prof_out)])
                profiles[label] = prof_out.read_text()
            params = sum(p.numel for p in [op.weight for op in config.graph.ops if op.weight])
            layouts = sorted({ly.strategy for ly in plan.layers if ly.weight is not None})
            rows.append((label, params, ", ".join(layouts), min(t_ours), THEIRS[theirs],
                         min(t_other), ours["losses"][-1], other["loss"]))
    print(f"{n} gloo processes, {args.steps} SGD steps: per launch the median of the last "
          f"{args.steps - WARMUP}, best of {args.repeat} alternating launches per side")
    head = (f"{'model':<10}{'weights':>10}  {'runtime ms':>11}{'hand-written':>24}{'ms':>8}"
            f"{'ratio':>8}{'loss runtime':>14}{'hand':>10}")
    print(head)
    print("-" * len(head))
    for label, params, _, t_ours, other, t_other, l_ours, l_other in rows:
        print(f"{label:<10}{params:>10,}  {t_ours * 1e3:>11.1f}{other:>24}{t_other * 1e3:>8.1f}"
              f"{t_ours / t_other:>8.2f}{l_ours:>14.5f}{l_other:>10.5f}")
    print("\nplans: " + "; ".join(f"{r[0]}: {r[2]}" for r in rows))
    for label, text in profiles.items():
        print(f"\n--- {label}: runtime rank 0, steps {WARMUP}..{args.steps - 1}, by own time ---")
        print(text[text.find("ncalls"):].rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
