"""The sweep's progress bar on stderr: done / total, failures, elapsed time and
ETA = elapsed / solved_this_run × remaining (points kept by a resume cost no time)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_progress(done: int, total: int, failed: int, elapsed_s: float, eta_s: float | None,
                    width: int = 24, label: str = "sweep") -> str:
    """``sweep  3/9 [########----------------]  33%  1 failed  elapsed 0:12  ETA 0:24``."""
    frac = done / total if total else 1.0
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    eta = "?" if eta_s is None else _clock(eta_s)
    return (f"{label} {done:>{len(str(total))}}/{total} [{bar}] {frac:4.0%}  {failed} failed  "
            f"elapsed {_clock(elapsed_s)}  ETA {eta}")


def _clock(s: float) -> str:
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """A one-line progress bar on a stream (stderr). On a terminal it redraws in place; on
    a pipe or file it writes one line per finished point."""

    def __init__(self, total: int, *, done: int = 0, failed: int = 0, stream: TextIO | None = None,
                 enabled: bool = True, label: str = "sweep"):
        self.total, self.done, self.failed = total, done, failed
        self.solved = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.label = label
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._draw(final=False)

    def update(self, failed: bool) -> None:
        self.done += 1
        self.solved += 1
        self.failed += int(failed)
        self._draw(final=False)

    def note(self, text: str) -> None:
        """A message between progress lines (a retried point): on a terminal it replaces the
        bar, which is redrawn below it."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(len(self.line())) + "\n")
            self._draw(final=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        remaining = self.total - self.done
        eta = elapsed / self.solved * remaining if self.solved else (0.0 if not remaining else None)
        return format_progress(self.done, self.total, self.failed, elapsed, eta, label=self.label)

    def _draw(self, final: bool) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
