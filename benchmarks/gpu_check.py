"""On a real GPU: the runtime on CUDA, and the compute model measured against the device.

One command, one table, a time budget (``--budget-s``, default 480 s; each part is skipped,
saying so, once too little is left)::

    python benchmarks/gpu_check.py [--out DIR] [--gpu NAME] [--steps 12]

1. **The executor on CUDA.** The tiny GPT and tiny MLP (``configs/tiny-*-cpu.yaml``, re-solved
   for one device) trained for 5 steps on the GPU under ``torchrun`` with ``--audit`` (executed
   collectives = planned) and ``--check-reference`` (losses and final parameters against the
   single-process reference); then the tiny GPT's 2-device plan as 2 ranks sharing the one
   GPU over gloo with CUDA tensors (NCCL refuses two ranks on one device).
2. **The device measured.** ``calibrate --measure``'s kernels (matmuls over shapes, a streaming
   kernel over sizes: :mod:`runtime.measure_kernels`) fitted to the roofline's parameters
   (:mod:`ilp_planner.inputs.compute_calibration`), beside the catalogue entry of this GPU
   (:mod:`ilp_planner.ir.device`).
3. **Step time, predicted vs measured.** A GPT of 124M parameters (GPT-2 small's shape: 12
   layers, hidden 768, 12 heads, seq 1024, vocab 50,304; bf16 compute, fp32 masters, Adam;
   8 sequences per step) as three one-device plans the planner chooses between — no
   recomputation, full recomputation, 4 micro-batches of 2 — each priced with the catalogue's
   figures and with the figures just fitted, then trained on the GPU (the median step after
   two warm-up steps; the last step runs under the profiler for the GPU's kernel time); and
   whether the model ranks them as the device does. Beside them, the same model as a plain
   ``nn.Module`` trained by PyTorch eager in this process, and how much of its step the
   GPU's kernels fill.
4. **Peak memory, predicted vs measured**: the plan's per-device peak beside
   ``torch.cuda.max_memory_allocated`` over the same runs (less what was allocated before).

Everything also goes to ``DIR/gpu_check.json``, the launches' logs beside it (``--out``). Without
CUDA the script refuses in one line (exit 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ilp_planner.api import solve
from ilp_planner.commands.calibrate import measure_host_time
from ilp_planner.commands.run import torchrun_command
from ilp_planner.inputs.compute_calibration import compute_section, fit_compute
from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.device import DeviceSpec, device_spec

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
GIB = 2**30
# GPT-2 small's shape, vocab padded to a multiple of 64 (as Megatron and nanoGPT pad it)
GPT_125M = {"kind": "gpt", "hidden": 768, "layers": 12, "heads": 12, "seq_len": 1024,
            "vocab": 50304, "batch": 8, "dtype": "bfloat16"}
# (label, solver.recompute, micro-batches): the choices a one-device plan has
VARIANTS = (("no recompute, 1 micro-batch", "never", 1),
            ("full recompute, 1 micro-batch", "always", 1),
            ("no recompute, 4 micro-batches", "never", 4))
# a GPU's name (torch.cuda.get_device_name) → its catalogue entry: the first pattern found
# (case-insensitive) wins; PCIe and NVL H100s, L40s and other parts have no entry (--gpu)
NAME_TO_CATALOGUE = ((r"\bH200\b", "h200"), (r"\bH100\b(?!.*\b(PCIe|NVL)\b)", "h100-sxm"),
                     (r"\bA100\b.*\b80GB\b", "a100-80gb"), (r"\bA100\b", "a100-40gb"),
                     (r"\bL4$", "l4"), (r"\bV100\b.*\b32GB\b", "v100-32gb"),
                     (r"\bV100\b", "v100-16gb"))


def catalogue_name(gpu_name: str) -> str:
    """The catalogue entry of a GPU named as CUDA names it, e.g. ``NVIDIA H100 80GB HBM3``."""
    for pattern, entry in NAME_TO_CATALOGUE:
        if re.search(pattern, gpu_name.strip(), re.IGNORECASE):
            return entry
    raise SystemExit(f"gpu_check: no catalogue entry matches {gpu_name!r}; pass --gpu NAME "
                     f"(a catalogue name: ilp_planner.ir.device)")


@dataclass
class Report:
    """The table's rows (part, item, expected or predicted, measured, verdict) and the raw
    results, written as JSON."""

    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    raw: dict = field(default_factory=dict)

    def add(self, part: str, item: str, want: str, got: str, verdict: str) -> None:
        self.rows.append((part, item, want, got, verdict))
        print(f"  [{part}] {item}: {want} | {got} | {verdict}", flush=True)

    def table(self) -> str:
        head = ("part", "check", "planned / predicted", "measured", "verdict")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


class Budget:
    """Seconds left of ``--budget-s``; a part that needs more than is left is skipped."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def cluster_for(gpu: str, devices: int) -> dict:
    """One node of ``devices`` catalogue GPUs (links named; one node, so only intra is used)."""
    return {"gpu": gpu, "nodes": 1, "devices_per_node": devices, "intra": "nvlink4",
            "inter": "8x-ib-ndr400"}


