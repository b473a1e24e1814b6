"""A heartbeat through torchrun's store, so that a stopped or hung rank ends the run within a
few beats, naming it, instead of at the collective time-out with a traceback per rank.

Every rank's beat thread adds one to its counter in the store every ``interval_s`` and reads
its peers' counters; a peer whose counter has not moved for :data:`MISSED_BEATS` beats (by
this rank's clock: no clock is compared across hosts) is declared stuck: the watcher writes the
account (:func:`runtime.failures.report`), ends the stuck process where it runs on the same
host (a stopped process would otherwise hold torchrun's teardown for its grace period), and
exits, which makes torchrun stop the others. A rank that finished marks itself done first.
Threads beat while the main thread waits in a collective or computes (both release the GIL);
a rank stopped by a signal, or wedged holding the GIL, does not.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from runtime.failures import STUCK, Failure, report

MISSED_BEATS = 3
STUCK_STATUS = 4  # the exit status of a rank that found a stuck peer
_PREFIX = "ilp_planner/heartbeat"


class Heartbeat:
    """This rank's beat thread; :meth:`stop` marks the rank done before it leaves."""

    def __init__(self, rank: int, world: int, interval_s: float) -> None:
        self.rank, self.interval_s = rank, interval_s
        self.peers = [r for r in range(world) if r != rank]
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False,
                                   timeout=datetime.timedelta(seconds=max(10.0, 3 * interval_s)))
        self.store.set(f"{_PREFIX}/where/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ilp-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and tell the peers this rank is done (so its silence is no alarm)."""
        self._stopped.set()
        self._thread.join()
        self.store.set(f"{_PREFIX}/done/{self.rank}", "1")

    def _beat(self) -> None:
        seen = {peer: (0, time.monotonic()) for peer in self.peers}
        while not self._stopped.wait(self.interval_s):
            self.store.add(f"{_PREFIX}/beats/{self.rank}", 1)
            for peer in self.peers:
                seen[peer] = self._watch(peer, *seen[peer])

    def _watch(self, peer: int, count: int, since: float) -> tuple[int, float]:
        """The peer's latest counter and when it last moved; declares it stuck once silent
        for :data:`MISSED_BEATS` beats."""
        now = time.monotonic()
        latest = self.store.add(f"{_PREFIX}/beats/{peer}", 0)
        if latest != count:
            return latest, now
        silent_s = now - since
        if silent_s > MISSED_BEATS * self.interval_s and not self._done(peer):
            self._declare_stuck(peer, silent_s)
        return count, since

    def _done(self, peer: int) -> bool:
        return self.store.check([f"{_PREFIX}/done/{peer}"])

    def _declare_stuck(self, peer: int, silent_s: float) -> None:
        """Report the stuck peer, end it if it runs here, and leave (torchrun stops the rest)."""
        cause = f"no heartbeat for {silent_s:.1f} s"
        report(Failure(peer, self.rank, STUCK, cause, time.time()))
        print(f"[rank {self.rank}] rank {peer} stopped responding: {cause}", file=sys.stderr,
              flush=True)
        host, pid = self.store.get(f"{_PREFIX}/where/{peer}").decode().split()
        if host == socket.gethostname():
            os.kill(int(pid), signal.SIGKILL)
        os._exit(STUCK_STATUS)


def start(rank: int, world: int, interval_s: float) -> Heartbeat | None:
    """This rank's heartbeat, or None when it is off (``interval_s`` 0) or alone."""
    if interval_s <= 0 or world < 2:
        return None
    return Heartbeat(rank, world, interval_s).start()
