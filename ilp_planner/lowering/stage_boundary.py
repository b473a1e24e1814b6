"""What a pipeline stage issues at its own boundaries, inside its own mesh.

A tensor crossing stages costs three programs: the producer brings it to the layout it is
sent in, the cross-mesh broadcasts move it (:mod:`ilp_planner.inter_op.resharding`, priced per
resharding entry), and the consumer reads it. The first and last depend only on the
stage's own layouts, so the stage's intra-op ILP prices them exactly and
:func:`ilp_planner.intra_op.realise.realise` lists them on the layers; the runtime runs the same
lowered programs (:mod:`runtime.stage_forward`, :mod:`runtime.transfers`):

* **export** (producer side, once per tensor whatever the number of entries reading it):
  partial sums resolved (:func:`~ilp_planner.lowering.strategies.resolve_partial`) — a device holds
  a block, not a summand, before anything is broadcast; its backward is the program back;
* **import** (consumer side, once per consuming edge): the tensor arrives in exactly the
  layout its consumer reads, so the forward is empty, and the backward brings the
  consumer's gradient (partial where the consumer's local backward yields partial sums)
  to the received layout before it is sent back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ilp_planner.ir.cluster import Cluster
from ilp_planner.ir.graph import Graph, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.redistribution import Redistribution, plan_redistribution
from ilp_planner.lowering.strategies import resolve_partial, tied_source


@dataclass(frozen=True)
class StageBoundary:
    """Of a stage's op list: ``imported`` tensors come from an earlier stage (autograd
    reaches them and their gradients go back); ``exported`` ops are read by a later stage.
    ``inflight``: the micro-batches whose activations the stage holds at its peak — its
    pipeline position's in-flight count under the schedule (1 without pipelining, where
    gradient accumulation runs one micro-batch's forward and backward at a time).
    ``tied_tables``: ops holding one copy of a table tied to an op in another stage (an
    embedding whose head runs later, or that head) — the stage's graph alone no longer
    shows the pair, and the cross-stage exchange sums both copies' full gradients, so their
    state must stay replicated (:func:`~ilp_planner.intra_op.problem.build_problem`)."""

    imported: frozenset[str] = frozenset()
    exported: frozenset[str] = frozenset()
    inflight: int = 1
    tied_tables: frozenset[str] = frozenset()


def stage_boundary(graph: Graph, names: Sequence[str]) -> StageBoundary:
    """The boundary of the stage running ops ``names`` of ``graph`` (graph inputs — the
    data — are loaded, not imported)."""
    inside = set(names)
    imported = {src for n in names for src in graph[n].inputs
                if src not in inside and graph[src].kind is not OpKind.INPUT}
    exported = {n for n in names if any(c not in inside for c in graph.consumers(n))}
    return StageBoundary(frozenset(imported), frozenset(exported),
                         tied_tables=frozenset(tied_across(graph, inside)))


def tied_across(graph: Graph, inside: set[str]) -> set[str]:
    """The ops of ``inside`` whose tied partner (head ↔ embedding, :func:`tied_source`)
    runs outside it."""
    out = set()
    for op in graph.ops:
        emb = tied_source(graph, op) if op.attrs.get("tied") else None
        if emb is not None and (op.name in inside) != (emb.name in inside):
            out.add(op.name if op.name in inside else emb.name)
    return out


def export_program(out: Layout, tensor: TensorSpec, cluster: Cluster) -> Redistribution:
    """Producer side: the op's output to the layout every resharding entry sends it from."""
    return plan_redistribution(out, resolve_partial(out, tensor), tensor, cluster)


def import_program(want: Layout, grad: Layout, tensor: TensorSpec, cluster: Cluster) -> Redistribution:
    """Consumer side: received in ``want``; the gradient leaves the consumer in ``grad``."""
    return plan_redistribution(want, want, tensor, cluster, grad)
