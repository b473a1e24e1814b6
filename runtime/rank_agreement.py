"""What every rank must hold alike when :func:`runtime.apply.parallelize` applies a plan.

``parallelize`` keeps, on each rank, its block of the value the module already holds, and
the module's code runs on every rank: where the ranks disagree before the first step, the
program silently trains something else than one process would —

* **the module's values** (:func:`check_same_values`): a module built after seeding each
  rank apart holds different weights on each; a replicated layer's replicas then train
  apart, and a split one is a patchwork of several initialisations;
* **the random generators** (:func:`check_generators`, where the plan drops anything): every
  rank draws each dropout mask whole, as one process draws it
  (:mod:`runtime.local_dropout`), so all must draw the same.

Each is one all-gather of a small digest while the plan is applied, before anything is
placed; a difference is refused naming the ranks (and the first value that differs)."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from runtime.errors import RuntimeSetupError

VALUE_RTOL = 1e-9
"""Relative tolerance of two ranks' float64 sums of one value: equal values summed in
another order (another thread count) differ in the last bits only."""


def _gathered(mine: object) -> list:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def value_sums(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """The names of the module's parameters and buffers (real-valued, materialised) and,
    per name, the float64 sums ``(Σx, Σx²)`` of its value."""
    named = [(n, t) for n, t in (*module.named_parameters(), *module.named_buffers())
             if t.device.type != "meta" and not t.is_complex()]
    if not named:
        return [], torch.zeros(0, 2, dtype=torch.float64)
    with torch.no_grad():
        sums = torch.stack([torch.stack((t.double().sum(), t.double().square().sum()))
                            for _, t in named]).cpu()
    return [n for n, _ in named], sums


def check_same_values(module: nn.Module) -> None:
    """Refuse where some rank's module holds other values than rank 0's (its parameters
    and buffers, compared by their float64 sums and sums of squares to
    :data:`VALUE_RTOL`), naming the first value that differs and the ranks."""
    names, sums = value_sums(module)
    every = _gathered((names, sums))
    ref_names, ref = every[0]
    apart, first = [], None
    for rank, (theirs_names, theirs) in enumerate(every):
        if theirs_names != ref_names:
            apart.append(rank)
            first = first or "the list of parameters and buffers"
            continue
        close = torch.isclose(theirs, ref, rtol=VALUE_RTOL, atol=0.0).all(dim=1)
        if not bool(close.all()):
            apart.append(rank)
            first = first or repr(ref_names[int((~close).nonzero()[0])])
    if apart:
        raise RuntimeSetupError(
            f"the module differs between ranks (rank(s) {', '.join(map(str, apart))} from "
            f"rank 0, first in {first}): parallelize keeps each rank's block of the value "
            f"its module holds, so every rank must build the same module — call "
            f"torch.manual_seed with the same seed on every rank before building it (or load "
            f"the same state dict on each)")


def generator_digest(device_type: str) -> bytes:
    """A digest of this rank's default generators' state: the CPU's, and on a CUDA mesh the
    current device's."""
    h = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes())
    if device_type == "cuda":
        h.update(torch.cuda.get_rng_state().numpy().tobytes())
    return h.digest()


def check_generators(device_type: str, what: str) -> None:
    """Refuse, naming the ranks, where the ranks' default generators differ: ``what`` (the
    plan's dropouts) draws each mask whole on every rank, so every rank must draw the same
    one."""
    every = _gathered(generator_digest(device_type))
    apart = [r for r, d in enumerate(every) if d != every[0]]
    if apart:
        raise RuntimeSetupError(
            f"the ranks' random generators differ (rank(s) {', '.join(map(str, apart))} from "
            f"rank 0), and {what}: every rank draws each dropout mask as one process would, so "
            f"all must draw alike — call torch.manual_seed with the same seed on every rank "
            f"before parallelize (a per-rank seed for data belongs to the sampler's own "
            f"generator)")
