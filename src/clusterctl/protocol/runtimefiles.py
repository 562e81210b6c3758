"""The names of the files in a node's runtime dir: the one place they are built, on both sides of the wire.

Per job ``<job>``:  ``<job>-rank<r>.json`` marker, ``<job>-rank<r>.contract`` signed contract (0600),
``<job>-rank<r>.hostfile.json`` ring hostfile, ``<job>-rank<r>.log`` a detached rank's log, ``<job>.gate``
opened once every rank is ready, ``<job>.lease`` the launcher lease.
Per deployment ``<dep>``: ``<dep>-cancel.json`` cancel request, ``<dep>-rank<r>-ack.json`` a rank's cancel ack.
Shared: ``trusted-keys/<key id>.pub``, the public keys contracts are checked against.

Besides the names, this module owns the files' formats: the pydantic models (``Marker``, ``Lease``,
``CancelFile``, ``CancelAck``), their tolerant readers (a missing, truncated, foreign or newer file is a
one-line error, never a traceback) and their atomic writers. The rank (``rank/``), the programs on the
nodes and the coordinator all read and write these files through it. What a rank DOES with them lives beside
the rank: the marker heartbeat in ``markers.py``, the cancel watch in ``cancelfile.py``.

Cancel files: ``clusterctl cancel`` writes a new, larger epoch and the request ids (or all) on every node of the
job; rank 0 applies it at a step boundary on every rank at once, each rank acks the epoch it received. Every
cancel file carries a random ``nonce`` and rank 0's ack names the (epoch, nonce) it applied and its RECENT_ACKS
before, so a coordinator counts rank 0 only when its own pair is there (docs/launch.md, "Cancel").
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, StringConstraints,
                      ValidationError, WrapValidator)

from clusterctl.atomic import atomic_write_bytes, atomic_write_json, dumps, read_json
from clusterctl.errors import ClusterctlError, Exit, IntegrityError, MissingInput, pydantic_line
from clusterctl.names import Ident, Name

TRUSTED_KEYS = "trusted-keys"
GATE_OPEN = b"open\n"
KEEPER_PID_ENV = "CLUSTERCTL_KEEPER_PID"  # the node keeper tells its rank which parent to watch (rank/watchdog.py)


@dataclass(frozen=True)
class RankFiles:
    """The files of one rank of one job in ``runtime_dir``."""

    runtime_dir: str
    job_id: str
    rank: int

    def _p(self, suffix: str) -> str:
        return os.path.join(self.runtime_dir, f"{self.job_id}-rank{self.rank}{suffix}")

    @property
    def marker(self) -> str:
        return self._p(".json")

    @property
    def contract(self) -> str:
        return self._p(".contract")

    @property
    def hostfile(self) -> str:
        return self._p(".hostfile.json")

    @property
    def log(self) -> str:
        return self._p(".log")


def gate_path(runtime_dir: str, job_id: str) -> str:
    return os.path.join(runtime_dir, f"{job_id}.gate")


def lease_path(runtime_dir: str, job_id: str) -> str:
    return os.path.join(runtime_dir, f"{job_id}.lease")


def trusted_key_path(runtime_dir: str, key_id: str) -> str:
    return os.path.join(runtime_dir, TRUSTED_KEYS, f"{key_id}.pub")


def cancel_name(deployment_id: str) -> str:
    return f"{deployment_id}-cancel.json"


def ack_name(deployment_id: str, rank: int) -> str:
    return f"{deployment_id}-rank{rank}-ack.json"


def belongs_to_job(name: str, job_id: str) -> bool:
    """Is ``name`` (a file name in a runtime dir) one of the job's own files (markers, contracts, hostfiles,
    logs, gate, lease)? Cancel files and acks are named by deployment: their content says whose they are."""
    return name.startswith(job_id + "-rank") or name in (f"{job_id}.gate", f"{job_id}.lease")


def marker_rank(name: str, job_id: str) -> str | None:
    """The rank number, as written, of a marker file name ``<job>-rank<r>.json`` of this job (else None)."""
    prefix = f"{job_id}-rank"
    if name.startswith(prefix) and name.endswith(".json") and name[len(prefix):-5].isdigit():
        return name[len(prefix):-5]
    return None


def is_cancel_or_ack(name: str) -> bool:
    return name.endswith(("-cancel.json", "-ack.json"))


# ---- markers and leases ----------------------------------------------------------------------------------------

MARKER_LIMIT = 64 * 1024
State = Literal["loading", "ready", "serving", "stopping", "lost", "failed"]
_ORDER = {"loading": 0, "ready": 1, "serving": 2, "stopping": 3, "lost": 4, "failed": 4}


class EndReason(str, enum.Enum):
    """Why a rank ended, as its marker says (typed: the supervisor and launch decide on this, never on the
    words of ``error``). ``peer_lost``: it only followed a lost ring peer (the ring broke, an exchange with a
    peer did not finish, the peer-loss ladder gave up on a peer); ``lease_expired``/``parent_gone``: its
    launcher or its keeper went away; ``failed``: an error of its own; ``internal``: a crash (a traceback)."""

    PEER_LOST = "peer_lost"
    LEASE_EXPIRED = "lease_expired"
    PARENT_GONE = "parent_gone"
    FAILED = "failed"
    INTERNAL = "internal"


def end_reason_of(value) -> EndReason | None:
    """A marker's ``reason`` as read from a file that may be old (none) or garbled: the enum, or None."""
    try:
        return EndReason(value) if isinstance(value, str) else None
    except ValueError:
        return None


