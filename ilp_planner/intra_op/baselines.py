"""Baselines under the same cost model, as restrictions of the planner's own problem.

Each baseline keeps, per op, only the strategies a hand-written layout would use, then
solves the restricted problem exactly (so e.g. Megatron gets the best alternation of
column/row parallel layers and the best mesh — a generous, hand-tuned Megatron):

* ``data_parallel`` — every op split over the batch on all devices, weights replicated;
* ``megatron(dp×tp)`` — linear layers column- or row-parallel over a TP axis, batch split
  over a DP axis; other ops split the batch over DP and keep heads (attention) or nothing
  split over TP. A batch norm keeps its batch whole over DP (its channels over TP or
  whole), as it did before the planner's space had synchronised batch norm: splitting it
  over DP too doubles every batch norm's options, which made ResNet-50's Megatron members
  four times slower to price for the same figure (data parallel and Megatron-SP price
  the synchronised layouts). An attention whose heads cannot split over TP (a fused ``[q | k | v]``
  projection, GPT-2's ``c_attn``, whose column blocks are not whole heads; key/value heads
  TP does not divide) keeps them whole there: its input is gathered over TP and it runs
  replicated, as ``parallelize`` runs it on the user's module. Every two-axis mesh is
  tried: TP inside a node and TP across nodes;
* ``megatron_sp(dp×tp)`` — Megatron with sequence parallelism: as ``megatron``, but the
  norms, residual adds and other token-wise ops split their tokens over TP as well (the
  activations between blocks are ``(S0, S0)``), so the TP AllReduce becomes a
  ReduceScatter after the row-parallel linear and an AllGather before the column-parallel
  one; an activation or a gated product between a column- and a row-parallel linear
  (SwiGLU's ``silu(w1 x) * w3 x``) may stay on the columns over TP, where Megatron-SP runs
  it (:data:`_TP_REGION`);
* ``summa(r×c)`` — linear layers as 2-D SUMMA on an ``r × c`` mesh; other ops free. A
  linear whose sizes the mesh does not divide (GPT-2's 50,257-wide head: no SUMMA member
  exists) splits only what divides, the way Megatron keeps undividable heads whole: its
  tokens over the rows and, over the columns, its contraction (the output a partial sum,
  its input in SUMMA's own layout) or its output columns — whichever divides, the cheaper
  if both;
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
never be worse than any baseline — a property the tests check. Two exceptions, each named
in the member's name: a member whose data-parallel degree does not split the configured
micro-batch runs on fewer, larger micro-batches (``…,microbatches=8)``; see
:class:`~ilp_planner.intra_op.baseline_prices.MemberBuilder`), as its engine would, and a
member whose restricted problem a time-limited ILP left open states its gap
(``…,gap=0.12%)``). A family none of whose members fits says the least per-device memory
one needs.

Pricing is fast at scale: each member's problem is built with only its own strategies
(:func:`~ilp_planner.intra_op.problem.build_problem`'s ``keep``; every op's strategies
generated once per build cache, a :class:`Restriction` testing only its factorisations'
against it) — the full problem restricted,
strategy for strategy — and solved exactly (:func:`solve_exact`): by evaluating every
choice where they are few, else by variable elimination.
:func:`restrict` restricts an already built problem the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from formulations.elimination import NoFit, enumerated_optimum, solve_elimination
from formulations.problem import Problem
from formulations.sbp_ilp import SbpIlp
from ilp_planner.intra_op.moe_baselines import (
    deepspeed_moe_filter,
    has_moe,
    moe_grid_filter,
    replicated_experts_filter,
    with_moe,
)
from ilp_planner.intra_op.problem import (
    GraphProblem,
    NodeCosts,
    NodeOption,
    Restriction,
    StrategyFilter,
    SubsetNodes,
    peak_memory,
)
from ilp_planner.ir.cluster import MeshAxis, mesh_factorisations
from ilp_planner.ir.graph import Op, OpKind
from ilp_planner.ir.layouts import B, Layout, Split, drop_unit_axes
from ilp_planner.lowering.strategies import Strategy, head_splits, summa_fits

Filter = StrategyFilter
_MATMUL = (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.CONV2D, OpKind.MATMUL)
_TP_REGION = (OpKind.GELU, OpKind.SILU, OpKind.RELU, OpKind.MUL)
"""Element-wise kinds Megatron-SP may run inside the TP region, on a column-parallel
linear's output columns: an MLP's activation, a gated MLP's product."""


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


