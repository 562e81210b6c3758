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

from clusterctl.errors import Busy
from clusterctl.connect.nodes import Connector
from clusterctl.launch.look import look_at_job

STALE_AFTER = 5.0  # heartbeats come every second; five missed ones make a marker stale


async def read_rank_markers(m, ssh: Connector, hs=None) -> dict[int, dict]:
    """Each rank's marker as its node sees it: {rank: {"marker": doc, "age": s}} or {rank: {"error": why}};
    a rank missing from the answer has no marker. Ages are judged on each node's own clock. ``hs``: node
    handles to reuse (left open); without, opened and closed here."""
    return (await look_at_job(m, ssh, hs=hs, processes=False)).markers


def clean_marker(mk: dict) -> dict:
    """A marker as status shows it: fields of the wrong type are dropped (a garbled file never crashes status)."""
    out = {}
    for key, kind in (("state", str), ("endpoint", str), ("error", str), ("reason", str)):
        v = mk.get(key)
        out[key] = v[:500] if isinstance(v, kind) else None
    ce = mk.get("cancel_epoch")
    out["cancel_epoch"] = ce if isinstance(ce, int) and not isinstance(ce, bool) else None
    ar = mk.get("active_requests")
    out["active_requests"] = [str(x)[:200] for x in ar[:1000]] if isinstance(ar, list) else []
    for key in ("batch", "queued", "tokens_out", "rss_bytes"):  # the step loop's load (status --watch)
        v = mk.get(key)
        out[key] = v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    for key in ("step_s", "idle_share"):
        v = mk.get(key)
        out[key] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9 else None
    v = mk.get("ladder")
    out["ladder"] = v[:200] if isinstance(v, str) else None
    pc = mk.get("prompt_cache")
    out["prompt_cache"] = pc if isinstance(pc, list) and len(pc) == 3 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in pc) else None
    return out


def judge(m, markers: dict[int, dict], *, stale_after: float = STALE_AFTER) -> dict:
    """Pure: the quiescence of launch ``m`` from its ranks' markers (the shape ``read_rank_markers`` returns)."""
    ranks = []
    for r in m.ranks:
        info = markers.get(r.rank)
        if info is None:
            ranks.append({"rank": r.rank, "node": r.node, "state": "unknown", "why": "no marker", "active": []})
            continue
        if "error" in info:
            ranks.append({"rank": r.rank, "node": r.node, "state": "unknown", "why": info["error"], "active": []})
            continue
        mk = clean_marker(info.get("marker") or {})
        age = info.get("age")
        active = mk["active_requests"]
        if not isinstance(age, (int, float)) or age > stale_after:
            why = f"heartbeat {age:.1f} s old" if isinstance(age, (int, float)) else "no heartbeat age"
            ranks.append({"rank": r.rank, "node": r.node, "state": "unknown", "why": why, "active": active})
        else:
            ranks.append({"rank": r.rank, "node": r.node, "state": "busy" if active else "idle", "why": None,
                          "active": active})
    states = {x["state"] for x in ranks}
    overall = "busy" if "busy" in states else "unknown" if "unknown" in states else "idle"
    return {"state": overall, "job_id": m.job_id, "deployment_id": m.deployment_id, "ranks": ranks}


def describe(q: dict) -> str:
    """One line: which ranks hold how many requests, or why it is not known."""
    parts = []
    for x in q["ranks"]:
        if x["state"] == "busy":
            parts.append(f"rank {x['rank']} on {x['node']}: {len(x['active'])} active request(s)")
        elif x["state"] == "unknown":
            parts.append(f"rank {x['rank']} on {x['node']}: unknown ({x['why']})")
    return "; ".join(parts) or "every rank idle"


async def quiescence(m, ssh: Connector, hs=None) -> dict:
    """``hs``: node handles to reuse (their sessions stay open); without, opened and closed here."""
    return judge(m, await read_rank_markers(m, ssh, hs))


async def wait_idle(m, ssh: Connector, seconds: float, *, poll: float = 0.5, hs=None) -> dict:
    """Poll until launch ``m`` is not busy or ``seconds`` have passed; the last answer."""
    deadline = time.monotonic() + seconds
    while True:
        q = await quiescence(m, ssh, hs)
        if q["state"] != "busy" or time.monotonic() >= deadline:
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
        if q["state"] in refuse:
            waited = f" after draining {drain:g} s" if drain > 0 else ""
            raise Busy(f"job {q['job_id']} is {q['state']}{waited}: {describe(q)}", hint=hints[q["state"]])
