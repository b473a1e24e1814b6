"""Regions ``torch.export`` keeps as higher-order ops (:mod:`ilp_planner.inputs.export_regions`):
a ``no_grad`` block imports as the detached values it makes; other regions are refused by
name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ilp_planner import from_module
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.export_regions import inline_no_grad_regions
from ilp_planner.ir.graph import OpKind
from tests.helpers.user_models import NoGradScaled

VOCAB, HIDDEN = 64, 32


class DetachScaled(NoGradScaled):
    """:class:`NoGradScaled` written with ``.detach()``: the same values, the same gradients."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.up(self.wte(ids))
        scale = h.detach().pow(2).mean(-1, keepdim=True).add(1.0).rsqrt()
        return self.head(self.down(F.gelu(h) * scale))


class TwoOut(nn.Module):
    """A ``no_grad`` block returning two tensors, read in the opposite order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            lo = h.amin(-1, keepdim=True)
            hi = h.amax(-1, keepdim=True) + 1.0
        return self.b((h - lo) / (hi - lo))


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.a(x).float()


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Autocast()
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.inner(x))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _shape(graph) -> list[tuple]:
    return [(op.name, op.kind, op.inputs, op.output, op.flops) for op in graph.ops]


def test_a_no_grad_region_imports_as_the_same_code_detached() -> None:
    """Before: ``TypeError: 'NoneType' object is not callable`` from the flop counter
    running the region node. Now the graph is the one ``.detach()`` gives: the same ops,
    inputs, shapes and FLOPs."""
    torch.manual_seed(0)
    plain, detached = NoGradScaled(VOCAB, HIDDEN), DetachScaled(VOCAB, HIDDEN)
    got, want = from_module(plain, (_ids(),)), from_module(detached, (_ids(),))
    assert _shape(got) == _shape(want)
    assert {op.kind for op in got.ops} >= {OpKind.EMBEDDING, OpKind.LINEAR, OpKind.GELU}


def test_the_inlined_program_computes_what_the_module_does_and_detaches_the_region() -> None:
    """The exported program after inlining: the module's output on a new input, and no
    gradient through the region's two results (read by index, out of order)."""
    torch.manual_seed(0)
    model, x = TwoOut(), torch.randn(3, HIDDEN)
    ep = torch.export.export(model, (x,), strict=False)
    regions = [n for n in ep.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert len(regions) == 1
    inline_no_grad_regions(ep, torch, "TwoOut")
    assert not [n for n in ep.graph.nodes
                if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert sum(n.target is torch.ops.aten.detach.default for n in ep.graph.nodes) == 2
    y = torch.randn(3, HIDDEN, requires_grad=True)
    y2 = y.detach().clone().requires_grad_()
    got, want = ep.module()(y), model(y2)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(y.grad, y2.grad)


def test_an_autocast_region_is_refused_naming_its_module() -> None:
    """An autocast block changes what its body computes: refused in one line naming the
    region and the module holding it."""
    with pytest.raises(ConfigError, match=r"cannot import Outer: module 'inner' runs a "
                                          r"wrap_with_autocast region") as exc:
        from_module(Outer(), (torch.randn(2, HIDDEN),))
    assert "\n" not in str(exc.value)
