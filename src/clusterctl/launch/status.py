"""What runs where: every launch manifest, and each rank's marker as its node sees it."""

from __future__ import annotations

import asyncio

from clusterctl.errors import ClusterctlError
from clusterctl.launch.manifest import ManifestStore
from clusterctl.launch.nodes import SshOptions, close_all, handles
from clusterctl.launch.reaper import coordinator_alive

STALE_AFTER = 5.0  # heartbeats come every second; five missed ones make a marker stale


async def job_markers(m, ssh: SshOptions, hs=None) -> dict[int, dict]:
    """Each rank's marker as its node sees it: {rank: {"marker": doc, "age": s}} or {rank: {"error": why}};
    a rank missing from the answer has no marker. Ages are judged on each node's own clock. ``hs``: node
    handles to reuse (left open); without, opened and closed here."""
    markers: dict[int, dict] = {}
    own = hs is None
    hs = hs or handles(m.nodes, ssh)
    try:
        dirs = {(r.node, r.runtime_dir) for r in m.ranks}

        async def one(node: str, d: str) -> None:
            try:
                ans = await hs[node].op("markers", {"runtime_dir": d, "job_id": m.job_id}, timeout=30)
            except ClusterctlError as e:
                for r in m.ranks:
                    if r.node == node:
                        markers[r.rank] = {"error": e.message}
                return
            for x in ans.get("markers", []):
                doc = x.get("marker") or {}
                if isinstance(doc.get("rank"), int) and not isinstance(doc.get("rank"), bool):
                    markers[doc["rank"]] = {"marker": doc, "age": x.get("age")}

        await asyncio.gather(*(one(n, d) for n, d in dirs))
    finally:
        if own:
            await close_all(hs)
    return markers


async def status(state, ssh: SshOptions, *, probe_nodes: bool = True, ref: str | None = None) -> dict:
    """Every launch (or those of ``ref``: a job id, deployment id or deployment file), each job's nodes asked
    concurrently."""
    from clusterctl.launch.manifest import job_ref
    from clusterctl.launch.quiescence import judge

    store = ManifestStore(state.launches, None, state.keyring.public_keys() if state.launches.is_dir() else [])
    good, bad = store.all() if state.launches.is_dir() else ([], [])
    if ref is not None:
        ref = job_ref(state, ref)
        good = [(p, m) for p, m in good if ref in (m.job_id, m.deployment_id)]
        bad = [(p, why) for p, why in bad if p.stem == ref or p.stem.startswith(ref + "-")]
    all_markers = await asyncio.gather(*(job_markers(m, ssh) for _, m in good)) if probe_nodes else [{}] * len(good)
    jobs = []
    for (path, m), markers in zip(good, all_markers):
        alive = coordinator_alive(m.coordinator)
        ranks = []
        for r in m.ranks:
            info = markers.get(r.rank, {})
            mk = _clean(info.get("marker") or {})
            age = info.get("age")
            ranks.append({
                "rank": r.rank, "node": r.node, "host": r.host, "pid": r.pid,
                "state": mk.get("state") or ("unreachable" if "error" in info else "no marker"),
                "layers": [r.start_layer, r.end_layer], "heartbeat_age": age,
                "stale": age is not None and age > STALE_AFTER,
                "active_requests": len(mk.get("active_requests") or []),
                "active_request_ids": mk.get("active_requests") or [], "cancel_epoch": mk.get("cancel_epoch"),
                "endpoint": mk.get("endpoint"), "error": info.get("error") or mk.get("error"),
            })
        q = judge(m, markers) if probe_nodes else None
        jobs.append({"job_id": m.job_id, "deployment_id": m.deployment_id, "state": m.state,
                     "endpoint": m.endpoint, "created_at": m.created_at, "coordinator_pid": m.coordinator.pid,
                     "coordinator_alive": alive, "detached": m.coordinator.detached, "manifest": str(path),
                     "activity": q["state"] if q else None, "ranks": ranks})
    return {"jobs": jobs, "malformed": [{"manifest": str(p), "error": e} for p, e in bad]}


def _clean(mk: dict) -> dict:
    """A marker as status shows it: fields of the wrong type are dropped (a garbled file never crashes status)."""
    out = {}
    for key, kind in (("state", str), ("endpoint", str), ("error", str)):
        v = mk.get(key)
        out[key] = v[:500] if isinstance(v, kind) else None
    ce = mk.get("cancel_epoch")
    out["cancel_epoch"] = ce if isinstance(ce, int) and not isinstance(ce, bool) else None
    ar = mk.get("active_requests")
    out["active_requests"] = [str(x)[:200] for x in ar[:1000]] if isinstance(ar, list) else []
    return out