@functools.cache  # one object per member: restricted builds cache by it
def data_parallel_filter(devices_axis: MeshAxis) -> Filter:
    full = (devices_axis,)
    target = Layout(full, (Split(0),))

    def keep(op: Op, s: Strategy) -> bool:
        if s.zero:
            return False
        if op.kind in _MATMUL:
            return s.label.startswith(("3d", "conv3d")) and s.fact[0] == devices_axis
        return not s.output.has_partial and _same_data(drop_unit_axes(s.output), target)
    one = MeshAxis(1, 1)
    return Restriction(keep, frozenset({(devices_axis, one, one)}))


@functools.cache  # one object per member: restricted builds cache by it
def megatron_filter(dp: MeshAxis, tp: MeshAxis, sequence_parallel: bool = False,
                    state: Callable[[Strategy], bool] = _replicated_state) -> Filter:
    """Megatron's layouts on the ``dp × tp`` mesh; ``sequence_parallel``: token-wise ops
    (norms, adds) split their tokens over TP too (Megatron-SP); ``state`` decides which
    state-sharding levels are allowed (replicated by default)."""
    one = MeshAxis(1, 1)
    fact2 = (dp, tp)
    allowed = {Layout(fact2, (x, y)).canonical_key() for x in (Split(0), B) for y in (B, Split(1))}
    whole_batch = {Layout(fact2, (B, y)).canonical_key() for y in (B, Split(1))}
    seq = Layout(fact2, (Split(0), Split(0))).canonical_key()
    # inside the TP region, between a column- and a row-parallel linear: the columns over TP
    columns = {Layout(fact2, (x, Split(1))).canonical_key() for x in (Split(0), B)}
    # an attention's output: tokens over DP, heads over TP where they split
    attention = {h: Layout(fact2, (Split(0), h)).canonical_key() for h in (Split(1), B)}
    matmul_facts = {(dp, tp, one), (dp, one, tp)}

    def keep(op: Op, s: Strategy) -> bool:
        if not state(s):
            return False
        if op.kind in _MATMUL:
            return s.label.startswith(("3d", "conv3d")) and s.fact in matmul_facts
        if op.kind is OpKind.ATTENTION:  # heads over TP, whole where they cannot split
            heads = Split(1) if head_splits(op) % tp.size == 0 else B
            return not s.output.has_partial and s.output.canonical_key() == attention[heads]
        # a per-head q / k norm (``attrs.group_width``) runs on the heads its TP rank holds,
        # between the column-parallel projection and the attention, as Megatron-Core's
        # ``qk_layernorm`` does, sequence-parallel or not
        if sequence_parallel and op.kind not in (OpKind.SOFTMAX, OpKind.OPAQUE) \
                and not op.attrs.get("group_width"):
            # an MLP's activation and a gated MLP's product (SwiGLU's ``silu(w1 x) * w3 x``)
            # run on the column-parallel linear's split inside the TP region, as
            # Megatron-SP runs them; the tokens split over TP outside it only
            if s.output.has_partial:
                return False
            key = s.output.canonical_key()
            return key == seq or (op.kind in _TP_REGION and key in columns)
        if op.kind is OpKind.BATCHNORM:  # see the module docstring
            return s.output.canonical_key() in whole_batch
        return not s.output.has_partial and s.output.canonical_key() in allowed
    return Restriction(keep, frozenset(matmul_facts))


