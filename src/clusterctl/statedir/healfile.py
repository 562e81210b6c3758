"""The supervisor's state file, ``<state>/heal/<cluster>.json``: one model, ``SupervisorState``, written
atomically by the supervisor (supervise/persist.py) and read by everyone else as that model: its successor
(resumes from it), ``status``, ``teardown`` and ``reap`` (launch/status.py, launch/supervisors.py) and the front
door (front/proxy.py: its /health and /metrics). docs/heal.md, "The state file".

Fields are only ever added (each new one with a default), so a file an older supervisor wrote still loads, and a
reader ignores a field a newer one added. A reader tolerates a missing, truncated or foreign file (None, never a
traceback); a supervisor record or port it cannot read is unknown (None), not the end of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, WrapValidator

from clusterctl.atomic import atomic_write_bytes, dumps, read_json
from clusterctl.errors import ClusterctlError
from clusterctl.statedir.manifest import Coordinator, coordinator_alive
from clusterctl.statedir.state import StateDir

LIMIT = 64 << 10
HealPhase = Literal["serving", "healing", "degraded"]
STATES = get_args(HealPhase)  # (the phases, named once: the supervisor's, status's and the front door's)


def _unknown(value, handler):
    try:
        return handler(value)
    except ValidationError:
        return None


Unknown = WrapValidator(_unknown)  # a field this reader cannot read is unknown (None), the rest of the file stands


class SupervisorState(BaseModel):
    """One cluster's supervision as its supervisor last said it: the phase (``state``), why and since when; what
    runs (``deployment``, ``job``: None while nothing does) and what it heals back to (``original``,
    ``lost_nodes``); where the cluster serves (``http_host``, ``http_port``: every relaunch binds them, by this
    supervisor or its successor); the nodes a heal under way leaves out (``leaving_out``, else None); and who
    wrote it (``supervisor``: its process identity)."""

    model_config = ConfigDict(extra="ignore")  # a newer supervisor's fields: ignored (fields are only added)
    schema_version: int = 1
    state: HealPhase
    reason: str | None = None
    since: str | None = None  # ISO-8601 UTC: when ``state`` began
    heals: int = 0
    degraded_seconds: float = 0.0
    deployment: str | None = None  # None only in a file no supervisor wrote: the front door still reads its state
    job: str | None = None
    cluster: str | None = None
    original: str | None = None
    lost_nodes: list[str] = Field(default_factory=list)
    http_host: str | None = None
    http_port: Annotated[StrictInt | None, Field(gt=0, lt=65536), Unknown] = None
    leaving_out: list[str] | None = None
    supervisor: Annotated[Coordinator | None, Unknown] = None
    updated_at: str | None = None

    def supervisor_alive(self) -> bool | None:
        """Its supervisor's process identity (pid and start time, boot id) checked on this machine (None: no
        record)."""
        return coordinator_alive(self.supervisor) if self.supervisor is not None else None


def path_of(state: StateDir, cluster: str) -> Path:
    return state.heal / f"{cluster}.json"


def write(state: StateDir, s: SupervisorState) -> None:
    if not s.cluster:
        raise ValueError("a heal state file names its cluster")
    atomic_write_bytes(path_of(state, s.cluster), dumps(s.model_dump(mode="json")))


def read(path: Path) -> SupervisorState | None:
    """One state file, or None when it is missing or not one."""
    try:
        return SupervisorState.model_validate(read_json(path, limit=LIMIT, what="heal state"))
    except (ClusterctlError, ValidationError, OSError, ValueError, TypeError, RecursionError):
        return None


def read_all(state: StateDir) -> list[SupervisorState]:
    """Every cluster's supervision: each state file that names the deployment it runs (``status``, ``teardown``
    and ``reap`` act on it)."""
    folder = state.heal
    found = (read(p) for p in sorted(folder.glob("*.json"))) if folder.is_dir() else ()
    return [s for s in found if s is not None and s.deployment is not None]


def read_state(state: StateDir, cluster: str) -> SupervisorState | None:
    """The front door's reading of ``cluster``'s heal: None when there is no file or not one, and when it says
    healing or degraded while its supervisor is gone ("healing" would be said forever)."""
    s = read(path_of(state, cluster))
    if s is None or (s.state != "serving" and s.supervisor_alive() is False):
        return None
    return s
