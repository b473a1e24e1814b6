"""Intra-op SBP ILP (Alpa's auto-sharding with AutoDDL's strategy space).

The model is emitted once, as arrays (:func:`formulate` → :class:`Milp`: bounds,
integrality, objective, row bounds and a sparse matrix), and handed to a backend
(:data:`MILP_BACKENDS`, option ``solver.milp``):

``scip`` (default)
    SCIP through OR-Tools' ``pywraplp``, in-process: the arrays go to OR-Tools' C++ model
    builder and are loaded without a file; the warm start is a complete hint (s, e and z of
    the choice), the log is read for :class:`~formulations.result.SolveStats`.
``cbc``
    PuLP's bundled CBC, the reference: a PuLP model of the same arrays, an MPS file and a
    CBC process (slower to build and start; kept to cross-check the in-process engine).

Variables
    s[g,k] ∈ {0,1}      group g takes strategy k                       (:meth:`_Builder.strategies`)
    e[u,v,a,b] ∈ [0,1]  edge (u,v): u's output class a meets v's input class b
    z[j] ∈ ℤ≥0          gradient-bucket chunks reduced over device group j (:meth:`_Builder.buckets`)

Constraints
    Σ_k s[g,k] = 1                                   one strategy per group (:meth:`_Builder.strategies`)
    Σ_b e[u,v,a,b] = Σ_{k∈a} s[u,k]                 edge rows agree with u (:meth:`_Builder.edges`)
    Σ_a e[u,v,a,b] = Σ_{l∈b} s[v,l]                 edge columns agree with v
    Σ_g Σ_k mem[g,k]·s[g,k] ≤ M                      per-device memory (:meth:`_Builder.memory`)
    Σ_g Σ_k (bytes[g,k,j] / cap)·s[g,k] ≤ z[j]        chunks cover group j's gradients

Objective
    min Σ_g Σ_k cost[g,k]·s[g,k] + Σ_(u,v) Σ_(a,b) R[u,v,a,b]·e[u,v,a,b] + Σ_j α[j]·z[j]

Minimising makes z[j] = ⌈Σ bytes / cap⌉ — exactly the chunks the runtime reduces
(:mod:`ilp_planner.lowering.grad_buckets`), so the bucket term is exact, not an estimate.

The edge variables linearise s_uᵀ R s_v. Strategies of u whose rows of R are identical
form one class a (and likewise columns for v), so e is indexed by classes, not strategy
pairs — the same optimum with far fewer variables. With s integral, e is integral too, so
e stays continuous. All-zero edge matrices get no variables.

Scaling. Costs are seconds (often 1e-6 … 1e-3), below MILP solvers' absolute tolerances
(~1e-7 on reduced costs and gaps), and memory is bytes (~1e10), far above them: unscaled,
CBC declares "optimal" choices that are up to 0.1 % off. The objective is therefore
multiplied by ``scale = OBJECTIVE_SCALE / U`` with U = Σ_g max_k cost + Σ max R (+ the
bucket term's largest latency), an upper bound on any choice's objective, and the memory row
is divided by M (Σ (mem/M)·s ≤ 1); reported objectives and bounds are unscaled. Both
backends run with the relative gap ``solver.gap`` (default 0: proven exactly).

Why SCIP: OR-Tools' in-process CBC ignores solution hints (a time-limited solve then
returns nothing where the warm start was a solution), and its HiGHS crashes on hints;
SCIP takes the hint as its first incumbent, reports its best bound and node count and
proves optimality with gap 0. Its probing presolve is switched off: on these models it
derives millions of implications and spends the whole time limit there.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from formulations.problem import Problem
from formulations.result import MILP_BACKENDS, SolveResult, SolveStats

# the scaled objective of the costliest possible choice (see the module docstring)
OBJECTIVE_SCALE = 1e6
DEFAULT_MILP = "scip"


def _classes(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row classes of ``matrix``: (class id per row, representative row per class)."""
    _, first, inverse = np.unique(matrix, axis=0, return_index=True, return_inverse=True)
    return inverse.reshape(-1), first


@dataclass
class _Edge:
    """The e block of edge (u, v): ``cols[a, b]`` the column of e[u,v,a,b]; ``row_cls`` /
    ``col_cls`` the class of each strategy of u / v."""

    u: int
    v: int
    row_cls: np.ndarray
    col_cls: np.ndarray
    cols: np.ndarray


