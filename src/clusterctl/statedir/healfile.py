"""The supervisor's state file, ``<state>/heal/<cluster>.json``: written atomically by supervise/loop.py,
read by ``status`` and by the front door (front/proxy.py: its /health and /metrics).

    {"schema_version": 1, "state": "serving"|"healing"|"degraded", "reason": str|null, "since": ISO-8601 UTC,
     "heals": int, "degraded_seconds": float, "deployment": id, "job": id|null,
     "cluster", "original", "lost_nodes", "http_host", "http_port", "leaving_out": [node]|null,
     "supervisor": {host, pid, start_time, boot_id}, "updated_at"}

Fields are only ever added. A reader tolerates a missing, truncated or foreign file (None, never a traceback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from clusterctl.atomic import atomic_write_bytes, dumps, read_json
from clusterctl.errors import ClusterctlError
from clusterctl.statedir.manifest import Coordinator, coordinator_alive
from clusterctl.statedir.state import StateDir

LIMIT = 64 << 10
HealPhase = Literal["serving", "healing", "degraded"]
STATES = get_args(HealPhase)  # (the phases, named once: the supervisor's, status's and the front door's)


class HealState(BaseModel):
    """What the front door tells its clients of a heal (its /health and /metrics): the phase, why, since when."""

    model_config = ConfigDict(extra="ignore")  # another component's file: read tolerantly
    state: HealPhase
    reason: str | None = None
    since: str | None = None


def path_of(state: StateDir, cluster: str) -> Path:
    return state.heal / f"{cluster}.json"


def write(state: StateDir, cluster: str, doc: dict) -> None:
    atomic_write_bytes(path_of(state, cluster), dumps(doc))


def read(path: Path) -> dict | None:
    """One state file, or None when it is missing or not one."""
    try:
        doc = read_json(path, limit=LIMIT, what="heal state")
    except (ClusterctlError, OSError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("state") not in STATES or not isinstance(doc.get("deployment"), str):
        return None
    return doc


def read_all(state: StateDir) -> list[dict]:
    """Every cluster's supervisor state, each with ``supervisor_alive`` (its process still runs here)."""
    folder = state.heal
    out = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        doc = read(p)
        if doc is not None:
            doc["supervisor_alive"] = _alive(doc.get("supervisor"))
            out.append(doc)
    return out


def read_state(state: StateDir, cluster: str) -> HealState | None:
    """The front door's reading of ``cluster``'s heal: None when there is no file or not one, and when it says
    healing or degraded while its supervisor is gone ("healing" would be said forever). ``read_all`` is status's:
    every file, each with whether its supervisor lives."""
    try:
        doc = read_json(path_of(state, cluster), limit=LIMIT, what="heal state")
        heal = HealState.model_validate(doc)
    except (ClusterctlError, ValidationError, OSError, ValueError, TypeError, RecursionError):
        return None
    if heal.state != "serving" and _alive(doc.get("supervisor")) is False:
        return None
    return heal


def _alive(sup) -> bool | None:
    """The supervisor's process identity (pid and start time, boot id) checked on this machine (None: no record,
    or one this reader does not know)."""
    try:
        return coordinator_alive(Coordinator.model_validate(sup)) if isinstance(sup, dict) else None
    except ValidationError:
        return None
