"""Runtime markers a rank writes about itself, and the launcher lease it reads.

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
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clusterctl.atomic import atomic_write_json, read_json
from clusterctl.errors import ClusterctlError, Exit, IntegrityError, MissingInput
from clusterctl.names import Ident, Name

MARKER_LIMIT = 64 * 1024
State = Literal["loading", "ready", "serving", "stopping", "lost", "failed"]
_ORDER = {"loading": 0, "ready": 1, "serving": 2, "stopping": 3, "lost": 4, "failed": 4}


class MarkerMissing(IntegrityError):
    """No marker (yet): the rank has not started, or its folder was cleaned."""

    exit_code = Exit.NOINPUT


class Marker(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    type: Literal["rank-marker"] = "rank-marker"
    deployment_id: Ident
    job_id: Ident
    nonce: str
    rank: int
    node: Name
    host: str
    pid: int
    pgid: int
    start_time: float  # psutil create_time: with pid, the process identity
    boot_id: Optional[str]
    state: State
    endpoint: Optional[str] = None
    active_requests: list[str] = Field(default_factory=list)
    cancel_epoch: Optional[int] = None  # the newest cancel epoch this rank acked (docs/launch.md, "Cancel")
    last_step_at: Optional[float] = None
    heartbeat_at: float  # this node's wall clock; compare only with the same node's clock
    error: Optional[str] = None
    env: dict[str, str] = Field(default_factory=dict)
    start_layer: Optional[int] = None
    end_layer: Optional[int] = None
    peak_rss_bytes: Optional[int] = None


class Lease(BaseModel):
    """Renewed by the coordinator: each renewal bumps ``seq``. Readers judge it by their own monotonic clock."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    type: Literal["lease"] = "lease"
    holder: str
    seq: int = Field(ge=0)
    duration_s: float = Field(gt=0, le=3600)


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def process_start_time(pid: int | None = None) -> float:
    import psutil

    return psutil.Process(pid or os.getpid()).create_time()


def write_marker(path: str | os.PathLike, marker: Marker) -> None:
    atomic_write_json(path, marker.model_dump(mode="json"))


def _read_model(path: str | os.PathLike, cls, what: str):
    try:
        obj = read_json(path, limit=MARKER_LIMIT, what=what)
    except MissingInput as e:
        raise MarkerMissing(e.message) from None
    if not isinstance(obj, dict):
        raise IntegrityError(f"{what} {path} is not a JSON object")
    kind = obj.get("type")
    want = cls.model_fields["type"].default
    if kind != want:
        raise IntegrityError(f"{path} is not a {what} (type {kind!r})")
    version = obj.get("schema_version")
    if isinstance(version, int) and version > 1:
        raise IntegrityError(f"{what} {path} has schema_version {version}, newer than this clusterctl reads (1)")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or what
        raise IntegrityError(f"{what} {path} is invalid: {where}: {first.get('msg', 'invalid')}") from None


def read_marker(path: str | os.PathLike) -> Marker:
    """The marker at ``path``; MarkerMissing (an IntegrityError) if absent, IntegrityError if unreadable."""
    return _read_model(path, Marker, "rank marker")


def write_lease(path: str | os.PathLike, lease: Lease) -> None:
    atomic_write_json(path, lease.model_dump(mode="json"))


def read_lease(path: str | os.PathLike) -> Lease:
    return _read_model(path, Lease, "lease")


def effective_env(environ: dict | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith(("MLX_", "JACCL_"))}


class MarkerWriter:
    """This rank's marker: one lock, a write on every state change and a heartbeat at least once a second."""

    def __init__(self, path: str | os.PathLike, *, deployment_id: str, job_id: str, nonce: str, rank: int,
                 node: str, interval: float = 0.5):
        self.path = Path(path)
        self.interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final = False
        self.marker = Marker(
            deployment_id=deployment_id, job_id=job_id, nonce=nonce, rank=rank, node=node,
            host=socket.gethostname(), pid=os.getpid(), pgid=os.getpgid(0), start_time=process_start_time(),
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

    def touch_step(self) -> None:
        # called per token from the step loop: no I/O here, the heartbeat carries it
        self.marker.last_step_at = time.time()

    def start(self) -> None:
        self.update()
        self._thread = threading.Thread(target=self._beat, name="marker-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
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