@dataclass
class Milp:
    """A minimisation MILP as arrays: column bounds ``lower``/``upper``, ``integer`` flags,
    ``objective`` (scaled), rows ``row_lower ≤ matrix·x ≤ row_upper``; and the maps back to
    the problem: ``strategy[g][k]`` the column of s[g,k], the edge blocks, ``bucket[j]`` the
    column of z[j]. ``scale`` multiplies the problem's objective."""

    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    objective: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    matrix: sp.csr_matrix
    scale: float
    strategy: list[np.ndarray]
    edges: list[_Edge] = field(default_factory=list)
    bucket: dict[int, int] = field(default_factory=dict)

    @property
    def num_variables(self) -> int:
        return len(self.lower)

    @property
    def num_integer(self) -> int:
        return int(np.count_nonzero(self.integer))

    @property
    def num_constraints(self) -> int:
        return self.matrix.shape[0]

    def point(self, problem: Problem, choice) -> np.ndarray:
        """The full solution vector (s, e, z) of ``choice``, e.g. as a warm start."""
        x = np.zeros(self.num_variables)
        for g, cols in enumerate(self.strategy):
            x[cols[choice[g]]] = 1.0
        for ed in self.edges:
            x[ed.cols[ed.row_cls[choice[ed.u]], ed.col_cls[choice[ed.v]]]] = 1.0
        if self.bucket:
            totals = problem.buckets.totals(choice) / problem.buckets.cap
            for j, col in self.bucket.items():
                x[col] = math.ceil(totals[j])
        return x

    def choice(self, strategy_values: list[np.ndarray]) -> tuple[int, ...] | None:
        """The choice of per-group s values, None if some group is not one-hot."""
        if any(abs(float(v.sum()) - 1.0) > 1e-6 for v in strategy_values):
            return None
        return tuple(int(np.argmax(v)) for v in strategy_values)


class _Builder:
    """Emits the columns and rows of :class:`Milp`; one method per family."""

    def __init__(self, problem: Problem, scale: float):
        self.p, self.scale = problem, scale
        self.cols: list[tuple[np.ndarray, ...]] = []  # (lower, upper, integer, objective)
        self.ncol = 0
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []  # (columns, coefficients)
        self.bounds: list[tuple[float, float]] = []
        self.strategy: list[np.ndarray] = []
        self.edge_blocks: list[_Edge] = []
        self.bucket: dict[int, int] = {}

    def columns(self, n: int, lower: float, upper: float, integer: bool, cost) -> np.ndarray:
        idx = np.arange(self.ncol, self.ncol + n)
        self.ncol += n
        self.cols.append((np.full(n, lower, float), np.full(n, upper, float), np.full(n, integer),
                          self.scale * np.asarray(cost, float)))
        return idx

    def row(self, cols: np.ndarray, coefs: np.ndarray, lower: float, upper: float) -> None:
        self.rows.append((cols, np.asarray(coefs, float)))
        self.bounds.append((lower, upper))

    def strategies(self) -> None:
        """s[g,k] binary, cost[g,k] in the objective; Σ_k s[g,k] = 1."""
        for c in self.p.cost:
            cols = self.columns(len(c), 0.0, 1.0, True, c)
            self.strategy.append(cols)
            self.row(cols, np.ones(len(cols)), 1.0, 1.0)

    def edges(self) -> None:
        """e[u,v,a,b] over class pairs; rows Σ_b e = Σ_{k∈a} s[u,k], columns likewise."""
        for (u, v), r in self.p.edges.items():
            if not np.any(r):
                continue
            row_cls, row_rep = _classes(r)
            col_cls, col_rep = _classes(r.T)
            small = r[np.ix_(row_rep, col_rep)]
            e = self.columns(small.size, 0.0, 1.0, False, small.reshape(-1)).reshape(small.shape)
            self.edge_blocks.append(_Edge(u, v, row_cls, col_cls, e))
            for a in range(len(row_rep)):
                members = self.strategy[u][row_cls == a]
                self.row(np.concatenate([e[a], members]),
                         np.concatenate([np.ones(e.shape[1]), -np.ones(len(members))]), 0.0, 0.0)
            for b in range(len(col_rep)):
                members = self.strategy[v][col_cls == b]
                self.row(np.concatenate([e[:, b], members]),
                         np.concatenate([np.ones(e.shape[0]), -np.ones(len(members))]), 0.0, 0.0)

    def memory(self) -> None:
        """Σ_g Σ_k (mem[g,k] / M)·s[g,k] ≤ 1."""
        budget = self.p.memory_budget
        if budget is None:
            return
        unit = float(budget) if budget > 0 else 1.0
        self.row(np.concatenate(self.strategy), np.concatenate(self.p.memory) / unit,
                 -math.inf, float(budget) / unit)

    def buckets(self) -> None:
        """z[j] ≥ Σ (bytes/cap)·s for each device group j that some strategy reduces over."""
        terms = self.p.buckets
        if terms is None:
            return
        cols = np.concatenate(self.strategy)
        for j, alpha in enumerate(terms.alpha):
            weights = np.concatenate([b[:, j] for b in terms.bytes]) / terms.cap
            nz = weights != 0
            if not nz.any():
                continue
            z = self.columns(1, 0.0, math.inf, True, [alpha])
            self.bucket[j] = int(z[0])
            self.row(np.concatenate([cols[nz], z]), np.concatenate([weights[nz], [-1.0]]),
                     -math.inf, 0.0)

    def milp(self) -> Milp:
        lower, upper, integer, objective = (np.concatenate(x) for x in zip(*self.cols, strict=True))
        counts = [len(c) for c, _ in self.rows]
        matrix = sp.csr_matrix(
            (np.concatenate([v for _, v in self.rows]),
             (np.repeat(np.arange(len(self.rows)), counts), np.concatenate([c for c, _ in self.rows]))),
            shape=(len(self.rows), self.ncol))
        bounds = np.array(self.bounds, float).reshape(-1, 2)
        return Milp(lower, upper, integer.astype(bool), objective, bounds[:, 0], bounds[:, 1],
                    matrix, self.scale, self.strategy, self.edge_blocks, self.bucket)


