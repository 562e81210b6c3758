"""Cancel files and their acks: how an operator cancels requests on a running deployment (docs/launch.md).

``clusterctl cancel`` writes ``<runtime_dir>/<deployment>-cancel.json`` on every node of the job (atomically):
a new, larger epoch and the request ids to cancel (or all). Rank 0 looks at it (a stat every 0.05 s at most, a read
when it changed, from its step loop), cancels the matching requests, and sends the epoch to every rank inside the next control
collective, so all ranks apply it at the same step boundary and none leaves a collective early. Each rank then
writes ``<deployment>-rank<r>-ack.json`` with the epoch it received. An epoch already consumed is ignored; a
corrupt or foreign file (another job, another user) is logged once and ignored.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from clusterctl.errors import ClusterctlError

CHECK_EVERY = 0.05  # a stat of one file (about 2 us); read only when it changed
EPOCH_MAX = 2**31 - 1  # travels in an int32 control word (one cancel a second for 68 years)


class CancelFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    type: Literal["cancel"] = "cancel"
    deployment_id: str
    job_id: str
    epoch: int = Field(ge=1, le=EPOCH_MAX)
    requests: Optional[list[str]] = None  # None: every request
    created_at: float


class CancelAck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    type: Literal["cancel-ack"] = "cancel-ack"
    deployment_id: str
    job_id: str
    rank: int
    epoch: int
    applied: list[str] = Field(default_factory=list)  # rank 0: the request ids it cancelled for this epoch
    at: float


def cancel_path(runtime_dir: str | os.PathLike, deployment_id: str) -> Path:
    return Path(runtime_dir) / f"{deployment_id}-cancel.json"


def ack_path(runtime_dir: str | os.PathLike, deployment_id: str, rank: int) -> Path:
    return Path(runtime_dir) / f"{deployment_id}-rank{rank}-ack.json"


def _read(path: Path, cls):
    from clusterctl.launch.markers import _read_model

    return _read_model(path, cls, "cancel file" if cls is CancelFile else "cancel ack")


def read_cancel(path: str | os.PathLike) -> CancelFile:
    st = os.lstat(path)
    if st.st_uid != os.getuid():
        from clusterctl.errors import IntegrityError

        raise IntegrityError(f"{path} belongs to another user (uid {st.st_uid}): ignored")
    return _read(Path(path), CancelFile)


def read_ack(path: str | os.PathLike) -> CancelAck:
    return _read(Path(path), CancelAck)


def cancel_here(runtime_dir: str, deployment_id: str, job_id: str, requests: list[str]) -> int:
    """Rank 0's own cancel of the requests it holds now (the abort stage of the peer-loss ladder and of a stale
    lease): a new epoch in this node's cancel file, applied by its step loop like an operator's. The ids are
    named, never "all": the step loop may only get to it after the ring is back, and a request accepted since
    must not be hit. Returns the epoch."""
    from clusterctl.atomic import atomic_write_json

    path = cancel_path(runtime_dir, deployment_id)
    try:
        prev = read_cancel(path).epoch
    except (ClusterctlError, OSError):
        prev = 0
    epoch = prev + 1 if prev < EPOCH_MAX else 1
    doc = CancelFile(deployment_id=deployment_id, job_id=job_id, epoch=epoch, requests=list(requests),
                     created_at=time.time())
    atomic_write_json(path, doc.model_dump(mode="json"), mode=0o600)
    return epoch


def write_ack(runtime_dir: str, deployment_id: str, job_id: str, rank: int, epoch: int, applied: list[str]) -> None:
    from clusterctl.atomic import atomic_write_json

    doc = CancelAck(deployment_id=deployment_id, job_id=job_id, rank=rank, epoch=epoch, applied=applied,
                    at=time.time())
    atomic_write_json(ack_path(runtime_dir, deployment_id, rank), doc.model_dump(mode="json"), mode=0o600)


class CancelWatch:
    """Rank 0's reader of its node's cancel file: ``poll()`` returns a cancel of this job with a new epoch. It
    looks at most every CHECK_EVERY seconds, and then only stats the file unless it changed."""

    def __init__(self, runtime_dir: str, deployment_id: str, job_id: str, *, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, every: float = CHECK_EVERY):
        self.path = cancel_path(runtime_dir, deployment_id)
        self.deployment_id, self.job_id = deployment_id, job_id
        self.log, self.clock, self.every = log, clock, every
        self.next_at = 0.0
        self.complained: set[tuple] = set()
        self.mtime: tuple | None = None
        self.consumed = 0  # a file left by an earlier job names that job: ignored as foreign, never applied

    def _stat_key(self) -> tuple | None:
        """What tells one version of the file from another without reading it (None: no file)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self) -> CancelFile | None:
        key = self._stat_key()
        if key is None:
            return None
        if key == self.mtime:
            return None  # unchanged since the last look
        self.mtime = key
        try:
            doc = read_cancel(self.path)
        except (ClusterctlError, OSError) as e:
            self._complain(key, f"ignoring cancel file {self.path}: {getattr(e, 'message', None) or e}")
            return None
        if doc.deployment_id != self.deployment_id or doc.job_id != self.job_id:
            self._complain(("foreign", doc.job_id, doc.epoch),
                           f"ignoring cancel file {self.path}: it is for job {doc.job_id}, not {self.job_id}")
            return None
        return doc

    def _complain(self, key, msg: str) -> None:
        if key not in self.complained:
            self.complained.add(key)
            self.log(msg)

    def changed(self) -> bool:
        """Has the file changed since the last look (a stat, nothing read)? Then the next ``poll()`` reads it at
        once. What an idle rank 0 asks between its meetings, so a cancel does not wait for the idle schedule."""
        key = self._stat_key()
        if key is None or key == self.mtime:
            return False
        self.next_at = 0.0
        return True

    def poll(self) -> CancelFile | None:
        now = self.clock()
        if now < self.next_at:
            return None
        self.next_at = now + self.every
        doc = self._load()
        if doc is None or doc.epoch <= self.consumed:
            return None
        self.consumed = doc.epoch
        return doc
