"""Reasons for a rank to end on its own: a stale launcher lease, a lost parent, a lost ring peer.

The lease is judged on THIS process's monotonic clock: the time since it last saw ``seq`` change, never a
comparison of wall clocks across machines. A lease file that never appeared is not stale (the launcher may not
use one); once seen, an unreadable or vanished lease counts as not renewed. The watchdog runs in its own thread,
because the main thread may be stuck inside a collective that a frozen peer will never finish.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from clusterctl.errors import ClusterctlError, Exit
from clusterctl.protocol.runtimefiles import KEEPER_PID_ENV, EndReason
from clusterctl.rank.markers import read_lease


class PeerLost(ClusterctlError):
    """The rank only followed a lost ring peer. ``peers``: the peer ranks known to be silent (named by the
    probe ladder or asked once on the way out), empty while nobody knows which one went."""

    exit_code = Exit.UNAVAILABLE
    reason = EndReason.PEER_LOST

    def __init__(self, message: str, *, peers: tuple[int, ...] = (), **kw):
        super().__init__(message, **kw)
        self.peers = tuple(peers)

    @classmethod
    def ring(cls, rank: int, what: str) -> "PeerLost":
        """A message that is not what it must be: MLX's ring can hand back a stale buffer after a peer died
        ("Failing pending tasks") instead of raising."""
        return cls(f"rank {rank}: lost a ring peer or the ring is corrupted ({what})")


class LeaseExpired(ClusterctlError):
    exit_code = Exit.UNAVAILABLE
    reason = EndReason.LEASE_EXPIRED


class ParentGone(ClusterctlError):
    exit_code = Exit.UNAVAILABLE
    reason = EndReason.PARENT_GONE


def end_reason(err: ClusterctlError) -> EndReason:
    """What a rank that ends on ``err`` writes in its marker's ``reason``: the watchdog's own kinds say it,
    any other error is the rank's own failure."""
    return err.reason if isinstance(err, (PeerLost, LeaseExpired, ParentGone)) else EndReason.FAILED


_PEER_WORDS = ("[ring]", "[jaccl]", "[mpi]", "peer", "connection", "recv", "send", "socket")


def peer_loss(exc: BaseException, rank: int) -> PeerLost | None:
    """A PeerLost for MLX's distributed-transport errors (e.g. ``[ring] connection to a peer was lost``)."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(w in text.lower() for w in _PEER_WORDS):
        return PeerLost(f"rank {rank}: lost a ring peer ({text})")
    return None


class LeaseWatch:
    """Tracks one lease file; ``check()`` returns a reason once it is stale."""

    def __init__(self, path: str | os.PathLike, max_seconds: float, *, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.max_seconds = max_seconds
        self.clock = clock
        self.seen = False
        self.seq: int | None = None
        self.holder: str | None = None
        self.duration = max_seconds
        self.changed_at = clock()

    def check(self) -> str | None:
        try:
            lease = read_lease(self.path)
        except ClusterctlError:
            lease = None
        now = self.clock()
        if lease is not None and (not self.seen or lease.seq != self.seq):
            self.seen = True
            self.seq = lease.seq
            self.holder = lease.holder
            # the lease states its term; the contract's lease_seconds caps it
            self.duration = min(lease.duration_s, self.max_seconds)
            self.changed_at = now
            return None
        if not self.seen:
            return None
        idle = now - self.changed_at
        if idle > self.duration:
            return (f"launcher lease {self.path.name} not renewed for {idle:.1f} s "
                    f"(limit {self.duration:g} s, holder {self.holder})")
        return None


class Watchdog:
    """Polls the lease, the parent pid and the armed deadline; calls ``on_trip(error)`` once and stops.

    The deadline covers exchanges that finish in milliseconds when the ring is healthy (joining, the idle
    meetings, checkpoints). MLX's ring may neither raise nor return after a peer dies, so a stuck exchange is
    the one sign left.

    The lease and the parent are looked at every ``interval`` (a lease's term is tens of seconds: a second more
    or less does not matter, and an idle rank wakes once a second instead of five times); an armed deadline is
    checked the moment it passes (the thread sleeps until then), not up to an interval later.
    """

    def __init__(self, *, rank: int, on_trip: Callable[[ClusterctlError], None], lease_path: str | None,
                 lease_seconds: float, interval: float = 1.0):
        self.rank = rank
        self.on_trip = on_trip
        self.interval = interval
        self.lease = LeaseWatch(lease_path, lease_seconds) if lease_path else None
        # A rank under a keeper watches that keeper (a keeper gone before this line counts too); a detached rank
        # has no parent to watch: whoever spawned it may exit at any time, that is what detached means.
        keeper = os.environ.get(KEEPER_PID_ENV, "")
        self.ppid = int(keeper) if keeper.isdigit() else None
        self._deadline: tuple[float, str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextlib.contextmanager
    def guard(self, seconds: float, what: str) -> Iterator[None]:
        """Trip with PeerLost if the block does not finish within ``seconds``."""
        self._deadline = (time.monotonic() + seconds, f"{what} did not finish within {seconds:g} s")
        try:
            yield
        finally:
            self._deadline = None

    def _next_look(self) -> float:
        """Until the next look: an interval, or sooner when an armed deadline passes before (a guard armed while
        this thread sleeps is seen within an interval, long before any deadline of seconds passes)."""
        deadline = self._deadline
        if deadline is None:
            return self.interval
        return min(self.interval, max(0.0, deadline[0] - time.monotonic()) + 0.001)

    def check(self) -> ClusterctlError | None:
        deadline = self._deadline
        if deadline is not None and time.monotonic() > deadline[0]:
            return PeerLost(f"rank {self.rank}: {deadline[1]} (a ring peer is frozen or gone)")
        if self.ppid is not None and os.getppid() != self.ppid:
            return ParentGone(f"rank {self.rank}: parent process {self.ppid} is gone")
        if self.lease is not None:
            reason = self.lease.check()
            if reason:
                return LeaseExpired(f"rank {self.rank}: {reason}")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self._next_look()):
            err = self.check()
            if err is not None:
                self.on_trip(err)
                return
