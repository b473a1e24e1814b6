"""The resharding rows of a pipelined plan: every tensor crossing stages, planned on its
real layouts by the cross-mesh planner (:mod:`ilp_planner.inter_op.resharding`) forward
and backward, as the plan stores them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.resharding import ReshardingPlan, ReshardOptions, plan_resharding
from ilp_planner.ir.cluster import Cluster, SubMesh
from ilp_planner.ir.graph import Graph, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.strategies import resolve_partial
from ilp_planner.plan.data import ReshardingEntry, Transfer, UnitTask


def _task_rows(rp: ReshardingPlan) -> tuple[UnitTask, ...]:
    """A solved resharding's unit tasks in their scheduled order, as the plan stores them."""
    return tuple(UnitTask(rp.tasks[t].region, rp.transfers[t].sender_device,
                          tuple(rp.tasks[t].holders), tuple(rp.tasks[t].receivers),
                          rp.transfers[t].start_s, rp.tasks[t].nbytes)
                 for t in rp.order)


def _resharding(tensor: TensorSpec, src: SubMesh, src_layout: Layout, dst: SubMesh,
                dst_layout: Layout, cluster: Cluster, options: ReshardOptions,
                solved: dict[tuple, ReshardingPlan]) -> ReshardingPlan:
    """:func:`plan_resharding`, solved once per crossing shape: meshes that differ from a
    solved pair's by the same whole number of nodes get its plan shifted there
    (:meth:`ReshardingPlan.shifted`) — an even pipeline's crossings are one problem."""
    base = min(src.node0, dst.node0)
    key = (tensor, dataclasses.replace(src, node0=src.node0 - base), src_layout,
           dataclasses.replace(dst, node0=dst.node0 - base), dst_layout)
    if key not in solved:
        solved[key] = plan_resharding(tensor, src, src_layout, dst, dst_layout, cluster,
                                      options)
    return solved[key].shifted(src.node0 - solved[key].src.node0)


def plan_stage_resharding(config: Config, graph: Graph, meshes: Sequence[SubMesh | None],
                          stage_of: dict[str, int],
                          out_layout: dict[str, Layout], in_layouts: dict[tuple[str, str], Layout],
                          solved: dict[tuple, ReshardingPlan]) -> list[ReshardingEntry]:
    """Every tensor crossing stages, once per (tensor, destination stage, layout), with its
    CP-SAT resharding schedules: ``tasks`` forward, ``backward_tasks`` for its gradient
    going back (from the devices that received it to those that sent it). A partial-sum
    output is reduced inside its stage first. ``solved``: schedules by (tensor, meshes,
    layouts), reused and filled."""
    out: list[ReshardingEntry] = []
    seen: set[tuple] = set()
    options = ReshardOptions(compare_strategies=False)
    for src, dst in graph.edges():
        if graph[src].kind is OpKind.INPUT or stage_of[src] == stage_of[dst]:
            continue
        a, b = stage_of[src], stage_of[dst]
        tensor = graph[src].output
        src_layout = resolve_partial(out_layout[src], tensor)
        dst_layout = in_layouts[(src, dst)]
        key = (src, b, dst_layout)
        if key in seen:
            continue
        seen.add(key)
        fwd, bwd = (_resharding(tensor, *ends, config.cluster, options, solved)
                    for ends in ((meshes[a], src_layout, meshes[b], dst_layout),
                                 (meshes[b], dst_layout, meshes[a], src_layout)))
        out.append(ReshardingEntry(
            a, b, src, dst, tuple(tensor.shape), tensor.dtype, src_layout, dst_layout,
            _task_rows(fwd), _task_rows(bwd),
            Transfer(fwd.src_spec, fwd.dst_spec, fwd.algorithm, fwd.status, fwd.makespan_s,
                     fwd.lower_bound_s, {r.name: r.makespan_s for r in fwd.runs},
                     bwd.makespan_s, bwd.lower_bound_s)))
    return out