@functools.cache  # one object per member: restricted builds cache by it
def summa_filter(rows: MeshAxis, cols: MeshAxis) -> Filter:
    """SUMMA on the ``rows × cols`` mesh (see the module docstring): every linear as SUMMA,
    or, where the mesh does not divide its sizes (:func:`summa_fits`), split only what
    divides — its tokens over the rows and its contraction or its output columns over the
    columns (the 3-D members ``(rows, 1, cols)`` and ``(rows, cols, 1)``)."""
    one = MeshAxis(1, 1)
    fallback = {(rows, one, cols), (rows, cols, one)}

    def keep(op: Op, s: Strategy) -> bool:
        if s.zero:
            return False
        if op.kind is OpKind.LINEAR:
            if summa_fits(op, rows.size, cols.size):
                return s.label.startswith("summa") and s.fact == (rows, cols)
            return s.label.startswith("3d") and s.fact in fallback
        return True
    # 3-D strategies stay for embeddings, convolutions and activation matmuls ("free")
    return keep


@dataclass(frozen=True)
class Priced:
    """A baseline member solved exactly on its restricted problem: the problem, the choice
    (indices into it), its objective and the relative gap to the proven bound (0 when
    proven; a time-limited ILP may leave one, which the member's name then states)."""

    gp: GraphProblem
    choice: list[int]
    objective: float
    gap: float = 0.0
    # whether the memory row moved the optimum (the problem without it costs less; True
    # where that is not proven): only then can checkpointing, which needs less memory, win
    memory_binds: bool = True


class Beaten:
    """A member whose solve stopped once its proven bound passed its family's best: it
    cannot be the family's figure. The bound is its memory row's: a checkpointed twin,
    which needs less memory, may still go below it."""


BEATEN = Beaten()


def solve_exact(sub: Problem, time_limit_s: float, cutoff: float | None = None
                ) -> tuple[list[int], float, float] | str | None:
    """The optimum of a restricted problem: every choice evaluated where they are few
    (:func:`~formulations.elimination.enumerated_optimum`), else variable elimination
    (exact, and fast on the few strategies a baseline keeps); what it leaves open goes to
    the ILP on the strategies its bound keeps, within ``time_limit_s``. Returns (choice,
    objective, gap) or why none; None where the enumeration or the elimination proves that
    no choice costs less than ``cutoff``."""
    deadline = time.perf_counter() + time_limit_s
    try:
        small = enumerated_optimum(sub)
        if small is not None:
            choice, objective = small
            return None if cutoff is not None and objective >= cutoff else (
                list(choice), objective, 0.0)
        exact = solve_elimination(sub, node_solver=functools.partial(_node_ilp, deadline),
                                  cutoff=cutoff)
    except NoFit as exc:
        return f"does not fit: {exc}"
    if exact is not None and cutoff is not None and exact.result.bound is not None and \
            exact.result.bound >= cutoff:
        return None
    if exact is not None and exact.keep is None:
        return list(exact.result.choice), exact.result.objective, 0.0
    keep = exact.keep if exact is not None else [np.arange(len(c)) for c in sub.cost]
    kept = sub.subset(keep)
    warm = None
    if exact is not None:
        warm = tuple(int(np.searchsorted(kk, k)) for kk, k in zip(keep, exact.result.choice,
                                                                  strict=True))
    out = SbpIlp(kept).solve(time_limit_s=max(deadline - time.perf_counter(), 1.0),
                             warm_start=warm)
    if out is None:
        return "restricted ILP found no solution in time"
    bound = out.bound if out.bound is not None else -np.inf
    if exact is not None and exact.result.bound is not None:
        bound = max(bound, exact.result.bound)
    gap = 0.0 if out.status == "optimal" and not out.gap else max(
        0.0, (out.objective - bound) / max(abs(out.objective), 1e-30))
    return [int(keep[g][k]) for g, k in enumerate(out.choice)], out.objective, min(gap, 1.0)


