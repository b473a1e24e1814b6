"""The exact intra-op solve on branching graphs (skip connections, parallel branches) at
realistic sizes: VGG13 and the shipped VGG13 config, ResNet-18-, ResNet-50- and
ViT-B/16-shaped models imported from ``nn.Module`` on the meta device, and the shipped
U-Transformer (long skips; a two-stage pipeline). Batch 256 on 8 × 8 H100-80GB-like devices unless the
shipped config says otherwise.

    python benchmarks/branching_solve.py [--before DIR] [--time-limit S]

Per model: ops, problem groups (followers merged, layers tied where the config ties them),
the induced width of the elimination order on the problem the elimination sees (after
dominance), the solver's seconds (build excluded), its status, proven gap and objective.
``--before DIR``: the same rows also solved by the code in DIR (an older checkout, e.g.
``git archive <commit> | tar -x -C DIR``), each row in a subprocess importing DIR first,
printed side by side. ``--time-limit`` caps every ILP (``solver.time_limit_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
H100_8X8 = {"name": "h100-80g-8x8", "nodes": 8, "devices_per_node": 8, "memory_gib": 80,
            "peak_tflops": 989, "efficiency": 0.5,
            "links": {"intra": {"latency_us": 3, "bandwidth_gbps": 3600},
                      "inter": {"latency_us": 10, "bandwidth_gbps": 400}}}
BATCH = 256


class Basic(nn.Module):
    """ResNet's basic block: two 3 × 3 conv/bn, the identity (or a 1 × 1 projection) added
    out of place (the importer drops an in-place ``+=``)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = self._body(cin, width, stride)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    @staticmethod
    def _body(cin: int, width: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, width, 3, stride, 1, bias=False),
                             nn.BatchNorm2d(width), nn.ReLU(),
                             nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return torch.relu(self.body(x) + identity)


class Bottleneck(Basic):
    """ResNet-50's block: 1 × 1 down, 3 × 3, 1 × 1 up (× 4)."""

    expansion = 4

    @staticmethod
    def _body(cin: int, width: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width),
                             nn.ReLU(), nn.Conv2d(width, width, 3, stride, 1, bias=False),
                             nn.BatchNorm2d(width), nn.ReLU(),
                             nn.Conv2d(width, width * 4, 1, bias=False),
                             nn.BatchNorm2d(width * 4))


