"""The house as its imports draw it (ARCHITECTURE.md): every module's imports read with ``ast``.

* no import cycle between the project's modules;
* every import runs down the declared layer order (:data:`MAY_IMPORT`);
* no import inside a function, except an optional or heavy third-party dependency of
  planner-side code named in :data:`LAZY` with its reason;
* a training rank (``runtime.launch``, the executor, ``parallelize``) loads no solver:
  OR-Tools, PuLP and ``scipy.optimize`` stay out of ``sys.modules``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ilp_planner", "formulations", "runtime")

# Unit (a sub-package of ilp_planner, or a top-level package) → the units it may import.
# Read bottom-up: errors < ir < formulations < lowering < inputs < plan < intra_op < inter_op <
# api < reports < sweeps < commands < cli; the runtime sits on plan and never sees a solver.
_BASE = {"ilp_planner.errors"}
_IR = _BASE | {"ilp_planner.ir"}
_PURE = _IR | {"formulations"}
_LOWERED = _PURE | {"ilp_planner.lowering"}
_INPUTS = _LOWERED | {"ilp_planner.inputs"}
_PLAN = _INPUTS | {"ilp_planner.plan"}
_SOLVE = _PLAN | {"ilp_planner.intra_op", "ilp_planner.inter_op", "ilp_planner.api"}
MAY_IMPORT: dict[str, set[str]] = {
    "ilp_planner": set(),  # the facade resolves its names lazily (importlib), so it imports none
    "ilp_planner.errors": set(),
    "ilp_planner.ir": _BASE,
    "formulations": _IR,
    "ilp_planner.lowering": _PURE,
    "ilp_planner.inputs": _LOWERED,
    "ilp_planner.plan": _INPUTS,
    "ilp_planner.intra_op": _PLAN,
    "ilp_planner.inter_op": _PLAN | {"ilp_planner.intra_op"},
    "ilp_planner.api": _PLAN | {"ilp_planner.intra_op", "ilp_planner.inter_op"},
    "ilp_planner.testing": _SOLVE,
    "ilp_planner.reports": _PLAN,
    "ilp_planner.sweeps": _SOLVE | {"ilp_planner.reports"},
    "runtime": _PLAN,
    "ilp_planner.commands": _SOLVE | {"ilp_planner.reports", "ilp_planner.sweeps", "runtime"},
    "ilp_planner.cli": _BASE | {"ilp_planner.commands"},
}

# Imports allowed inside a function: (module, imported top-level package) → why it is lazy.
LAZY: dict[tuple[str, str], str] = {
    ("formulations.sbp_ilp", "ortools"): "the SCIP backend: only a solve that reaches the MILP loads it",
    ("formulations.sbp_ilp", "pulp"): "the CBC backend: only a solve that reaches the MILP loads it",
    ("formulations.simulator", "matplotlib"): "plots are optional output (simulate --plot)",
    ("ilp_planner.sweeps.plots", "matplotlib"): "plots are optional output (sweep plots:)",
    ("ilp_planner.sweeps.backends", "ray"): "the Ray backend is an optional extra",
    ("ilp_planner.ir.layouts", "torch"): "DTensor conversions for users of torch; the IR is torch-free",
    ("ilp_planner.inputs.config", "torch"): "a `kind: torch` model only; YAML configs need no torch",
    ("ilp_planner.inputs.importer", "torch"): "the nn.Module importer: the planner runs without torch",
    ("ilp_planner.inputs.dtensor_gaps", "torch"): "DTensor's rule tables, read by the importer "
                                                  "and the runtime only",
    ("runtime.applied_edges", "torch"): "a DTensor internal (local shapes), only where an edge moves data",
    ("runtime.applied_hooks", "torch"): "SDPA's kernel choice, only on CPU meshes",
    ("runtime.fidelity", "torch"): "torch's fake process group and fake tensors (test-only internals)",
    ("runtime.measure", "torch"): "`--help` and argument errors answer before torch loads",
    ("runtime.measure_kernels", "torch"): "the `calibrate` verb imports it; the CLI starts "
                                          "without torch",
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "ilp_planner" and len(parts) > 1 else parts[0]


def _imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported name, inside a function?, line) for every import statement of ``module``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            if node.module == "__future__":
                continue
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [(n, id(node) in inner, node.lineno) for n in names]
    return out


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for m in MODULES:
        for name, _, _ in _imports(m):
            if name.split(".")[0] in PACKAGES and (t := _resolve(name)) and t != m:
                edges[m].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_unit_is_declared():
    assert {unit(m) for m in MODULES} <= set(MAY_IMPORT)


def test_imports_follow_the_layer_order():
    wrong = sorted(f"{m} -> {t}" for m, ts in _graph().items() for t in ts
                   if unit(t) != unit(m) and unit(t) not in MAY_IMPORT[unit(m)])
    assert wrong == []


def test_no_imports_inside_functions_but_the_listed_lazy_ones():
    wrong = []
    used = set()
    for m in MODULES:
        for name, inside, line in _imports(m):
            top = name.split(".")[0]
            if not inside:
                continue
            if top in PACKAGES:
                wrong.append(f"{m}:{line} imports {name} inside a function")
            elif (m, top) in LAZY:
                used.add((m, top))
            else:
                wrong.append(f"{m}:{line} imports {name} inside a function (not in LAZY)")
    assert wrong == []
    assert set(LAZY) == used, f"stale LAZY entries: {sorted(set(LAZY) - used)}"


RANK_IMPORTS = """
import sys
import runtime.launch, runtime.executor, runtime.apply
loaded = sorted(m for m in sys.modules
                if m.split(".")[0] in ("ortools", "pulp") or m.startswith("scipy.optimize"))
print(loaded)
"""


def test_a_rank_loads_no_solver():
    out = subprocess.run([sys.executable, "-c", RANK_IMPORTS], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def _oversized() -> list[str]:
    out = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                out.append(f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    return out


def test_functions_and_classes_are_small():
    """No function over 80 lines and no class over 300."""
    assert _oversized() == []