def formulate(problem: Problem) -> Milp:
    """The ILP of ``problem`` (module docstring), objective scaled to ``OBJECTIVE_SCALE``."""
    upper = sum(float(np.max(c)) for c in problem.cost) + sum(
        float(np.max(r)) for r in problem.edges.values())
    if problem.buckets is not None:
        upper += problem.buckets.upper_bound()
    builder = _Builder(problem, OBJECTIVE_SCALE / upper if upper > 0 else 1.0)
    builder.strategies()
    builder.edges()
    builder.memory()
    builder.buckets()
    return builder.milp()


@dataclass
class _Run:
    """What a backend reports: per-group s values (None: no solution), whether it proved
    optimality, its best bound (scaled, None if unknown), seconds loading the model into
    the solver and running it, nodes, the final incumbent's time on the solver's clock
    (None if unknown), presolve seconds (None if not reported) and a note naming the engine."""

    values: list[np.ndarray] | None
    optimal: bool
    bound: float | None
    load_s: float
    run_s: float
    nodes: int | None = None
    incumbent_s: float | None = None
    presolve_s: float | None = None
    note: str = ""


class SbpIlp:
    """The ILP of a :class:`Problem`, built once (:func:`formulate`), solved by ``backend``
    (one of :data:`MILP_BACKENDS`)."""

    def __init__(self, problem: Problem, backend: str = DEFAULT_MILP):
        if backend not in MILP_BACKENDS:
            raise ValueError(f"unknown MILP backend {backend!r}; expected one of {MILP_BACKENDS}")
        t0 = time.perf_counter()
        self.problem = problem
        self.backend = backend
        self.milp = formulate(problem)
        self.formulate_s = time.perf_counter() - t0
        self.load_s = 0.0
        self.stats: SolveStats | None = None

    @property
    def build_s(self) -> float:
        """Seconds emitting the model plus (after :meth:`solve`) loading it into the solver."""
        return self.formulate_s + self.load_s

    def solve(self, time_limit_s: float | None = None, threads: int = 1,
              warm_start: tuple[int, ...] | None = None, seed: int = 0,
              gap: float = 0.0, cutoff: float | None = None) -> SolveResult | None:
        """Solve; None if the solver found no solution within the time limit (``stats``
        is set either way). ``gap``: the relative gap at which the solver stops and
        reports ``optimal`` (0: proven exactly). ``cutoff``: no choice costing that much is
        wanted — SCIP stops once its proven bound reaches it (``limits/dual``; the result
        is then ``feasible``, its bound at least the cutoff); CBC ignores it."""
        hint = None if warm_start is None else self.milp.point(self.problem, warm_start)
        limit = None if time_limit_s is None else max(time_limit_s, 0.01)
        run = _BACKENDS[self.backend](self.milp, limit, threads, hint, seed, gap,
                                      None if cutoff is None else cutoff * self.milp.scale)
        self.load_s = run.load_s
        if run.values is None:  # no incumbent: the whole run was search
            search = run.run_s
        else:
            search = None if run.incumbent_s is None else min(max(run.incumbent_s, 0.0), run.run_s)
        self.stats = SolveStats(
            self.milp.num_variables, self.milp.num_integer, self.milp.num_constraints, run.nodes,
            self.build_s, run.presolve_s, search,
            None if search is None else run.run_s - search, run.note)
        choice = None if run.values is None else self.milp.choice(run.values)
        if choice is None:
            return None
        objective = self.problem.objective(choice)
        bound = None if run.bound is None or not math.isfinite(run.bound) \
            else run.bound / self.milp.scale
        if run.optimal:
            bound = objective if bound is None else bound
        gap = None if bound is None else max(0.0, (objective - bound) / max(abs(objective), 1e-30))
        if run.optimal:
            gap = 0.0 if gap is None or gap < 1e-6 else gap
        return SolveResult("optimal" if run.optimal else "feasible", objective, bound, gap,
                           self.build_s, run.run_s, choice, "ilp",
                           "" if run.optimal else f"{self.backend.upper()} stopped at its time limit",
                           self.stats)


