"""Is a deployment idle? One answer, from what the ranks themselves report (docs/launch.md, "Quiescence").

Evidence per rank is its marker as its node sees it: the request ids it holds (rank 0: accepted, queued or
generating; the others: generating) and the age of its heartbeat on that node's clock. A rank is ``busy`` when a
fresh marker lists requests, ``idle`` when a fresh marker lists none, and ``unknown`` when its marker is missing,
unreadable, stale or its node cannot be reached. The deployment is busy when any rank is, else unknown when any
rank is, else idle: missing evidence is never read as idle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from clusterctl.errors import Busy
from clusterctl.connect.nodes import Connector
from clusterctl.launch.look import RankView, look_at_job

STALE_AFTER = 5.0  # heartbeats come every second; five missed ones make a marker stale


Activity = Literal["busy", "idle", "unknown"]


class RankActivity(BaseModel):
    """One rank's part of the answer: busy, idle or unknown, why it is not known, the requests it holds."""

    model_config = ConfigDict(frozen=True)

    rank: int
    node: str
    state: Activity
    why: Optional[str] = None
    active: list[str] = Field(default_factory=list)


class Quiescence(BaseModel):
    """Is job ``job_id`` of ``deployment_id`` idle: ``state``, from each of its ranks (``ranks``)."""

    model_config = ConfigDict(frozen=True)

    state: Activity
    job_id: str
    deployment_id: str
    ranks: list[RankActivity]

    def describe(self) -> str:
        """One line: which ranks hold how many requests, or why it is not known."""
        parts = []
        for x in self.ranks:
            if x.state == "busy":
                parts.append(f"rank {x.rank} on {x.node}: {len(x.active)} active request(s)")
            elif x.state == "unknown":
                parts.append(f"rank {x.rank} on {x.node}: unknown ({x.why})")
        return "; ".join(parts) or "every rank idle"


async def read_rank_markers(m, ssh: Connector, hs=None) -> dict[int, RankView]:
    """Each rank's marker as its node sees it (a rank missing from the answer has no marker). Ages are judged
    on each node's own clock. ``hs``: node handles to reuse (left open); without, opened and closed here."""
    return (await look_at_job(m, ssh, hs=hs, processes=False)).markers


def _activity(r, seen: RankView | None, stale_after: float) -> RankActivity:
    if seen is None:
        return RankActivity(rank=r.rank, node=r.node, state="unknown", why="no marker")
    if seen.error is not None:
        return RankActivity(rank=r.rank, node=r.node, state="unknown", why=seen.error)
    active, age = seen.marker.active_requests, seen.age
    if age is None or age > stale_after:
        why = f"heartbeat {age:.1f} s old" if age is not None else "no heartbeat age"
        return RankActivity(rank=r.rank, node=r.node, state="unknown", why=why, active=active)
    return RankActivity(rank=r.rank, node=r.node, state="busy" if active else "idle", active=active)


def judge(m, markers: dict[int, RankView], *, stale_after: float = STALE_AFTER) -> Quiescence:
    """Pure: the quiescence of launch ``m`` from its ranks' markers (as ``read_rank_markers`` returns them)."""
    ranks = [_activity(r, markers.get(r.rank), stale_after) for r in m.ranks]
    states = {x.state for x in ranks}
    overall = "busy" if "busy" in states else "unknown" if "unknown" in states else "idle"
    return Quiescence(state=overall, job_id=m.job_id, deployment_id=m.deployment_id, ranks=ranks)


async def quiescence(m, ssh: Connector, hs=None) -> Quiescence:
    """``hs``: node handles to reuse (their sessions stay open); without, opened and closed here."""
    return judge(m, await read_rank_markers(m, ssh, hs))


async def wait_idle(m, ssh: Connector, seconds: float, *, poll: float = 0.5, hs=None) -> Quiescence:
    """Poll until launch ``m`` is not busy or ``seconds`` have passed; the last answer."""
    deadline = time.monotonic() + seconds
    while True:
        q = await quiescence(m, ssh, hs)
        if q.state != "busy" or time.monotonic() >= deadline:
            return q
        await asyncio.sleep(min(poll, max(0.0, deadline - time.monotonic())))


async def refuse_activity(jobs, ssh: Connector, *, refuse: tuple[str, ...], hints: dict[str, str],
                          drain: float = 0.0, log=lambda msg: None, hs_of: dict | None = None) -> None:
    """Raise Busy (exit 75) for the first job whose activity is in ``refuse`` (after ``drain`` seconds of
    waiting for it to go idle), naming its ranks' requests or why they are unknown; ``hints`` by activity.
    Teardown refuses ``busy`` only (stopping a broken job is its purpose); replan refuses ``unknown`` too.
    ``hs_of``: node handles per job id to reuse."""

    hs_of = hs_of or {}
    if drain > 0:
        log(f"draining: waiting up to {drain:g} s for requests in flight to finish")
        answers = await asyncio.gather(*(wait_idle(m, ssh, drain, hs=hs_of.get(m.job_id)) for m in jobs))
    else:
        answers = await asyncio.gather(*(quiescence(m, ssh, hs_of.get(m.job_id)) for m in jobs))
    for q in answers:
        if q.state in refuse:
            waited = f" after draining {drain:g} s" if drain > 0 else ""
            raise Busy(f"job {q.job_id} is {q.state}{waited}: {q.describe()}", hint=hints[q.state])
