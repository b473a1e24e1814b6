"""Regions ``torch.export`` wraps in higher-order ops, made plain before the importer's walk.

A ``with torch.no_grad():`` block inside a forward (PhiMoE's and GraniteMoE's expert masks,
a scale computed from an activation and kept out of autograd) is exported as one
``wrap_with_set_grad_enabled(False, submodule, *inputs)`` node whose body is a separate
graph. The walk lifts aten ops, one node at a time; it has no handler for such a node and
torch's flop counter cannot run it. :func:`inline_no_grad_regions` copies each body into the
enclosing graph in place of the node and passes every tensor it returns through
``aten.detach`` — what the block computes, and, as under ``no_grad``, nothing of it that
autograd follows. The walk then reads it as it reads a user's own ``.detach()``.

Other regions (``torch.autocast`` blocks: ``wrap_with_autocast``, ``cond``, ``map``) change
what their body computes or whether it runs; they are refused, naming the region and the
module that holds it, rather than priced as something else.

torch is the importer's lazy dependency: these functions receive it.
"""

from __future__ import annotations

from typing import Any

from ilp_planner.errors import ConfigError

NO_GRAD = "wrap_with_set_grad_enabled"


def inline_no_grad_regions(ep: Any, torch: Any, model: str) -> None:
    """Inline every ``no_grad`` region of exported program ``ep`` (module docstring), in
    place; raises :class:`ConfigError` naming ``model``, the region and its module for a
    region of another kind."""
    gm = ep.graph_module
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target,
                                                         torch._ops.HigherOrderOperator):
            continue
        name = node.target.name()
        enabled = node.args[0] if node.args else None
        if name != NO_GRAD or enabled is not False:
            where = _module_of(node) or "the model's own forward"
            raise ConfigError(
                f"cannot import {model}: {where} runs a {name}"
                f"{'(True)' if name == NO_GRAD else ''} region (an autocast, enable_grad or "
                f"control-flow block, which torch.export keeps as one higher-order op); "
                f"the importer walks plain aten ops only — run that code outside such a block")
        _inline(gm, node, getattr(gm, node.args[1].target), node.args[2:], torch)
        changed = True
    if changed:
        gm.recompile()


def _inline(gm: Any, node: Any, body: Any, inputs: tuple, torch: Any) -> None:
    """The body of region ``node`` copied in before it, its placeholders bound to
    ``inputs``, each tensor it returns detached; the region's ``getitem`` readers then read
    those results and the region node goes."""
    env: dict[Any, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs, strict=True))
    results: list[Any] = []
    graph = gm.graph
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = [env[a] if isinstance(a, torch.fx.Node) else a
                           for a in torch.utils._pytree.tree_leaves(inner.args[0])]
                continue
            if inner.op == "get_attr":  # a constant of the body: held by the outer module
                target = f"{node.name}_{inner.target}"
                setattr(gm, target, getattr(body, inner.target))
                env[inner] = graph.get_attr(target)
                env[inner].meta.update(inner.meta)
                continue
            env[inner] = graph.node_copy(inner, lambda a: env[a])
        results = [_detached(graph, r, node, torch) for r in results]
    for user in list(node.users):
        if user.op != "call_function" or user.target.__name__ != "getitem":
            raise ConfigError(f"a no_grad region's result read as a whole by {user.name!r}; "
                              f"expected its items one by one")
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _detached(graph: Any, value: Any, region: Any, torch: Any) -> Any:
    """``aten.detach`` of a tensor the region returns (its metadata, the region's module);
    anything else as it is."""
    if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("val"),
                                                               torch.Tensor):
        return value
    out = graph.call_function(torch.ops.aten.detach.default, (value,))
    out.meta.update(value.meta)
    if "nn_module_stack" in region.meta:
        out.meta["nn_module_stack"] = region.meta["nn_module_stack"]
    return out


def _module_of(node: Any) -> str | None:
    """The innermost module path recorded for ``node`` by the export, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [p for p, _ in stack.values() if p]
    return f"module {paths[-1]!r}" if paths else None
