"""Baselines under the same cost model, as restrictions of the planner's own problem.

Each baseline keeps, per op, only the strategies a hand-written layout would use, then
solves the restricted problem exactly (so e.g. Megatron gets the best alternation of
column/row parallel layers and the best mesh — a generous, hand-tuned Megatron):

* ``data_parallel`` — every op split over the batch on all devices, weights replicated;
* ``megatron(dp×tp)`` — linear layers column- or row-parallel over a TP axis, batch split
  over a DP axis; other ops split the batch over DP and keep heads (attention) or nothing
  split over TP. An attention whose heads cannot split over TP (a fused ``[q | k | v]``
  projection, GPT-2's ``c_attn``, whose column blocks are not whole heads; key/value heads
  TP does not divide) keeps them whole there: its input is gathered over TP and it runs
  replicated, as ``parallelize`` runs it on the user's module. Every two-axis mesh is
  tried: TP inside a node and TP across nodes;
* ``megatron_sp(dp×tp)`` — Megatron with sequence parallelism: as ``megatron``, but the
  norms, residual adds and other token-wise ops split their tokens over TP as well (the
  activations between blocks are ``(S0, S0)``), so the TP AllReduce becomes a
  ReduceScatter after the row-parallel linear and an AllGather before the column-parallel
  one;
* ``summa(r×c)`` — linear layers as 2-D SUMMA on an ``r × c`` mesh; other ops free;
* ``torchtitan(…)`` — what a careful torchtitan user picks by sweeping its knobs: the best
  of the grid FSDP (ZeRO-3) or DDP degree × TP degree × sequence parallel × activation
  checkpointing {none, full, selective (every other block)} (:func:`torchtitan_choice`;
  pipeline stages are not part of this grid yet).

Mixture-of-experts ops (:mod:`ilp_planner.intra_op.moe_baselines`): ``data_parallel``
replicates the experts; ``deepspeed_moe`` (graphs with MoE ops) is data parallel with the
experts split over an EP group of the data-parallel devices; the Megatron baselines and the
torchtitan grid lay the experts out EP × ETP (ETP = TP or 1) as Megatron-Core and torchtitan do.

None of these shards optimizer state or recomputes activations except torchtitan's.

Because these strategies are members of the planner's space, the planner's optimum can
never be worse than any baseline — a property the tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from formulations.problem import Problem
from formulations.sbp_ilp import SbpIlp
from ilp_planner.intra_op.moe_baselines import (
    deepspeed_moe_filter,
    has_moe,
    moe_grid_filter,
    replicated_experts_filter,
    with_moe,
)
from ilp_planner.intra_op.problem import GraphProblem, peak_memory
from ilp_planner.ir.cluster import MeshAxis, mesh_factorisations
from ilp_planner.ir.graph import Op, OpKind
from ilp_planner.ir.layouts import B, Layout, Split, drop_unit_axes
from ilp_planner.lowering.strategies import Strategy, head_splits

Filter = Callable[[Op, Strategy], bool]
_MATMUL = (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.CONV2D, OpKind.MATMUL)


def restrict(gp: GraphProblem, keep: Filter) -> tuple[Problem, list[np.ndarray]] | str:
    """The sub-problem keeping only strategies passing ``keep``; or a reason string."""
    allowed: list[np.ndarray] = []
    for group in gp.groups:
        node = group[0]
        op = gp.graph[node]
        # an op nothing can shard is replicated in any hand-written layout too
        idx = np.array([k for k, o in enumerate(gp.options[node])
                        if (op.kind is OpKind.OPAQUE and not o.base.zero) or keep(op, o.base)],
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


def _replicated_state(s: Strategy) -> bool:
    return s.zero == 0


def _fully_sharded(s: Strategy) -> bool:
    """FSDP: every parameter whose gradient is reduced is sharded (ZeRO-3); the others
    (complete gradients, nothing replicated) stay as they are."""
    return s.zero == 3 or not any(c.purpose == "grad_sync" for c in s.collectives)


def data_parallel_filter(devices_axis: MeshAxis) -> Filter:
    full = (devices_axis,)
    target = Layout(full, (Split(0),))

    def keep(op: Op, s: Strategy) -> bool:
        if s.zero:
            return False
        if op.kind in _MATMUL:
            return s.label.startswith(("3d", "conv3d")) and s.fact[0] == devices_axis
        return not s.output.has_partial and _same_data(drop_unit_axes(s.output), target)
    return keep


def megatron_filter(dp: MeshAxis, tp: MeshAxis, sequence_parallel: bool = False,
                    state: Callable[[Strategy], bool] = _replicated_state) -> Filter:
    """Megatron's layouts on the ``dp × tp`` mesh; ``sequence_parallel``: token-wise ops
    (norms, adds) split their tokens over TP too (Megatron-SP); ``state`` decides which
    state-sharding levels are allowed (replicated by default)."""
    one = MeshAxis(1, 1)
    fact2 = (dp, tp)
    allowed = {Layout(fact2, (x, y)).canonical_key() for x in (Split(0), B) for y in (B, Split(1))}
    seq = Layout(fact2, (Split(0), Split(0))).canonical_key()
    matmul_facts = {(dp, tp, one), (dp, one, tp)}

    def keep(op: Op, s: Strategy) -> bool:
        if not state(s):
            return False
        if op.kind in _MATMUL:
            return s.label.startswith(("3d", "conv3d")) and s.fact in matmul_facts
        if op.kind is OpKind.ATTENTION:  # heads over TP, whole where they cannot split
            heads = Split(1) if head_splits(op) % tp.size == 0 else B
            return not s.output.has_partial and s.output.canonical_key() == Layout(
                fact2, (Split(0), heads)).canonical_key()
        if sequence_parallel and op.kind not in (OpKind.SOFTMAX, OpKind.OPAQUE):
            return not s.output.has_partial and s.output.canonical_key() == seq
        return not s.output.has_partial and s.output.canonical_key() in allowed
    return keep


def summa_filter(rows: MeshAxis, cols: MeshAxis) -> Filter:
    def keep(op: Op, s: Strategy) -> bool:
        if s.zero:
            return False
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
        return (f"does not fit: needs at least {sub.min_memory()[0] / 2**30:.4g} GiB per device, "
                f"budget {sub.memory_budget / 2**30:.4g} GiB")
    out = SbpIlp(sub).solve(time_limit_s=time_limit_s)
    if out is None:
        return "restricted ILP found no solution in time"
    choice = [int(allowed[g][k]) for g, k in enumerate(out.choice)]
    return choice, out.objective


def baseline_choices(gp: GraphProblem, time_limit_s: float = 30.0) -> dict[str, list[int] | str]:
    """Best choice (full-problem strategy indices) per baseline name, or a reason string."""
    nodes, local = gp.ctx.nodes, gp.ctx.local
    out: dict[str, list[int] | str] = {}
    dp = _solve_restricted(gp, with_moe(data_parallel_filter(MeshAxis(nodes, local)),
                                        replicated_experts_filter(nodes * local)), time_limit_s)
    out["data_parallel"] = dp if isinstance(dp, str) else dp[0]
    if has_moe(gp.graph):
        ds = _solve_restricted(gp, with_moe(data_parallel_filter(MeshAxis(nodes, local)),
                                            deepspeed_moe_filter(nodes * local)), time_limit_s)
        out["deepspeed_moe"] = ds if isinstance(ds, str) else ds[0]
    for label, make in (("megatron", megatron_filter), ("megatron_sp", _megatron_sp),
                        ("summa", summa_filter)):
        best: tuple[float, str, list[int]] | None = None
        reasons = []
        for a, b in mesh_factorisations(nodes, local, 2):
            if a.size == 1 or b.size == 1:
                continue
            keep = make(a, b)
            if label != "summa":  # Megatron-Core: experts EP × ETP beside the dense layers
                keep = with_moe(keep, moe_grid_filter(a, b, _replicated_state))
            res = _solve_restricted(gp, keep, time_limit_s)
            if isinstance(res, str):
                reasons.append(res)
                continue
            name = f"{label}(dp={a},tp={b})" if label != "summa" else f"summa({a}x{b})"
            if best is None or res[1] < best[0]:
                best = (res[1], name, res[0])
        if best is None:
            out[label] = reasons[0] if reasons else "needs a two-axis mesh (more than one device per axis)"
        else:
            out[best[1]] = best[2]
    return out


def _megatron_sp(dp: MeshAxis, tp: MeshAxis) -> Filter:
    return megatron_filter(dp, tp, sequence_parallel=True)


AC_MODES = ("none", "full", "selective")
"""torchtitan's activation checkpointing: none, every block, or every other block (its
layer-level selective mode with frequency 2)."""


def ac_blocks(graph, mode: str) -> frozenset[tuple[str, int]]:
    """The blocks an activation checkpointing mode recomputes."""
    units = graph.blocks()
    return frozenset({"none": [], "full": units, "selective": units[::2]}[mode])


Build = Callable[[tuple[int, ...], frozenset], GraphProblem]


@dataclass(frozen=True)
class GridPoint:
    """The best torchtitan configuration: its name, the problem it was priced on (with its
    state sharding levels and recomputed blocks), the choice and the memory reserved for
    transients."""

    name: str
    gp: GraphProblem
    choice: list[int]
    objective: float
    reserve: float


def torchtitan_choice(graph, build: Build, nodes: int, local: int, budget: float | None,
                      time_limit_s: float = 30.0) -> GridPoint | str:
    """The best point of torchtitan's grid under the same cost model and memory budget:
    data parallel as DDP (replicated state) or FSDP (ZeRO-3), × every dp × tp mesh
    (tp = 1: pure data parallel), × sequence parallel on or off (tp > 1), × activation
    checkpointing (:data:`AC_MODES`; only ``none`` without a budget, where recomputation
    only costs). ``build(zero_levels, recomputed_blocks)`` builds the planner's problem.
    Each point is solved exactly; FSDP reserves its largest gathered transient, and a point
    whose exact peak (:func:`~ilp_planner.intra_op.problem.peak_memory`) exceeds the budget is
    dropped. Returns a reason string when no point fits."""

    best: GridPoint | None = None
    reasons: list[str] = []
    modes = AC_MODES if budget is not None else ("none",)
    for fsdp in (False, True):
        for mode in modes:
            gp = build((0, 3) if fsdp else (0,), ac_blocks(graph, mode))
            for dp, tp in mesh_factorisations(nodes, local, 2):
                for sp in (False, True) if tp.size > 1 else (False,):
                    state = _fully_sharded if fsdp else _replicated_state
                    keep = with_moe(megatron_filter(dp, tp, sp, state),
                                    moe_grid_filter(dp, tp, state))
                    res = restrict(gp, keep)
                    if isinstance(res, str):
                        reasons.append(res)
                        continue
                    sub, allowed = res
                    reserve = max((gp.options[n][int(k)].transient_bytes
                                   for g, group in enumerate(gp.groups) for n in group
                                   for k in allowed[g]), default=0.0)
                    if budget is not None:
                        sub.memory_budget = budget - reserve
                        if sub.memory_budget <= 0 or sub.min_memory()[0] > sub.memory_budget:
                            reasons.append(f"dp={dp},tp={tp}: does not fit")
                            continue
                    out = SbpIlp(sub).solve(time_limit_s=time_limit_s)
                    if out is None:
                        reasons.append("restricted ILP found no solution in time")
                        continue
                    choice = [int(allowed[g][k]) for g, k in enumerate(out.choice)]
                    if budget is not None and peak_memory(gp, choice) > budget * (1 + 1e-9):
                        reasons.append(f"dp={dp},tp={tp}: re-materialised blocks exceed the "
                                       f"budget")
                        continue
                    if best is None or out.objective < best.objective:
                        name = (f"torchtitan({'fsdp' if fsdp else 'ddp'}={dp},tp={tp},"
                                f"{'sp,' if sp else ''}ac={mode})")
                        best = GridPoint(name, gp, choice, out.objective, reserve)
    if best is None:
        return reasons[0] if reasons else "no grid point fits"
    return best

