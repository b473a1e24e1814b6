"""Intra-op SBP ILP (Alpa's auto-sharding with AutoDDL's strategy space), solved with
PuLP's bundled CBC.

Variables
    s[g,k] ∈ {0,1}      group g takes strategy k                       (:meth:`_add_strategies`)
    e[u,v,a,b] ∈ [0,1]  edge (u,v): u's output class a meets v's input class b
    z[j] ∈ ℤ≥0          gradient-bucket chunks reduced over device group j (:meth:`_add_buckets`)

Constraints
    Σ_k s[g,k] = 1                                   one strategy per group (:meth:`_add_one_hot`)
    Σ_b e[u,v,a,b] = Σ_{k∈a} s[u,k]                 edge rows agree with u (:meth:`_add_edges`)
    Σ_a e[u,v,a,b] = Σ_{l∈b} s[v,l]                 edge columns agree with v
    Σ_g Σ_k mem[g,k]·s[g,k] ≤ M                      per-device memory (:meth:`_add_memory`)
    Σ_g Σ_k (bytes[g,k,j] / cap)·s[g,k] ≤ z[j]        chunks cover group j's gradients

Objective (:meth:`_set_objective`)
    min Σ_g Σ_k cost[g,k]·s[g,k] + Σ_(u,v) Σ_(a,b) R[u,v,a,b]·e[u,v,a,b] + Σ_j α[j]·z[j]

Minimising makes z[j] = ⌈Σ bytes / cap⌉ — exactly the chunks the runtime reduces
(:mod:`ilp_planner.grad_buckets`), so the bucket term is exact, not an estimate.

The edge variables linearise s_uᵀ R s_v. Strategies of u whose rows of R are identical
form one class a (and likewise columns for v), so e is indexed by classes, not strategy
pairs — the same optimum with far fewer variables. With s integral, e is integral too, so
e stays continuous. Names are built from group and strategy indices and a registry maps
them back.

Scaling. Costs are seconds (often 1e-6 … 1e-3), below CBC's absolute tolerances (~1e-7 on
reduced costs and gaps), and memory is bytes (~1e10), far above them: unscaled, CBC declares
"optimal" choices that are up to 0.1 % off. The objective is therefore multiplied by
``scale = OBJECTIVE_SCALE / U`` with U = Σ_g max_k cost + Σ max R, an upper bound on any
choice's objective, and the memory row is divided by M (Σ (mem/M)·s ≤ 1); reported
objectives and bounds are unscaled.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time

import numpy as np
import pulp

from formulations.result import SolveResult
from formulations.sbp_problem import Problem

# the scaled objective of the costliest possible choice (see the module docstring)
OBJECTIVE_SCALE = 1e6


def _classes(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row classes of ``matrix``: (class id per row, representative row per class)."""
    _, first, inverse = np.unique(matrix, axis=0, return_index=True, return_inverse=True)
    return inverse.reshape(-1), first