class ResNet(nn.Module):
    """torchvision's ResNet shape: stem, four stages of ``blocks`` blocks, pool, classifier."""

    def __init__(self, block: type[Basic], blocks: list[int], classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            layer = []
            for b in range(n):
                layer.append(block(cin, width, 2 if i and not b else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*layer))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


class Encoder(nn.Module):
    """A pre-norm ViT encoder block (fused qkv, SDPA, GELU MLP), residuals out of place."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """ViT-B/16's shape: 16 × 16 patches of a 224 × 224 image, 12 blocks of width 768, a
    learned position table, mean-pooled tokens into the classifier."""

    def __init__(self, dim: int = 768, layers: int = 12, heads: int = 12, classes: int = 1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 16, 16)
        self.pos = nn.Parameter(torch.zeros(1, 14 * 14, dim))
        self.blocks = nn.Sequential(*[Encoder(dim, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.ln(self.blocks(x)).mean(dim=1))


def _imported_config(module: nn.Module, name: str):
    """``module`` imported on the meta device at batch 256 of 224 × 224 images, on 8 × 8."""
    from ilp_planner.inputs.config import load_config
    from ilp_planner.inputs.importer import from_module

    graph = from_module(module, (torch.zeros(BATCH, 3, 224, 224, device="meta"),), name=name)
    return load_config({"name": name, "model": graph, "cluster": H100_8X8,
                        "training": {"optimizer": "adam_mixed"}})


def _config(name: str):
    """The config of row ``name``."""
    from ilp_planner.inputs.config import load_config

    if name == "vgg13-8x8":
        return load_config({"name": name, "model": {"kind": "vgg13", "batch": BATCH, "image": 224,
                                                   "classes": 1000, "dtype": "float16"},
                           "cluster": H100_8X8, "training": {"optimizer": "adam_mixed"},
                           "solver": {"tie_layers": False}})
    with torch.device("meta"):
        module = {"resnet18-8x8": lambda: ResNet(Basic, [2, 2, 2, 2]),
                  "resnet50-8x8": lambda: ResNet(Bottleneck, [3, 4, 6, 3]),
                  "vit-b16-8x8": ViT}.get(name, lambda: None)()
    if module is not None:
        return _imported_config(module, name)
    return load_config(REPO / "configs" / f"{name}.yaml")


ROWS = ("vgg13-2x8", "vgg13-8x8", "resnet18-8x8", "resnet50-8x8", "vit-b16-8x8",
        "u-transformer-2x4")


def row(name: str, time_limit: float) -> dict:
    """One model solved by the code on ``sys.path``: its sizes and the solve's figures."""
    from formulations.elimination import _merged_edges, elimination_order
    from formulations.problem import dominated_free
    from ilp_planner.api import solve
    from ilp_planner.intra_op.request import MeshSolveRequest
    from ilp_planner.intra_op.solve_mesh import solve_mesh

    config = _config(name)
    config = config.with_overrides({"solver.time_limit_s": time_limit})
    t0 = time.perf_counter()
    if config.pipeline.pipelined:
        plan = solve(config, baselines=False)
        report = plan.solver
        status, gap, objective = report.status, report.gap, report.objective
        solve_s = time.perf_counter() - t0  # the whole pipelined solve, builds included
    else:
        _, result = solve_mesh(MeshSolveRequest.whole_cluster(config))
        status, gap, objective, solve_s = result.status, result.gap, result.objective, \
            result.solve_s
    wall = time.perf_counter() - t0
    gp, _ = _sizes_problem(config)
    kept = gp.problem.subset(dominated_free(gp.problem))
    order = elimination_order([len(c) for c in kept.cost], _merged_edges(kept))
    return {"model": name, "ops": len(gp.graph.ops), "groups": gp.problem.num_groups,
            "width": order.width, "solve_s": solve_s, "wall_s": wall, "status": status,
            "gap": gap, "objective": objective}


def _sizes_problem(config):
    """The whole-cluster problem of ``config`` with nothing recomputed (its sizes and width;
    a pipelined config's stages are slices of it)."""
    from ilp_planner.intra_op.problem import build_problem

    c = config.cluster
    graph = config.microbatch_graph()
    gp = build_problem(graph, c, c.nodes, c.devices_per_node, config.memory,
                       tie_layers=config.solver.tie_layers,
                       microbatches=config.pipeline.microbatches,
                       grad_bucket_bytes=config.grad_bucket_bytes)
    return gp, graph


def _run(name: str, code: Path, time_limit: float) -> dict:
    """Row ``name`` in a subprocess importing ``code`` first."""
    env = dict(os.environ, PYTHONPATH=str(code))
    out = subprocess.run([sys.executable, __file__, "--row", name, "--time-limit",
                          str(time_limit)], env=env, cwd=code, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cells(r: dict) -> str:
    gap = "—" if r["gap"] is None else f"{100 * r['gap']:.3f} %"
    return f"{r['solve_s']:>9.1f}{r['status']:>10}{gap:>10}{r['objective']:>12.5g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row")
    ap.add_argument("--before", type=Path)
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    if args.row:
        print(json.dumps(row(args.row, args.time_limit)))
        return
    head = f"{'model':<20}{'ops':>5}{'groups':>7}{'width':>6}"
    sub = f"{'solve s':>9}{'status':>10}{'gap':>10}{'objective':>12}"
    print(head + (f"  before: {sub}" if args.before else "") + f"  after: {sub}")
    for name in ROWS:
        after = _run(name, REPO, args.time_limit)
        line = f"{name:<20}{after['ops']:>5}{after['groups']:>7}{after['width']:>6}"
        if args.before:
            line += "  before: " + _cells(_run(name, args.before, args.time_limit))
        print(line + "  after: " + _cells(after), flush=True)


if __name__ == "__main__":
    main()
