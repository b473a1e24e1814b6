"""Typed reading of parsed YAML values, with errors that say where and what.

Every check takes the dotted key path of the value it reads (``cluster.links.inter.beta``,
``model.ops[3].inputs[0]``) and raises :class:`~ilp_planner.errors.ConfigError` naming the
file, that path and what was expected, e.g.
``configs/x.yaml: cluster.nodes: expected a positive integer, got 'two'``.

A :class:`Key` declares one configuration key (type, bounds, default, meaning); the
declarations themselves are :data:`ilp_planner.inputs.config_keys.SECTIONS`, which
:meth:`Reader.section` and :meth:`Reader.read` check a document against.

Numbers: YAML 1.1 (PyYAML) reads ``1e-6`` (no dot) as a *string*; number fields therefore
also accept strings that Python's ``float`` parses, so ``beta: 8e-10`` works as written.
Integers must be integers (``4``, not ``4.0`` nor ``true``).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ilp_planner.errors import ConfigError


def join(path: str, key: str | int) -> str:
    """``join('cluster', 'nodes') == 'cluster.nodes'``,
    ``join('model.ops', 3) == 'model.ops[3]'``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 3, 4, 6, 50, 50


def show(value: Any, limit: int = 60) -> str:
    """A short ``repr`` for error messages: bounded work and size whatever the value (a
    YAML alias bomb is a small file but an astronomically large ``repr``)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


REQUIRED = object()
"""The default of a key that must be given."""

# the types :meth:`Reader.read` checks; a key of another type (a list, a mapping, "an integer
# or auto") is read by its section's parser, which the reference describes by ``type``
_PLAIN_TYPES = ("integer", "number", "boolean", "string", "choice")


@dataclass(frozen=True)
class Key:
    """One configuration key: its type and bounds, its default and what it means.

    ``positive`` / ``nonneg`` / ``at_most`` bound integers and numbers as
    :meth:`Reader.integer` and :meth:`Reader.number` do; ``choices`` and ``noun`` are a
    choice's values and what the error calls them; ``null``: an explicit null means the
    default (``max_units: null``); ``default_text`` describes a default computed from
    other keys."""

    type: str
    description: str
    default: Any = REQUIRED
    positive: bool = False
    nonneg: bool = False
    at_most: float | None = None
    choices: tuple[Any, ...] = ()
    noun: str = "value"
    null: bool = False
    default_text: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def type_text(self) -> str:
        """The type column of the reference: ``integer ≥ 1``, ``one of: a, b``, …"""
        if self.type == "choice":
            return "one of: " + ", ".join(str(c) for c in self.choices)
        bound = ("> 0" if self.type == "number" else "≥ 1") if self.positive else (
            "≥ 0" if self.nonneg else "")
        if self.at_most is not None:
            most = f"≤ {self.at_most if self.type == 'integer' else _number_text(self.at_most)}"
            bound = f"{bound}, {most}" if bound else most
        return f"{self.type} {bound}".strip() + (" or null" if self.null else "")

    def default_str(self) -> str:
        if self.default_text:
            return self.default_text
        if self.required:
            return "required"
        if self.default is None:
            return "null"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        if isinstance(self.default, tuple):
            return str(list(self.default))
        if isinstance(self.default, float):
            return _number_text(self.default)
        return str(self.default)


def _number_text(x: float) -> str:
    """``60``, ``0.5``, ``1e9``: how a YAML file would write the number."""
    return f"{x:g}".replace("e+0", "e").replace("e+", "e")


class Reader:
    """Reads values of one configuration source (a file name, or None for in-memory data)."""

    def __init__(self, source: str | None):
        self.source = source

    def fail(self, path: str, message: str) -> NoReturn:
        raise ConfigError(message, source=self.source, key=path or None)

    # -- containers -------------------------------------------------------------------

    def mapping(self, value: Any, path: str, *, required: Iterable[str] = (),
                optional: Iterable[str] = ()) -> dict[str, Any]:
        """A mapping whose keys are all among ``required ∪ optional`` and that has every
        required key. Unknown keys are errors because a typo (``bandwith_gbps``) would
        otherwise silently fall back to a default."""
        required, optional = list(required), list(optional)
        if not isinstance(value, Mapping):
            self.fail(path, f"expected a mapping, got {show(value)}")
        allowed = required + [k for k in optional if k not in required]
        for key in value:
            if not isinstance(key, str):
                self.fail(path, f"keys must be strings, got {show(key)}")
            if key not in allowed:
                self.fail(join(path, key),
                          f"unknown key {key!r}; allowed keys: {', '.join(allowed)}")
        for key in required:
            if key not in value:
                self.fail(join(path, key),
                          f"missing required key {key!r} (required here: {', '.join(required)})")
        return dict(value)

    def sequence(self, value: Any, path: str, *, min_len: int = 0) -> list[Any]:
        if not isinstance(value, list | tuple):
            self.fail(path, f"expected a list, got {show(value)}")
        if len(value) < min_len:
            self.fail(path, f"expected a list of at least {min_len} items, got {len(value)}")
        return list(value)

    def section(self, value: Any, path: str, keys: Mapping[str, Key]) -> dict[str, Any]:
        """A mapping with the keys :data:`SECTIONS` declares for it (required ones first in
        the allowed-keys message, each group in declaration order)."""
        return self.mapping(value, path, required=[k for k, key in keys.items() if key.required],
                            optional=[k for k, key in keys.items() if not key.required])

    def read(self, key: Key, value: Any, path: str) -> Any:
        """A value of one of the plain types, checked as ``key`` declares."""
        if key.type == "integer":
            return self.integer(value, path,
                                minimum=1 if key.positive else 0 if key.nonneg else None,
                                at_most=key.at_most)
        if key.type == "number":
            return self.number(value, path, positive=key.positive, nonneg=key.nonneg,
                               at_most=key.at_most)
        if key.type == "boolean":
            return self.boolean(value, path)
        if key.type == "string":
            return self.string(value, path)
        if key.type == "choice":
            return self.choice(value, path, key.choices, key.noun)
        raise TypeError(f"{path}: a {key.type} is read by its section's parser, not Reader.read")

    # -- scalars ----------------------------------------------------------------------

    def integer(self, value: Any, path: str, *, minimum: int | None = None,
                at_most: float | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            what = "a positive integer" if minimum == 1 else (
                "a non-negative integer" if minimum == 0 else "an integer")
            self.fail(path, f"expected {what}, got {show(value)}")
        if minimum is not None and value < minimum:
            what = ("a positive integer" if minimum == 1 else "a non-negative integer"
                    if minimum == 0 else f"an integer >= {minimum}")
            self.fail(path, f"expected {what}, got {value}")
        if at_most is not None and value > at_most:
            self.fail(path, f"expected an integer <= {at_most}, got {show(value)}")
        return int(value)

    def positive_int(self, value: Any, path: str) -> int:
        return self.integer(value, path, minimum=1)

    def nonneg_int(self, value: Any, path: str) -> int:
        return self.integer(value, path, minimum=0)

    def number(self, value: Any, path: str, *, positive: bool = False,
               nonneg: bool = False, at_most: float | None = None) -> float:
        what = ("a positive number" if positive
                else "a non-negative number" if nonneg else "a number")
        if at_most is not None:
            what += f" <= {at_most:g}"
        if isinstance(value, bool):
            self.fail(path, f"expected {what}, got {show(value)}")
        if isinstance(value, str):
            try:
                x = float(value)
            except ValueError:
                self.fail(path, f"expected {what}, got {show(value)}")
        elif isinstance(value, int | float):
            x = float(value)
        else:
            self.fail(path, f"expected {what}, got {show(value)}")
        if not math.isfinite(x):
            self.fail(path, f"expected {what}, got {show(value)}")
        if (positive and x <= 0) or (nonneg and x < 0) or (at_most is not None and x > at_most):
            self.fail(path, f"expected {what}, got {x:g}")
        return x

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {show(value)}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(path, f"expected a non-empty string, got {show(value)}")
        return value

    def choice(self, value: Any, path: str, choices: Iterable[str], what: str = "value") -> str:
        choices = list(choices)
        if not isinstance(value, str) or value not in choices:
            self.fail(path, f"unknown {what} {show(value)}; expected one of: {', '.join(choices)}")
        return value

    def shape(self, value: Any, path: str) -> tuple[int, ...]:
        """A non-empty list of positive integers."""
        items = self.sequence(value, path, min_len=1)
        return tuple(self.positive_int(d, join(path, i)) for i, d in enumerate(items))

