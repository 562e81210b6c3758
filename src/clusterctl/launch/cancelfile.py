"""Cancel files and their acks: how an operator cancels requests on a running deployment (docs/launch.md).

``clusterctl cancel`` writes ``<runtime_dir>/<deployment>-cancel.json`` on every node of the job (atomically):
a new, larger epoch and the request ids to cancel (or all). Rank 0 looks at it (a stat every 0.05 s at most, a read
when it changed, from its step loop), cancels the matching requests, and sends the epoch to every rank inside the next control
collective, so all ranks apply it at the same step boundary and none leaves a collective early. Each rank then
writes ``<deployment>-rank<r>-ack.json`` with the epoch it received. An epoch already consumed is ignored (logged
once); a corrupt or foreign file (another job, another user) is logged once and ignored.

An epoch alone does not prove a cancel was applied: a coordinator that cannot read a newer file may write an epoch
rank 0 already consumed, and then the old acks carry that epoch too. So every cancel file carries a random
``nonce``, and rank 0's ack names the (epoch, nonce) it applied and its RECENT_ACKS before: a coordinator counts
rank 0 only when its own pair is there, and the other ranks only once rank 0 counts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from clusterctl.errors import ClusterctlError

CHECK_EVERY = 0.05  # a stat of one file (about 2 us); read only when it changed
EPOCH_MAX = 2**31 - 1  # travels in an int32 control word (one cancel a second for 68 years)
# What a request id may be (the CLI checks the same): rank 0's own ids are "cmpl-<hex>" / "chatcmpl-<hex>". The
# bounds keep a cancel file far below the 64 KiB its readers accept (256 x 128 bytes = 32 KiB).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
MAX_REQUEST_IDS = 256
NONCE_PATTERN = r"^[0-9a-f]{16,64}$"
RECENT_ACKS = 32  # (epoch, nonce) pairs rank 0's ack keeps: a cancel overtaken by newer ones still shows

RequestId = Annotated[str, StringConstraints(pattern=REQUEST_ID_PATTERN)]
Nonce = Annotated[str, StringConstraints(pattern=NONCE_PATTERN)]


def new_nonce() -> str:
    import secrets

    return secrets.token_hex(8)


class CancelFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    type: Literal["cancel"] = "cancel"
    deployment_id: str
    job_id: str
    epoch: int = Field(ge=1, le=EPOCH_MAX)
    requests: Optional[list[RequestId]] = Field(default=None, max_length=MAX_REQUEST_IDS)  # None: every request
    created_at: float
    nonce: Optional[Nonce] = None  # None: written by a clusterctl from before nonces (it can never be acked)


class CancelAck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = 1
    type: Literal["cancel-ack"] = "cancel-ack"
    deployment_id: str
    job_id: str
    rank: int
    epoch: int = Field(ge=0, le=EPOCH_MAX)
    applied: list[str] = Field(default_factory=list)  # rank 0: the request ids it cancelled for this epoch
    at: float
    nonce: Optional[Nonce] = None  # rank 0: the nonce of the cancel file of ``epoch``
    recent: list[tuple[int, Nonce]] = Field(default_factory=list, max_length=RECENT_ACKS)  # rank 0: applied before

    def shows(self, epoch: int, nonce: str) -> bool:
        """Rank 0 applied the cancel file (epoch, nonce): now, or among its recent ones."""
        return (self.epoch, self.nonce) == (epoch, nonce) or (epoch, nonce) in self.recent


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


def cancel_here(runtime_dir: str, deployment_id: str, job_id: str, requests: list[str], *, consumed: int = 0) -> int:
    """Rank 0's own cancel of the requests it holds now (the abort stage of the peer-loss ladder and of a stale
    lease): a new epoch in this node's cancel file, applied by its step loop like an operator's. The ids are
    named, never "all": the step loop may only get to it after the ring is back, and a request accepted since
    must not be hit. ``consumed``: the newest epoch rank 0 took (the file may be one it could not read, and an
    epoch not above it would be ignored). Returns the epoch."""
    from clusterctl.atomic import atomic_write_json

    path = cancel_path(runtime_dir, deployment_id)
    try:
        prev = read_cancel(path).epoch
    except (ClusterctlError, OSError):
        prev = 0
    prev = max(prev, consumed)
    epoch = prev + 1 if prev < EPOCH_MAX else 1
    # more ids than a cancel file holds (a queue launched beyond MAX_REQUEST_IDS): all, rather than none
    named = list(requests) if len(requests) <= MAX_REQUEST_IDS else None
    doc = CancelFile(deployment_id=deployment_id, job_id=job_id, epoch=epoch, requests=named,
                     created_at=time.time(), nonce=new_nonce())
    atomic_write_json(path, doc.model_dump(mode="json"), mode=0o600)
    return epoch


def write_ack(runtime_dir: str, deployment_id: str, job_id: str, rank: int, epoch: int, applied: list[str], *,
              nonce: str | None = None, recent: list[tuple[int, str]] = ()) -> None:
    from clusterctl.atomic import atomic_write_json

    doc = CancelAck(deployment_id=deployment_id, job_id=job_id, rank=rank, epoch=epoch, applied=applied,
                    at=time.time(), nonce=nonce, recent=list(recent)[-RECENT_ACKS:])
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
        self.consumed_nonce: str | None = None

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
        if doc is None:
            return None
        if doc.epoch <= self.consumed:
            # the cancel just applied, written again (nodes that share this runtime dir each get a copy): not news
            if (doc.epoch, doc.nonce) != (self.consumed, self.consumed_nonce) or doc.nonce is None:
                # said once per cancel: the rank log then explains a cancel that was never applied
                self._complain(("consumed", doc.epoch, doc.nonce),
                               f"ignoring cancel file {self.path}: epoch {doc.epoch} is not above the "
                               f"{self.consumed} already consumed")
            return None
        self.consumed, self.consumed_nonce = doc.epoch, doc.nonce
        return doc
