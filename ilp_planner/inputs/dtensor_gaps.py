"""The aten ops of an imported model that DTensor cannot run: no sharding rule for them.

``parallelize`` runs the user's code on DTensors, so every aten op the module's forward and
autograd's backward dispatch needs a DTensor sharding rule. Most have one; some do not —
``torch.nn.utils.parametrizations.weight_norm``'s backward
(``aten._weight_norm_interface_backward``), for one — and such an op used to fail in the
first backward, mid-step. The importer finds them up front: the exported program is
replayed, forward and backward, on its own fake tensors (no memory, no data) under a
dispatch mode recording every op below autograd — where DTensor dispatches — and the ones
DTensor has no rule or composite kernel for are recorded on the graph
(``Graph.replicated_ops``). The runtime registers a rule for each
(:mod:`runtime.replicated_ops`): an element-wise one (an activation's backward) runs on the
blocks its operands share, any other on every rank's whole values, as one process does —
which is how the planner lays such ops out (an op it cannot shard is ``opaque``,
replicated). Torch is passed in (the importer's lazy import)."""

from __future__ import annotations

import contextlib
from typing import Any


def dtensor_gaps(torch: Any, ep: Any) -> tuple[str, ...]:
    """The aten ops (``aten.<name>.<overload>``) returning tensors that the exported
    program ``ep`` dispatches, forward and backward, that DTensor has no rule for — but
    those the runtime runs below DTensor itself (:func:`_run_locally`) and the checks
    export inserts (``_assert_tensor_metadata``: no tensor out; eager code never calls
    them); none where the program cannot be
    replayed on its fake tensors (then nothing is known, and nothing is claimed)."""
    try:
        seen = _dispatched(torch, ep)
    except Exception:  # noqa: BLE001 - a replay torch refuses: nothing found, as before
        return ()
    return tuple(sorted(str(op) for op in seen
                        if op.namespace == "aten" and not _run_locally(op)
                        and any(r.type.isSubtypeOf(torch._C.TensorType.get())
                                for r in op._schema.returns)
                        and lacks_rule(torch, op)))


def _run_locally(op: Any) -> bool:
    """Whether the runtime runs ``op`` on each rank's blocks itself, below DTensor: SDPA
    (:mod:`runtime.local_attention`) and batch norm (:mod:`runtime.local_batchnorm`),
    forward and backward."""
    name = op._schema.name
    return "scaled_dot_product" in name or "batch_norm" in name


def lacks_rule(torch: Any, op: Any) -> bool:
    """Whether DTensor has no rule of its own for aten op ``op``: no strategy or rule
    registered, no composite kernel torch decomposes it by before DTensor sees it. An op
    DTensor would only run through its propagator's decompositions counts as lacking one:
    that path fails on some (``hardtanh_backward``, ReLU6's, in torch 2.13) and cannot be
    told from the ones it serves without a device mesh."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    tables = (prop.op_strategy_funcs, prop.op_to_rules,
              getattr(prop, "op_single_dim_strategy_funcs", {}))
    if any(op in t for t in tables):
        return False
    return not torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


def _custom(torch: Any, target: Any) -> bool:
    """Whether ``target`` is an op outside torch's own namespaces (a custom op)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in (
        "aten", "prims")


def _dispatched(torch: Any, ep: Any) -> set[Any]:
    """Every op reading a tensor that the exported program's forward and its backward
    (gradients of its floating outputs with respect to its parameters) dispatch below
    autograd, replayed on the export's fake tensors."""
    nodes = list(ep.graph.nodes)
    metas = [n.meta.get("val") for n in nodes]
    fake = torch._guards.detect_fake_mode(
        [t for t in torch.utils._pytree.tree_leaves(metas) if isinstance(t, torch.Tensor)])
    if fake is None:
        return set()
    seen: set[Any] = set()

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if any(isinstance(t, torch.Tensor)
                   for t in torch.utils._pytree.tree_leaves((args, kwargs))):
                seen.add(func)  # an op reading no tensor never reaches DTensor
            return func(*args, **(kwargs or {}))

    params = set(ep.graph_signature.inputs_to_parameters)
    with fake, Recorder():
        env: dict[str, Any] = {}
        leaves, outs = [], []
        for n in nodes:
            if n.op == "placeholder":
                val = n.meta.get("val")
                if n.name in params and isinstance(val, torch.Tensor) \
                        and val.is_floating_point():
                    val = val.detach().requires_grad_()
                    leaves.append(val)
                env[n.name] = val
            elif n.op == "get_attr":
                env[n.name] = getattr(ep.graph_module, n.target)
            elif n.op == "call_function":
                args, kwargs = torch.utils._pytree.tree_map(
                    lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a,
                    (n.args, n.kwargs))
                # a custom op (the importer's routed mixture of experts, which the runtime
                # replaces by its own kernel) has no backward to replay: cut there
                with torch.no_grad() if _custom(torch, n.target) else contextlib.nullcontext():
                    env[n.name] = n.target(*args, **kwargs)
            elif n.op == "output":
                outs = [env[a.name] for a in torch.utils._pytree.tree_leaves(n.args)
                        if isinstance(a, torch.fx.Node)]
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad
                and o.is_floating_point()]
        if outs and leaves:
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                allow_unused=True)
    return seen
