"""A choice of the intra-op problem realised: its layers' plans and its cost breakdown, as
the plan stores and the runtime runs them."""

from __future__ import annotations

from ilp_planner.intra_op.problem import GraphProblem, peak_memory
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.cost_model import Collective
from ilp_planner.lowering.grad_buckets import exposed_grad_sync, fill_buckets
from ilp_planner.lowering.redistribution import plan_redistribution
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.stage_boundary import export_program, import_program
from ilp_planner.lowering.strategies import (
    SyncBucket,
    tie_transposes,
    tied_exchange_collectives,
    tied_source,
)
from ilp_planner.plan.data import CostBreakdown, LayerPlan


def realise(gp: GraphProblem, choice: list[int], stage: int = 0,
            stage_of: dict[str, int] | None = None) -> tuple[list[LayerPlan], CostBreakdown]:
    """Per-layer plans and the cost breakdown of a choice: intra-op collectives of each op
    plus the redistribution of every input into the layout its consumer needs (a shared
    read's once, on its priced reader: :mod:`ilp_planner.lowering.shared_reads`), and, for a
    pipeline stage, its boundary programs (:mod:`ilp_planner.lowering.stage_boundary`). Each op's
    gradient synchronisation is fused into the runtime's buckets
    (:func:`~ilp_planner.lowering.grad_buckets.fill_buckets`, per stage when ``stage_of`` cuts the
    graph into stages), listed on the layer completing each."""
    chosen = gp.node_choice(choice)
    graph = gp.graph
    rides = riders(graph)
    rows: list[tuple] = []
    syncs: list[tuple[str, SyncBucket]] = []
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        node = gp.owner[op.name]
        pos = gp.position[op.name]
        opt = chosen[node]
        colls: list[Collective] = []
        for idx, src in enumerate(op.inputs):
            want = opt.inputs[pos][idx]
            if src in gp.boundary.imported:
                red = import_program(want, opt.grads[pos][idx], graph[src].output, gp.ctx.cluster)
                colls += red.forward + red.backward
                continue
            if graph[src].kind is OpKind.INPUT:
                continue
            if gp.owner[src] == node:
                continue  # a follower reads its producer inside the node (resolve counted)
            if (op.name, idx) in rides:
                continue  # reads the shared value its priced reader's program made
            have = chosen[gp.owner[src]].outputs[gp.position[src]]
            red = plan_redistribution(have, want, graph[src].output, gp.ctx.cluster,
                                      opt.grads[pos][idx])
            colls += red.forward + red.backward
            if opt.recompute:  # the checkpointed block runs its input programs again
                colls += [c.with_phase("recompute") for c in red.forward]
        colls += [c for c in opt.collectives[pos] if c.purpose != "grad_sync"]
        if pos == 0:  # the strategy's grad_sync collectives, as SyncBuckets to fuse
            syncs += [(op.name, b) for b in opt.syncs]
        if op.name in gp.boundary.exported:
            red = export_program(opt.outputs[pos], op.output, gp.ctx.cluster)
            colls += red.forward + red.backward
        emb = tied_source(graph, op) if op.attrs.get("tied") else None
        if emb is not None and emb.name in gp.owner and pos == 0:
            colls += tied_exchange_collectives(chosen[gp.owner[emb.name]].base.weight,
                                               opt.base.weight, emb.weight, gp.ctx.cluster,
                                               tie_transposes(op))
        rows.append((op, pos, node, opt, colls))
    where = stage_of or {}
    colls_of = {r[0].name: r[4] for r in rows}
    for s in sorted({where.get(name, stage) for name, _ in syncs}):
        mine = [(name, b) for name, b in syncs if where.get(name, stage) == s]
        for bucket in fill_buckets(mine, gp.grad_bucket_bytes, gp.ctx):
            colls_of[bucket.launcher].append(bucket.collective)
    layers: list[LayerPlan] = []
    for op, pos, node, opt, colls in rows:
        is_base = pos == 0
        held = 0.0 if opt.recompute else opt.outputs[pos].local_bytes(op.output)
        layers.append(LayerPlan(
            op.name, op.kind.value, opt.base.label if is_base else f"follows {node}",
            opt.inputs[pos], opt.base.weight if is_base else None, opt.outputs[pos],
            opt.compute_s[pos], (opt.state_bytes if is_base else 0.0) + held, tuple(colls),
            stage, tuple(graph[s].output.shape for s in op.inputs), op.output.shape,
            opt.base.zero if is_base else 0, opt.recompute,
        ))
    compute = sum(ly.compute_s for ly in layers)
    return layers, CostBreakdown.of(compute, [c for ly in layers for c in ly.collectives],
                                    peak_memory(gp, choice), gp.microbatches,
                                    exposed_grad_sync(layers))