def _node_ilp(deadline: float, problem: Problem) -> tuple[tuple[int, ...], float] | None:
    """The elimination's node solver: the ILP on one branch-and-bound node, exactly, within
    what is left of the member's time."""
    left = deadline - time.perf_counter()
    if left <= 0:
        return None
    res = SbpIlp(problem).solve(time_limit_s=left)
    if res is None or res.status != "optimal":
        return None
    return res.choice, min(res.objective, res.bound)


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
    """Best choice (full-problem indices) per baseline name, or a reason string, each a
    restriction of ``gp`` solved by the ILP: the reference :func:`price_families` (which
    builds only each member's strategies and solves them by elimination) is checked
    against."""
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
        for a, b in two_axis_meshes(nodes, local):
            keep = make(a, b)
            if label != "summa":  # Megatron-Core: experts EP × ETP beside the dense layers
                keep = with_moe(keep, moe_grid_filter(a, b, _replicated_state))
            res = _solve_restricted(gp, keep, time_limit_s)
            if isinstance(res, str):
                reasons.append(res)
                continue
            name = member_name(label, a, b)
            if best is None or res[1] < best[0]:
                best = (res[1], name, res[0])
        if best is None:
            out[label] = reasons[0] if reasons else "needs a two-axis mesh (more than one device per axis)"
        else:
            out[best[1]] = best[2]
    return out


def two_axis_meshes(nodes: int, local: int) -> list[tuple[MeshAxis, MeshAxis]]:
    """The ``a × b`` views of the mesh with more than one device per axis (Megatron's
    dp × tp, SUMMA's rows × columns)."""
    return [(a, b) for a, b in mesh_factorisations(nodes, local, 2) if a.size > 1 and b.size > 1]


def member_name(label: str, a: MeshAxis, b: MeshAxis) -> str:
    """A family member's name: ``megatron(dp=16,tp=8)``, ``summa(4x8)``."""
    return f"summa({a}x{b})" if label == "summa" else f"{label}(dp={a},tp={b})"


Build = Callable[[tuple[int, ...], frozenset, Filter, int], NodeCosts | SubsetNodes]
"""``build(zero_levels, recomputed_blocks, keep, dp)``: the first half
(:func:`~ilp_planner.intra_op.problem.build_nodes`) of the planner's problem restricted to
the strategies ``keep`` passes (:func:`~ilp_planner.intra_op.problem.build_problem`'s
``keep``), for a member splitting the batch ``dp`` ways — on the configured micro-batches,
or where their batch does not split so, on another micro-batch count that does (the
problem's ``microbatches`` says which). Raises ``ValueError`` naming what is missing."""


@dataclass(eq=False)
class _Built:
    """A member's restricted build, its edges priced only once it is solved (``nodes``:
    :class:`~ilp_planner.intra_op.problem.NodeCosts`, under the budget left to it), and
    the least memory any of its choices needs (with its reserve); ``priced``: its price
    once solved."""

    nodes: NodeCosts | SubsetNodes
    need: float
    priced: Priced | float | str | None = None
    # a proven bound on its optimum without the memory row, once a solve under a budget
    # found it (:func:`_solved`): no checkpointed twin goes below it
    floor: float | None = None

    @property
    def gp(self) -> GraphProblem:
        """The whole problem (its edges priced on first use)."""
        return self.nodes.complete()


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Members built per :data:`Build` (dropped with it), with their prices once solved:
Megatron's and Megatron-SP's members are the torchtitan grid's DDP points without
checkpointing — the same cached filter objects, levels, blocks and budget — so the families
read the grid's builds and prices."""


def _member_problem(build: Build, keep: Filter, dp: int, budget: float | None,
                    levels: tuple[int, ...] = (0,), blocks: frozenset = frozenset(),
                    reserve_transients: bool = False) -> _Built | float | str:
    """A member's build (once per ``build``, :data:`_BUILT`): :func:`_build_member`."""
    memo = _BUILT.setdefault(build, {})
    key = (keep, dp, budget, levels, blocks, reserve_transients)
    if key not in memo:
        memo[key] = _build_member(build, keep, dp, budget, levels, blocks, reserve_transients)
    return memo[key]


