"""ILP build and solve time against model depth, tying and cluster size.

GPT with hidden 2560, 32 heads, sequences of 2048, vocabulary 51200, batch 16, fp16 with
mixed-precision Adam (18 B/param), 80 GiB per device so memory does not bind, on A100-like
clusters (312 TFLOP/s, NVLink 2400 Gb/s, 100 Gb/s between nodes) of 1 × 8, 2 × 8 and
8 × 8 devices; 4 … 96 layers, tied (AutoDDL §4.5.1: one strategy per repeated op) and
untied. Each run is :func:`ilp_planner.planner.solve_mesh`: build the problem (strategies,
resharding matrices), drop dominated strategies, warm-start (coordinate descent; for untied
runs also the tied optimum, solved first and counted in the time), build the PuLP model,
solve with CBC under a time limit. Untied runs projected (from the previous depth, time ∝
layers^1.3) to exceed ``--skip-above`` seconds are skipped.

Columns: ``k`` most strategies of a group before pruning; ``build s`` problem + pruning +
PuLP model, ``solve s`` searches + CBC; ``mem/M`` the plan's memory over the budget (1.00 =
the budget binds); ``tied/ilp`` (untied rows) the tied optimum of the same depth over the
untied result — tying is a restriction, so the value is at most 1.

    python benchmarks/solve_scaling.py [--time-limit 60] [--skip-above 120]
"""

from __future__ import annotations

import argparse
import time

from ilp_planner.config import parse_config
from ilp_planner.planner import solve_mesh

LAYERS = (4, 12, 24, 48, 96)
CLUSTERS = ((1, 8), (2, 8), (8, 8))


def gpt_config(layers: int, nodes: int, local: int, tie: bool):
    return parse_config({
        "name": f"gpt-L{layers}-{nodes}x{local}",
        "model": {"kind": "gpt", "hidden": 2560, "layers": layers, "heads": 32, "seq_len": 2048,
                  "vocab": 51200, "batch": 16, "dtype": "float16"},
        "cluster": {"nodes": nodes, "devices_per_node": local, "memory_gib": 80,
                    "peak_tflops": 312, "efficiency": 0.5,
                    "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 2400},
                              "inter": {"latency_us": 10, "bandwidth_gbps": 100}}},
        "training": {"optimizer": "adam_mixed"},
        "solver": {"tie_layers": tie},
    })


H100 = {"peak_tflops": 989, "efficiency": 0.5,
        "links": {"intra": {"latency_us": 3, "bandwidth_gbps": 3600},
                  "inter": {"latency_us": 10, "bandwidth_gbps": 400}}}


def gpt175b_config(nodes: int = 128, local: int = 8, microbatches: int = 16):
    """GPT-3 175B (96 layers, d 12288, 96 heads) in bf16 with gradient accumulation on
    ``nodes × local`` H100-80GB-like devices."""
    return parse_config({
        "name": f"gpt-175b-{nodes}x{local}",
        "model": {"kind": "gpt", "hidden": 12288, "layers": 96, "heads": 96, "seq_len": 2048,
                  "vocab": 51200, "batch": 1536, "dtype": "bfloat16"},
        "cluster": {"nodes": nodes, "devices_per_node": local, "memory_gib": 80, **H100},
        "training": {"optimizer": "adam_mixed"},
        "pipeline": {"microbatches": microbatches},
    })


