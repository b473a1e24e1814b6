"""Baselines under the same cost model, as restrictions of the planner's own problem.

Each baseline keeps, per op, only the strategies a hand-written layout would use, then
solves the restricted problem exactly (so e.g. Megatron gets the best alternation of
column/row parallel layers and the best mesh — a generous, hand-tuned Megatron):

* ``data_parallel`` — every op split over the batch on all devices, weights replicated;
* ``megatron(dp×tp)`` — linear layers column- or row-parallel over a TP axis, batch split
  over a DP axis; other ops split the batch over DP and keep heads (attention) or nothing
  split over TP. Every two-axis mesh is tried: TP inside a node and TP across nodes;
* ``summa(r×c)`` — linear layers as 2-D SUMMA on an ``r × c`` mesh; other ops free.

Because these strategies are members of the planner's space, the planner's optimum can
never be worse than any baseline — a property the tests check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from formulations.sbp_ilp import SbpIlp
from formulations.sbp_problem import GraphProblem, Problem
from ilp_planner.cluster import MeshAxis, mesh_factorisations
from ilp_planner.graph import Op, OpKind
from ilp_planner.layouts import B, Layout, Split, drop_unit_axes
from ilp_planner.strategies import Strategy

Filter = Callable[[Op, Strategy], bool]
_MATMUL = (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.CONV2D, OpKind.MATMUL)


def restrict(gp: GraphProblem, keep: Filter) -> tuple[Problem, list[np.ndarray]] | str:
    """The sub-problem keeping only strategies passing ``keep`` (none with sharded state:
    these baselines replicate it); or a reason string."""
    allowed: list[np.ndarray] = []
    for group in gp.groups:
        node = group[0]
        op = gp.graph[node]
        # an op nothing can shard is replicated in any hand-written layout too
        idx = np.array([k for k, o in enumerate(gp.options[node])
                        if not o.base.zero and (op.kind is OpKind.OPAQUE or keep(op, o.base))],
                       dtype=int)
        if idx.size == 0:
            offered = sorted({str(drop_unit_axes(o.base.output)) for o in gp.options[node]})
            return (f"no allowed strategy for {node} ({op.kind.value} {op.output.shape}): the "
                    f"baseline's layouts are not among the {len(offered)} output layouts this op "
                    f"can take on the mesh (e.g. {', '.join(offered[:3])})")
        allowed.append(idx)
    return gp.problem.subset(allowed), allowed


def _same_data(a: Layout, b: Layout) -> bool:
    return a.canonical_key() == b.canonical_key()


def data_parallel_filter(devices_axis: MeshAxis) -> Filter:
    full = (devices_axis,)
    target = Layout(full, (Split(0),))

    def keep(op: Op, s: Strategy) -> bool:
        if op.kind in _MATMUL:
            return s.label.startswith(("3d", "conv3d")) and s.fact[0] == devices_axis
        return not s.output.has_partial and _same_data(drop_unit_axes(s.output), target)
    return keep


def megatron_filter(dp: MeshAxis, tp: MeshAxis) -> Filter:
    one = MeshAxis(1, 1)
    fact2 = (dp, tp)
    allowed = {Layout(fact2, (x, y)).canonical_key() for x in (Split(0), B) for y in (B, Split(1))}
    matmul_facts = {(dp, tp, one), (dp, one, tp)}

    def keep(op: Op, s: Strategy) -> bool:
        if op.kind in _MATMUL:
            return s.label.startswith(("3d", "conv3d")) and s.fact in matmul_facts
        if op.kind is OpKind.ATTENTION:
            return not s.output.has_partial and s.output.canonical_key() == Layout(
                fact2, (Split(0), Split(1))).canonical_key()
        return not s.output.has_partial and s.output.canonical_key() in allowed
    return keep


def summa_filter(rows: MeshAxis, cols: MeshAxis) -> Filter:
    def keep(op: Op, s: Strategy) -> bool:
        if op.kind is OpKind.LINEAR:
            return s.label.startswith("summa") and s.fact == (rows, cols)
        return True
    return keep


def _solve_restricted(gp: GraphProblem, keep: Filter, time_limit_s: float) -> tuple[list[int], float] | str:
    res = restrict(gp, keep)
    if isinstance(res, str):
        return res
    sub, allowed = res
    if sub.memory_budget is not None and sub.min_memory()[0] > sub.memory_budget:
        return (f"does not fit: needs at least {sub.min_memory()[0] / 2**30:.2f} GiB per device, "
                f"budget {sub.memory_budget / 2**30:.2f} GiB")
    out = SbpIlp(sub).solve(time_limit_s=time_limit_s)
    if out is None:
        return "restricted ILP found no solution in time"
    choice = [int(allowed[g][k]) for g, k in enumerate(out.choice)]
    return choice, out.objective


def baseline_choices(gp: GraphProblem, time_limit_s: float = 30.0) -> dict[str, list[int] | str]:
    """Best choice (full-problem strategy indices) per baseline name, or a reason string."""
    nodes, local = gp.ctx.nodes, gp.ctx.local
    out: dict[str, list[int] | str] = {}
    dp = _solve_restricted(gp, data_parallel_filter(MeshAxis(nodes, local)), time_limit_s)
    out["data_parallel"] = dp if isinstance(dp, str) else dp[0]
    for label, make in (("megatron", megatron_filter), ("summa", summa_filter)):
        best: tuple[float, str, list[int]] | None = None
        reasons = []
        for a, b in mesh_factorisations(nodes, local, 2):
            if a.size == 1 or b.size == 1:
                continue
            res = _solve_restricted(gp, make(a, b), time_limit_s)
            if isinstance(res, str):
                reasons.append(res)
                continue
            name = f"megatron(dp={a},tp={b})" if label == "megatron" else f"summa({a}x{b})"
            if best is None or res[1] < best[0]:
                best = (res[1], name, res[0])
        if best is None:
            out[label] = reasons[0] if reasons else "needs a two-axis mesh (more than one device per axis)"
        else:
            out[best[1]] = best[2]
    return out
