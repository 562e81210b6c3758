"""What runs where: every launch manifest, and each rank's marker as its node sees it."""

from __future__ import annotations

import asyncio

from clusterctl.errors import ClusterctlError
from clusterctl.statedir.manifest import coordinator_alive, job_ref, manifest_store
from clusterctl.connect.nodes import Connector
from clusterctl.launch.look import look_at_job
from clusterctl.launch.quiescence import STALE_AFTER, clean_marker, judge
from clusterctl.atomic import read_capped
from clusterctl.statedir.healfile import read_all
from clusterctl.protocol.deployment import decode
from clusterctl.front.records import annotate_jobs  # the front door of each job's cluster (docs/front.md)
from clusterctl.statedir.state import StateDir

LIVE_STATES = ("loading", "ready", "serving", "stopping")  # what a marker says while its rank works
DOWN = ("dead", "lost", "failed")  # a job's ranks_down counts these


def rank_state(marker_state: str | None, process: str | None, stale: bool, reachable: bool) -> str:
    """Pure: what status shows for a rank. A marker says what its rank last wrote; a rank that died without a
    word (SIGKILL, OOM, a crash past its handlers) leaves it saying ``serving`` forever. So: ``dead`` when its
    process is gone (identity-checked on its node: pid, start time, nonce), ``lost`` when its heartbeat is
    stale while the marker claims it works (wedged, stopped, or gone where we cannot look), ``stopped`` when a
    stopping rank's process is gone, else the marker's (``failed`` and ``lost`` are a rank's last word: they say
    why it ended)."""
    if not reachable:
        return "unreachable"
    if process in ("dead", "foreign") and marker_state in (None, "loading", "ready", "serving", "stopping"):
        return "stopped" if marker_state == "stopping" else "dead"
    if marker_state is None:
        return "no marker"
    if stale and marker_state in LIVE_STATES:
        return "lost"
    return marker_state


async def _look(m, ssh: Connector, pool=None) -> tuple[dict, dict]:
    """A job's markers and its ranks' processes, over one session per node (``pool``'s, kept open after)."""
    seen = await look_at_job(m, ssh, pool=pool)
    return seen.markers, seen.procs


def _serving_defaults(state: StateDir, deployment_id: str) -> dict | None:
    """Rank 0's defaults for what requests leave out, as the deployment sets them (None: OpenAI's own, or the
    deployment file is not at hand)."""

    try:  # read only: status never migrates or moves a file
        path = state.deployment_path(deployment_id)
        dep = decode(read_capped(path, what="deployment file"), state.keyring.public_keys(),
                     source=str(path)).deployment
    except ClusterctlError:
        return None
    if dep.options.serving is None:
        return None
    doc = dep.options.serving.model_dump(mode="json", exclude_defaults=True)
    if "chat_template" in doc:
        doc["chat_template"] = f"({len(doc['chat_template'])} characters)"
    return doc or None


async def status(state: StateDir, ssh: Connector, *, probe_nodes: bool = True, ref: str | None = None,
                 pool=None) -> dict:
    """Every launch (or those of ``ref``: a job id, deployment id or deployment file), each job's nodes asked
    concurrently. ``pool`` (nodes.NodePool): node sessions kept between calls (``status --watch``)."""
    store = manifest_store(state)
    good, bad = store.all() if state.launches.is_dir() else ([], [])
    if ref is not None:
        ref = job_ref(state, ref)
        good = [(p, m) for p, m in good if ref in (m.job_id, m.deployment_id)]
        bad = [(p, why) for p, why in bad if p.stem == ref or p.stem.startswith(ref + "-")]
    looks = await asyncio.gather(*(_look(m, ssh, pool) for _, m in good)) if probe_nodes \
        else [({}, {})] * len(good)
    jobs = []
    for (path, m), (markers, procs) in zip(good, looks):
        alive = coordinator_alive(m.coordinator)
        ranks = []
        for r in m.ranks:
            if r.rank and not r.rank % 64:
                await asyncio.sleep(0)  # a job of hundreds of ranks: the loop serves the node sessions between
            info = markers.get(r.rank, {})
            mk = clean_marker(info.get("marker") or {})
            age = info.get("age")
            stale = age is not None and age > STALE_AFTER
            ranks.append({
                "rank": r.rank, "node": r.node, "host": r.host, "pid": r.pid,
                "state": rank_state(mk.get("state"), procs.get(r.rank), stale, "error" not in info),
                "marker_state": mk.get("state"), "process": procs.get(r.rank),
                "layers": [r.start_layer, r.end_layer], "heartbeat_age": age,
                "stale": stale,
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
                     "activity": q["state"] if q else None, "ranks": ranks,
                     "serving": _serving_defaults(state, m.deployment_id),
                     "ranks_down": sum(x["state"] in DOWN for x in ranks) if probe_nodes else None})
    heal = _heal_states(state, ref, {j["deployment_id"] for j in jobs})
    for h in heal:
        h["condition"] = heal_condition(h, jobs, probe_nodes)
    for j in jobs:  # the supervisor's state (supervise/loop.py) on the job it supervises
        j["heal"] = next((h for h in heal if h.get("job") == j["job_id"]), None)
    fronts = annotate_jobs(state, jobs)
    return {"jobs": jobs, "malformed": [{"manifest": str(p), "error": e} for p, e in bad], "heal": heal,
            "fronts": fronts}


def heal_condition(h: dict, jobs: list[dict], probed: bool) -> str | None:
    """Pure: what a state file no longer says by itself. Its supervisor dead, its last word (``healing``,
    ``serving``) is stale: say whether anything of the cluster still serves (every rank of a job of its
    deployment up, as seen now). None while the supervisor runs (its word stands) or when nobody looked."""
    if h.get("supervisor_alive") is not False:
        return None
    if h.get("state") == "degraded" and h.get("job") is None:
        return "supervisor dead, nothing serving"
    if not probed:
        return None
    up = [j["job_id"] for j in jobs if j["deployment_id"] == h.get("deployment") and j["ranks"]
          and all(r["state"] in ("ready", "serving") for r in j["ranks"])]
    return f"supervisor dead; job {up[0]} serving unsupervised" if up else "supervisor dead, nothing serving"


def _heal_states(state: StateDir, ref: str | None, deployments: set[str]) -> list[dict]:
    """Every supervisor's state file (or those of ``ref``'s deployments, current or original)."""

    return [h for h in read_all(state) if ref is None or {h.get("deployment"), h.get("original"), h.get("job")}
            & (deployments | {ref})]
