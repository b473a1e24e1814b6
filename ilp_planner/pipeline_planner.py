"""Pipelined plans: slice the layer sequence into stages on sub-meshes (Alpa §5 DP), plan
each stage's ops with the intra-op ILP, plan the cross-mesh resharding of every tensor that
crosses a stage boundary (long skip connections included), and simulate the schedule.

Layer units. The DP slices a sequence of *units*: each repetition of a block is a unit
(ops before the first block join the first, ops after the last join the last); a graph
without blocks has one unit per weighted op with its followers. Long sequences are
coarsened to at most ``MAX_UNITS`` units of consecutive blocks, which bounds the number of
(range, sub-mesh) intra-op solves.

Stage cost ``t_i`` is the time of one micro-batch (forward + backward compute and
activation communication) of the stage's ops on its sub-mesh, from the ILP; ranges with
the same op signature (e.g. any four GPT blocks) share one solve. The boundary cost of a
cut is the cross-mesh time of every tensor crossing it, estimated with the stage's
batch-split layout on both sides; the final plan re-plans every crossing tensor with its
real layouts (CP-SAT). A skip edge crossing several cuts is charged at each cut it
crosses in the DP (as if relayed), and sent once, directly, in the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ilp_planner.cluster import SubMesh
from ilp_planner.graph import Graph, Op, OpKind

MAX_UNITS = 16


def layer_units(graph: Graph, max_units: int = MAX_UNITS) -> list[list[str]]:
    """Op names per unit, in graph order (inputs excluded)."""
    ops = [op for op in graph.ops if op.kind is not OpKind.INPUT]
    blocks = [op.block_index for op in ops]
    if any(b is not None for b in blocks):
        first = next(i for i, b in enumerate(blocks) if b is not None)
        units: list[list[str]] = []
        current: int | None = None
        for i, op in enumerate(ops):
            b = op.block_index
            if i < first:
                b = blocks[first]
            elif b is None:
                b = current
            if b != current:
                units.append([])
                current = b
            units[-1].append(op.name)
    else:
        units = []
        for op in ops:
            weighted = op.weight is not None or op.params > 0
            if weighted or not units:
                units.append([])
            units[-1].append(op.name)
    return _coarsen(units, max_units)


def _coarsen(units: list[list[str]], max_units: int) -> list[list[str]]:
    if len(units) <= max_units:
        return units
    per = math.ceil(len(units) / max_units)
    return [sum(units[i:i + per], []) for i in range(0, len(units), per)]


def subgraph(graph: Graph, names: Sequence[str]) -> Graph:
    """The ops ``names`` as a graph; tensors produced outside become inputs (they arrive by
    cross-mesh resharding, whose cost is the boundary cost, so loading them is free here)."""
    inside = set(names)
    ops: list[Op] = []
    added: set[str] = set()
    for name in names:
        op = graph[name]
        for src in op.inputs:
            if src not in inside and src not in added:
                ops.append(Op(src, OpKind.INPUT, (), graph[src].output))
                added.add(src)
        ops.append(op)
    return Graph(f"{graph.name}[{names[0]}..{names[-1]}]", ops)


def signature(graph: Graph, names: Sequence[str]) -> tuple:
    """Name-free description of a range: equal for any k consecutive repeated blocks."""
    index = {n: i for i, n in enumerate(names)}
    return tuple(
        (op.kind, op.output, op.weight, op.params,
         tuple(index[s] - index[n] if s in index else ("ext", graph[s].output) for s in op.inputs))
        for n in names for op in (graph[n],)
    )


def crossing(graph: Graph, units: list[list[str]], cut: int) -> list[tuple[str, str]]:
    """(producer, consumer) edges from units ``< cut`` to units ``≥ cut``."""
    before = {n for u in units[:cut] for n in u} | {op.name for op in graph.ops
                                                    if op.kind is OpKind.INPUT}
    after = {n for u in units[cut:] for n in u}
    return [(s, d) for s, d in graph.edges() if s in before and d in after
            and graph[s].kind is not OpKind.INPUT]


@dataclass(frozen=True)
class Placement:
    """Where a stage runs: its sub-mesh and its devices (global ranks, mesh order)."""

    submesh: SubMesh

    @property
    def devices(self) -> list[int]:
        return self.submesh.device_ids()


def allocate(shapes: Sequence[tuple[int, int]], nodes: int, devices_per_node: int) -> list[SubMesh]:
    """Place stage sub-meshes in order: ``(1, d)`` shapes fill a node left to right,
    ``(n, devices_per_node)`` shapes take whole nodes. Raises ValueError if they do not fit."""
    out: list[SubMesh] = []
    node, offset = 0, 0
    for n, d in shapes:
        if n > 1 or d == devices_per_node:
            if offset:
                node, offset = node + 1, 0
            out.append(SubMesh(node, n, 0, d, devices_per_node))
            node += n
        else:
            if offset + d > devices_per_node:
                node, offset = node + 1, 0
            out.append(SubMesh(node, 1, offset, d, devices_per_node))
            offset += d
            if offset == devices_per_node:
                node, offset = node + 1, 0
        if node > nodes or (node == nodes and offset):
            raise ValueError(f"stage sub-meshes {list(shapes)} do not fit a {nodes}x"
                             f"{devices_per_node} cluster")
    return out
