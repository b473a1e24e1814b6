"""The forward of one stage on one micro-batch: its ops through the lowered edge programs.

Recomputation (``LayerPlan.recompute``): each run of consecutive recomputed layers of one
block executes under non-reentrant ``torch.utils.checkpoint``, with the edge programs of its
inputs inside, so the backward replays them and the layers' own collectives; the replay is
recorded in phase ``recompute`` (:func:`runtime.recorder.replaying`), the phase the plan
lists it in. A ZeRO-3 op gathers its sharded parameters first and keeps no gathered block
for the backward (:class:`runtime.zero.released`). Under mixed precision every op reads one
compute-dtype copy of each fp32 master, cast once per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.utils.checkpoint

from ilp_planner.ir.graph import OpKind
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.strategies import is_summa
from ilp_planner.plan.data import Stage
from runtime import model
from runtime.comm import LVal
from runtime.compiled import CompiledPlan
from runtime.ops import OPS, StageContext
from runtime.recorder import Recorder, replaying
from runtime.zero import gather, released
from runtime.zero_state import ZeroState

Have = Callable[[str, int, str], LVal]  # (consumer, input index, producer) -> the input's value


class StageForward:
    """Runs this rank's stage forward; keeps the step's compute copies and the data blocks."""

    def __init__(self, compiled: CompiledPlan, stage: Stage, ctx: StageContext,
                 params: dict[str, LVal], layout_of: dict[str, Layout], zero: ZeroState,
                 recorder: Recorder, seed: int, device: torch.device):
        self.compiled = compiled
        self.stage = stage
        self.ctx = ctx
        self.layout_of = layout_of
        self.zero = zero
        self.recorder = recorder
        self.seed = seed
        self.device = device
        self.layer_params = {name: {k.rsplit(".", 1)[1]: v for k, v in params.items()
                                    if k.rsplit(".", 1)[0] == name} for name in stage.layers}
        self.copies: dict[str, LVal] = {}  # this step's compute copies (_compute_copy)
        self._data: list[dict] | None = None
        self._blocks: dict[tuple, torch.Tensor] = {}

    def run(self, mb: int, recv: dict[int, LVal]) -> tuple[dict[int, LVal], LVal | None]:
        """The stage's ops on micro-batch ``mb`` (``recv``: the received boundary tensors);
        returns each outgoing entry's tensor in its source layout, and the loss when the
        stage computes it."""
        c, s, comm = self.compiled, self.stage, self.ctx.comm
        data = self._batch()[mb]
        vals: dict[str, LVal] = {}

        def have(name: str, idx: int, src: str) -> LVal:
            return vals[src] if c.stage_of[src] == s.index else recv[c.entry_of[(name, idx)]]

        for recompute, names in c.segments[s.index]:
            if recompute:
                self._checkpointed(names, mb, data, have, vals)
            else:
                vals[names[0]] = self._op_forward(names[0], mb, data, have)
        loss = next((vals[n] for n in s.layers if c.graph[n].kind is OpKind.LOSS), None)
        sent = {name: comm.edge(vals[name], red, "activation", "send")
                for name, red in c.exports.items() if c.stage_of[name] == s.index}
        return {i: sent[e.tensor] for i, e in enumerate(c.entries) if e.src_stage == s.index}, loss

    def drop_copies(self) -> None:
        """The next step casts the updated masters again."""
        self.copies = {}

    def _batch(self) -> list[dict]:
        if self._data is None:
            batch = model.make_batch(self.compiled.full_graph, self.seed)
            self._data = [{k: v.to(self.device) for k, v in mb.items()}
                          for mb in model.split_microbatches(batch, self.compiled.microbatches)]
        return self._data

    def _op_forward(self, name: str, mb: int, data: dict, have: Have) -> LVal:
        """One op on micro-batch ``mb``: its inputs through their lowered edge programs
        (``have`` gives the producer's value), then its kernel. A ZeRO-3 op gathers its
        sharded parameters first and runs under :class:`runtime.zero.released`, so the
        gathered blocks are not kept for the backward (a recomputed op's recomputation
        keeps its own gather for the backward, through the checkpoint)."""
        op, lp = self.compiled.graph[name], self.compiled.layers[name]
        xs = [self._input(name, idx, src, mb, data, have) for idx, src in enumerate(op.inputs)]
        params = dict(self.layer_params[name])
        gathered = []
        if lp.zero == 3:
            for zb in self.zero.of[name]:
                views, pair = gather(zb, self.recorder)
                params.update({r: LVal(t, self.layout_of[f"{name}.{r}"])
                               for r, t in views.items()})
                gathered.append(pair)
        params = self._in_compute_dtype(name, params)
        with released(gathered) if gathered else contextlib.nullcontext():
            return OPS[op.kind](self.ctx, op, lp, xs, params, data)

    def _input(self, name: str, idx: int, src: str, mb: int, data: dict, have: Have) -> LVal:
        """Input ``idx`` of ``name`` in its planned layout: the model's data cut to this
        rank's block (once per micro-batch: the batch is fixed), or the producer's value
        through the edge's lowered program."""
        c = self.compiled
        want = c.layers[name].inputs[idx]
        if c.graph[src].kind is OpKind.INPUT:
            key = (mb, src, want)
            if key not in self._blocks:
                self._blocks[key] = self.ctx.comm.block(data[src], want)
            return LVal(self._blocks[key], want)
        return self.ctx.comm.edge(have(name, idx, src), c.edges[(name, idx)], "activation", name)

    def _in_compute_dtype(self, name: str, params: dict[str, LVal]) -> dict[str, LVal]:
        """Mixed precision: compute copies of the masters (SUMMA gathers its weight's
        master and casts it itself; ZeRO gathers and ZeRO-1/2 blocks are in the compute
        dtype already)."""
        dtype = self.compiled.compute_dtype
        if dtype == model.DTYPE:
            return params
        summa = is_summa(self.compiled.layers[name].strategy)
        return {r: v if (r == "weight" and summa) or v.t.dtype == dtype
                else self._compute_copy(f"{name}.{r}", v) for r, v in params.items()}

    def _compute_copy(self, key: str, master: LVal) -> LVal:
        """The compute-dtype copy of a master block, cast once per step: every micro-batch's
        forward (and a recomputation) reads the same copy, so the step holds it once — the
        planner's w bytes a parameter — not once per micro-batch in flight, and autograd
        adds each micro-batch's gradient to the fp32 master through the one cast."""
        copy = self.copies.get(key)
        if copy is None:
            copy = self.copies[key] = LVal(master.t.to(self.compiled.compute_dtype), master.layout)
        return copy

    def _checkpointed(self, names: tuple[str, ...], mb: int, data: dict, have: Have,
                      vals: dict[str, LVal]) -> None:
        """A recomputed run of one block's layers under ``torch.utils.checkpoint``
        (non-reentrant): the values it reads from outside enter as the checkpoint's inputs
        and pass through the layers' edge programs *inside* it, so the recomputation in
        the backward replays those programs and every collective of the layers — recorded
        in phase ``recompute`` (:func:`runtime.recorder.replaying`), as the plan lists
        them. Only the run's values read after it leave it. ``early_stop=False``: the whole
        run is replayed (stopping at the last saved tensor would skip the collectives after
        it). The executor runs no dropout (:func:`runtime.model.check_supported`), so the
        replay recomputes the same values."""
        g = self.compiled.graph
        inside = set(names)
        keys, ext = self._outside_values(names)
        first = {k: next(v for v, kk in ext.items() if kk == k) for k in keys}
        given = [have(n, i, g[n].inputs[i]) for n, i in (first[k] for k in keys)]
        outs = [n for n in names
                if n in self.compiled.exports or any(c not in inside for c in g.consumers(n))]
        layouts = [v.layout for v in given]

        def run(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            local = {k: LVal(t, lay) for k, t, lay in zip(keys, ts, layouts, strict=True)}
            here: dict[str, LVal] = {}

            def lookup(name: str, idx: int, src: str) -> LVal:
                return here[src] if src in inside else local[ext[(name, idx)]]

            for name in names:
                here[name] = self._op_forward(name, mb, data, lookup)
            return tuple(here[n].t for n in outs)

        got = torch.utils.checkpoint.checkpoint(
            run, *(v.t for v in given), use_reentrant=False, early_stop=False,
            context_fn=lambda: (contextlib.nullcontext(), replaying()))
        for n, t in zip(outs, got, strict=True):
            vals[n] = LVal(t, self.compiled.layers[n].output)

    def _outside_values(self, names: tuple[str, ...]
                        ) -> tuple[list[tuple], dict[tuple[str, int], tuple]]:
        """The values a recomputed run reads from outside it, in first-read order (a layer
        of this stage, or a received entry), and which one each (layer, input) reads."""
        c, g = self.compiled, self.compiled.graph
        inside = set(names)
        ext: dict[tuple[str, int], tuple] = {}
        keys: list[tuple] = []
        for name in names:
            for idx, src in enumerate(g[name].inputs):
                if src in inside or g[src].kind is OpKind.INPUT:
                    continue
                key = (src,) if c.stage_of[src] == self.stage.index else \
                    ("recv", c.entry_of[(name, idx)])
                if key not in keys:
                    keys.append(key)
                ext[(name, idx)] = key
        return keys, ext
