"""Where a sweep's points are solved: worker processes of this machine, or a Ray cluster.

:func:`ilp_planner.sweeps.sweep` builds one :class:`~ilp_planner.sweeps.points.PointTask` per point
and hands the list to a backend together with a ``record`` callback. A backend runs
:func:`~ilp_planner.sweeps.points.solve_point` on every task and calls ``record`` once per task, in
the calling thread, as outcomes arrive (a row plus the plan's JSON text). Everything else —
resume, results files, plan files, progress, plots — stays with the driver
(:mod:`ilp_planner.sweeps.sweep`), so the backends differ only in where the solves run and
how a lost worker is handled:

``local`` (:class:`LocalBackend`, the default): ``jobs`` worker processes started with
*spawn*; ``jobs=1`` solves in the calling process. A worker that dies fails its point.

``ray`` (:class:`RayBackend`): one Ray task per point, reserving the point's
``solver.threads`` CPUs and the sweep's ``solve.memory_gib``. Without an address, Ray
starts a local instance (``jobs`` CPUs, default all cores) and stops it afterwards; with
one (``auto``, ``HOST:PORT``, ``ray://…``) the sweep joins that cluster, whose nodes must
have this package installed. A point whose worker is lost (killed, out of memory, its node
gone) is submitted again up to ``retries`` times, then recorded as failed with the cause.
``solve.timeout_s`` is enforced inside the task, as in a local worker (Ray runs a task on
its worker's main thread, where the alarm works), so a time-out row reads the same on both.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from ilp_planner.errors import BackendError, ConfigError
from ilp_planner.sweeps.points import (
    Point,
    PointOutcome,
    PointTask,
    describe_error,
    failed_row,
    solve_point,
)

BACKENDS = ("local", "ray")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
Record = Callable[[PointOutcome], None]
Note = Callable[[str], None]


class Backend(Protocol):
    def run(self, tasks: Sequence[PointTask], record: Record, note: Note) -> None:
        """Solve every task, calling ``record`` once per task (in this thread) as outcomes
        arrive and ``note`` for events worth a line beside the progress bar. On any
        exception, Ctrl-C included, stop the outstanding work and re-raise: what was
        recorded so far is what a resumed sweep keeps."""


def make_backend(name: str, *, jobs: int | None = None, address: str | None = None) -> Backend:
    """The backend called ``name`` (one of :data:`BACKENDS`), its options checked."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError(f"jobs (-j): expected a positive integer, got {jobs!r}")
    if name == "local":
        if address is not None:
            raise ConfigError(f"address {address!r} is for the ray backend; pass backend='ray' "
                              f"(--backend ray) to run on a Ray cluster")
        return LocalBackend(jobs)
    if name == "ray":
        if address is not None and jobs is not None:
            raise ConfigError("jobs (-j) sets the CPUs of the Ray instance started here; a cluster "
                              f"joined at {address!r} brings its own, so pass one or the other")
        return RayBackend(address, jobs)
    raise ConfigError(f"unknown sweep backend {name!r}; expected one of: {', '.join(BACKENDS)}")


# -- this machine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalBackend:
    """``jobs`` worker processes (default: the number of cores; 1 = the calling process)."""

    jobs: int | None = None

    def run(self, tasks: Sequence[PointTask], record: Record, note: Note) -> None:
        workers = min(self.jobs or os.cpu_count() or 1, len(tasks))
        if workers <= 1:
            for task in tasks:
                try:
                    outcome = solve_point(task)
                except Exception as exc:  # noqa: BLE001 - as a dead worker: fail the point
                    outcome = PointOutcome(failed_row(task, _worker_failed(exc)))
                record(outcome)
            return
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                 initializer=exit_with_driver, initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(solve_point, t): t for t in tasks}
            try:
                for fut in as_completed(futures):
                    try:
                        outcome = fut.result()
                    except Exception as exc:  # noqa: BLE001 - a dead worker fails its point only
                        outcome = PointOutcome(failed_row(futures[fut], _worker_failed(exc)))
                    record(outcome)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise


def exit_with_driver(driver_pid: int) -> None:
    """Pool-worker initializer: a worker ends when the sweep's driver dies, even by SIGKILL
    (no ``finally`` runs there). Without it an idle worker waits on its task queue forever
    (it holds both ends of the pipe, so it never sees end-of-file), and multiprocessing's
    resource tracker, which stops once every holder of its pipe is gone, stays with it.
    Linux: the kernel sends SIGKILL when the parent goes (``prctl(PR_SET_PDEATHSIG)``, works
    while a solver holds the GIL); elsewhere a thread polls for the parent."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        threading.Thread(target=_watch_driver, args=(driver_pid,), daemon=True).start()
    if os.getppid() != driver_pid:  # the driver died before the line above took effect
        os._exit(1)


def _watch_driver(driver_pid: int) -> None:
    while os.getppid() == driver_pid:
        time.sleep(1.0)
    os._exit(1)


def _worker_failed(exc: BaseException) -> str:
    error = f"worker failed: {describe_error(exc)}"
    if isinstance(exc, BrokenProcessPool):
        error += ("; workers start by re-importing the main script (spawn): call sweep() under "
                  "`if __name__ == \"__main__\":`, or use jobs=1")
    return error


# -- a Ray cluster ---------------------------------------------------------------------------


def import_ray() -> ModuleType:
    """The ``ray`` module, or a :class:`BackendError` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise BackendError(f"the ray backend needs Ray, which is not installed ({exc}); install "
                           f"the extra: pip install 'ilp-planner[ray]' (pip install -e '.[ray]' "
                           f"in a checkout)") from exc
    return ray


