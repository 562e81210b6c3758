"""The wire of the node operations: one request model and one answer model per op, on both sides.

The coordinator (connect/opsession.py: a transport's ``ask``) sends a request model and gets its answer model back; the
node (node/nodeops.py) parses each request into its model and answers with its answer model. On the wire each is a
JSON line: ``{"id", "op", "req"}`` in, ``{"id", "answer"}`` or ``{"id", "error", "kind"}`` out, with the request
and the answer as JSON objects (``Request.wire`` and ``Answer.wire``: only the fields an op sets, so the lines are
the ones older versions wrote and read).

Both sides ignore fields they do not know: a node of another version must still answer the probe (preflight then
refuses it by its versions), and a teardown must reach a node that a newer coordinator tears down. A field of the
wrong type or a missing one is refused: the node answers ``bad request``, the coordinator raises ``BadAnswer``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clusterctl.errors import RemoteCommandFailed, pydantic_line
from clusterctl.protocol.identity import Identity

Status = Literal["alive", "dead", "foreign", "unverifiable"]
StopStatus = Literal["gone", "not-ours", "survived", "permission-denied"]


class Answer(BaseModel):
    """An op's answer. ``wire``: what the node sends (the fields it set, by their wire names)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    def wire(self) -> dict:
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


class Request(BaseModel):
    """An op's request: ``op`` names it on the wire, ``answer`` is the model of its answer."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    op: ClassVar[str]
    answer: ClassVar[type[Answer]]

    def wire(self) -> dict:
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


class BadAnswer(RemoteCommandFailed):
    """A node's answer that is not its op's answer model (a field missing or of the wrong type)."""

    @classmethod
    def of(cls, node: str, op: str, e: ValidationError, argv: list[str]) -> "BadAnswer":
        return cls(f"node {node}: {op} answered malformed: {pydantic_line(e, op)}", host=node, argv=argv)


def parse_answer(req: Request, doc: Any, *, node: str, argv: list[str]) -> Answer:
    """The answer model of ``req`` from the answer object a node sent; BadAnswer when it is not one."""
    try:
        return req.answer.model_validate(doc)
    except ValidationError as e:
        raise BadAnswer.of(node, req.op, e, [*argv, req.op]) from None


# ---- processes ---------------------------------------------------------------------------------------------------

class StopResult(Answer):
    """What a verified stop did to one process (node/procs.stop)."""

    pid: int
    status: StopStatus
    detail: str = ""


class StopAnswer(Answer):
    results: list[StopResult] = Field(default_factory=list)


class StopRequest(Request):
    """Identity-checked TERM, grace, KILL of these processes."""

    op: ClassVar[str] = "stop"
    answer: ClassVar[type[Answer]] = StopAnswer
    targets: list[Identity] = Field(default_factory=list)
    grace: float = 10.0


class KillGroupAnswer(Answer):
    killed: bool  # False: the leader is not the process reported (gone, or its pid reused), nothing signalled


class KillGroupRequest(Request):
    """SIGKILL the group a keeper leads now, only while its leader is the process the keeper reported (the
    keeper's ``ChildInfo``): a keeper that outlived its grace."""

    op: ClassVar[str] = "kill_group"
    answer: ClassVar[type[Answer]] = KillGroupAnswer
    pid: int
    pgid: int
    start_time: Optional[float]
    boot_id: Optional[str]


class SweepRequest(Request):
    """Stop what the job's markers recorded (pid, start time and the job's nonce checked) and ``extra``.
    ``ranks``: only the markers of these rank numbers (nodes that are one machine share a runtime dir)."""

    op: ClassVar[str] = "sweep"
    answer: ClassVar[type[Answer]] = StopAnswer
    runtime_dir: str
    job_id: str
    nonce: str
    grace: float = 10.0
    extra: list[Identity] = Field(default_factory=list)
    ranks: Optional[list[int]] = None


class AliveAnswer(Answer):
    status: list[Status] = Field(default_factory=list)  # one per target, in order


class AliveRequest(Request):
    """Which of these processes are still ours and running (no signal sent)."""

    op: ClassVar[str] = "alive"
    answer: ClassVar[type[Answer]] = AliveAnswer
    targets: list[Identity] = Field(default_factory=list)


class SpawnAnswer(Answer):
    """The detached rank's process (its nonce is the one the coordinator put in its environment)."""

    pid: int
    pgid: int
    start_time: Optional[float]
    boot_id: Optional[str]


class SpawnRequest(Request):
    """Start a rank detached: its own session, output to ``log_path``, stdin from /dev/null."""

    op: ClassVar[str] = "spawn"
    answer: ClassVar[type[Answer]] = SpawnAnswer
    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    log_path: str


# ---- a job's files -----------------------------------------------------------------------------------------------

class MarkerEntry(Answer):
    """One marker file of the job: its document (as the rank wrote it: read tolerantly by the coordinator) and
    its age on the node's own clock, or why it could not be read."""

    path: str = ""
    marker: Optional[dict[str, Any]] = None
    age: Optional[float] = None
    error: Optional[str] = None

    @property
    def rank(self) -> int | None:
        """The rank number the marker says (None when it has none, or not an integer)."""
        r = (self.marker or {}).get("rank")
        return r if isinstance(r, int) and not isinstance(r, bool) else None


class MarkersAnswer(Answer):
    markers: list[MarkerEntry] = Field(default_factory=list)
    time: Optional[float] = None  # the node's clock when it looked


class MarkersRequest(Request):
    """Read a job's markers in ``runtime_dir``."""

    op: ClassVar[str] = "markers"
    answer: ClassVar[type[Answer]] = MarkersAnswer
    runtime_dir: str
    job_id: str


class WatchedRank(Identity):
    """A detached rank the marker wait watches: its process and its log (whose last lines say why it ended)."""

    log_path: Optional[str] = None


class Exited(Answer):
    log_tail: list[str] = Field(default_factory=list)


class WaitMarkersAnswer(Answer):
    """The markers at the paths, in order (None: missing, unreadable or foreign), and for each a watched rank
    whose process is gone while its marker is short of the states (None: not that)."""

    markers: list[Optional[dict[str, Any]]] = Field(default_factory=list)
    exited: list[Optional[Exited]] = Field(default_factory=list)


class WaitMarkersRequest(Request):
    """Wait (up to ``timeout`` s, at most 30) until every marker at ``paths`` is in one of ``states``, one
    failed, or a watched rank's process is gone."""

    op: ClassVar[str] = "wait_markers"
    answer: ClassVar[type[Answer]] = WaitMarkersAnswer
    paths: list[str]
    states: list[str]
    timeout: float = 1.0
    watch: Optional[list[Optional[WatchedRank]]] = None


class CleanAnswer(Answer):
    removed: list[str] = Field(default_factory=list)


class CleanRequest(Request):
    """Remove a job's files from ``runtime_dir`` (its own names; cancel files and acks by their content)."""

    op: ClassVar[str] = "clean"
    answer: ClassVar[type[Answer]] = CleanAnswer
    runtime_dir: str
    job_id: str


class ReadAnswer(Answer):
    data: str  # base64


class ReadRequest(Request):
    """A small regular file (not through a symlink), base64 in the answer."""

    op: ClassVar[str] = "read"
    answer: ClassVar[type[Answer]] = ReadAnswer
    path: str
    limit: int = 65536


class TailAnswer(Answer):
    size: int  # the file's whole size
    data: str  # base64: its last ``limit`` bytes at most


class TailRequest(Request):
    """The end of a log (a rank's, kept when a launch fails): its size and its last ``limit`` bytes. Never through
    a symlink, never blocking on a FIFO planted at the path, regular files only."""

    op: ClassVar[str] = "tail"
    answer: ClassVar[type[Answer]] = TailAnswer
    path: str
    limit: int = Field(default=4 << 20, ge=0, le=64 << 20)


class WriteAnswer(Answer):
    written: Optional[int] = None


class WriteRequest(Request):
    """Replace a file atomically (temp file, fsync, rename), creating its folder."""

    op: ClassVar[str] = "write"
    answer: ClassVar[type[Answer]] = WriteAnswer
    path: str
    data: str  # base64
    mode: int = 0o600


# ---- the node itself ---------------------------------------------------------------------------------------------

class ModelFolder(Answer):
    """Is a folder one this node can serve from (node/modelops.model_check)."""

    ok: bool
    absent: Optional[bool] = None
    error: Optional[str] = None
    files: Optional[list[str]] = None


class CopySummary(Answer):
    """Preflight's look at a node's copy against the manifest: state and counts (the file lists stay there)."""

    state: str
    detail: Optional[str] = None
    n_missing: int = 0
    n_stale: int = 0
    checked_bytes: Optional[int] = None
    first: Optional[str] = None


class RuntimeDirCheck(Answer):
    path: str
    ok: bool
    error: Optional[str] = None


class ProbeAnswer(Answer):
    """Preflight's facts of a node. Every field has a default: a node of another version must still get as far
    as its ``versions`` (preflight refuses it by them)."""

    hostname: Optional[str] = None
    boot_id: Optional[str] = None
    time: Optional[float] = None
    versions: dict[str, Optional[str]] = Field(default_factory=dict)
    mem_available: int = 0
    mem_total: int = 0
    default_runtime_dir: Optional[str] = None
    backend_available: bool = False
    mlx_error: Optional[str] = None
    model: Optional[ModelFolder] = None
    copy_check: Optional[CopySummary] = Field(default=None, alias="model_copy")  # (BaseModel owns model_copy)
    ports_busy: list[int] = Field(default_factory=list)
    runtime_dir: Optional[RuntimeDirCheck] = None


class ProbeRequest(Request):
    op: ClassVar[str] = "probe"
    answer: ClassVar[type[Answer]] = ProbeAnswer
    backend: Optional[str] = None  # can mlx use it here
    model_path: Optional[str] = None  # check the model folder there
    manifest: Optional[dict[str, Any]] = None  # and its copy against this manifest
    verify: bool = False  # every byte re-hashed
    ports: list[int] = Field(default_factory=list)  # which are busy
    bind_host: str = "0.0.0.0"
    runtime_dir: Optional[str] = None  # None: the node's default


class CanaryAnswer(Answer):
    ok: bool
    error: Optional[str] = None
    tokens: Optional[int] = None
    text: Optional[str] = None
    seconds: Optional[float] = None


class CanaryRequest(Request):
    """A short greedy completion against rank 0, from rank 0's own node (it may listen on loopback only)."""

    op: ClassVar[str] = "canary"
    answer: ClassVar[type[Answer]] = CanaryAnswer
    url: str
    api_key: Optional[str] = None
    timeout: float = 60.0
    model: str = "default_model"
    prompt: str = "Hello"
    max_tokens: int = 2


class WarmAnswer(Answer):
    imported: list[str] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)


