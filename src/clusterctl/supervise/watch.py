"""What the supervisor (supervise/loop.py) sees: one look at a job's ranks on their nodes (each rank's marker
and its process, identity-checked, as ``status`` does), each rank's record for the policy (supervise/policy.py:
``culprits``: up or why not, and whether it only followed a lost peer), and a probe of nodes that may serve.
Every node answers within LOOK_TIMEOUT or counts as not answering: a cut link must not stall the loop."""

from __future__ import annotations

import asyncio
import contextlib

from clusterctl.errors import ClusterctlError, Exit
from clusterctl.connect.nodes import close_all, handles
from clusterctl.launch.look import look
from clusterctl.launch.quiescence import STALE_AFTER, clean_marker
from clusterctl.launch.status import rank_state
from clusterctl.protocol.runtimefiles import followed_a_peer
from clusterctl.protocol.nodeops import ProbeRequest

LOOK_TIMEOUT = 5.0  # one node's answer to a look or a probe
UP = ("loading", "ready", "serving")


async def look_at(m, hs: dict, unreachable: dict[str, bool]) -> tuple[dict, dict]:
    """Job ``m``'s markers (rank -> {"marker", "age"} or {"error"}) and processes (rank -> alive/dead/...) over
    the sessions ``hs``; ``unreachable`` gets each node's answer (True: it did not answer both questions: then
    each of its ranks has the error and no process)."""
    seen = await look(m, hs, timeout=LOOK_TIMEOUT)
    for r in m.ranks:
        why = seen.failed.get(r.node)
        unreachable[r.node] = why is not None
        if why is not None:
            seen.markers[r.rank] = {"error": why}
            seen.procs.pop(r.rank, None)
    return seen.markers, seen.procs


def rank_record(r, info: dict, process: str | None, running=None) -> dict:
    """One rank as the policy takes it: ``state`` (``up`` or why not), ``follower`` (it only followed a lost
    peer: its marker's typed reason or its ladder's ``lost``, or in the foreground its keeper's exit 69, the
    rank's ``Exit.UNAVAILABLE`` for a peer, lease or parent lost, whatever its process does now), ``silent_s``
    (a frozen rank's heartbeat age)."""
    mk = clean_marker(info.get("marker") or {})
    age = info.get("age")
    st = rank_state(mk.get("state"), process, age is not None and age > STALE_AFTER, "error" not in info)
    follower = followed_a_peer(mk.get("state"), mk.get("reason"))
    if running is not None and running.exited(r.rank):
        st = "exited"
        follower = follower or running.procs[r.rank].returncode == Exit.UNAVAILABLE
    return {"rank": r.rank, "node": r.node, "state": "up" if st in UP else st, "follower": follower,
            "silent_s": age if st == "lost" and isinstance(age, (int, float)) else None}


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