def solve_to(raw: dict, path: Path) -> dict:
    """Solve a config given as a mapping, write the plan JSON; its ``cost`` section."""
    plan = solve(parse_config(raw, str(path.with_suffix(".yaml"))))
    plan.save(path)
    return plan.to_dict()["cost"]


def launch(plans: list[Path], nproc: int, extra: list[str], work: Path, tag: str,
           budget: Budget) -> list[dict]:
    """Train ``plans`` in one torchrun launch; the per-plan results (``--results``). The
    launch's output is kept as ``work/<tag>.log``; a launch that wrote no results raises with
    its tail."""
    results = work / f"{tag}.json"
    cmd = torchrun_command(nproc, "runtime.launch",
                           [str(p) for p in plans] + ["--results", str(results), *extra])
    log = work / f"{tag}.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=max(budget.left(), 1.0))
        except subprocess.TimeoutExpired:  # torchrun and its workers, which hold the GPU
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timed out"
    if not results.exists():  # a failed check (exit 1) still writes its results
        raise RuntimeError(f"launch {tag} failed ({rc}):\n{log.read_text()[-1500:]}")
    return json.loads(results.read_text())


def executor_part(rep: Report, work: Path, budget: Budget) -> None:
    """Part 1: the tiny plans on the GPU, audited and checked against one process."""
    plans = []
    for stem in ("tiny-gpt-cpu", "tiny-mlp-cpu"):
        raw = yaml.safe_load((CONFIGS / f"{stem}.yaml").read_text())
        raw["cluster"].update(nodes=1, devices_per_node=1)
        solve_to(raw, work / f"{stem}-1.json")
        plans.append(work / f"{stem}-1.json")
    two = yaml.safe_load((CONFIGS / "tiny-gpt-cpu.yaml").read_text())
    two["cluster"].update(nodes=1, devices_per_node=2)
    solve_to(two, work / "tiny-gpt-cpu-2.json")
    checks = ["--steps", "5", "--audit", "--check-reference", "--quiet"]
    for tag, files, nproc, extra in (("executor-1gpu", plans, 1, []),
                                     ("executor-2ranks-gloo", [work / "tiny-gpt-cpu-2.json"], 2,
                                      ["--backend", "gloo"])):
        try:
            runs = launch(files, nproc, checks + extra, work, tag, budget)
        except RuntimeError as exc:
            rep.raw[tag] = str(exc)
            rep.add("1 executor", tag, "5 steps, audit, reference", "launch failed",
                    str(exc).splitlines()[0])
            continue
        rep.raw[tag] = runs
        for r in runs:
            ref = r.get("reference") or {}
            ok = r["audit_ok"] and max(ref.get("loss_rel_err", 1), ref.get("param_rel_err", 1)) <= 1e-4
            rep.add("1 executor", f"{r['plan']} ({r['world']} {r['backend']} rank(s))",
                    "executed = planned; matches one process",
                    f"audit {'OK' if r['audit_ok'] else 'MISMATCH'}; loss rel err "
                    f"{ref.get('loss_rel_err', float('nan')):.1e}, worst param "
                    f"{ref.get('param_rel_err', float('nan')):.1e}",
                    "OK" if ok else "FAIL")