def llama_graph_spec(layers: int = 32, hidden: int = 4096, heads: int = 32, kv_heads: int = 8,
                     ffn: int = 14336, vocab: int = 128256, seq: int = 8192,
                     batch: int = 8) -> dict:
    """A Llama-3-8B-shaped decoder as an explicit graph (``model: {kind: graph}``):
    RMSNorm as a layernorm op, grouped-query attention's fused QKV (h + 2·h·kv/heads
    columns), the SwiGLU MLP as gate and up projections, an elementwise activation on the
    gate and a two-input elementwise op for the product (priced like the residual add:
    same shapes, one FLOP per element), and an untied output head. Same parameter count
    and shapes as Llama-3-8B (8.0 B); not executable by the runtime (no SiLU / product
    kinds), which this solve-time benchmark does not need."""
    tokens, kv = batch * seq, 2 * hidden * kv_heads // heads
    dt = "bfloat16"
    ops: list[dict] = [
        {"name": "tokens", "kind": "input", "shape": [tokens], "dtype": "int64"},
        {"name": "embed", "kind": "embedding", "inputs": ["tokens"], "shape": [tokens, hidden],
         "weight": [vocab, hidden], "attrs": {"seq_len": seq}},
    ]
    x = "embed"

    def op(name, kind, inputs, width, i, **kw):
        ops.append({"name": f"h.{i}.{name}", "kind": kind, "inputs": inputs,
                    "shape": [tokens, width], "block": "h", "block_index": i, **kw})
        return f"h.{i}.{name}"

    for i in range(layers):
        n1 = op("ln1", "layernorm", [x], hidden, i, params=hidden)
        qkv = op("attn.qkv", "linear", [n1], hidden + kv, i, weight=[hidden, hidden + kv])
        att = op("attn.core", "attention", [qkv], hidden, i, attrs={"heads": heads, "seq_len": seq})
        proj = op("attn.proj", "linear", [att], hidden, i, weight=[hidden, hidden])
        r1 = op("attn.residual", "add", [x, proj], hidden, i)
        n2 = op("ln2", "layernorm", [r1], hidden, i, params=hidden)
        gate = op("mlp.gate", "linear", [n2], ffn, i, weight=[hidden, ffn])
        up = op("mlp.up", "linear", [n2], ffn, i, weight=[hidden, ffn])
        act = op("mlp.silu", "gelu", [gate], ffn, i)
        prod = op("mlp.product", "add", [act, up], ffn, i)
        down = op("mlp.down", "linear", [prod], hidden, i, weight=[ffn, hidden])
        x = op("mlp.residual", "add", [r1, down], hidden, i)
    ops += [
        {"name": "ln_f", "kind": "layernorm", "inputs": [x], "shape": [tokens, hidden],
         "params": hidden},
        {"name": "lm_head", "kind": "linear", "inputs": ["ln_f"], "shape": [tokens, vocab],
         "weight": [hidden, vocab]},
        {"name": "loss", "kind": "loss", "inputs": ["lm_head"], "shape": [1]},
    ]
    for o in ops:
        o.setdefault("dtype", dt)
    return {"kind": "graph", "ops": ops}


def llama8b_config(nodes: int = 8, local: int = 8, tie: bool = False):
    """The Llama-3-8B shape on ``nodes × local`` H100-80GB-like devices, untied layers."""
    return parse_config({
        "name": f"llama3-8b-shape-{nodes}x{local}",
        "model": llama_graph_spec(),
        "cluster": {"nodes": nodes, "devices_per_node": local, "memory_gib": 80, **H100},
        "training": {"optimizer": "adam_mixed"},
        "solver": {"tie_layers": tie},
    })


def run(layers: int, nodes: int, local: int, tie: bool, time_limit: float) -> dict:
    config = gpt_config(layers, nodes, local, tie).with_overrides(
        {"solver.time_limit_s": time_limit})
    t0 = time.perf_counter()
    gp, res = solve_mesh(config, nodes, local, config.cluster.memory_bytes)
    p = gp.problem
    return {
        "groups": p.num_groups, "k": max(len(c) for c in p.cost),
        "build_s": res.build_s, "solve_s": res.solve_s, "total_s": time.perf_counter() - t0,
        "status": res.status, "gap": res.gap, "objective": res.objective,
        "mem": p.memory_of(res.choice) / p.memory_budget,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--skip-above", type=float, default=120.0)
    ap.add_argument("--layers", type=int, nargs="*", default=list(LAYERS))
    args = ap.parse_args()
    head = (f"{'mesh':<5} {'tied':<5} {'L':>3} {'groups':>6} {'k':>4} {'build s':>8} "
            f"{'solve s':>8} {'total s':>8} {'status':<9} {'gap':>7} {'mem/M':>5} {'tied/ilp':>8}")
    print(head)
    print("-" * len(head))
    t_start = time.perf_counter()
    tied_opt: dict[tuple[int, int, int], float] = {}
    for nodes, local in CLUSTERS:
        for tie in (True, False):
            prev: tuple[int, float] | None = None
            for layers in args.layers:
                mesh = f"{nodes}x{local}"
                if prev is not None and not tie:
                    projected = prev[1] * (layers / prev[0]) ** 1.3
                    if projected > args.skip_above:
                        print(f"{mesh:<5} {str(tie):<5} {layers:>3} skipped (projected "
                              f"{projected:.0f} s > {args.skip_above:.0f} s)")
                        continue
                r = run(layers, nodes, local, tie, args.time_limit)
                prev = (layers, r["total_s"])
                gap = "n/a" if r["gap"] is None else f"{r['gap']:.2%}"
                if tie:
                    tied_opt[nodes, local, layers] = r["objective"]
                    vs_tied = ""
                else:
                    vs_tied = f"{tied_opt[nodes, local, layers] / r['objective']:.4f}"
                print(f"{mesh:<5} {str(tie):<5} {layers:>3} {r['groups']:>6} {r['k']:>4} "
                      f"{r['build_s']:>8.2f} {r['solve_s']:>8.2f} {r['total_s']:>8.2f} "
                      f"{r['status']:<9} {gap:>7} {r['mem']:>5.2f} {vs_tied:>8}", flush=True)
    print(f"wall time {time.perf_counter() - t_start:.0f} s; ILP time limit {args.time_limit:.0f} s")


if __name__ == "__main__":
    main()