class WarmRequest(Request):
    """Import modules the next requests will need (node/nodeops.WARM_MODULES)."""

    op: ClassVar[str] = "warm"
    answer: ClassVar[type[Answer]] = WarmAnswer
    modules: list[str] = Field(default_factory=list)


# ---- model copies (node/modelops.py) -----------------------------------------------------------------------------

class RsyncFacts(Answer):
    path: Optional[str] = None  # None: no rsync here
    version: Optional[str] = None


class ModelStatusAnswer(Answer):
    """A node's copy against the manifest (modelfiles/copycheck.check_copy), the free space there and its rsync."""

    state: str
    path: Optional[str] = None
    expected_hash: Optional[str] = None
    detail: Optional[str] = None
    missing: list[str] = Field(default_factory=list)
    stale: list[str] = Field(default_factory=list)
    extra: int = 0
    checked_bytes: int = 0
    n_missing: Optional[int] = None
    n_stale: Optional[int] = None
    warning: Optional[str] = None
    free_bytes: Optional[int] = None
    rsync: RsyncFacts = Field(default_factory=RsyncFacts)

    def copy_state(self) -> dict:
        """What modelfiles/copycheck.needed_files reads of a copy's state."""
        return {"state": self.state, "missing": self.missing, "stale": self.stale}


