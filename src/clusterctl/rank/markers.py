"""The marker a rank keeps about itself (the heartbeat writer); the file formats are in runtimefiles.py.

A marker says who the rank is (pid, pgid, process start time, boot id, host, job, nonce) so the launcher can
check identity before signalling, and how it is doing (state, heartbeat, active requests). Writes are atomic;
reads never follow symlinks, are capped at 64 KiB and parse strictly, so a missing, truncated or foreign file
gives a one-line IntegrityError instead of a traceback.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from clusterctl.errors import ClusterctlError
from clusterctl.protocol.identity import boot_id, start_time_of
# the file formats live in runtimefiles.py; re-exported here for the rank (rank/) that imports them so
from clusterctl.protocol.runtimefiles import (_ORDER, MARKER_LIMIT, Lease, Marker, MarkerMissing, State,  # noqa: F401
                                           encode_lease, read_lease, read_marker, write_lease, write_marker)

def effective_env(environ: dict | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith(("MLX_", "JACCL_"))}


IDLE_HEARTBEAT_S = 1.0  # a rank's heartbeat while it holds no request (every 0.5 s while it does)


class MarkerWriter:
    """This rank's marker: one lock, a write on every state change and a heartbeat at least once a second:
    every ``interval`` while the rank holds a request (the heartbeat carries its step notes), every
    ``idle_interval`` (default: the same) while it holds none."""

    def __init__(self, path: str | os.PathLike, *, deployment_id: str, job_id: str, nonce: str, rank: int,
                 node: str, interval: float = 0.5, idle_interval: float | None = None):
        self.path = Path(path)
        self.interval = interval
        self.idle_interval = interval if idle_interval is None else idle_interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final = False
        self.marker = Marker(
            deployment_id=deployment_id, job_id=job_id, nonce=nonce, rank=rank, node=node,
            host=socket.gethostname(), pid=os.getpid(), pgid=os.getpgid(0), start_time=start_time_of(),
            boot_id=boot_id(), state="loading", heartbeat_at=time.time(), env=effective_env(),
        )

    def update(self, *, final: bool = False, **fields) -> None:
        """Change fields and write now. After a ``final`` write (failed/stopping at exit) nothing overrides it."""
        with self._lock:
            if self._final:
                return
            if _ORDER.get(fields.get("state"), 99) < _ORDER[self.marker.state]:
                fields.pop("state")  # states only move forward: a late "serving" must not undo "stopping"
            for k, v in fields.items():
                setattr(self.marker, k, v)
            self.marker.heartbeat_at = time.time()
            self.marker.peak_rss_bytes = peak_rss_bytes()
            self._final = final
            try:
                write_marker(self.path, self.marker)
            except ClusterctlError:
                pass  # a full or vanished runtime dir must not kill serving; the heartbeat retries

    def note(self, **fields) -> None:
        """Change fields without writing: the next heartbeat (at most ``interval`` later) carries them."""
        with self._lock:
            if not self._final:
                for k, v in fields.items():
                    setattr(self.marker, k, v)

    def touch_step(self) -> None:
        # called per token from the step loop: no I/O here, the heartbeat carries it
        self.marker.last_step_at = time.time()

    def start(self) -> None:
        self.update()
        self._thread = threading.Thread(target=self._beat, name="marker-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        # an idle rank's beat is half its cost of idling (a JSON dump and an atomic write); a stale marker is
        # judged after 5 s (quiescence.STALE_AFTER), so a beat a second still leaves four to miss
        while not self._stop.wait(self.interval if self.marker.active_requests else self.idle_interval):
            self.update()

    def stop(self) -> None:
        self._stop.set()


def peak_rss_bytes() -> int | None:
    """This process's peak RSS. Linux: VmHWM of the current address space, because ru_maxrss carries the
    PARENT's peak across fork+exec (a rank started by a big process would report the parent's size)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return int(peak) if os.uname().sysname == "Darwin" else int(peak) * 1024
