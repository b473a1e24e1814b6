"""The importer's walk: every node of an exported graph, in order, to a value, through one
``aten op name → handler`` table (as DTensor's op registry dispatches).

Nodes no input flows into become constants; an op with no handler becomes opaque (kept
replicated, listed by ``validate``), so any model imports and the plan says what it could
not shard.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.lift_elementwise import ELEMENTWISE_HANDLERS, lift_const, write_into
from ilp_planner.inputs.lift_graph import DraftGraph, Handler
from ilp_planner.inputs.lift_layers import LAYER_HANDLERS
from ilp_planner.inputs.lift_moe import MOE_OP, lift_moe
from ilp_planner.inputs.lift_values import IGNORED, Act, Call, Const, flatten, op_name

HANDLERS: MappingProxyType[str, Handler] = MappingProxyType(
    {**ELEMENTWISE_HANDLERS, **LAYER_HANDLERS, MOE_OP: lift_moe})


def lift(g: DraftGraph, ep: Any) -> None:
    """Walk the exported program ``ep``, filling ``g``'s drafts, values and outputs."""
    sig = ep.graph_signature
    params = dict(sig.inputs_to_parameters)
    constants = set(sig.inputs_to_buffers) | set(
        getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            g.values[node.name] = g.placeholder(node, params, constants)
        elif node.op == "call_function":
            g.values[node.name] = _visit(g, node)
        elif node.op == "output":
            g.outputs = [g.values.get(getattr(a, "name", ""), Const())
                         for a in flatten(node.args)]


def _visit(g: DraftGraph, node: Any) -> Any:
    """One ``call_function`` node's value, by its op's handler; an in-place op is lifted as
    its out-of-place form and the tensor it mutated takes the result (``out += identity``)."""
    op = _in_place_base(op_name(node.target))
    value = _lifted(g, node, op)
    if op != op_name(node.target) and node.args and hasattr(node.args[0], "name"):
        g.values[node.args[0].name] = value
    return value


def _number(val: Any) -> bool:
    """Whether a node's value is a Python (symbolic) number, not a tensor or a list."""
    return type(val).__name__ in ("SymInt", "SymFloat", "SymBool", "int", "float", "bool")


def _check_static(node: Any, op: str, val: Any) -> None:
    """Refuse a tensor whose shape torch.export could only describe by a symbol of the data
    (an unbacked size: JetMoE's tokens split by how many each expert drew), naming the
    op and the model's line: a plan fixes every op's shape."""
    tensors = [v for v in flatten(val if isinstance(val, (list, tuple)) else [val])
               if hasattr(v, "shape")]
    shapes = [tuple(v.shape) for v in tensors]
    if all(isinstance(d, int) for shape in shapes for d in shape):
        return
    shown = next(str(tuple(str(d) for d in shape)) for shape in shapes
                 if not all(isinstance(d, int) for d in shape))
    raise ConfigError(f"op {node.name} ({op}) makes a tensor whose shape depends on the data "
                      f"{shown}{_model_line(node)}: a plan fixes every op's shape, so no size "
                      f"may be computed from the inputs (a per-expert token count, a mask's "
                      f"nonzero count) — compute such a block as dense tensors")


def _model_line(node: Any) -> str:
    """`` at file:line ('code')``: the last frame of the model's own code (outside torch)
    in the node's recorded stack, or empty."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)',
                        node.meta.get("stack_trace") or "")
    mine = [f for f in frames if "/torch/" not in f[0]]
    if not mine:
        return ""
    path, line, code = mine[-1]
    return f" at {Path(path).name}:{line} ({code.strip()!r})"


def _in_place_base(op: str) -> str:
    """``add_`` → ``add``: the out-of-place op an in-place one computes, when the table
    lifts it and not the in-place name itself (``relu_`` has its own entry)."""
    base = op.removesuffix("_")
    if base != op and op not in HANDLERS and op not in IGNORED and base in HANDLERS:
        return base
    return op


def _lifted(g: DraftGraph, node: Any, op: str) -> Any:
    """The node's value from the handler of ``op``."""
    args = [g.arg(a) for a in node.args]
    if op == "getitem":
        seq, idx = args[0], args[1]
        return seq[idx] if isinstance(seq, (list, tuple)) else Const()
    if op == "copy_" and isinstance(args[0], Act) and "buffer" in args[0].parts:
        return write_into(g, args[0], args[1], node)  # a slice of a new_empty tensor filled
    call = Call(node, op, args, {k: g.arg(v) for k, v in node.kwargs.items()},
                node.meta.get("val"))
    if op in IGNORED or call.val is None:
        return Const()
    _check_static(node, op, call.val)
    if not call.acts:  # nothing here depends on the inputs
        return lift_const(g, call)
    handler = HANDLERS.get(op)
    if handler is not None:
        return handler(g, call)
    if _number(call.val):  # a number read off the data (``.item()``; XLM asserts
        # ``lengths.max().item() <= slen``): export guards any branch on it, so what is
        # left of it only checks
        return Const()
    return g.opaque(node, args, call.acts, call.val, op)