class SbpIlp:
    """PuLP model of a :class:`Problem`; one method per constraint family."""

    def __init__(self, problem: Problem):
        t0 = time.perf_counter()
        self.problem = problem
        self.model = pulp.LpProblem("sbp", pulp.LpMinimize)
        self.registry: dict[str, tuple] = {}
        upper = sum(float(np.max(c)) for c in problem.cost) + sum(
            float(np.max(r)) for r in problem.edges.values())
        if problem.buckets is not None:
            upper += problem.buckets.upper_bound()
        self.scale = OBJECTIVE_SCALE / upper if upper > 0 else 1.0
        self._add_strategies()
        self._add_one_hot()
        self._edge_terms: list = []
        self._add_edges()
        self._add_memory()
        self._bucket_terms: list = []
        self._add_buckets()
        self._set_objective()
        self.build_s = time.perf_counter() - t0

    def _add_strategies(self) -> None:
        self.s = []
        for g, costs in enumerate(self.problem.cost):
            row = []
            for k in range(len(costs)):
                name = f"s_{g}_{k}"
                row.append(self.model.add_variable(name, cat=pulp.LpBinary))
                self.registry[name] = ("strategy", self.problem.names[g], k)
            self.s.append(row)

    def _add_one_hot(self) -> None:
        for g, row in enumerate(self.s):
            self.model += pulp.lpSum(row) == 1, f"onehot_{g}"

    def _add_edges(self) -> None:
        for (u, v), r in self.problem.edges.items():
            if not np.any(r):
                continue
            row_cls, row_rep = _classes(r)
            col_cls, col_rep = _classes(r.T)
            small = r[np.ix_(row_rep, col_rep)]
            e = {}
            for a in range(len(row_rep)):
                for b in range(len(col_rep)):
                    name = f"e_{u}_{v}_{a}_{b}"
                    e[a, b] = self.model.add_variable(name, lowBound=0, upBound=1)
                    self.registry[name] = ("edge", self.problem.names[u], self.problem.names[v], a, b)
                    if small[a, b]:
                        self._edge_terms.append(self.scale * float(small[a, b]) * e[a, b])
            for a in range(len(row_rep)):
                members = [self.s[u][k] for k in np.flatnonzero(row_cls == a)]
                self.model += (pulp.lpSum(e[a, b] for b in range(len(col_rep)))
                               == pulp.lpSum(members)), f"edge_{u}_{v}_row_{a}"
            for b in range(len(col_rep)):
                members = [self.s[v][k] for k in np.flatnonzero(col_cls == b)]
                self.model += (pulp.lpSum(e[a, b] for a in range(len(row_rep)))
                               == pulp.lpSum(members)), f"edge_{u}_{v}_col_{b}"

    def _add_memory(self) -> None:
        """Σ_g Σ_k (mem[g,k] / M)·s[g,k] ≤ 1."""
        budget = self.problem.memory_budget
        if budget is None:
            return
        unit = float(budget) if budget > 0 else 1.0
        self.model += pulp.lpSum(
            (float(m[k]) / unit) * self.s[g][k] for g, m in enumerate(self.problem.memory)
            for k in range(len(m))
        ) <= float(budget) / unit, "memory"

    def _add_buckets(self) -> None:
        """z[j] ≥ Σ (bytes/cap)·s for each device group j that some strategy reduces over."""
        terms = self.problem.buckets
        if terms is None:
            return
        for j, alpha in enumerate(terms.alpha):
            row = [(float(b[k, j]) / terms.cap) * self.s[g][k] for g, b in enumerate(terms.bytes)
                   for k in range(len(b)) if b[k, j]]
            if not row:
                continue
            z = self.model.add_variable(f"z_{j}", lowBound=0, cat=pulp.LpInteger)
            self.registry[f"z_{j}"] = ("buckets", j)
            self.model += pulp.lpSum(row) <= z, f"buckets_{j}"
            self._bucket_terms.append(self.scale * float(alpha) * z)

    def _set_objective(self) -> None:
        """min scale · (Σ cost·s + Σ R·e + Σ α·z)."""
        node_terms = [self.scale * float(c[k]) * self.s[g][k] for g, c in enumerate(self.problem.cost)
                      for k in range(len(c)) if c[k]]
        self.model += pulp.lpSum(node_terms + self._edge_terms + self._bucket_terms)

    def solve(self, time_limit_s: float | None = None, threads: int = 1,
              warm_start: tuple[int, ...] | None = None, seed: int = 0) -> SolveResult | None:
        """Solve with CBC. Returns None if CBC found no solution within the time limit."""
        if warm_start is not None:
            for g, row in enumerate(self.s):
                for k, var in enumerate(row):
                    var.setInitialValue(1 if warm_start[g] == k else 0)
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "cbc.log")
            solver = pulp.PULP_CBC_CMD(
                msg=False, timeLimit=None if time_limit_s is None else max(time_limit_s, 0.01),
                threads=threads, warmStart=warm_start is not None, logPath=log,
                options=[f"randomSeed {seed + 1}", f"randomCbcSeed {seed + 1}"],
            )
            t0 = time.perf_counter()
            self.model.solve(solver)
            solve_s = time.perf_counter() - t0
            text = open(log).read() if os.path.exists(log) else ""
        choice = []
        for row in self.s:
            vals = [v.value() or 0.0 for v in row]
            choice.append(int(np.argmax(vals)))
        if self.model.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return None
        if any(abs(sum(v.value() or 0.0 for v in row) - 1) > 1e-6 for row in self.s):
            return None
        objective = self.problem.objective(choice)
        stopped = "Stopped on time" in text or "stopped on time" in text.lower()
        optimal = self.model.status == pulp.LpStatusOptimal and not stopped
        bound = _parse_float(text, r"Lower bound:\s*([-\d.eE+]+)")
        if bound is not None:
            bound /= self.scale
        if optimal:
            bound = objective if bound is None else bound
        gap = None if bound is None else max(0.0, (objective - bound) / max(abs(objective), 1e-30))
        if optimal:
            gap = 0.0 if gap is None or gap < 1e-6 else gap
        return SolveResult("optimal" if optimal else "feasible", objective, bound, gap,
                           self.build_s, solve_s, tuple(choice), "ilp",
                           "" if optimal else "CBC stopped at its time limit")


def _parse_float(text: str, pattern: str) -> float | None:
    matches = re.findall(pattern, text)
    if not matches:
        return None
    val = float(matches[-1])
    return val if math.isfinite(val) else None
