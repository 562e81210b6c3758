"""The supervisor's look (supervise/loop.py calls it every step): one look at a job's ranks on their nodes (each
rank's marker and its process, identity-checked, as ``status`` does), each rank's record for the policy
(supervise/policy.py: ``culprits``: up or why not, and whether it only followed a lost peer), the loss they add up
to (``Watch.look``), and a probe of nodes that may serve. Every node answers within LOOK_TIMEOUT or counts as not
answering: a cut link must not stall the loop."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from clusterctl.errors import ClusterctlError, Exit
from clusterctl.connect.nodes import Connector, close_all, handles
from clusterctl.launch.foreground import Running
from clusterctl.launch.look import RankView, look
from clusterctl.launch.quiescence import STALE_AFTER, judge
from clusterctl.launch.status import rank_state
from clusterctl.protocol.runtimefiles import followed_a_peer
from clusterctl.protocol.nodeops import ProbeRequest
from clusterctl.statedir.manifest import LaunchManifest
from clusterctl.supervise.policy import Book, culprits

LOOK_TIMEOUT = 5.0  # one node's answer to a look or a probe
UP = ("loading", "ready", "serving")


async def look_at(m, hs: dict, unreachable: dict[str, bool]) -> tuple[dict[int, RankView], dict[int, str]]:
    """Job ``m``'s markers (rank -> what its node saw) and processes (rank -> alive/dead/...) over
    the sessions ``hs``; ``unreachable`` gets each node's answer (True: it did not answer both questions: then
    each of its ranks has the error and no process)."""
    seen = await look(m, hs, timeout=LOOK_TIMEOUT)
    for r in m.ranks:
        why = seen.failed.get(r.node)
        unreachable[r.node] = why is not None
        if why is not None:
            seen.markers[r.rank] = RankView(error=why)
            seen.procs.pop(r.rank, None)
    return seen.markers, seen.procs


def rank_record(r, seen: RankView | None, process: str | None, running=None) -> dict:
    """One rank as the policy takes it: ``state`` (``up`` or why not), ``follower`` (it only followed a lost
    peer: its marker's typed reason or its ladder's ``lost``, or in the foreground its keeper's exit 69,
    the rank's ``Exit.UNAVAILABLE`` for a peer, lease or parent lost, whatever its process does now), ``silent_s`` (a frozen rank's heartbeat age)."""
    seen = seen or RankView()
    mk, age = seen.marker, seen.age
    st = rank_state(mk.state, process, age is not None and age > STALE_AFTER, seen.reachable)
    follower = followed_a_peer(mk.state, mk.reason)
    if running is not None and running.exited(r.rank):
        st = "exited"
        follower = follower or running.procs[r.rank].returncode == Exit.UNAVAILABLE
    return {"rank": r.rank, "node": r.node, "state": "up" if st in UP else st, "follower": follower,
            "silent_s": age if st == "lost" and age is not None else None}


async def probe_nodes(dep, names: list[str], ssh) -> dict[str, bool]:
    """Each node of ``dep``: does it answer a probe (on a session of its own) with its runtime dir usable and
    the deployment's model folder there?"""
    hs = handles([dep.node(n) for n in names], ssh)

    async def one(n: str) -> bool:
        try:
            ans = await hs[n].ask(ProbeRequest(model_path=dep.path_map.get(n), runtime_dir=hs[n].runtime_dir),
                                  timeout=LOOK_TIMEOUT)
        except ClusterctlError:
            return False
        return ans.model is not None and ans.model.ok and ans.runtime_dir is not None and ans.runtime_dir.ok

    try:
        ok = await asyncio.wait_for(asyncio.gather(*(one(n) for n in names)), LOOK_TIMEOUT + 5)
    except asyncio.TimeoutError:
        ok = [False] * len(names)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close_all(hs), LOOK_TIMEOUT)
    return dict(zip(names, ok))


@dataclass(frozen=True)
class Loss:
    """What a look found: the nodes to blame, and why (every rank down, in words)."""

    blame: list[str]
    why: str


class Watch:
    """The supervisor's look at its job: the sessions it looks over (opened per job, closed with it), each node's
    answer to the last look (``unreachable``: True, it gave none), and whether the job was idle then."""

    def __init__(self, ssh: Connector, clock):
        self.ssh, self.clock = ssh, clock
        self.hs: dict = {}
        self.unreachable: dict[str, bool] = {}
        self.idle = False

    async def look(self, m: LaunchManifest, running: Running | None, book: Book, now: float) -> Loss | None:
        """One look at every rank of job ``m`` (``running``: launched here in the foreground), seen by ``book``;
        the loss, once something has been down for the grace."""
        if not self.hs:
            self.hs = handles(m.nodes, self.ssh)
        markers, procs = await look_at(m, self.hs, self.unreachable)
        ranks = [rank_record(r, markers.get(r.rank), procs.get(r.rank), running) for r in m.ranks]
        self.idle = judge(m, markers).state == "idle"
        down = [x for x in ranks if x["state"] != "up"]
        # down since the look began (a node that let it time out has not answered since then), or since its
        # last heartbeat (a frozen rank: its age on its node's clock), judged now
        silent = {x["node"]: now - x["silent_s"] for x in down if x.get("silent_s")}
        book.seen_down(now, {x["node"] for x in down}, since=silent)
        now = self.clock()
        if not book.due(now):
            return None
        first = min(book.down_since.values())
        blame = culprits(ranks, insist=now - first >= book.policy.grace_s + STALE_AFTER)
        if not blame:
            return None  # only ranks that followed a lost peer so far: the one that left shows itself soon
        return Loss(blame, "; ".join(f"rank {x['rank']} on {x['node']} {x['state']}" for x in down))

    async def close(self) -> None:
        """The job's sessions closed (within LOOK_TIMEOUT: a dead connection is let go)."""
        hs, self.hs = self.hs, {}
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close_all(hs), LOOK_TIMEOUT)