def _build_member(build: Build, keep: Filter, dp: int, budget: float | None,
                  levels: tuple[int, ...], blocks: frozenset, reserve_transients: bool
                  ) -> _Built | float | str:
    """The problem, or the least memory it needs where that exceeds ``budget``, or why it
    has no layout."""
    try:
        nodes = build(levels, blocks, keep, dp)
    except ValueError as exc:
        return str(exc)
    reserve = _reserve(nodes.options) if reserve_transients else 0.0
    need = nodes.min_memory() + reserve
    if budget is not None:
        if need > budget:
            return need
        nodes.memory_budget = budget - reserve
    return _Built(nodes, need)


def _member_price(built: _Built, budget: float | None, time_limit_s: float,
                  beat: float | None = None) -> Priced | float | str | Beaten | None:
    """A built member's price (once: ``built.priced``), against ``beat``, the best objective
    of its family so far: None where a bound without the memory row already exceeds it
    (the member's nodes alone, then with its edges, then its memory-free solve stopped
    there) — nor can any checkpointed twin go below it, as each of their choices costs at
    least as much; :data:`BEATEN` where the solve with the row stopped there."""
    if built.priced is not None:
        return built.priced
    cutoff = None if beat is None else beat * (1 + _BEAT_MARGIN)
    if cutoff is not None and (built.nodes.bound() > cutoff
                               or lower_bound(built.gp.problem) > cutoff):
        return None  # the first test before the edges are priced
    res = _solved(built, budget, time_limit_s, cutoff)
    if res is not None and res is not BEATEN:
        built.priced = res
    return res


def _solved(built: _Built, budget: float | None, time_limit_s: float,
            cutoff: float | None) -> Priced | float | str | Beaten | None:
    """:func:`_member_price`'s solves. Under a budget the problem is solved without its
    memory row first: where that optimum fits it is the optimum, and the row binds nothing
    (one solve, and the answer the grid's checkpointing skip needs)."""
    gp, need = built.gp, built.need
    problem, out, free, binds = gp.problem, None, None, True
    if problem.memory_budget is not None:
        free = solve_exact(dataclasses.replace(problem, memory_budget=None), time_limit_s, cutoff)
        if free is None:
            return None
        if not isinstance(free, str):
            built.floor = free[1] - free[2] * abs(free[1])
        if not isinstance(free, str) and free[2] == 0 and problem.feasible(free[0]):
            out, binds = free, False
    if out is None:
        out = solve_exact(problem, time_limit_s, cutoff)
        if out is None:  # without a budget the problem is the memory-free one
            return None if problem.memory_budget is None else BEATEN
        if not isinstance(out, str) and out[2] == 0 and isinstance(free, tuple) \
                and free[2] == 0:
            binds = free[1] < out[1] * (1 - 1e-12)  # another choice as cheap as the free one
    if isinstance(out, str):
        return need if out.startswith("does not fit") else out
    choice, objective, gap = out
    if budget is not None and peak_memory(gp, choice) > budget * (1 + 1e-9):
        return peak_memory(gp, choice)  # re-materialised blocks or transients exceed it
    broken = gp.unrunnable(choice)  # every member breaks what the runtime can run
    if broken is not None:
        return f"parallelize: {broken}"
    return Priced(gp, choice, objective, gap, binds)


_BEAT_MARGIN = 1e-6
"""Relative margin of :func:`_member_price`'s skip and cutoff: a bound only this far above
the best is still solved, so that the solvers' rounding cannot skip a member whose price
ties it."""


def lower_bound(problem: Problem) -> float:
    """A bound no choice of ``problem`` goes below: every group's cheapest strategy and
    every edge's cheapest entry, each on its own (the fused gradient AllReduces' latency,
    never negative, left out)."""
    return float(sum(c.min() for c in problem.cost)
                 + sum(r.min() for r in problem.edges.values() if r.size))


