"""The configurations the config compares against (``compare:``), offered to the planner
as rival pipelines, so that its plan is never predicted slower than one of them.

The stage DP's space holds a compared configuration's stage layout only without
interleaving; Megatron-LM's published runs interleave (``vpp > 1``), and the planner's own
interleaved candidates cut their chunks by a min–max DP, not the engine's uniform split.
So the guarantee "the plan is at least the compared configuration" is made here: each
pipelined compared configuration is priced exactly as ``--compare`` prices it
(:func:`~ilp_planner.inter_op.given_price.given_pipeline`: its uniform stages or chunks,
restricted intra-op solves, assembled and simulated like the planner's own pipelines), and
where it fits the memory budget, is what the config leaves free (:func:`out_of_space`)
and simulates faster than the planner's pipeline, it becomes
the plan (the report's note says so). The plan's step is then at most every such compared
configuration's priced step, by construction.
"""

from __future__ import annotations

import dataclasses

from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inputs.given_config import GivenConfig, microbatches
from ilp_planner.inter_op.assembly import AssembledPipeline
from ilp_planner.inter_op.given_price import given_pipeline


def out_of_space(config: Config, g: GivenConfig) -> str | None:
    """Why ``g`` cannot be the plan of ``config`` (None: it can): the config fixes what
    ``g`` does otherwise — its stage count, its sub-meshes, a schedule other than 1F1B
    (``g`` runs 1F1B, interleaved where ``vpp > 1``: listing it in ``compare:`` is taken as
    consent to its interleaving), its micro-batch count, no recomputation."""
    m = microbatches(g, config.model.get("batch"))
    pipe = config.pipeline
    if g.pp < 2:
        return "not pipelined"
    if pipe.stages != "auto" and int(pipe.stages) != g.pp:
        return f"{g.pp} stages, the config's pipeline.stages is {pipe.stages}"
    if pipe.submeshes:
        return "the config fixes pipeline.submeshes"
    if pipe.schedule != "1f1b":
        return f"1F1B, the config's pipeline.schedule is {pipe.schedule}"
    if m != config.pipeline.microbatches:
        return f"{m} micro-batches, the config's pipeline.microbatches is {config.pipeline.microbatches}"
    if g.recompute != "none" and config.solver.recompute == "never":
        return f"recompute={g.recompute}, the config's solver.recompute is never"
    return None


def given_if_faster(config: Config, pipeline: AssembledPipeline) -> AssembledPipeline:
    """``pipeline``, or the fastest compared configuration's pipeline (module docstring)
    where it simulates faster, with a note naming what was kept and why others were not."""
    best, best_g, notes = pipeline, None, []
    budget = config.cluster.memory_bytes
    for g in config.compare:
        why = out_of_space(config, g)
        if why == "not pipelined":
            continue
        if why is None:
            try:
                rival = given_pipeline(config, g)
            except InfeasibleError as exc:
                why = f"not priced: {exc}"
        if why is None:
            peak = max(s.times.cost.peak_memory_bytes for s in rival.stages if s.times)
            if peak > budget * (1 + 1e-9):
                why = f"needs {peak / 2**30:.4g} GiB a device, over the budget"
            elif rival.step_s < best.step_s:
                best, best_g = rival, g
            else:
                notes.append(f"{g.text()} offered as the plan: {rival.step_s:.6g} s a step, "
                             f"not faster")
        if why is not None:
            notes.append(f"{g.text()} not offered as the plan ({why})")
    if best_g is not None:
        v = best.schedule.virtual_stages
        notes.insert(0, f"the compared configuration {best_g.text()}: {len(best.stages) // v} stages"
                        f"{f' × {v} chunks' if v > 1 else ''} simulate to {best.step_s:.6g} s a "
                        f"step, the planner's pipeline {pipeline.step_s:.6g} s: kept the "
                        f"compared configuration")
    if not notes:
        return best
    return dataclasses.replace(best, note="; ".join(n for n in (pipeline.note, *notes) if n))
