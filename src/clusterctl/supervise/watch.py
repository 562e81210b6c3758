"""What the supervisor (supervise/loop.py) sees: one look at a job's ranks on their nodes (each rank's marker
and its process, identity-checked, as ``status`` does), each rank's record for the policy (supervise/policy.py:
``culprits``: up or why not, and whether it only followed a lost peer), and a probe of nodes that may serve.
Every node answers within LOOK_TIMEOUT or counts as not answering: a cut link must not stall the loop."""

from __future__ import annotations

import asyncio
import contextlib

from clusterctl.errors import ClusterctlError
from clusterctl.connect.nodes import close_all, handles
from clusterctl.launch.look import RankView, look
from clusterctl.launch.quiescence import STALE_AFTER
from clusterctl.launch.status import rank_state
from clusterctl.protocol.runtimefiles import followed_a_peer
from clusterctl.protocol.nodeops import ProbeRequest

LOOK_TIMEOUT = 5.0  # one node's answer to a look or a probe
UP = ("loading", "ready", "serving")
FOLLOWER_EXIT = 69  # a foreground rank's keeper: its rank left because a peer, its lease or its parent was lost


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
    peer: its marker's typed reason or its ladder's ``lost``, or its keeper's exit 69 in the foreground,
    whatever its process does now), ``silent_s`` (a frozen rank's heartbeat age)."""
    seen = seen or RankView()
    mk, age = seen.marker, seen.age
    st = rank_state(mk.state, process, age is not None and age > STALE_AFTER, seen.reachable)
    follower = followed_a_peer(mk.state, mk.reason)
    if running is not None and running.exited(r.rank):
        st = "exited"
        follower = follower or running.procs[r.rank].returncode == FOLLOWER_EXIT
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