def _named(name: str, priced: Priced, microbatches: int) -> str:
    """``name`` with what differs from the plan: another micro-batch count, a gap left."""
    extra = [f"microbatches={priced.gp.microbatches}"] * (priced.gp.microbatches != microbatches)
    extra += [f"gap={priced.gap:.2%}"] * (priced.gap > 0)
    if not extra:
        return name
    return f"{name[:-1]},{','.join(extra)})" if name.endswith(")") else f"{name}({','.join(extra)})"


def family_failure(label: str, needs: list[tuple[float, str]], reasons: list[str],
                   budget: float | None) -> str:
    """Why a family has no price: the least per-device memory any member needs against
    the budget, or (no member has its layouts) the first member's reason."""
    if needs and budget is not None:
        need, who = min(needs)
        return (f"no {label} member fits: the smallest needs {need / 2**30:.4g} GiB per "
                f"device ({who}); the budget is {budget / 2**30:.4g} GiB")
    return reasons[0] if reasons else "needs a two-axis mesh (more than one device per axis)"


def price_families(build: Build, nodes: int, local: int, microbatches: int,
                   budget: float | None, time_limit_s: float,
                   moe: bool = False, prune: bool = True) -> dict[str, Priced | str]:
    """The usual baselines (data parallel, Megatron, Megatron-SP, SUMMA), each the best of
    its members (every two-axis mesh) on restricted problems solved exactly — the prices
    of :func:`baseline_choices` without building or searching the strategies they drop.
    ``microbatches``: the plan's (a member on another count says so in its name). A family
    with no member that fits says the least memory one needs. ``moe``: the graph has MoE
    ops (:mod:`~ilp_planner.intra_op.moe_baselines`: data parallel replicates the experts,
    Megatron-Core splits them EP × ETP, and DeepSpeed-MoE joins the families). ``prune``:
    skip the solve of a member whose lower bound exceeds its family's best so far, and stop
    a solve once its proven bound does (:func:`_member_price`; the same prices; False
    solves every member to its optimum, the reference the tests check it against)."""
    out: dict[str, Priced | str] = {}
    whole = MeshAxis(nodes, local)
    families = [("data_parallel", [(whole, None)])] + [
        (label, two_axis_meshes(nodes, local)) for label in ("megatron", "megatron_sp", "summa")]
    if moe:
        families.insert(1, ("deepspeed_moe", [(whole, None)]))
    for label, meshes in families:
        best = _best_member(build, label, meshes, budget, time_limit_s, prune)
        if isinstance(best, str):
            out[label] = best
        else:
            out[_named(best[0], best[1], microbatches)] = best[1]
    return out


def _best_member(build: Build, label: str, meshes: list, budget: float | None,
                 time_limit_s: float, prune: bool) -> tuple[str, Priced] | str:
    """A family's best member, or why it has none. Every member's nodes are built first
    (:class:`~ilp_planner.intra_op.problem.NodeCosts`), then members are solved cheapest
    node bound first, so that the first prices found are low and the members whose bound
    exceeds the best are neither completed nor solved, nor solved past it (``prune``); the
    best is the first member in ``meshes`` order at the least objective, as solving them in
    order."""
    needs: list[tuple[float, str]] = []
    reasons: list[tuple[int, str]] = []
    staged: list[tuple[float, int, str, _Built]] = []
    for i, (a, b) in enumerate(meshes):
        name = label if b is None else member_name(label, a, b)
        built = _member_problem(build, _family_filter(label, a, b),
                                1 if label == "summa" else a.size, budget)
        if isinstance(built, float):
            needs.append((built, name))
        elif isinstance(built, str):
            reasons.append((i, built))
        else:
            staged.append((built.nodes.bound(), i, name, built))
    best: tuple[float, int, str, Priced] | None = None
    for _, i, name, built in sorted(staged, key=lambda s: s[:2]):
        res = _member_price(built, budget, time_limit_s,
                            beat=None if best is None or not prune else best[0])
        if isinstance(res, float):
            needs.append((res, name))
        elif isinstance(res, str):
            reasons.append((i, res))
        elif isinstance(res, Priced) and (best is None or (res.objective, i) < best[:2]):
            best = (res.objective, i, name, res)
    if best is None:
        return family_failure(label, needs, [r for _, r in sorted(reasons)], budget)
    return best[2], best[3]


