"""Name every process group a compiled plan uses, before any is created.

``torch.distributed.new_group`` is collective: every rank must create the same groups in
the same order. So every rank registers, from the same :class:`~runtime.compiled.CompiledPlan`
and in one fixed order, every group the edge programs, SUMMA's gathers, the MoE AllToAlls, the loss's
reductions, the parameters' meshes, the weight-gradient buckets, the cross-mesh transfers
and the tied-weight exchanges use; :meth:`runtime.mesh.MeshRegistry.create` then creates
them all at once.
"""

from __future__ import annotations

from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.moe_strategies import moe_programs
from ilp_planner.lowering.strategies import is_summa, loss_axes, param_layouts, summa_programs
from ilp_planner.plan.data import Stage
from runtime.comm import Comm
from runtime.compiled import CompiledPlan
from runtime.mesh import MeshRegistry
from runtime.transfers import transfer_group


def register_groups(c: CompiledPlan, registry: MeshRegistry, comms: dict[int, Comm]) -> None:
    """Register every group of ``c`` in ``registry`` (``comms``: one per stage)."""
    for s in c.stages:
        for name in s.layers:
            _register_layer(c, s, name, registry, comms[s.index])
    _register_transfers(c, registry, comms)
    _register_tied(c, registry, comms)


def _register_layer(c: CompiledPlan, stage: Stage, name: str, registry: MeshRegistry,
                    comm: Comm) -> None:
    """One layer's meshes, edge programs, SUMMA gathers, loss reductions and gradient
    buckets."""
    g = c.graph
    op, lp = g[name], c.layers[name]
    registry.need_mesh(stage.devices, lp.output.fact)
    for idx, src in enumerate(op.inputs):
        registry.need_mesh(stage.devices, lp.inputs[idx].fact)
        if g[src].kind is not OpKind.INPUT:
            comm.register(c.edges[(name, idx)])
    if op.kind is OpKind.LINEAR and is_summa(lp.strategy):
        assert op.weight is not None
        for red in summa_programs(lp.output.fact, g[op.inputs[0]].output, op.master_spec,
                                  c.cluster):
            comm.register(red)
    if op.kind is OpKind.MOE:
        for red in moe_programs(op, lp.inputs[0], c.cluster) or ():
            comm.register(red)
    if op.kind is OpKind.LOSS:
        for axes in loss_axes(lp.inputs[0]):
            if axes:
                comm.register_axes(lp.inputs[0], axes)
    for lay, _ in param_layouts(op, lp.strategy, lp.inputs, lp.weight, lp.output).values():
        registry.need_mesh(stage.devices, lay.fact)
    for b in c.syncs(name):
        registry.need_axes(stage.devices, b.fact, b.axes)


def _register_transfers(c: CompiledPlan, registry: MeshRegistry, comms: dict[int, Comm]) -> None:
    """Export programs, both stages' meshes, and one group per unit task and direction
    (a 1F1B stage interleaves the two directions differently from its neighbour), and
    under interleaved 1F1B per chunk link (:func:`runtime.transfers.transfer_group`)."""
    for e in c.entries:
        comms[e.src_stage].register(c.exports[e.tensor])
        registry.need_mesh(c.stages[e.src_stage].devices, e.src_layout.fact)
        registry.need_mesh(c.stages[e.dst_stage].devices, e.dst_layout.fact)
        for direction, tasks in (("forward", e.tasks), ("backward", e.backward_tasks)):
            for t in tasks:
                registry.need_group(transfer_group(direction, t, e, c.interleaved), t.group)


def _register_tied(c: CompiledPlan, registry: MeshRegistry, comms: dict[int, Comm]) -> None:
    """A tied pair on one stage runs its lowered exchange; across stages, one AllReduce
    over both stages' ranks (group ``("tied", head)``)."""
    for head, emb in c.tied.items():
        a, b = c.stage_of[emb], c.stage_of[head]
        if head in c.tied_programs:
            for red in c.tied_programs[head]:
                comms[a].register(red)
        else:
            registry.need_group(("tied", head), c.stages[a].devices + c.stages[b].devices)
