"""Tied weights (GPT's head uses the embedding table transposed).

The head keeps its own copy in its planned layout, initialised identically; after gradient
synchronisation both copies' gradients are summed and both copies take the same update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.plan.check import Stage
from runtime.comm import Comm, LVal
from runtime.compiled import CompiledPlan
from runtime.mesh import MeshRegistry
from runtime.recorder import Recorder, tagged, timed


class TiedWeights:
    """Sums the gradients of each tied pair's two copies, on this rank's stage."""

    def __init__(self, compiled: CompiledPlan, stage: Stage, rank: int, comm: Comm,
                 registry: MeshRegistry, recorder: Recorder):
        self.compiled = compiled
        self.stage = stage
        self.rank = rank
        self.comm = comm
        self.registry = registry
        self.recorder = recorder

    def exchange(self, grads: dict[str, torch.Tensor], params: dict[str, LVal]) -> None:
        """Sum the gradients of a tied weight's two copies into both (in fp32). On one
        stage: the lowered programs of
        :func:`ilp_planner.lowering.strategies.tied_exchange`. Across stages: each stage
        gathers its copy's gradient (lowered program to replicated), one AllReduce over both
        stages' ranks sums them, each keeps its block."""
        c = self.compiled
        for head, emb in c.tied.items():
            if self.stage.index not in (c.stage_of[emb], c.stage_of[head]):
                continue
            if head in c.tied_programs:
                self._on_one_stage(head, emb, grads)
            else:
                self._across_stages(head, emb, grads, params)

    def _on_one_stage(self, head: str, emb: str, grads: dict[str, torch.Tensor]) -> None:
        table = self.compiled.graph[emb].master_spec
        ek, hk = f"{emb}.weight", f"{head}.weight"
        to_emb, back = self.compiled.tied_programs[head]
        moved = self.comm.run(grads[hk].t().contiguous(), to_emb.steps, table, "step",
                              "tied_weight", head)
        total = grads[ek] + moved
        grads[ek] = total
        grads[hk] = self.comm.run(total, back.steps, table, "step", "tied_weight",
                                  head).t().contiguous()

    def _across_stages(self, head: str, emb: str, grads: dict[str, torch.Tensor],
                       params: dict[str, LVal]) -> None:
        """This stage's copy gathered to replicated, summed with the other stage's by one
        AllReduce (only the stage's first device contributes), then cut back to its block."""
        comm = self.comm
        table = self.compiled.graph[emb].master_spec
        is_emb = self.stage.index == self.compiled.stage_of[emb]
        key = f"{emb}.weight" if is_emb else f"{head}.weight"
        lay = params[key].layout
        spec = TensorSpec(tuple(table.shape if is_emb else table.shape[::-1]), table.dtype)
        full = comm.run(grads[key], comm.program(lay, Layout.replicated(lay.fact), spec).steps,
                        spec, "step", "tied_weight", head)
        full = full if is_emb else full.t()
        if self.rank != self.stage.devices[0]:
            full = torch.zeros_like(full)
        full = full.contiguous()
        with tagged("step", "tied_weight", head), timed(self.recorder):
            dist.all_reduce(full, group=self.registry.group(("tied", head)))
        full = full if is_emb else full.t()
        grads[key] = comm.block(full, lay)