# -- SCIP in-process (OR-Tools) ---------------------------------------------------------------

# SCIP settings: the gap comes from MPSolverParameters; probing presolve off (module docstring)
_SCIP_SETTINGS = ("propagating/probing/maxprerounds = 0\n"
                  "presolving/sparsify/maxrounds = 0\npresolving/dualsparsify/maxrounds = 0\n")
_SCIP_INFINITY = 1e19  # SCIP's default infinity is 1e20
_CAPTURE = threading.Lock()


@contextlib.contextmanager
def _stdout_captured() -> Iterator[list[str]]:
    """What C code writes to file descriptor 1 inside the block, as the list's one item
    after it (solver logs go there). One capture at a time per process."""
    out: list[str] = []
    with _CAPTURE, tempfile.TemporaryFile() as tmp:
        sys.stdout.flush()
        libc = ctypes.CDLL(None)
        saved = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        try:
            yield out
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _solve_scip(milp: Milp, time_limit_s: float | None, threads: int, hint: np.ndarray | None,
                seed: int, gap: float, cutoff: float | None = None) -> _Run:
    from ortools.linear_solver import pywraplp
    from ortools.linear_solver.python import model_builder_helper as mbh

    t0 = time.perf_counter()
    helper = mbh.ModelBuilderHelper()
    helper.fill_model_from_sparse_data(milp.lower, milp.upper, milp.objective, milp.row_lower,
                                       milp.row_upper, milp.matrix)
    for j in np.flatnonzero(milp.integer):
        helper.set_var_integrality(int(j), True)
    proto = mbh.to_mpmodel_proto(helper)
    if hint is not None:
        proto.solution_hint.var_index.extend(range(len(hint)))
        proto.solution_hint.var_value.extend(hint.tolist())
    solver = pywraplp.Solver.CreateSolver("SCIP")
    error = solver.LoadModelFromProto(proto)
    if error:
        raise RuntimeError(f"SCIP rejected the model: {error}")
    if time_limit_s is not None:
        solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    solver.SetNumThreads(threads)
    if not solver.SetSolverSpecificParametersAsString(
            _SCIP_SETTINGS + f"randomization/randomseedshift = {seed}\n"
            + ("" if cutoff is None else f"limits/dual = {cutoff!r}\n")):
        raise RuntimeError("SCIP rejected its settings")
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, gap)
    solver.EnableOutput()
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with _stdout_captured() as log:
        status = solver.Solve(params)
    run_s = time.perf_counter() - t1
    text = log[0]
    values = None
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        variables = solver.variables()
        values = [np.array([variables[int(c)].solution_value() for c in cols])
                  for cols in milp.strategy]
    bound = solver.Objective().BestBound() if values is not None else None
    if bound is not None and abs(bound) >= _SCIP_INFINITY:  # no bound yet
        bound = None
    return _Run(values, status == pywraplp.Solver.OPTIMAL, bound, load_s, run_s,
                int(solver.nodes()), _scip_incumbent_s(text, hint is not None),
                _last_float(text, r"Presolving Time:\s*([-\d.eE+]+)"), "SCIP (OR-Tools, in-process)")