def followed_a_peer(state: object, reason: object) -> bool:
    """Did the rank whose marker says ``state`` and ``reason`` only follow a lost ring peer? Its ladder's last
    word (``lost``) or its typed reason says so, whatever its process does now (a follower exits 69 at once)."""
    return state == "lost" or end_reason_of(reason) is EndReason.PEER_LOST


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
    reason: Optional[EndReason] = None  # why it ended, with ``error`` (markers before this field: None)
    env: dict[str, str] = Field(default_factory=dict)
    start_layer: Optional[int] = None
    end_layer: Optional[int] = None
    peak_rss_bytes: Optional[int] = None
    # what the step loop last said of its load (status --watch): requests in its batch, waiting (rank 0), tokens
    # generated so far (rank 0), recent step time and idle share, resident memory now, the peer-loss ladder's
    # last stage, the prompt cache (entries, tokens held, tokens allowed)
    batch: Optional[int] = None
    queued: Optional[int] = None
    tokens_out: Optional[int] = None
    step_s: Optional[float] = None
    idle_share: Optional[float] = None
    rss_bytes: Optional[int] = None
    ladder: Optional[str] = None
    prompt_cache: Optional[list[int]] = None


class Lease(BaseModel):
    """Renewed by the coordinator: each renewal bumps ``seq``. Readers judge it by their own monotonic clock."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    type: Literal["lease"] = "lease"
    holder: str
    seq: int = Field(ge=0)
    duration_s: float = Field(gt=0, le=3600)


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
        raise IntegrityError(f"{what} {path} is invalid: {pydantic_line(e, what)}") from None


def read_marker(path: str | os.PathLike) -> Marker:
    """The marker at ``path``; MarkerMissing (an IntegrityError) if absent, IntegrityError if unreadable."""
    return _read_model(path, Marker, "rank marker")


def encode_lease(lease: Lease) -> bytes:
    """The lease file's bytes: what the coordinator writes on every node (through its op session) and
    ``write_lease`` writes here."""
    return dumps(lease.model_dump(mode="json"))


def write_lease(path: str | os.PathLike, lease: Lease) -> None:
    atomic_write_bytes(path, encode_lease(lease))


def read_lease(path: str | os.PathLike) -> Lease:
    return _read_model(path, Lease, "lease")


def parse_marker(doc) -> Marker | None:
    """A marker document a node sent (as JSON) -> the model, or None when there is none or it is not one: the
    strict reader, for the launcher's decisions (a rank is ready only by a whole, valid marker). What a look
    shows of a marker is read tolerantly instead: ``MarkerView.read``."""
    if not isinstance(doc, dict):
        return None
    try:
        return Marker.model_validate(doc)
    except ValidationError:
        return None


def _or_none(value, handler):
    try:
        return handler(value)
    except ValidationError:
        return None


def _count(v: int) -> int:
    if v < 0:
        raise ValueError("a count is not negative")
    return v


def _seconds(v: float) -> float:
    if not 0 <= v < 1e9:  # NaN and infinities too
        raise ValueError("out of range")
    return v


def _texts(v) -> list[str]:
    return [str(x)[:200] for x in v[:1000]] if isinstance(v, list) else []


def _triple(v: list[int]) -> list[int]:
    if len(v) != 3:
        raise ValueError("not three numbers")
    return v


def _tolerant(kind, *checks):
    """A field of a marker as a look reads it: of the wrong type, or failing a check, it reads as None."""
    inner = Annotated[kind, *map(AfterValidator, checks)] if checks else kind
    return Annotated[Optional[inner], WrapValidator(_or_none)]


_Text = _tolerant(StrictStr, lambda s: s[:500])
_Int = _tolerant(StrictInt)
_Count = _tolerant(StrictInt, _count)
_Seconds = _tolerant(float, _seconds)


class MarkerView(BaseModel):
    """A marker as a look at a job shows it (status, quiescence, the supervisor): the one tolerant reader of
    what a node sent. A field of the wrong type, out of range or missing is None (the request ids: none), the
    texts are cut short, the rest of the document is ignored: a garbled or foreign file never crashes a look."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    rank: _Int = None
    state: _Text = None
    endpoint: _Text = None
    error: _Text = None
    reason: _Text = None
    cancel_epoch: _Int = None
    active_requests: Annotated[list[str], WrapValidator(lambda v, _: _texts(v))] = Field(default_factory=list)
    batch: _Count = None  # the step loop's load (status --watch)
    queued: _Count = None
    tokens_out: _Count = None
    rss_bytes: _Count = None
    step_s: _Seconds = None
    idle_share: _Seconds = None
    ladder: _tolerant(StrictStr, lambda s: s[:200]) = None
    prompt_cache: _tolerant(list[StrictInt], _triple) = None

    @classmethod
    def read(cls, doc) -> MarkerView:
        """``doc`` as a node sent it (any JSON value: not an object reads as an empty marker)."""
        return cls.model_validate(doc if isinstance(doc, dict) else {})


