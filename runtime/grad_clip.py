"""Gradient clipping for a module under :func:`runtime.apply.parallelize`.

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm into one tensor, which
DTensor refuses when the parameters live on several device meshes — and a plan lays its
layers out on several (a 4-device axis for one layer, a 2 × 2 grid in another rank order
for the next). :func:`clip_grad_norm_` computes the same total norm mesh by mesh: each
mesh's gradients' norms stacked and reduced to one plain value (DTensor's own reduction of
the partial norms: one small AllReduce per mesh, outside the plan, like the optimizer's
step), the values combined, and every gradient scaled by the same coefficient as torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
                    max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``parameters`` (a module's, or an iterable of parameters) so
    that their total ``norm_type``-norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on one process; returns the total norm before
    clipping, a plain tensor with the whole value on every rank."""
    params = (list(parameters.parameters()) if isinstance(parameters, nn.Module)
              else [parameters] if isinstance(parameters, torch.Tensor) else list(parameters))
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for gs in by_mesh.values():
        n = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in gs]), norm_type)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).cpu())
    # in the gradients' dtype, as torch's total and coefficient are (a float64 model's
    # norm rounded to float32 moved its clipped step); mixed dtypes promote within a mesh,
    # but a mesh of half-precision gradients rounds its own norm first, where torch
    # promotes every gradient's norm before summing
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({float(total)}), so it cannot be clipped")
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
