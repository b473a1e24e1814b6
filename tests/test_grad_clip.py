"""Gradient clipping for a parallelized module (:mod:`runtime.grad_clip`): gradients on
several device meshes, which ``torch.nn.utils.clip_grad_norm_`` refuses, clipped to the
same total norm and coefficient as one process. (On 4 ranks, every model of the Hugging
Face launch clips each step against torch's on one process: ``test_hf_parallelize``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor

import ilp_planner


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _params(meshes: list[DeviceMesh], dtype: torch.dtype = torch.float32
            ) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    torch.manual_seed(0)
    plain = [torch.randn(4, 3, dtype=dtype), torch.randn(5, dtype=dtype),
             torch.randn(2, 2, dtype=dtype)]
    params = []
    for i, g in enumerate(plain):
        mesh = meshes[i % len(meshes)]
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh,
                                                 [Replicate()] * mesh.ndim))
        p.grad = distribute_tensor(g.clone(), mesh, [Replicate()] * mesh.ndim)
        params.append(p)
    return params, plain


@pytest.mark.parametrize("max_norm,norm_type", [(1.0, 2.0), (100.0, 2.0), (1.0, 1.0),
                                                (0.5, float("inf"))])
def test_gradients_on_several_meshes_clip_as_one_process(one_rank, max_norm, norm_type):
    meshes = [DeviceMesh("cpu", [0]), DeviceMesh("cpu", [[0]], mesh_dim_names=("a", "b"))]
    params, plain = _params(meshes)
    with pytest.raises(RuntimeError, match="same mesh"):  # what users met
        torch.nn.utils.clip_grad_norm_(_params(meshes)[0], max_norm, norm_type)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in plain]
    for r, g in zip(ref, plain, strict=True):
        r.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    got = ilp_planner.clip_grad_norm_(params, max_norm, norm_type)
    assert not isinstance(got, torch.distributed.tensor.DTensor)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for p, r in zip(params, ref, strict=True):
        assert torch.allclose(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_norm_and_coefficient_keep_the_gradients_dtype(one_rank, dtype):
    """A float64 model's total norm and clipped gradients are torch's to the last bit of
    float64 (the norm rounded to float32 moved a MobileNetV2's clipped step, amplified by
    its batch norms over 1 × 1 images into a 0.7 % difference two steps later); a float32
    model's are torch's float32 coefficient's."""
    meshes = [DeviceMesh("cpu", [0])]
    params, plain = _params(meshes, dtype)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in plain]
    for r, g in zip(ref, plain, strict=True):
        r.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 0.3)
    got = ilp_planner.clip_grad_norm_(params, 0.3)
    assert got.dtype == dtype and float(got) == float(want)
    for p, r in zip(params, ref, strict=True):
        assert torch.equal(p.grad.full_tensor(), r.grad)


def test_a_non_finite_norm_is_refused_when_asked(one_rank):
    params, _ = _params([DeviceMesh("cpu", [0])])
    params[0].grad.to_local()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        ilp_planner.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
