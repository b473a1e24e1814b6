"""How the hand-written baselines lay out a mixture-of-experts op (:mod:`ilp_planner.
intra_op.baselines` wraps its per-op filters with these for :data:`OpKind.MOE
<ilp_planner.ir.graph.OpKind>` ops; every other op keeps its baseline's filter):

* data parallel — every expert replicated, tokens split over every device;
* DeepSpeed-MoE — expert parallelism inside data parallelism: tokens split over every
  device, experts split over an EP group of ``gcd(experts, devices)`` data-parallel devices
  (the rest expert data parallel), no expert tensor parallelism, state replicated;
* the torchtitan / Megatron-Core grid (EP × TP × FSDP) — on a ``dp × tp`` mesh the experts are
  either tensor-parallel over the same TP axis as the dense layers (ETP = TP) with EP taken
  from the data-parallel devices, or not tensor-parallel (ETP = 1) with EP borrowing the TP
  devices too, the token exchange then spanning both; state as the grid point says.

The grid lets the restricted exact solve pick the EP degree (a generous hand-tuned user), so the
planner's optimum can never be worse.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from ilp_planner.intra_op.problem import Restriction
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import Op, OpKind
from ilp_planner.lowering.moe_strategies import expert_parallel
from ilp_planner.lowering.strategies import Strategy

MoeFilter = Callable[[Op, Strategy], bool]


@functools.cache  # one object per member: restricted builds cache by it
def with_moe(keep: MoeFilter, moe_keep: MoeFilter) -> MoeFilter:
    """``keep`` for every op but the MoE ones, which ``moe_keep`` decides (a
    :class:`Restriction` stays one: its matmul factorisations do not concern MoE ops)."""
    def both(op: Op, s: Strategy) -> bool:
        return moe_keep(op, s) if op.kind is OpKind.MOE else keep(op, s)
    return Restriction(both, keep.matmul_facts) if isinstance(keep, Restriction) else both


def _degrees(s: Strategy) -> tuple[int, int, int]:
    p0, p1, p2 = (a.size for a in s.fact)
    return p0, p1, p2


@functools.cache
def replicated_experts_filter(devices: int) -> MoeFilter:
    """Plain data parallelism: tokens over every device, every expert on every device."""
    def keep(op: Op, s: Strategy) -> bool:
        return s.zero == 0 and _degrees(s) == (devices, 1, 1)
    return keep


@functools.cache
def deepspeed_moe_filter(devices: int) -> MoeFilter:
    """Tokens over every device, the experts over an EP group of ``gcd(experts, devices)``
    of them (one expert per device where there are as many), no ETP, no state sharding."""
    def keep(op: Op, s: Strategy) -> bool:
        p0, p1, p2 = _degrees(s)
        return (s.zero == 0 and expert_parallel(s.inputs[0]) and p2 == 1
                and p0 * p1 == devices and p1 == math.gcd(op.attr("experts"), devices))
    return keep


@functools.cache
def moe_grid_filter(dp: MeshAxis, tp: MeshAxis, state: Callable[[Strategy], bool]) -> MoeFilter:
    """The torchtitan / Megatron-Core choices on the ``dp × tp`` mesh (module docstring)."""
    def keep(op: Op, s: Strategy) -> bool:
        if not state(s) or not expert_parallel(s.inputs[0]):
            return False
        p0, p1, p2 = _degrees(s)
        if p2 == 1:
            return p0 * p1 == dp.size * tp.size
        return s.fact[2] == tp and p0 * p1 == dp.size
    return keep


def has_moe(graph) -> bool:
    return any(op.kind is OpKind.MOE for op in graph.ops)
