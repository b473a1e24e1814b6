"""PyTorch tensor-parallel styles for the layers its own styles cannot shard, for
:func:`runtime.tp_styles.to_parallelize_plan`.

``ColwiseParallel`` and ``RowwiseParallel`` dispatch on ``nn.Linear`` (weight stored ``(out,
in)``) and ``nn.Embedding`` and raise on any other module, and each wraps the parameters of
its own module in new DTensor parameters. Two things a plan needs fall outside that:

* a projection module storing its weight ``(in, out)`` — Hugging Face's GPT-2 ``Conv1D``
  (``bias + x @ W``): column-parallel splits ``W``'s dim 1 and the bias, row-parallel ``W``'s
  dim 0 with the bias replicated (added once, to the partial sums' total, as DTensor's
  ``addmm`` does for a replicated bias);
* a table several modules share (an embedding and the head tied to it): each style would
  wrap the one parameter in its own DTensor, so the copies would train apart. Here every
  style of one plan registers through one :class:`SharedParams`, which creates the DTensor
  parameter once and registers that same parameter in every module holding the original —
  one parameter, one gradient, as in one process. :mod:`runtime.tp_styles` returns these
  styles only where the plan places the table alike in both (checked there, and again here).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement


class SharedParams:
    """The DTensor parameters one plan's styles created, by the original parameter they
    replace (kept alive here so its id is not reused)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def register(self, module: nn.Module, name: str, placements: list[Any],
                 mesh: DeviceMesh, src_data_rank: int | None) -> None:
        """Register ``module.<name>`` as a DTensor parameter in ``placements``: the one
        already made from the same original parameter (a shared table), else a new one."""
        original = getattr(module, name)
        made = self._made.get(id(original))
        if made is None:
            new = nn.Parameter(distribute_tensor(original, mesh, placements,
                                                 src_data_rank=src_data_rank),
                               requires_grad=original.requires_grad)
            self._made[id(original)] = (original, new)
        else:
            new = made[1]
            if tuple(new.placements) != tuple(placements):
                raise ValueError(f"{type(module).__name__}.{name} is shared with a module "
                                 f"whose style placed it {tuple(new.placements)}, this style "
                                 f"wants {tuple(placements)}: one parameter has one placement")
        module.register_parameter(name, new)


def _check_in_out(module: nn.Module, style: str) -> None:
    """The module a ``(in, out)`` style shards has a 2-D ``weight`` (and maybe a bias)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        raise NotImplementedError(f"{style} shards a module storing a 2-D weight (in, out) "
                                  f"(Hugging Face's Conv1D); {type(module).__name__} has none")


class _Planned:
    """What both planned styles add to torch's: the dims they split (``(out, in)`` or ``(in,
    out)`` weight, bias, table) as class data, registration through :class:`SharedParams`,
    and ``distribute_module`` for an ``(in, out)`` module torch's ``_apply`` refuses."""

    WEIGHT_DIM: tuple[int, int]  # the split dim of an (out, in) weight, of an (in, out) one
    BIAS: Placement
    TABLE_DIM: int  # the split dim of an embedding's table
    IN_OUT_INPUT: tuple[Placement, ...] | None  # the input an (in, out) module is handed

    def __init__(self, *, shared: SharedParams, in_out: bool = False, **layouts: Any):
        super().__init__(**layouts)  # type: ignore[call-arg]
        self.shared, self.in_out = shared, in_out

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        self.shared.register(module, "weight", [Shard(self.WEIGHT_DIM[self.in_out])],
                             device_mesh, self.src_data_rank)
        if getattr(module, "bias", None) is not None:
            self.shared.register(module, "bias", [self.BIAS], device_mesh, self.src_data_rank)

    def _partition_embedding_fn(self, name: str, module: nn.Module,
                                device_mesh: DeviceMesh) -> None:
        self.shared.register(module, "weight", [Shard(self.TABLE_DIM)], device_mesh,
                             self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.in_out:
            return super()._apply(module, device_mesh)  # type: ignore[misc]
        _check_in_out(module, type(self).__name__)
        if self.IN_OUT_INPUT is not None:
            self.desired_input_layouts = self.IN_OUT_INPUT
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class PlannedColwise(_Planned, ColwiseParallel):
    """``ColwiseParallel`` that also shards a ``(in, out)`` weight (``in_out``) and shares
    one table between the modules holding it (``shared``): the output features (dim 0 of
    ``nn.Linear``'s ``(out, in)``, dim 1 of ``(in, out)``) and the bias are split."""

    WEIGHT_DIM, BIAS, TABLE_DIM, IN_OUT_INPUT = (0, 1), Shard(0), 1, None


class PlannedRowwise(_Planned, RowwiseParallel):
    """``RowwiseParallel`` that also shards a ``(in, out)`` weight (``in_out``) and shares
    one table between the modules holding it (``shared``): the input features (dim 1 of
    ``(out, in)``, dim 0 of ``(in, out)``) are split, the bias replicated (added once to the
    partial sums' total), and the input arrives split on its last dim."""

    WEIGHT_DIM, BIAS, TABLE_DIM, IN_OUT_INPUT = (1, 0), Replicate(), 0, (Shard(-1),)
