"""Replan history: which deployment is current for a cluster, and every applied replan before it.

    <state>/history/<cluster>.json   {"cluster": NAME, "entries": [ENTRY, ...]}   (oldest first)
    ENTRY = {"applied_at", "from", "from_hash", "to", "to_hash", "changes": [str], "file": PATH | null,
             "relaunched": JOB_ID | null, "kind": "heal" | "rejoin" (only entries the supervisor made)}

Every deployment an entry names stays signed in ``<state>/deployments/`` (plans are never deleted, and no two
deployments share an id, so none is ever overwritten by another), so ``clusterctl replan --to ID`` can go back to
any of them. An entry whose ``from`` is its ``to`` updated the record's measurements (speeds) in place. Written atomically; the replan lock (one per cluster)
serialises writers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from clusterctl.atomic import atomic_write_bytes, dumps, read_json
from clusterctl.errors import ClusterctlError, IntegrityError

if TYPE_CHECKING:
    from clusterctl.statedir.state import StateDir

LIMIT = 4 << 20


def path_of(state: StateDir, cluster: str) -> Path:
    return state.history / f"{cluster}.json"


def entries(state: StateDir, cluster: str) -> list[dict]:
    p = path_of(state, cluster)
    if not p.exists():
        return []
    try:
        doc = read_json(p, limit=LIMIT, what="replan history")
    except ClusterctlError as e:
        raise IntegrityError(f"{p}: {e.message}", hint="move the file aside to start a new history") from None
    if not isinstance(doc, dict) or doc.get("cluster") != cluster or not isinstance(doc.get("entries"), list) \
            or not all(isinstance(x, dict) and isinstance(x.get("to"), str) for x in doc["entries"]):
        raise IntegrityError(f"{p} is not a replan history of cluster {cluster}",
                             hint="move the file aside to start a new history")
    return doc["entries"]


def append(state: StateDir, cluster: str, entry: dict) -> None:
    items = entries(state, cluster) + [entry]
    atomic_write_bytes(path_of(state, cluster), dumps({"cluster": cluster, "entries": items}))


def current(state: StateDir, cluster: str) -> str | None:
    """The deployment id the last applied replan made current (None before the first replan)."""
    items = entries(state, cluster)
    return items[-1]["to"] if items else None


def clusters_of(state: StateDir, target: str | None) -> list[str]:
    """The clusters ``clusterctl history TARGET`` shows: every one with a history, the one named, or the cluster
    of the deployment (file or id) named."""
    folder = state.history
    if target is None:
        return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    if (folder / f"{target}.json").exists():
        return [target]
    _, loaded = state.load_deployment(target)
    return [loaded.deployment.cluster]
