"""One step of one stage: its lowered action list interpreted through a ``kind → handler`` table
(:func:`run_mesh` runs a rank's stages — several chunks under interleaved 1F1B — in the
schedule's order).

``RF`` receives activations, ``F`` runs the forward of a micro-batch, ``SF`` sends
activations, ``RB``/``B``/``SB`` the same for the backward, ``W`` nothing: ``B`` computes
weight gradients too. During the stage's last ``B`` each complete gradient chunk — the
priced buckets — is reduced asynchronously (:class:`runtime.grad_sync.GradSync`, and
ZeRO-1's reduce-scatters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ilp_planner.plan.data import Stage
from runtime.compiled import CompiledPlan
from runtime.grad_sync import GradSync, last_backward
from runtime.recorder import Recorder
from runtime.stage_forward import StageForward
from runtime.transfers import Transfers
from runtime.zero_state import ZeroState


def run_mesh(loops: dict[int, ScheduleLoop], order: list[tuple[int, str, int]]) -> None:
    """One step of a rank: its mesh's ``(stage, kind, micro-batch)`` actions in the
    schedule's order, each by its stage's loop (one stage, or under interleaved 1F1B the
    mesh's chunks taking turns)."""
    for loop in loops.values():
        loop.state = {}
    for stage, kind, mb in order:
        loops[stage].handlers[kind](mb)


class ScheduleLoop:
    """Interprets this stage's actions; ``state`` holds each micro-batch in flight."""

    def __init__(self, compiled: CompiledPlan, stage: Stage, compute: StageForward,
                 transfers: Transfers, grad_sync: GradSync, zero: ZeroState, recorder: Recorder,
                 overlap: bool, device: torch.device):
        self.compiled = compiled
        self.stage = stage
        self.compute = compute
        self.transfers = transfers
        self.grad_sync = grad_sync
        self.zero = zero
        self.recorder = recorder
        self.overlap = overlap  # reduce gradient chunks during the last backward
        self.device = device
        self.actions = compiled.actions[stage.index]
        self.last_backward = last_backward(self.actions)
        self.state: dict[int, dict[str, Any]] = {}  # micro-batch -> what its actions share
        # kind -> handler (formulations.schedules action kinds; lowered schedules)
        self.handlers: dict[str, Callable[[int], None]] = {
            "RF": self.recv_forward, "F": self.forward, "SF": self.send_forward,
            "RB": self.recv_backward, "B": self.backward, "SB": self.send_backward,
            "W": self.weight_grad,
        }

    def recv_forward(self, mb: int) -> None:
        """RF: receive every boundary tensor this stage reads, as leaf blocks."""
        self.state.setdefault(mb, {})["recv"] = {
            i: self.transfers.recv_forward(e) for i, e in enumerate(self.compiled.entries)
            if e.dst_stage == self.stage.index}

    def forward(self, mb: int) -> None:
        """F: run the stage's ops on micro-batch ``mb`` through the lowered edge programs;
        bring outgoing tensors to their entries' source layouts; keep what the backward
        needs."""
        st = self.state.setdefault(mb, {})
        if "recv" not in st:
            self.recv_forward(mb)
        st["out"], st["loss"] = self.compute.run(mb, st["recv"])

    def send_forward(self, mb: int) -> None:
        """SF: broadcast each outgoing tensor's unit tasks (asynchronously)."""
        for idx, v in self.state[mb]["out"].items():
            self.transfers.send_forward(self.compiled.entries[idx], v)

    def recv_backward(self, mb: int) -> None:
        """RB: receive the gradients of this stage's outgoing tensors."""
        st = self.state[mb]
        st["grad_in"] = self.transfers.recv_backward(st["out"])

    def backward(self, mb: int) -> None:
        """B: autograd from the loss (last stage, scaled by 1/M and the float16 loss scale)
        and from the received gradients of the outgoing tensors; weight gradients
        accumulate in the local leaf blocks."""
        st = self.state[mb]
        if "grad_in" not in st:
            self.recv_backward(mb)
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if st["loss"] is not None:
            local = st["loss"].t / self.compiled.microbatches  # this rank's part of the loss
            tensors.append(local.sum())
            grads.append(torch.full((), self.compiled.loss_scale, device=self.device))
        for idx, v in st["out"].items():
            if v.t.requires_grad:
                tensors.append(v.t)
                grads.append(st["grad_in"][idx])
        # the last backward's gradients are final: reduce each chunk as soon as it is complete
        self._arm(self.overlap and mb == self.last_backward)
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._arm(False)
        self.zero.after_microbatch()
        self.recorder.mark(f"backward_end:{mb}")
        st["done"] = True
        del st["out"], st["grad_in"], st["loss"]

    def send_backward(self, mb: int) -> None:
        """SB: send the gradients of the tensors received in RF back to their holders."""
        st = self.state.pop(mb)
        for idx, leaf in st.get("recv", {}).items():
            self.transfers.send_backward(self.compiled.entries[idx], leaf)

    def weight_grad(self, mb: int) -> None:
        """W: nothing left to do — B already computed the weight gradients (the runtime does
        not split the backward; a split schedule runs correctly, without the overlap)."""

    def _arm(self, on: bool) -> None:
        self.grad_sync.armed = self.zero.armed = on
