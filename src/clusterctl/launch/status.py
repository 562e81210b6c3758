"""What runs where: every launch manifest, and each rank's marker as its node sees it."""

from __future__ import annotations

import asyncio

from clusterctl.launch.manifest import ManifestStore, coordinator_alive, job_ref
from clusterctl.launch.nodes import SshOptions
from clusterctl.launch.quiescence import STALE_AFTER, clean_marker, job_markers, judge

async def status(state, ssh: SshOptions, *, probe_nodes: bool = True, ref: str | None = None) -> dict:
    """Every launch (or those of ``ref``: a job id, deployment id or deployment file), each job's nodes asked
    concurrently."""
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
            mk = clean_marker(info.get("marker") or {})
            age = info.get("age")
            ranks.append({
                "rank": r.rank, "node": r.node, "host": r.host, "pid": r.pid,
                "state": mk.get("state") or ("unreachable" if "error" in info else "no marker"),
                "layers": [r.start_layer, r.end_layer], "heartbeat_age": age,
                "stale": age is not None and age > STALE_AFTER,
                "active_requests": len(mk.get("active_requests") or []),
                "active_request_ids": mk.get("active_requests") or [], "cancel_epoch": mk.get("cancel_epoch"),
                "endpoint": mk.get("endpoint"), "error": info.get("error") or mk.get("error"),
                **{k: mk.get(k) for k in ("batch", "queued", "tokens_out", "step_s", "idle_share", "rss_bytes",
                                          "ladder", "prompt_cache")},
            })
        q = judge(m, markers) if probe_nodes else None
        jobs.append({"job_id": m.job_id, "deployment_id": m.deployment_id, "state": m.state,
                     "endpoint": m.endpoint, "created_at": m.created_at, "coordinator_pid": m.coordinator.pid,
                     "coordinator_alive": alive, "detached": m.coordinator.detached, "manifest": str(path),
                     "activity": q["state"] if q else None, "ranks": ranks})
    return {"jobs": jobs, "malformed": [{"manifest": str(p), "error": e} for p, e in bad]}