def _family_filter(label: str, a: MeshAxis, b: MeshAxis | None) -> Filter:
    """A family member's filter (cached objects: restricted builds cache by them), with
    the MoE ops' choices of that family (a graph without MoE ops never consults them)."""
    devices = a.size * (b.size if b is not None else 1)
    if label == "data_parallel":
        return with_moe(data_parallel_filter(a), replicated_experts_filter(devices))
    if label == "deepspeed_moe":
        return with_moe(data_parallel_filter(a), deepspeed_moe_filter(devices))
    assert b is not None
    if label == "summa":
        return summa_filter(a, b)
    return with_moe(_FILTERS[label](a, b), moe_grid_filter(a, b, _replicated_state))


@functools.cache  # one object per member: restricted builds cache by it
def _megatron_sp(dp: MeshAxis, tp: MeshAxis) -> Filter:
    return megatron_filter(dp, tp, sequence_parallel=True)


_FILTERS: dict[str, Callable[[MeshAxis, MeshAxis], Filter]] = {
    # called as the torchtitan grid's DDP points call it: the same (cached) filter object,
    # so the two share restricted options within one build cache
    "megatron": lambda a, b: megatron_filter(a, b, False, _replicated_state),
    "megatron_sp": lambda a, b: megatron_filter(a, b, True, _replicated_state),
    "summa": summa_filter}


AC_MODES = ("none", "full", "selective")
"""torchtitan's activation checkpointing: none, every block, or every other block (its
layer-level selective mode with frequency 2)."""


def ac_blocks(graph, mode: str) -> frozenset[tuple[str, int]]:
    """The blocks an activation checkpointing mode recomputes."""
    units = graph.blocks()
    return frozenset({"none": [], "full": units, "selective": units[::2]}[mode])


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
                      time_limit_s: float = 30.0, microbatches: int | None = None,
                      prune: bool = True) -> GridPoint | str:
    """The best point of torchtitan's grid under the same cost model and memory budget:
    data parallel as DDP (replicated state) or FSDP (ZeRO-3), × every dp × tp mesh
    (tp = 1: pure data parallel), × sequence parallel on or off (tp > 1), × activation
    checkpointing (:data:`AC_MODES`; only ``none`` without a budget, where recomputation
    only costs). ``build`` (:data:`Build`) builds the planner's problem restricted to each
    point's strategies. Each point is solved exactly; FSDP reserves its largest gathered
    transient, and a point whose exact peak
    (:func:`~ilp_planner.intra_op.problem.peak_memory`) exceeds the budget is dropped.
    ``microbatches``: the plan's (a point on another count says so in its name). Returns
    why when no point fits (the least memory a point needs, against the budget). ``prune``:
    as :func:`price_families`'s."""

    modes = AC_MODES if budget is not None else ("none",)
    # modes recomputing the same blocks are one point (a model without blocks: all three)
    modes = tuple({ac_blocks(graph, m): m for m in reversed(modes)}.values())[::-1]
    search = _GridSearch(build, budget, time_limit_s, prune)
    for fsdp in (False, True):
        for mode in modes:
            search.group(fsdp, mode, ac_blocks(graph, mode), mesh_factorisations(nodes, local, 2))
    if search.best is None:
        return family_failure("torchtitan grid", search.needs,
                              [r for _, r in sorted(search.reasons)], budget)
    _, _, name, priced, reserve = search.best
    return GridPoint(_named(name, priced, microbatches or priced.gp.microbatches), priced.gp,
                     priced.choice, priced.objective, reserve)


