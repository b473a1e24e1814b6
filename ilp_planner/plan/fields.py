"""Typed reads of a plan file's fields, each error naming the JSON path it is about.

A plan file is untrusted input (:mod:`ilp_planner.plan.check`): every ``from_dict`` of
:mod:`ilp_planner.plan.data` reads its fields through these, so a missing field, a value of
the wrong type, a non-finite number or a negative time, size or count ends in one
:class:`~ilp_planner.errors.PlanFormatError` saying where (``stages[1].devices[0]``) and what
was expected — the declaration of which fields are non-negative lives with each field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from ilp_planner.errors import PlanFormatError

T = TypeVar("T")


def _shown(value: Any) -> str:
    return repr(value)[:60]


def mapping(value: Any, path: str) -> dict:
    """``value`` as a JSON object."""
    if not isinstance(value, dict):
        raise PlanFormatError(f"{path}: expected a mapping, got {_shown(value)}")
    return value


def required(d: dict, key: str, path: str) -> Any:
    """``d[key]``, or an error naming ``path.key`` as missing."""
    if key not in mapping(d, path):
        raise PlanFormatError(f"{path}.{key}: missing")
    return d[key]


def items(value: Any, path: str, read: Callable[[Any, str], T]) -> tuple[T, ...]:
    """A JSON list, each item read by ``read`` under its own path ``path[i]``."""
    if not isinstance(value, list):
        raise PlanFormatError(f"{path}: expected a list, got {_shown(value)}")
    return tuple(read(v, f"{path}[{i}]") for i, v in enumerate(value))


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise PlanFormatError(f"{path}: expected a string, got {_shown(value)}")
    return value


def flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise PlanFormatError(f"{path}: expected true or false, got {_shown(value)}")
    return value


def integer(value: Any, path: str, minimum: int = 0) -> int:
    """A JSON integer ≥ ``minimum`` (indices, devices and counts are never negative)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer ≥ {minimum}")
        raise PlanFormatError(f"{path}: expected {kind}, got {_shown(value)}")
    return value


def finite(value: Any, path: str) -> float:
    """A finite JSON number (an objective, a bound: any sign)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlanFormatError(f"{path}: expected a finite number, got {_shown(value)}")
    return value


def amount(value: Any, path: str) -> float:
    """A time, a size, a fraction or a gap: finite and never negative."""
    if finite(value, path) < 0:
        raise PlanFormatError(f"{path}: expected a non-negative number, got {_shown(value)}")
    return value


def optional(value: Any, path: str, read: Callable[[Any, str], T]) -> T | None:
    """``read(value)``, or None where the plan says null."""
    return None if value is None else read(value, path)
