"""``clusterctl status --watch``: the status of a deployment's ranks again and again, with rates between two looks.

Each refresh asks every node for its ranks' markers (launch/status.py), over the same connection and node session
each time (reopened only when it dropped). Markers carry what each rank's step loop last said of its load:
requests in its batch, the queue (rank 0), tokens generated (rank 0), step time, idle share, RSS, the peer-loss
ladder's last stage. Tokens per second is the difference of rank 0's token count
between two refreshes over the time between them. The loop ends on Ctrl-C (exit 0) or ``count`` refreshes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from clusterctl.connect.nodes import NodePool
from clusterctl.launch.status import status
from clusterctl.statedir.state import StateDir


def with_rates(doc: dict, prev: dict | None, dt: float) -> dict:
    """Pure: ``doc`` with ``tok_s`` on every rank whose token count moved since ``prev`` (``dt`` seconds ago)."""
    before = {(j["job_id"], r["rank"]): r.get("tokens_out") for j in (prev or {}).get("jobs", []) for r in j["ranks"]}
    for job in doc["jobs"]:
        for r in job["ranks"]:
            a, b = before.get((job["job_id"], r["rank"])), r.get("tokens_out")
            r["tok_s"] = (b - a) / dt if a is not None and b is not None and b >= a and dt > 0 else None
    return doc


async def _looks(state: StateDir, ssh, ref: str | None, interval: float, show: Callable[[dict], None],
                 count: int | None) -> None:
    pool = NodePool(ssh)  # each node's connection and session kept between refreshes; a dropped one reopened
    prev, t_prev, n = None, None, 0
    try:
        while count is None or n < count:
            t0 = time.monotonic()
            doc = (await status(state, ssh, ref=ref, pool=pool)).to_json()
            show(with_rates(doc, prev, t0 - t_prev if t_prev is not None else 0.0))
            prev, t_prev, n = doc, t0, n + 1
            if count is None or n < count:
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))
    finally:
        await pool.close()


def watch(state: StateDir, ssh, ref: str | None, interval: float, show: Callable[[dict], None],
          count: int | None = None) -> None:
    """Show a fresh status every ``interval`` seconds until Ctrl-C (returns normally then)."""
    try:
        asyncio.run(_looks(state, ssh, ref, interval, show, count))
    except KeyboardInterrupt:
        pass
