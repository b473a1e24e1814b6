"""A functional fan-out priced once: which reader of a shared value carries its program.

When one producer's output is read by several pieces of the user's functional code
(:meth:`ilp_planner.ir.graph.Graph.shared_reads`: no module boundary between them, e.g.
DeepSeek-V2's ``kv_a_proj_with_mqa`` output read by MLA's latent copy and its attention),
the runtime (:mod:`runtime.apply`) converts that value once, at the producer's boundary,
and every reader reads the result; autograd sums the readers' gradients and runs the one
backward program. So the readers must take one input layout and hand back their gradient
in one layout (the planner couples them: :mod:`ilp_planner.intra_op.problem`), and the
program is priced once — on the *priced reader*, here; the others ride on it
(:func:`riders`). The planner, the realised plan (:mod:`ilp_planner.intra_op.realise`),
its edge programs (:mod:`ilp_planner.plan.programs`) and the runtime's hook table read the
same choice from this module.
"""

from __future__ import annotations

from ilp_planner.ir.graph import Graph, Op
from ilp_planner.lowering.strategies import FOLLOWER_KINDS

Read = tuple[str, int]  # (consumer, input index)


def _fused(op: Op) -> bool:
    """A follower the planner fuses into its producer's node: the reader's program is
    priced inside that node already, so it is the one to carry a shared read's price."""
    return op.kind in FOLLOWER_KINDS and len(op.inputs) == 1


def priced_read(graph: Graph, readers: tuple[Read, ...]) -> Read:
    """The reader whose edge carries a shared read's program: a follower fused into the
    producer's node if one reads it (its price is in the node already), else the first
    reader in graph order that a gradient comes back through (not
    :attr:`~ilp_planner.ir.graph.Op.unused`: its edge's backward program is the one autograd
    runs), else the first."""
    return next((r for r in readers if _fused(graph[r[0]])),
                next((r for r in readers if not graph[r[0]].unused), readers[0]))


def riders(graph: Graph) -> dict[Read, Read]:
    """Every functional reader that reads a shared value priced on another reader: reader →
    the priced reader (same producer). Empty for a graph without ``attrs.functional``."""
    out: dict[Read, Read] = {}
    for readers in graph.shared_reads().values():
        priced = priced_read(graph, readers)
        out.update({r: priced for r in readers if r != priced})
    return out
