"""Start the ranks of one host under torchrun's agent, in this process, and turn a failed
run into one line.

Running the agent here (``torch.distributed.run``, as ``torchrun`` itself does) gives the
exit status of the rank that failed first, which a torchrun subprocess only prints as a
report; the agent's stderr goes to ``torchrun.log`` in the run folder and each rank's
to ``rank{N}.log`` (:mod:`runtime.failures`), so the console shows rank 0's output and, on
failure, the one line :func:`runtime.failures.explain_failure` writes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from runtime.errors import RunFailedError
from runtime.failures import CHECK_FAILED_STATUS, RUN_DIR_ENV, clear_failures, explain_failure


def launch_ranks(nproc: int, module: str, module_args: list[str], folder: Path) -> int:
    """Run ``python -m module module_args`` on ``nproc`` local ranks reporting into
    ``folder``; 0 on success, :data:`CHECK_FAILED_STATUS` when a rank's check failed, and
    :class:`RunFailedError` with the one line otherwise."""
    argv = ["--standalone", "--nproc-per-node", str(nproc), "-m", module, *module_args]
    clear_failures(folder)
    with _environment(RUN_DIR_ENV, str(folder)), _stderr_to(folder / "torchrun.log"):
        try:
            torchrun.run(torchrun.parse_args(argv))
        except ChildFailedError as exc:
            exits = {rank: f.exitcode for rank, f in exc.failures.items()}
            line = explain_failure(folder, exits)
            if line is None:
                return CHECK_FAILED_STATUS
            raise RunFailedError(line) from None
        except SignalException as exc:  # Ctrl-C or a kill: the agent has stopped the ranks
            raise RunFailedError(f"interrupted by {exc.sigval.name}; logs in {folder}") from None
    return 0


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``name=value`` for the ranks the agent starts (they inherit this process's
    environment), restored afterwards."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """This process's stderr, and so the inherited stderr of the ranks until each opens its
    own log, into ``path``: the agent's messages (rendezvous, OMP_NUM_THREADS, its failure
    report) and whatever a rank prints before its log exists (an interrupted import)."""
    sys.stderr.flush()
    saved = os.dup(sys.stderr.fileno())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, sys.stderr.fileno())
        os.close(saved)