# ---- cancel files and acks -------------------------------------------------------------------------------------

EPOCH_MAX = 2**31 - 1  # travels in an int32 control word (one cancel a second for 68 years)
# What a request id may be (the CLI checks the same): rank 0's own ids are "cmpl-<hex>" / "chatcmpl-<hex>". The
# bounds keep a cancel file far below the 64 KiB its readers accept (256 x 128 bytes = 32 KiB).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
MAX_REQUEST_IDS = 256
NONCE_PATTERN = r"^[0-9a-f]{16,64}$"
RECENT_ACKS = 32  # (epoch, nonce) pairs rank 0's ack keeps: a cancel overtaken by newer ones still shows



class EpochsUsedUp(ClusterctlError):
    """A job's cancel epochs reached EPOCH_MAX: a new job starts again at 1."""

    exit_code = Exit.FAILED


def epoch_is_new(epoch: int, last: int) -> bool:
    """The one epoch rule, on both sides: a cancel counts only with an epoch above the last one taken (rank 0's
    cancel watch, every rank's ack). Epochs never wrap: an epoch wrapped to 1 would be ignored as consumed."""
    return last < epoch <= EPOCH_MAX


def next_epoch(top: int) -> int:
    """The epoch of a new cancel, above ``top`` (every epoch seen): the writers' side of ``epoch_is_new``."""
    if top >= EPOCH_MAX:
        raise EpochsUsedUp(f"cancel epochs are used up (epoch {top})",
                           hint="relaunch the deployment: a new job starts at epoch 1")
    return max(top, 0) + 1


RequestId = Annotated[str, StringConstraints(pattern=REQUEST_ID_PATTERN)]
Nonce = Annotated[str, StringConstraints(pattern=NONCE_PATTERN)]


def new_cancel_nonce() -> str:
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
    return Path(runtime_dir) / cancel_name(deployment_id)


def ack_path(runtime_dir: str | os.PathLike, deployment_id: str, rank: int) -> Path:
    return Path(runtime_dir) / ack_name(deployment_id, rank)


def _read(path: Path, cls):
    return _read_model(path, cls, "cancel file" if cls is CancelFile else "cancel ack")


def read_cancel(path: str | os.PathLike) -> CancelFile:
    st = os.lstat(path)
    if st.st_uid != os.getuid():
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
    path = cancel_path(runtime_dir, deployment_id)
    try:
        prev = read_cancel(path).epoch
    except (ClusterctlError, OSError):
        prev = 0
    epoch = next_epoch(max(prev, consumed))  # used up: raises (a wrapped epoch would never be applied)
    # more ids than a cancel file holds (a queue launched beyond MAX_REQUEST_IDS): all, rather than none
    named = list(requests) if len(requests) <= MAX_REQUEST_IDS else None
    doc = CancelFile(deployment_id=deployment_id, job_id=job_id, epoch=epoch, requests=named,
                     created_at=time.time(), nonce=new_cancel_nonce())
    atomic_write_json(path, doc.model_dump(mode="json"), mode=0o600)
    return epoch


def write_ack(runtime_dir: str, deployment_id: str, job_id: str, rank: int, epoch: int, applied: list[str], *,
              nonce: str | None = None, recent: list[tuple[int, str]] = ()) -> None:
    doc = CancelAck(deployment_id=deployment_id, job_id=job_id, rank=rank, epoch=epoch, applied=applied,
                    at=time.time(), nonce=nonce, recent=list(recent)[-RECENT_ACKS:])
    atomic_write_json(ack_path(runtime_dir, deployment_id, rank), doc.model_dump(mode="json"), mode=0o600)
