"""What runs where: every launch manifest, and each rank's marker as its node sees it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel

from clusterctl.errors import ClusterctlError
from clusterctl.statedir.manifest import coordinator_alive, job_ref, manifest_store
from clusterctl.connect.nodes import Connector
from clusterctl.launch.look import RankView, look_at_job
from clusterctl.launch.quiescence import STALE_AFTER, judge
from clusterctl.atomic import read_capped
from clusterctl.statedir.healfile import SupervisorState, read_all
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


class RankStatus(BaseModel):
    """One rank as status shows it: its record, what its marker says (read tolerantly: launch/look.py) and what
    is judged from both (``state``: ``rank_state``)."""

    rank: int
    node: str
    host: str
    pid: Optional[int]
    state: str
    marker_state: Optional[str]
    process: Optional[str]  # alive | dead | foreign | unverifiable, identity-checked on its node
    layers: list[Optional[int]]  # [start, end)
    heartbeat_age: Optional[float]
    stale: bool
    active_requests: int
    active_request_ids: list[str]
    cancel_epoch: Optional[int]
    endpoint: Optional[str]
    error: Optional[str]
    # the step loop's load, as its marker last said it (status --watch)
    batch: Optional[int]
    queued: Optional[int]
    tokens_out: Optional[int]
    step_s: Optional[float]
    idle_share: Optional[float]
    rss_bytes: Optional[int]
    ladder: Optional[str]
    prompt_cache: Optional[list[int]]

    @classmethod
    def of(cls, r, seen: RankView | None, process: str | None) -> RankStatus:
        """Rank record ``r`` as a look saw it: its marker (None: none) and its process."""
        seen = seen or RankView()
        mk, age = seen.marker, seen.age
        stale = age is not None and age > STALE_AFTER
        load = mk.model_dump(include={"batch", "queued", "tokens_out", "step_s", "idle_share", "rss_bytes", "ladder",
                                      "prompt_cache"})
        return cls(rank=r.rank, node=r.node, host=r.host, pid=r.pid,
                   state=rank_state(mk.state, process, stale, seen.reachable), marker_state=mk.state,
                   process=process, layers=[r.start_layer, r.end_layer], heartbeat_age=age, stale=stale,
                   active_requests=len(mk.active_requests), active_request_ids=mk.active_requests,
                   cancel_epoch=mk.cancel_epoch, endpoint=mk.endpoint, error=seen.error or mk.error, **load)


class JobStatus(BaseModel):
    """One launch as status shows it: its manifest, its coordinator, its ranks, and (once looked at) its
    activity; the heal state of its supervisor and its cluster's front door are added after."""

    job_id: str
    deployment_id: str
    state: str
    endpoint: Optional[str]
    created_at: str
    coordinator_pid: Optional[int]
    coordinator_alive: bool
    detached: bool
    manifest: str
    activity: Optional[str]  # quiescence: busy | idle | unknown (None: nobody looked)
    ranks: list[RankStatus]
    serving: Optional[dict]  # rank 0's defaults for what requests leave out (the deployment's)
    ranks_down: Optional[int]
    heal: Optional[dict] = None  # the supervisor's state file on the job it supervises (statedir/healfile.py)
    front: Optional[str] = None  # the URL of its cluster's front door (front/records.py)

    def serves(self) -> bool:
        """Every rank up, as seen now."""
        return bool(self.ranks) and all(r.state in ("ready", "serving") for r in self.ranks)


@dataclass
class HealStatus:
    """A supervisor's state file as status shows it: whether its supervisor lives, and ``heal_condition``."""

    file: SupervisorState
    alive: bool | None
    condition: str | None = None

    def to_json(self) -> dict:
        return {**self.file.model_dump(mode="json"), "supervisor_alive": self.alive, "condition": self.condition}


@dataclass
class StatusReport:
    """What ``status`` found; ``to_json`` is what ``status --json`` prints and the tables are drawn from."""

    jobs: list[JobStatus]
    malformed: list[tuple[Path, str]]  # a manifest that could not be read, and why
    heal: list[HealStatus]  # every supervisor's state file (statedir/healfile.py), each with its ``condition``
    fronts: list[dict]  # the running front doors (front/records.py)

    def to_json(self) -> dict:
        return {"jobs": [j.model_dump(mode="json") for j in self.jobs],
                "malformed": [{"manifest": str(p), "error": e} for p, e in self.malformed], "heal": [h.to_json() for h in self.heal],
                "fronts": self.fronts}


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
                 pool=None) -> StatusReport:
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
        ranks = []
        for r in m.ranks:
            if r.rank and not r.rank % 64:
                await asyncio.sleep(0)  # a job of hundreds of ranks: the loop serves the node sessions between
            ranks.append(RankStatus.of(r, markers.get(r.rank), procs.get(r.rank)))
        jobs.append(JobStatus(
            job_id=m.job_id, deployment_id=m.deployment_id, state=m.state, endpoint=m.endpoint,
            created_at=m.created_at, coordinator_pid=m.coordinator.pid,
            coordinator_alive=coordinator_alive(m.coordinator), detached=m.coordinator.detached, manifest=str(path),
            activity=judge(m, markers).state if probe_nodes else None, ranks=ranks,
            serving=_serving_defaults(state, m.deployment_id),
            ranks_down=sum(x.state in DOWN for x in ranks) if probe_nodes else None))
    heal = _heal_states(state, ref, {j.deployment_id for j in jobs})
    for h in heal:
        h.condition = heal_condition(h, jobs, probe_nodes)
    for j in jobs:  # the supervisor's state (supervise/loop.py) on the job it supervises
        j.heal = next((h.to_json() for h in heal if h.file.job == j.job_id), None)
    fronts = annotate_jobs(state, jobs)
    return StatusReport(jobs=jobs, malformed=bad, heal=heal, fronts=fronts)


def heal_condition(h: HealStatus, jobs: list[JobStatus], probed: bool) -> str | None:
    """Pure: what a state file no longer says by itself. Its supervisor dead, its last word (``healing``,
    ``serving``) is stale: say whether anything of the cluster still serves (every rank of a job of its
    deployment up, as seen now). None while the supervisor runs (its word stands) or when nobody looked."""
    if h.alive is not False:
        return None
    if h.file.state == "degraded" and h.file.job is None:
        return "supervisor dead, nothing serving"
    if not probed:
        return None
    up = [j.job_id for j in jobs if j.deployment_id == h.file.deployment and j.serves()]
    return f"supervisor dead; job {up[0]} serving unsupervised" if up else "supervisor dead, nothing serving"


def _heal_states(state: StateDir, ref: str | None, deployments: set[str]) -> list[HealStatus]:
    """Every supervisor's state file (or those of ``ref``'s deployments, current or original)."""

    return [HealStatus(h, h.supervisor_alive()) for h in read_all(state)
            if ref is None or {h.deployment, h.original, h.job} & (deployments | {ref})]
