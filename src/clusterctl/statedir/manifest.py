"""Launch manifests: ``<state>/launches/<job>.json``, one per job, signed, written atomically.

Written BEFORE the first rank starts and updated as ranks start (saves coalesced: launch/start.py), so that a
coordinator killed at any point leaves enough on disk for ``clusterctl reap`` to find and stop everything it
started. Removed only after a verified teardown.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clusterctl.atomic import atomic_write_bytes, dumps, move_aside, read_capped, strict_loads
from clusterctl.errors import IntegrityError, pydantic_line
from clusterctl.names import Ident, Name
from clusterctl.protocol.nodespec import Node
from clusterctl.protocol.signing import PublicKey, SigningKey, sign_payload, verify_signed
from clusterctl.node.procs import boot_id, start_time_of, status_of
from clusterctl.protocol.identity import Identity
from clusterctl.statedir.state import StateDir

KIND = "launch-manifest"
SCHEMA_VERSION = 1


class Coordinator(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str
    pid: int
    start_time: float | None
    boot_id: str | None
    detached: bool = False

    def identity(self) -> Identity:
        """This coordinator's process (no nonce: it has none)."""
        return Identity(pid=self.pid, start_time=self.start_time, boot_id=self.boot_id)


class RankRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int
    node: Name
    host: str
    local: bool
    runtime_dir: str
    marker_path: str
    contract_path: str
    hostfile_path: str | None = None
    log_path: str | None = None
    port: int | None = None
    start_layer: int | None = None
    end_layer: int | None = None
    pid: int | None = None  # the rank (keeper's child); None until it started
    pgid: int | None = None
    start_time: float | None = None
    boot_id: str | None = None
    state: Literal["pending", "started", "ready", "stopped", "failed"] = "pending"

    def identity(self, nonce: str) -> Identity:
        """The rank's process as its node checks it (pid, start time, the job's nonce): only once it has a pid."""
        assert self.pid is not None, f"rank {self.rank} has not started"
        return Identity(pid=self.pid, start_time=self.start_time, nonce=nonce, pgid=self.pgid, boot_id=self.boot_id)


class LaunchManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["launch-manifest"] = KIND
    job_id: Ident
    deployment_id: Ident
    plan_hash: str
    deployment_file: str
    created_at: str
    nonce: str
    coordinator: Coordinator
    state: Literal["starting", "ready", "stopping", "failed"] = "starting"
    endpoint: str | None = None
    http_port: int | None = None
    ports: list[int] = Field(default_factory=list)
    lease_path: str | None = None
    lease_seconds: float | None = None
    mlx_launch_hostfile: dict = Field(default_factory=dict)
    nodes: list[Node]  # how to reach each node, so teardown and reap never depend on the deployment file
    ranks: list[RankRecord]

    def rank(self, r: int) -> RankRecord:
        return self.ranks[r]


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def this_coordinator(detached: bool = False) -> Coordinator:
    return Coordinator(host=socket.gethostname(), pid=os.getpid(), start_time=start_time_of(os.getpid()),
                       boot_id=boot_id(), detached=detached)


class ManifestStore:
    def __init__(self, folder: Path, key: SigningKey | None, trusted: list[PublicKey]):
        self.folder = folder
        self.key = key
        self.trusted = trusted

    def path(self, job_id: str) -> Path:
        return self.folder / f"{job_id}.json"

    def save(self, m: LaunchManifest) -> Path:
        return self.save_doc(m.job_id, m.model_dump(mode="json"))

    def save_doc(self, job_id: str, doc: dict) -> Path:
        """Save a manifest already dumped (``model_dump(mode="json")``): so a caller can take the snapshot on its
        event loop and leave the JSON, the signature and the fsyncs to a thread."""
        if self.key is None:
            raise IntegrityError("no signing key to write a launch manifest")
        p = self.path(job_id)
        atomic_write_bytes(p, sign_payload(dumps(doc), KIND, self.key), mode=0o600)
        return p

    def load(self, path: Path) -> LaunchManifest:
        data = read_capped(path, limit=4 << 20, what="launch manifest")
        payload = verify_signed(data, KIND, self.trusted, source=f"launch manifest {path}")
        doc = strict_loads(payload, source=f"launch manifest {path}")
        if not isinstance(doc, dict) or doc.get("type") != KIND:
            raise IntegrityError(f"launch manifest {path} is not a launch manifest")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise IntegrityError(f"launch manifest {path} has schema_version {doc.get('schema_version')!r}; "
                                 f"this clusterctl reads {SCHEMA_VERSION}")
        try:
            return LaunchManifest.model_validate(doc)
        except ValidationError as e:
            raise IntegrityError(f"launch manifest {path}: {pydantic_line(e)}") from None

    def all(self) -> tuple[list[tuple[Path, LaunchManifest]], list[tuple[Path, str]]]:
        """Every manifest on disk: (good ones, (path, error) for malformed ones, which are reported and kept)."""
        good, bad = [], []
        try:
            paths = sorted(p for p in self.folder.glob("*.json") if not p.name.startswith("."))
        except OSError:
            paths = []
        for p in paths:
            try:
                good.append((p, self.load(p)))
            except IntegrityError as e:
                bad.append((p, e.message))
            except Exception as e:  # a reader never crashes on a foreign file
                bad.append((p, f"unreadable: {e}"))
        return good, bad

    def remove(self, job_id: str) -> None:
        try:
            os.unlink(self.path(job_id))
        except FileNotFoundError:
            pass

    def move_aside(self, path: Path) -> Path:
        return move_aside(path, "malformed")


def manifest_store(state: StateDir, key: SigningKey | None = None) -> ManifestStore:
    """The state dir's launch manifests, checked against the keyring's public keys (``key``: the one that signs
    new ones, for ``launch``). With no launch ever recorded there is nothing to check, so no key is read."""
    trusted = state.keyring.public_keys() if key is not None or state.launches.is_dir() else []
    return ManifestStore(state.launches, key, trusted)


def job_ref(state: StateDir, target: str) -> str:
    """What an operator names a running deployment by: a job id, a deployment id, or the deployment FILE that
    `launch` was given (its signature checked; its deployment id returned)."""
    import os

    if os.path.isfile(target) or target.endswith(".json"):
        _, loaded = state.load_deployment(target)
        return loaded.deployment.deployment_id
    return target


def coordinator_alive(c: Coordinator) -> bool:
    """Is the coordinator that wrote a launch manifest still running (judged on this machine only)?"""

    if c.detached:
        return True  # a detached job has no coordinator to outlive; only `teardown` ends it
    if c.host != socket.gethostname():
        return True  # another machine's coordinator: not ours to judge
    if c.boot_id and boot_id() and c.boot_id != boot_id():
        return False
    return status_of(c.identity()) in ("alive", "unverifiable")