class ModelStatusRequest(Request):
    op: ClassVar[str] = "model_status"
    answer: ClassVar[type[Answer]] = ModelStatusAnswer
    manifest: dict[str, Any]
    path: str
    verify: bool = False
    only: Optional[list[str]] = None  # just these files (after a transfer)


class ModelPrepareAnswer(Answer):
    path: Optional[str] = None
    free_bytes: Optional[int] = None
    error: Optional[str] = None  # alone in the answer: the op failed (the coordinator raises)


class ModelPrepareRequest(Request):
    """Create the folder (and parents) a sync writes into; report the free space there."""

    op: ClassVar[str] = "model_prepare"
    answer: ClassVar[type[Answer]] = ModelPrepareAnswer
    path: str


class FetchFailure(Answer):
    path: str
    error: str


class FetchAnswer(Answer):
    done: list[str] = Field(default_factory=list)
    failed: list[FetchFailure] = Field(default_factory=list)
    bytes: int = 0


class FetchRequest(Request):
    """Download manifest files from an HTTP mirror into ``path`` (node/download.py)."""

    op: ClassVar[str] = "fetch"
    answer: ClassVar[type[Answer]] = FetchAnswer
    url: str
    path: str
    manifest: dict[str, Any]
    files: list[str]
    timeout: float = 60.0


REQUESTS: dict[str, type[Request]] = {r.op: r for r in (
    ProbeRequest, StopRequest, KillGroupRequest, AliveRequest, SweepRequest, CleanRequest, SpawnRequest, CanaryRequest,
    MarkersRequest, ModelStatusRequest, ModelPrepareRequest, FetchRequest, ReadRequest, TailRequest, WriteRequest,
    WaitMarkersRequest, WarmRequest)}
