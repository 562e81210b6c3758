"""One look at a job on its nodes: each rank's marker as its node sees it (its age on that node's own clock) and
each started rank's process, identity-checked by its node (pid, start time, the job's nonce, boot id).

Status, quiescence, the reaper and the supervisor each judge a job from such a look (launch/status.py,
launch/quiescence.py, launch/reaper.py, supervise/watch.py); this module only asks, once per node and
concurrently, and says who answered what.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from pydantic import BaseModel, ConfigDict

from clusterctl.errors import ClusterctlError
from clusterctl.connect.nodes import Connector, close_all, handles
from clusterctl.protocol.identity import Identity
from clusterctl.protocol.nodeops import AliveAnswer, AliveRequest, MarkersAnswer, MarkersRequest
from clusterctl.protocol.runtimefiles import MarkerView

LOOK_OP_TIMEOUT = 30.0  # one node's answer to a look's op (the supervisor asks within less: supervise/watch.py)


class RankView(BaseModel):
    """One rank's marker as its node saw it: the marker (read tolerantly) and its age on that node's own clock,
    or (``error``) why its node could not read it (then the marker is empty)."""

    model_config = ConfigDict(frozen=True)

    marker: MarkerView = MarkerView()
    age: Optional[float] = None
    error: Optional[str] = None

    @classmethod
    def seen(cls, doc, age: float | None) -> RankView:
        """A marker document ``doc`` as a node sent it, ``age`` seconds old."""
        return cls(marker=MarkerView.read(doc), age=age)

    @property
    def reachable(self) -> bool:
        return self.error is None


@dataclass
class JobLook:
    """What the nodes of a job said."""

    markers: dict[int, RankView] = field(default_factory=dict)  # a rank missing here has no marker
    procs: dict[int, str] = field(default_factory=dict)  # a started rank -> alive | dead | foreign | unverifiable
    failed: dict[str, str] = field(default_factory=dict)  # node -> why one of its ops got no answer


def alive_targets(m, recs: list) -> list[Identity]:
    """The processes of the started ranks ``recs`` of job ``m``, as node ops take them (``alive``)."""
    return [r.identity(m.nonce) for r in recs if r.pid]


async def look(m, hs: dict, *, markers: bool = True, processes: bool = True,
               timeout: float = LOOK_OP_TIMEOUT) -> JobLook:
    """Ask each node of job ``m`` over the sessions ``hs`` (left open) for its ranks' markers (``markers``) and
    its started ranks' processes (``processes``), both at once. A marker counts for the node its rank runs on
    (nodes that are one machine share a runtime dir). A node whose markers cannot be read has an error for each
    of its ranks; a process answer that does not match the question is left out."""
    out = JobLook()
    by_node: dict[str, list] = {}
    for r in m.ranks:
        by_node.setdefault(r.node, []).append(r)

    async def one(node: str, recs: list) -> None:
        started = [r for r in recs if r.pid] if processes else []
        dirs = list(dict.fromkeys(r.runtime_dir for r in recs)) if markers else []
        if not dirs and not started:
            return
        h = hs[node]
        asks = [h.ask(MarkersRequest(runtime_dir=d, job_id=m.job_id), timeout=timeout) for d in dirs]
        if started:
            asks.append(h.ask(AliveRequest(targets=alive_targets(m, started)), timeout=timeout))
        answers = await asyncio.gather(*asks, return_exceptions=True)
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, ClusterctlError):
                raise a
        ours = {r.rank for r in recs}
        for a in answers[:len(dirs)]:
            for x in a.markers if isinstance(a, MarkersAnswer) else []:
                if x.rank is not None and x.rank in ours:
                    out.markers[x.rank] = RankView.seen(x.marker, x.age)
        for a in answers[:len(dirs)]:
            if isinstance(a, ClusterctlError):
                out.failed.setdefault(node, a.message)
                out.markers.update({r.rank: RankView(error=a.message) for r in recs})
        if started:
            a = answers[-1]
            if isinstance(a, ClusterctlError):
                out.failed.setdefault(node, a.message)
                return
            if isinstance(a, AliveAnswer) and len(a.status) == len(started):
                out.procs.update({r.rank: x for r, x in zip(started, a.status)})

    await asyncio.gather(*(one(n, recs) for n, recs in by_node.items()))
    return out


async def look_at_job(m, ssh: Connector, *, hs: dict | None = None, pool=None, **what) -> JobLook:
    """``look`` over the sessions ``hs`` or ``pool``'s (nodes.NodePool; both left open), else over sessions to
    the nodes it asks, opened and closed here. ``what``: ``look``'s choices."""
    if hs is not None:
        return await look(m, hs, **what)
    asked = {r.node for r in m.ranks if what.get("markers", True) or (what.get("processes", True) and r.pid)}
    nodes = [n for n in m.nodes if n.name in asked]
    hs = pool.handles(nodes) if pool is not None else handles(nodes, ssh)
    try:
        return await look(m, hs, **what)
    finally:
        if pool is None:
            await close_all(hs)
