"""A choice of the intra-op problem realised: its layers' plans and its cost breakdown, as
the plan stores and the runtime runs them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from formulations.result import SolveResult
from ilp_planner.intra_op.problem import GraphProblem, peak_memory
from ilp_planner.ir.graph import OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.cost_model import Collective
from ilp_planner.lowering.grad_buckets import exposed_grad_sync, fill_buckets
from ilp_planner.lowering.redistribution import plan_redistribution
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.stage_boundary import export_program, import_program
from ilp_planner.lowering.strategies import (
    SyncBucket,
    follower_held_bytes,
    tie_transposes,
    tied_exchange_collectives,
    tied_source,
)
from ilp_planner.plan.data import CostBreakdown, LayerPlan

EdgeMemo = dict
"""Cluster → ``(have, want, tensor, grad)`` → the edge's (forward, backward) collectives and
its slices' (forward, backward) seconds: the programs of :func:`plan_redistribution` kept
across realisations (a pure function of its arguments; the stage DP realises thousands of
choices over the same edges)."""

Row = tuple
"""(op, position in its node, node, chosen option, the op's collectives, the seconds a
micro-batch of its programs' local work beside them — the slices' copies,
:attr:`~ilp_planner.lowering.redistribution.RedistStep.local_s` — which its layer's
``compute_s`` carries)."""


def realise(gp: GraphProblem, choice: list[int], stage: int = 0,
            stage_of: dict[str, int] | None = None, memo: EdgeMemo | None = None,
            ) -> tuple[list[LayerPlan], CostBreakdown]:
    """Per-layer plans and the cost breakdown of a choice: intra-op collectives of each op
    plus the redistribution of every input into the layout its consumer needs (a shared
    read's once, on its priced reader: :mod:`ilp_planner.lowering.shared_reads`), and, for a
    pipeline stage, its boundary programs (:mod:`ilp_planner.lowering.stage_boundary`). Each op's
    gradient synchronisation is fused into the runtime's buckets
    (:func:`~ilp_planner.lowering.grad_buckets.fill_buckets`, per stage when ``stage_of`` cuts the
    graph into stages), listed on the layer completing each. ``memo`` keeps the edges'
    programs across calls (:data:`EdgeMemo`)."""
    layers: list[LayerPlan] = []
    for op, pos, node, opt, colls, local in _rows(gp, choice, stage, stage_of, memo):
        is_base = pos == 0
        held = 0.0 if opt.recompute else (
            opt.outputs[pos].local_bytes(op.output) if is_base else follower_held_bytes(
                op, gp.graph[op.inputs[0]].output, opt.inputs[pos][0], opt.outputs[pos]))
        layers.append(LayerPlan(
            op.name, op.kind.value, opt.base.label if is_base else f"follows {node}",
            opt.inputs[pos], opt.base.weight if is_base else None, opt.outputs[pos],
            opt.compute_s[pos] + local, (opt.state_bytes if is_base else 0.0) + held,
            tuple(colls),
            stage, tuple(gp.graph[s].output.shape for s in op.inputs), op.output.shape,
            opt.base.zero if is_base else 0, opt.recompute,
        ))
    compute = sum(ly.compute_s for ly in layers)
    return layers, CostBreakdown.of(compute, [c for ly in layers for c in ly.collectives],
                                    peak_memory(gp, choice), gp.microbatches,
                                    exposed_grad_sync(layers))


def realised_total_s(gp: GraphProblem, choice: list[int], memo: EdgeMemo | None = None) -> float:
    """``realise(gp, choice)[1].total_s``, bit for bit (the same figures summed in the same
    order), without building the layers' plans or the figures ``total_s`` does not read:
    what the stage DP's table needs of every stage solve it makes."""
    rows = _rows(gp, choice, 0, None, memo)
    compute = sum(r[3].compute_s[r[1]] + r[5] for r in rows)
    return CostBreakdown.of(compute, [c for r in rows for c in r[4]], 0.0,
                            gp.microbatches).total_s


@dataclass(eq=False)
class LazyRealisation:
    """A solve of ``gp`` and its realisation, made on first use: unpacks (and indexes) as
    ``(gp, res, layers, cost)``. :attr:`total_s` needs no layers
    (:func:`realised_total_s`): a stage DP reads only that of most of its solves."""

    gp: GraphProblem
    res: SolveResult
    memo: EdgeMemo | None = None
    _realised: tuple[list[LayerPlan], CostBreakdown] | None = field(default=None, repr=False)
    _total_s: float | None = field(default=None, repr=False)

    @property
    def layers(self) -> list[LayerPlan]:
        return self._realise()[0]

    @property
    def cost(self) -> CostBreakdown:
        return self._realise()[1]

    @property
    def total_s(self) -> float:
        """The cost's ``total_s``, without realising the layers."""
        if self._realised is not None:
            return self._realised[1].total_s
        if self._total_s is None:
            self._total_s = realised_total_s(self.gp, list(self.res.choice), self.memo)
        return self._total_s

    def _realise(self) -> tuple[list[LayerPlan], CostBreakdown]:
        if self._realised is None:
            self._realised = realise(self.gp, list(self.res.choice), memo=self.memo)
        return self._realised

    def __iter__(self) -> Iterator[Any]:
        return iter((self.gp, self.res, self.layers, self.cost))

    def __getitem__(self, i: int) -> Any:
        return getattr(self, ("gp", "res", "layers", "cost")[i])

    def __len__(self) -> int:
        return 4


def _edge(have: Layout, want: Layout, tensor: TensorSpec, grad: Layout | None, gp: GraphProblem,
          edges: dict | None
          ) -> tuple[tuple[Collective, ...], tuple[Collective, ...], float, float]:
    """The forward and backward collectives of one edge's program and its slices' forward
    and backward seconds (through ``edges``, the cluster's part of an :data:`EdgeMemo`,
    when given)."""
    key = (have, want, tensor, grad)
    hit = None if edges is None else edges.get(key)
    if hit is None:
        red = plan_redistribution(have, want, tensor, gp.ctx.cluster, grad)
        hit = (tuple(red.forward), tuple(red.backward), red.local_forward_s,
               red.local_backward_s)
        if edges is not None:
            edges[key] = hit
    return hit


def _rows(gp: GraphProblem, choice: list[int], stage: int, stage_of: dict[str, int] | None,
          memo: EdgeMemo | None) -> list[Row]:
    """Every op's :data:`Row` in graph order, its collectives complete: input programs, its
    own, boundary programs, tied exchanges, and the gradient buckets it launches."""
    chosen = gp.node_choice(choice)
    graph = gp.graph
    rides = riders(graph)
    edges = None if memo is None else memo.setdefault(gp.ctx.cluster, {})
    rows: list[Row] = []
    syncs: list[tuple[str, SyncBucket]] = []
    carriers = graph.gradient_carriers(gp.boundary.imported)
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        node = gp.owner[op.name]
        pos = gp.position[op.name]
        opt = chosen[node]
        colls: list[Collective] = []
        local = 0.0
        for idx, src in enumerate(op.inputs):
            want = opt.inputs[pos][idx]
            if src in gp.boundary.imported:
                red = import_program(want, opt.grads[pos][idx], graph[src].output, gp.ctx.cluster)
                colls += red.forward + red.backward
                local += red.local_forward_s + red.local_backward_s
                continue
            if graph[src].kind is OpKind.INPUT:
                continue
            if gp.owner[src] == node:
                continue  # a follower reads its producer inside the node (resolve counted)
            if (op.name, idx) in rides:
                continue  # reads the shared value its priced reader's program made
            fwd, bwd, local_fwd, local_bwd = _edge(
                chosen[gp.owner[src]].outputs[gp.position[src]], want, graph[src].output,
                opt.grads[pos][idx], gp, edges)
            colls += fwd
            local += local_fwd
            if src in carriers and not op.unused:  # else no gradient comes back: no backward
                colls += bwd
                local += local_bwd
            if opt.recompute:  # the checkpointed block runs its input programs again
                colls += [c.with_phase("recompute") for c in fwd]
                local += local_fwd
        colls += [c for c in opt.collectives[pos] if c.purpose != "grad_sync"]
        if pos == 0:  # the strategy's grad_sync collectives, as SyncBuckets to fuse
            syncs += [(op.name, b) for b in opt.syncs]
        if op.name in gp.boundary.exported:
            red = export_program(opt.outputs[pos], op.output, gp.ctx.cluster)
            colls += red.forward + red.backward
            local += red.local_forward_s + red.local_backward_s
        emb = tied_source(graph, op) if op.attrs.get("tied") else None
        if emb is not None and emb.name in gp.owner and pos == 0:
            exchange, once = tied_exchange_collectives(
                chosen[gp.owner[emb.name]].base.weight, opt.base.weight, emb.master_spec,
                gp.ctx.cluster, tie_transposes(op))
            colls += exchange
            local += once / gp.microbatches  # once a step, spread over its micro-batches
        rows.append((op, pos, node, opt, colls, local))
    where = stage_of or {}
    colls_of = {r[0].name: r[4] for r in rows}
    for s in sorted({where.get(name, stage) for name, _ in syncs}):
        mine = [(name, b) for name, b in syncs if where.get(name, stage) == s]
        for bucket in fill_buckets(mine, gp.grad_bucket_bytes, gp.ctx):
            colls_of[bucket.launcher].append(bucket.collective)
    return rows