@dataclass(frozen=True)
class RayBackend:
    """One Ray task per point (see the module docstring). ``address``: the cluster to join,
    None for a local instance of ``cpus`` CPUs (default: all cores). A process that is
    already connected (it called ``ray.init``) keeps its connection, and then neither may
    be given. ``retries``: submissions after the first for a point whose worker is lost."""

    address: str | None = None
    cpus: int | None = None
    retries: int = 2

    def run(self, tasks: Sequence[PointTask], record: Record, note: Note) -> None:
        if not tasks:  # everything was resumed: no cluster needed
            return
        ray = import_ray()
        connected_here = self._connect(ray)
        try:
            if connected_here and self.address is None:
                # a local instance never grows: a point it cannot hold would wait forever
                tasks = self._fail_oversized(tasks, ray.cluster_resources(), record)
            self._solve(ray, tasks, record, note)
        finally:
            if connected_here:
                ray.shutdown()

    def _connect(self, ray: ModuleType) -> bool:
        """Connect (or start a local instance); True when this call made the connection."""
        if ray.is_initialized():
            if self.address is not None or self.cpus is not None:
                raise BackendError("this process is already connected to Ray (ray.init was called) "
                                   "and the sweep uses that connection: pass neither address nor "
                                   "jobs")
            return False
        kwargs = {"address": self.address} if self.address is not None else {"num_cpus": self.cpus}
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"join the Ray cluster at {self.address!r}" if self.address else \
                "start a local Ray instance"
            raise BackendError(f"cannot {where}: {exc}") from exc
        return True

    @staticmethod
    def _fail_oversized(tasks: Sequence[PointTask], total: dict[str, float],
                        record: Record) -> list[PointTask]:
        """Record a failure for each point needing more CPUs or memory than the local instance
        has; return the others."""
        fits = []
        for task in tasks:
            cpus, mem = total.get("CPU", 0), total.get("memory", 0) / 2**30
            if task.cpus > cpus:
                record(PointOutcome(failed_row(task, f"needs {task.cpus} CPUs (solver.threads) but "
                                                     f"the local Ray instance has {cpus:g}; raise -j")))
            elif task.memory_gib is not None and task.memory_gib > mem:
                record(PointOutcome(failed_row(task, f"needs {task.memory_gib:g} GiB "
                                                     f"(solve.memory_gib) but the local Ray instance "
                                                     f"has {mem:.1f} GiB")))
            else:
                fits.append(task)
        return fits

    def _solve(self, ray: ModuleType, tasks: Sequence[PointTask], record: Record, note: Note) -> None:
        lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError,
                ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError)
        remote = ray.remote(solve_point)
        pending: dict = {}  # ObjectRef -> (task, submissions so far)

        def submit(task: PointTask, attempt: int) -> None:
            options = {"num_cpus": task.cpus, "max_retries": 0}  # retried here, with a note
            if task.memory_gib is not None:
                options["memory"] = int(task.memory_gib * 2**30)
            pending[remote.options(**options).remote(task)] = (task, attempt)

        for task in tasks:
            submit(task, 1)
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    task, attempt = pending.pop(ref)
                    try:
                        outcome = ray.get(ref)
                    except lost as exc:
                        label = Point(task.index, task.overrides).label
                        if attempt <= self.retries:
                            note(f"point {task.index} ({label}): worker lost ({_cause(exc)}); "
                                 f"retrying ({attempt}/{self.retries})")
                            submit(task, attempt + 1)
                            continue
                        outcome = PointOutcome(failed_row(
                            task, f"worker lost on all {attempt} attempts; last: {_cause(exc)}"))
                    except ray.exceptions.RayTaskError as exc:
                        outcome = PointOutcome(failed_row(task, f"worker failed: {_cause(exc.cause)}"))
                    except ray.exceptions.RayError as exc:
                        outcome = PointOutcome(failed_row(task, f"ray task failed: {_cause(exc)}"))
                    record(outcome)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise


def _cause(exc: BaseException) -> str:
    """``WorkerCrashedError: The worker died unexpectedly…``: the type and the first line
    (Ray's messages go on with log hints and ids)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