def calibrate_part(rep: Report, spec: DeviceSpec, dtype: str, work: Path) -> dict | None:
    """Part 2: the roofline fitted on this GPU beside the catalogue entry; the fitted
    ``cluster.compute`` section (efficiencies of the catalogue's datasheet figures)."""
    import torch

    from runtime.measure_kernels import measure_kernels

    rows, name = measure_kernels(quick=False, dtype=dtype)
    rows += measure_host_time(work / "kernels.csv", dtype)
    torch.cuda.empty_cache()
    rep.raw["kernels"] = [r.__dict__ for r in rows]
    cal = fit_compute(rows)
    rep.raw["fit"] = {**cal.__dict__, "device": name}
    peak, hbm = spec.peak(dtype), spec.hbm_bytes_per_s
    section = compute_section(cal, peak / 1e12, hbm / 1e9)
    rep.raw["fit"]["section"] = section
    fit = spec.fit
    for item, cat, got in (
            ("matmul efficiency e_max", f"{fit.matmul_efficiency:.3f}",
             f"{section['matmul_efficiency']:.3f} ({cal.matmul_flops / 1e12:.0f} TFLOP/s)"),
            ("matmul half dim d½", f"{fit.matmul_half_dim:.0f}", f"{cal.half_dim:.0f}"),
            ("memory efficiency", f"{fit.memory_efficiency:.3f}",
             f"{section['memory_efficiency']:.3f} ({cal.bandwidth / 1e9:.0f} GB/s)"),
            ("kernel floor", f"{fit.kernel_floor_s * 1e6:.1f} µs", f"{cal.floor_s * 1e6:.1f} µs"),
            ("host time a kernel issued", f"{fit.dispatch_s * 1e6:.1f} µs (not modelled)",
             "not measured" if cal.dispatch_s is None else f"{cal.dispatch_s * 1e6:.1f} µs"),
            ("host time a replayed kernel adds", f"{fit.replay_s * 1e6:.1f} µs (not modelled)",
             "not measured" if cal.replay_s is None else f"{cal.replay_s * 1e6:.1f} µs")):
        rep.add("2 device", f"{item} ({name}, {dtype})", f"catalogue {cat}", got,
                f"fit over {cal.rows} kernels, median relative error {cal.median_abs_rel:.1%}")
    return section


def gpt_part(rep: Report, gpu: str, section: dict | None, work: Path, steps: int,
             budget: Budget, gpt: dict = GPT_125M) -> None:
    """Parts 3 and 4: a GPT's (the 124M one's) three plans priced (catalogue, fitted) and run."""
    predicted, files = [], []
    for i, (label, recompute, mbs) in enumerate(VARIANTS):
        raw = {"name": f"gpt-124m-{i}", "model": dict(gpt), "cluster": cluster_for(gpu, 1),
               "training": {"optimizer": "adam"}, "solver": {"recompute": recompute},
               "pipeline": {"microbatches": mbs}}
        cat = solve_to(raw, work / f"gpt-124m-{i}.json")
        fitted = None
        if section is not None:
            tuned = copy.deepcopy(raw)
            tuned["cluster"]["compute"] = {k: v for k, v in section.items()
                                           if k not in ("peak_tflops", "hbm_gbps")}
            fitted = solve_to(tuned, work / f"gpt-124m-{i}-fitted.json")
        predicted.append((label, cat, fitted))
        files.append(work / f"gpt-124m-{i}.json")
    runs = launch(files, 1, ["--steps", str(steps), "--quiet", "--profile-last-step"], work,
                  "gpt-124m", budget)
    rep.raw["gpt"] = {"predicted": predicted, "runs": runs}
    # two warm-up steps; the last ran under the profiler
    measured = [statistics.median(r["step_s"][2:-1]) for r in runs]
    for (label, cat, fitted), got, r in zip(predicted, measured, runs, strict=True):
        want = f"{cat['step_s'] * 1e3:.1f} ms catalogue"
        ratio = f"catalogue {cat['step_s'] / got:.2f}×"
        if fitted is not None:
            want += f", {fitted['step_s'] * 1e3:.1f} ms fitted"
            ratio += f", fitted {fitted['step_s'] / got:.2f}×"
        busy = r.get("last_step_kernel_s")
        rep.add("3 step time", label, want, f"{got * 1e3:.1f} ms" + (
            "" if busy is None else f" (GPU busy {busy * 1e3:.1f} ms)"),
                f"predicted/measured {ratio}")
        peak = r.get("peak_memory_bytes")
        rep.add("4 memory", label, f"{cat['peak_memory_bytes'] / GIB:.2f} GiB",
                "n/a" if peak is None else f"{peak / GIB:.2f} GiB",
                "n/a" if peak is None else f"predicted/measured {cat['peak_memory_bytes'] / peak:.2f}×")
    order = sorted(range(len(runs)), key=measured.__getitem__)
    for name, key in (("catalogue", 1), ("fitted", 2)):
        if predicted[0][key] is None:
            continue
        model_order = sorted(range(len(runs)), key=lambda i: predicted[i][key]["step_s"])
        rep.add("3 step time", f"ranking ({name})", " < ".join(str(i + 1) for i in model_order),
                " < ".join(str(i + 1) for i in order),
                "same order" if model_order == order else "DIFFERENT order")


