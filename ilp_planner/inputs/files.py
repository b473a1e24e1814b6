"""Reading inputs and writing outputs with errors a user can act on.

Readers take only regular files of bounded size (``/dev/zero`` or a multi-gigabyte file is
not a configuration) and decode UTF-8 with an error naming the byte; writers create missing
parent folders, and say why they cannot (a folder given for a file, a file standing where a
folder must be, no permission) instead of raising an ``OSError`` traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from ilp_planner.errors import ConfigError, PlannerError

MAX_INPUT_BYTES = 64 * 2**20
"""Largest configuration, plan or results file read (``ILP_PLANNER_MAX_INPUT_BYTES`` raises it)."""


def max_input_bytes() -> int:
    raw = os.environ.get("ILP_PLANNER_MAX_INPUT_BYTES")
    if raw is None:
        return MAX_INPUT_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"ILP_PLANNER_MAX_INPUT_BYTES: expected an integer, got {raw[:40]!r}") \
            from None
    if value < 1:
        raise ConfigError(f"ILP_PLANNER_MAX_INPUT_BYTES: expected a positive integer, got {value}")
    return value


def read_input(path: str | Path, error: type[PlannerError] = ConfigError) -> str:
    """The text of an input file; any problem raises ``error`` naming the file."""
    p = Path(path)

    def fail(message: str) -> PlannerError:
        if error is ConfigError:
            return ConfigError(message, source=str(path))
        return error(f"{path}: {message}")

    try:
        if not p.exists():
            raise fail("file not found")
        if not p.is_file():
            raise fail("not a regular file")
        limit = max_input_bytes()
        size = p.stat().st_size
        if size > limit:
            raise fail(f"{size} bytes; inputs are limited to {limit} (set "
                       f"ILP_PLANNER_MAX_INPUT_BYTES to raise it)")
        with p.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise fail(f"cannot read the file: {exc.strerror}") from None
    if len(data) > limit:
        raise fail(f"more than {limit} bytes; inputs are limited (set ILP_PLANNER_MAX_INPUT_BYTES "
                   f"to raise it)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 text (byte {exc.start})") from None


def prepare_output(path: str | Path, *, folder: bool = False) -> Path:
    """``path`` ready to be written: its parent folders created (for ``folder=True`` the
    folder itself). Raises :class:`ConfigError` naming the path and what stands in the way."""
    p = Path(path)
    target = p if folder else p.parent
    try:
        if not folder and p.is_dir():
            raise ConfigError("is a folder; give a file name", source=str(path))
        if folder and p.exists() and not p.is_dir():
            raise ConfigError("is a file; give a folder for the results", source=str(path))
        target.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"cannot create the folder {target}: a file of that name is in the way",
                          source=str(path)) from None
    except NotADirectoryError:
        raise ConfigError(f"cannot create the folder {target}: part of its path is a file",
                          source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot create the folder {target}: {exc.strerror}",
                          source=str(path)) from None
    return p


def write_output(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (parents created); errors name the path."""
    p = prepare_output(path)
    try:
        p.write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write the file: {exc.strerror}", source=str(path)) from None