def _scip_incumbent_s(log: str, hinted: bool) -> float | None:
    """When SCIP found its final incumbent, from its log: the last display line marked
    with a heuristic's letter (each new incumbent gets one) or presolve-time message;
    0 with a hint and no later solution."""
    times = [float(t) for t in re.findall(r"^\S\s*([\d.]+)s\|", log, re.MULTILINE)]
    times += [float(t) for t in re.findall(r"found by \S+ heuristic after ([\d.]+) seconds", log)]
    if times:
        return max(times)
    if hinted:
        return 0.0
    return _last_float(log, r"Presolving Time:\s*([-\d.eE+]+)") if "presolving solved" in log else None


# -- PuLP's CBC (reference) -----------------------------------------------------------------


def _solve_cbc(milp: Milp, time_limit_s: float | None, threads: int, hint: np.ndarray | None,
               seed: int, gap: float, cutoff: float | None = None) -> _Run:
    import pulp

    t0 = time.perf_counter()
    model = pulp.LpProblem("sbp", pulp.LpMinimize)
    xs = [model.add_variable(f"x{j}", lowBound=lo, upBound=None if math.isinf(up) else up,
                             cat=pulp.LpInteger if intg else pulp.LpContinuous)
          for j, (lo, up, intg) in enumerate(zip(milp.lower, milp.upper, milp.integer, strict=True))]
    m = milp.matrix
    for i in range(m.shape[0]):
        lo, up = milp.row_lower[i], milp.row_upper[i]
        span = slice(m.indptr[i], m.indptr[i + 1])
        expr = pulp.LpAffineExpression(
            zip([xs[j] for j in m.indices[span]], m.data[span].tolist(), strict=True))
        sense, rhs = ((pulp.LpConstraintEQ, lo) if lo == up else
                      (pulp.LpConstraintLE, up) if math.isinf(lo) else (pulp.LpConstraintGE, lo))
        model += pulp.LpConstraint(expr, sense, f"r{i}", rhs)
    nz = np.flatnonzero(milp.objective)
    model += pulp.LpAffineExpression(zip([xs[j] for j in nz], milp.objective[nz].tolist(), strict=True))
    if hint is not None:
        for x, val in zip(xs, hint.tolist(), strict=True):
            x.setInitialValue(val)
    load_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, threads=threads, warmStart=hint is not None,
            gapRel=gap or None,
            logPath=log, options=[f"randomSeed {seed + 1}", f"randomCbcSeed {seed + 1}"])
        t1 = time.perf_counter()
        model.solve(solver)
        run_s = time.perf_counter() - t1
        text = open(log).read() if os.path.exists(log) else ""
    values = None
    if model.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        values = [np.array([xs[int(c)].value() or 0.0 for c in cols]) for cols in milp.strategy]
    stopped = "stopped on time" in text.lower()
    nodes = _last_float(text, r"Enumerated nodes:\s*(\d+)")
    incumbents = re.findall(r"Integer solution of \S+ found .*?\(([\d.]+) seconds\)", text)
    incumbent = float(incumbents[-1]) if incumbents else (0.0 if hint is not None else None)
    return _Run(values, model.status == pulp.LpStatusOptimal and not stopped,
                _last_float(text, r"Lower bound:\s*([-\d.eE+]+)"), load_s, run_s,
                None if nodes is None else int(nodes), incumbent, None,
                "CBC (PuLP, subprocess); incumbent times on CBC's clock; presolve not reported")


def _last_float(text: str, pattern: str) -> float | None:
    matches = re.findall(pattern, text)
    if not matches:
        return None
    val = float(matches[-1])
    return val if math.isfinite(val) else None


_BACKENDS = {"scip": _solve_scip, "cbc": _solve_cbc}