def eager_part(rep: Report, steps: int, gpt: dict = GPT_125M) -> None:
    """Part 3's yardstick: the same GPT as a plain ``nn.Module`` (:class:`runtime.modules.GPT`)
    trained in this process by PyTorch eager under bf16 autocast with the same fused Adam —
    what the executor's step costs beside PyTorch's own — and how much of its step the GPU
    is busy (the profiler's kernel time): a step longer than its kernels waits on the host."""
    import torch

    from runtime import model
    from runtime.launch import kernel_seconds
    from runtime.modules import GPT
    from runtime.optim import Optimizer, OptimizerSpec

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    m = GPT(gpt["hidden"], gpt["layers"], gpt["heads"], gpt["seq_len"], gpt["vocab"]).to(dev)
    params = dict(m.named_parameters())
    opt = Optimizer(OptimizerSpec("adam", 1e-4))
    tokens = gpt["batch"] * gpt["seq_len"]
    ids, tgt = (torch.randint(0, gpt["vocab"], (tokens,), device=dev) for _ in range(2))

    def step() -> None:
        for p in params.values():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.cross_entropy(m(ids), tgt)
        loss.backward()
        opt.step({k: p.data for k, p in params.items()}, {k: p.grad for k, p in params.items()})
        torch.cuda.synchronize(dev)

    secs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        secs.append(time.perf_counter() - t0)
    _, busy = kernel_seconds(step)
    wall = statistics.median(secs[2:])
    rep.raw["eager"] = {"step_s": secs, "kernel_s": busy}
    rep.add("3 step time", "plain PyTorch eager, same model (autocast bf16, fused Adam)",
            "yardstick", f"{wall * 1e3:.1f} ms", f"GPU busy {busy * 1e3:.1f} ms of it")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=480.0, help="time budget (default 480 s)")
    p.add_argument("--out", metavar="DIR", default=None, help="write gpu_check.json and logs here")
    p.add_argument("--gpu", default=None, help="catalogue entry (default: from the GPU's name)")
    p.add_argument("--steps", type=int, default=12,
                   help="steps per GPT plan, at least 4: two warm-up, one profiled (default 12)")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps: at least 4 (two warm-up steps, one timed, one profiled)")
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False): this benchmark "
              "measures a GPU", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s)
    name = torch.cuda.get_device_name(0)
    gpu = args.gpu or catalogue_name(name)
    spec = device_spec(gpu)
    print(f"gpu_check on {name} (catalogue: {spec.name}), torch {torch.__version__}", flush=True)
    rep = Report(raw={"device": name, "catalogue": spec.name, "torch": torch.__version__})
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _part(rep, "1 executor", budget, 90, lambda: executor_part(rep, work, budget))
        section = _part(rep, "2 device", budget, 60, lambda: calibrate_part(rep, spec, "bfloat16", work))
        _part(rep, "3 step time", budget, 60,
              lambda: gpt_part(rep, gpu, section, work, args.steps, budget))
        _part(rep, "3 step time", budget, 20, lambda: eager_part(rep, args.steps))
        rep.raw["wall_s"] = time.monotonic() - t0
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_check.json").write_text(json.dumps(rep.raw, indent=1, default=str))
            for log in work.glob("*.log"):
                shutil.copy(log, out / log.name)
    print(f"\n{name} (catalogue {spec.name}), torch {torch.__version__}, "
          f"{rep.raw['wall_s']:.0f} s\n")
    print(rep.table())
    return 0


def _part(rep: Report, part: str, budget: Budget, needs_s: float, run):
    """Run one part unless fewer than ``needs_s`` seconds are left; a part that raises is a
    FAIL row (the run goes on to the next part)."""
    if budget.left() < needs_s:
        rep.add(part, "skipped", f"needs ~{needs_s:.0f} s", f"{budget.left():.0f} s left", "SKIPPED")
        return None
    try:
        return run()
    except Exception as exc:  # a broken part must not hide the others' results
        rep.raw.setdefault("errors", {})[part] = repr(exc)
        rep.add(part, "error", "", type(exc).__name__, str(exc).splitlines()[0][:200])
        return None


if __name__ == "__main__":
    sys.exit(main())
