"""The rejoin (docs/heal.md, "Rejoin"): the lost nodes are probed; once every one has answered well for the
policy's time, at a moment with no request in flight (or after the drain deadline: supervise/policy.py), back to
the original deployment, recorded as kind ``rejoin``. A rejoin that does not launch: back on the survivors
(supervise/heal.py), after the backoff."""

from __future__ import annotations

import asyncio

from clusterctl.errors import ClusterctlError
from clusterctl.launch.replan import PlanChange, propose
from clusterctl.supervise.heal import apply, retry, retry_leftovers, stop_job
from clusterctl.supervise.persist import Supervision


async def probe_lost(s: Supervision, now: float) -> None:
    for n, ok in (await s.probe(list(s.book.lost))).items():
        s.book.probed(now, n, ok)


async def rejoin(s: Supervision) -> None:
    """Every lost node answered well for long enough: back to the original deployment."""
    lost = list(s.book.lost)
    s.phase("healing", f"rejoin: {', '.join(lost)} healthy again; back to {s.original}")
    try:
        p = await asyncio.to_thread(propose, s.state, s.ref, PlanChange(to=s.original))
    except ClusterctlError as e:
        s.phase("degraded", f"rejoin to {s.original} refused: {e.message}")
        return
    await stop_job(s)
    await retry_leftovers(s)
    s.book.rejoined(s.clock())
    if await apply(s, p, "rejoin"):
        s.phase("serving")
        return
    s.book.lost = lost  # back on the survivors at the next step (after the backoff)
    s.pending = retry(s)