@dataclass
class _GridSearch:
    """:func:`torchtitan_choice`'s state over its groups of points (one state sharding and
    checkpointing mode each): the best so far as (objective, order, name, price, memory
    reserved for transients) — the first point in grid order at the least objective — and
    why the others have none."""

    build: Build
    budget: float | None
    time_limit_s: float
    prune: bool
    best: tuple[float, int, str, Priced, float] | None = None
    needs: list[tuple[float, str]] = field(default_factory=list)
    reasons: list[tuple[int, str]] = field(default_factory=list)
    # (fsdp, dp, tp, sp) of the points whose optimum without checkpointing ignores the
    # memory row, or whose bound without the row already exceeds the best: checkpointing
    # cannot win there (:meth:`_done_without_checkpointing`)
    done: set[tuple] = field(default_factory=set)
    # (fsdp, dp, tp, sp) → its plain point's proven bound without the memory row
    # (:attr:`_Built.floor`): a checkpointed twin costs at least that, so once the best
    # is below it the twin is never built
    floors: dict[tuple, float] = field(default_factory=dict)
    order: int = 0

    def group(self, fsdp: bool, mode: str, blocks: frozenset, meshes: list) -> None:
        """One group's points: all built, then solved cheapest lower bound first."""
        staged: list[tuple[float, int, str, tuple, _Built]] = []
        for dp, tp in meshes:
            for sp in (False, True) if tp.size > 1 else (False,):
                self.order += 1
                if mode != "none" and ((fsdp, dp, tp, sp) in self.done
                                       or self._beaten_twin((fsdp, dp, tp, sp))):
                    continue  # checkpointing could only add work (``done``, ``floors``)
                name = (f"torchtitan({'fsdp' if fsdp else 'ddp'}={dp},tp={tp},"
                        f"{'sp,' if sp else ''}ac={mode})")
                state = _fully_sharded if fsdp else _replicated_state
                keep = with_moe(megatron_filter(dp, tp, sp, state),
                                moe_grid_filter(dp, tp, state))
                built = _member_problem(self.build, keep, dp.size, self.budget,
                                        (0, 3) if fsdp else (0,), blocks,
                                        reserve_transients=fsdp)
                if isinstance(built, float):
                    self.needs.append((built, name))
                elif isinstance(built, str):
                    self.reasons.append((self.order, built))
                else:
                    staged.append((built.nodes.bound(), self.order, name, (dp, tp, sp),
                                   built))
        for _, i, name, point, built in sorted(staged, key=lambda s: s[:2]):
            beat = None if self.best is None or not self.prune else self.best[0]
            res = _member_price(built, self.budget, self.time_limit_s, beat)
            if mode == "none" and self._done_without_checkpointing(res):
                self.done.add((fsdp, *point))
            if mode == "none" and built.floor is not None:
                self.floors[(fsdp, *point)] = built.floor
            if isinstance(res, float):
                self.needs.append((res, name))
            elif isinstance(res, str):
                self.reasons.append((i, res))
            elif isinstance(res, Priced) and (self.best is None
                                              or (res.objective, i) < self.best[:2]):
                self.best = (res.objective, i, name, res,
                             _reserve(res.gp.options) if fsdp else 0.0)

    def _beaten_twin(self, point: tuple) -> bool:
        """Whether the best so far is already below what every checkpointed twin of
        ``point`` costs (its plain point's :attr:`floors`; with ``prune`` only)."""
        floor = self.floors.get(point)
        return (self.prune and self.best is not None and floor is not None
                and floor > self.best[0] * (1 + _BEAT_MARGIN))

    @staticmethod
    def _done_without_checkpointing(res: Priced | float | str | Beaten | None) -> bool:
        """Whether a point's checkpointed twins need no pricing, from its plain price:
        none where its memory-free bound already exceeds the best (None), or where its
        optimum is the one without the memory row (recomputation only adds work: a
        recomputed option costs at least its plain twin — its forward again; under ZeRO-3
        the recomputation's gather replaces the backward's — and a recomputed block's input
        programs run again, so every choice costs at least as much checkpointed)."""
        return res is None or (isinstance(res, Priced) and not res.memory_binds)


def _reserve(options: dict[str, list[NodeOption]]) -> float:
    """The largest transient of any option (FSDP's gathered weights): what a point
    reserves of the budget."""
    return max((o.transient_bytes for opts in options.values() for o in opts), default=0.0)
