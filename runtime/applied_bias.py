"""Learned attention-bias tables read inside the user's functional attention code, for
:mod:`runtime.apply`.

T5's ``relative_attention_bias`` (an ``nn.Embedding`` of ``(buckets, heads)``) is looked up
at constant bucket ids by the first layer of each stack, and the bias it yields (``(1,
heads, q, k)``) is added to the scores of every self-attention of the stack — in SDPA, as
its mask. The importer gives the table to the first attention reading it
(``attrs.bias_buckets``, role ``rel_bias``) and marks every reader ``bias_table``; the
planner keeps the table whole and lets those attentions split only the batch or the heads
on every mesh axis (:func:`ilp_planner.lowering.strategies.bias_table_layouts`), so the
ranks' blocks partition (batch × heads).

Swin's ``relative_position_bias_table`` is a bare parameter of a module of its own
(``SwinRelativePositionBias``) indexed at constant positions, one per window attention; it
takes the same path. Here the table's module looks up its rows in this rank's copy of the
whole table as a plain tensor; :class:`~runtime.local_attention.LocalAttention` slices the bias to this rank's
batch and heads, so the gradient each rank's lookup returns is its blocks' share — a partial
sum over every mesh axis, which the plan's weight-gradient AllReduce over all ranks
completes (priced as the table's ``grad_sync``).
"""

from __future__ import annotations

from torch import nn

from ilp_planner.ir.graph import Graph, OpKind
from runtime.applied_params import AppliedParams, PlacedParam, owner_of
from runtime.dtensors import Meshes, Unwrap, dtensor_spec, placements
from runtime.errors import RuntimeSetupError


def check_bias_tables(graph: Graph, module: nn.Module) -> None:
    """Refuse, before anything changes, an attention's bias table held by a module that
    holds other parameters too: :func:`install_bias_tables` swaps the table for this rank's
    whole copy while its module runs, so that module must be the table's lookup alone (an
    ``nn.Embedding``, or Swin's ``SwinRelativePositionBias`` indexing its one parameter at
    constant positions), not a layer whose other weights are placed."""
    for op in graph.ops:
        if op.kind is not OpKind.ATTENTION or not op.attrs.get("bias_buckets"):
            continue
        for fqn in op.source_params:
            owner, attr = owner_of(module, fqn)
            others = [n for n, p in owner.named_parameters() if n != attr]
            if others:
                raise RuntimeSetupError(
                    f"attention {op.name!r} adds the bias table {fqn}, which parallelize "
                    f"looks up while the module holding it runs; {type(owner).__name__} "
                    f"holds other parameters too ({others[0]}): hold the table in a module "
                    f"of its own (an nn.Embedding) whose forward looks it up")


def install_bias_tables(graph: Graph, params: AppliedParams, module: nn.Module,
                        meshes: Meshes) -> None:
    """Hooks on each bias table's own module: this rank's whole table, whose gradient
    returns partial over every axis, while the module runs; the placed parameter after."""
    for op in graph.ops:
        if op.kind is not OpKind.ATTENTION or not op.attrs.get("bias_buckets"):
            continue
        for p in params.of_op(op.name).values():
            owner, attr = owner_of(module, p.fqn)  # an nn.Embedding: check_bias_tables
            owner.register_forward_pre_hook(
                lambda m, args, p=p, attr=attr: _lookup_locally(m, attr, p, meshes))
            owner.register_forward_hook(
                lambda m, args, out, p=p, attr=attr: m._parameters.__setitem__(attr,
                                                                               p.registered))


def _lookup_locally(owner: nn.Module, attr: str, p: PlacedParam, meshes: Meshes) -> None:
    spec = dtensor_spec(meshes.of(p.stored), placements(p.grad, p.dims, f"gradient of {p.fqn}"),
                        p.value, tuple(p.value.shape))
    owner._parameters[attr] = Unwrap.apply(p.value, spec)  # nn.Module refuses non-Parameters
