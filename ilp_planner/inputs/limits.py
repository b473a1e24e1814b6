"""Bounds on the size of a problem, checked before anything is built.

A config with 10⁶ layers or 10⁹ devices is valid YAML but no solve of it ends; a sweep of
10⁶ points queues gigabytes. Each bound is far above any real use (the largest shipped
problems are 128 devices, 96 layers) and names the environment variable that raises it,
so a user who means it can go on.
"""

from __future__ import annotations

import os

from ilp_planner.errors import ConfigError

LIMITS = {
    "devices": 65_536,       # cluster.nodes × cluster.devices_per_node
    "layers": 4_096,         # model.layers, len(model.dims), graph ops / 16
    "microbatches": 65_536,  # pipeline.microbatches
    "dim": 2**31,            # any single model size (hidden, batch, seq_len, vocab, ...)
    "points": 10_000,        # sweep points (also --max-points)
}


def limit(name: str) -> int:
    """The bound called ``name``, raised by ``ILP_PLANNER_MAX_<NAME>`` if set."""
    env = f"ILP_PLANNER_MAX_{name.upper()}"
    raw = os.environ.get(env)
    if raw is None:
        return LIMITS[name]
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{env}: expected an integer, got {raw[:40]!r}") from None
    if value < 1:
        raise ConfigError(f"{env}: expected a positive integer, got {value}")
    return value


def check_limit(name: str, value: int, what: str, *, source: str | None = None,
                key: str | None = None, bound: int | None = None, how: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``value`` exceeds the bound ``name`` (or ``bound``,
    given by the caller's own option ``how``)."""
    bound = limit(name) if bound is None else bound
    if value > bound:
        raise ConfigError(f"{what} is {value}, above the limit of {bound} ("
                          f"{how or f'set ILP_PLANNER_MAX_{name.upper()}'} to raise it)",
                          source=source, key=key)
