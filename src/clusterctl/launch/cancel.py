"""`clusterctl cancel`: cancel requests on a running deployment through cancel files (launch/cancelfile.py).

The coordinator writes the cancel file on rank 0's node first (its answer is the epoch), then on every other
node of the job with at least that epoch; with ``wait`` it reads the ranks' acks until each one has consumed
the epoch. Nothing here touches a collective: the ranks apply the cancel at their own next step boundary.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from clusterctl.errors import ClusterctlError, Exit, MissingInput
from clusterctl.launch.manifest import ManifestStore
from clusterctl.launch.nodes import SshOptions, close_all, handles

ACK_POLL = 0.2


class CancelNotAcked(ClusterctlError):
    exit_code = Exit.FAILED


def resolve_jobs(state, target: str) -> list:
    """Launch manifests of a job id, a deployment id, or the deployment FILE that `launch` was given."""
    ref = target
    p = Path(target)
    if p.is_file() or target.endswith(".json"):
        _, loaded = state.load_deployment(target)
        ref = loaded.deployment.deployment_id
    store = ManifestStore(state.launches, None, state.keyring.public_keys() if state.launches.is_dir() else [])
    good, _ = store.all() if state.launches.is_dir() else ([], [])
    jobs = [m for _, m in good if ref in (m.job_id, m.deployment_id)]
    if not jobs:
        raise MissingInput(f"no launch of {target!r} in {state.launches}", hint="clusterctl status lists what runs")
    return jobs


async def cancel_job(m, ssh: SshOptions, requests: list[str] | None, *, wait: float) -> dict:
    hs = handles(m.nodes, ssh)
    t0 = time.monotonic()
    try:
        lead = m.ranks[0]
        req = {"deployment_id": m.deployment_id, "job_id": m.job_id, "requests": requests}
        epoch = (await hs[lead.node].op("cancel", {**req, "runtime_dir": lead.runtime_dir}, timeout=30))["epoch"]
        others = sorted({(r.node, r.runtime_dir) for r in m.ranks} - {(lead.node, lead.runtime_dir)})
        await asyncio.gather(*(hs[n].op("cancel", {**req, "runtime_dir": d, "min_epoch": epoch}, timeout=30)
                               for n, d in others))
        acks: dict[int, dict | None] = {r.rank: None for r in m.ranks}
        places = sorted({(r.node, r.runtime_dir) for r in m.ranks})
        deadline = t0 + wait
        while wait > 0:
            async def one(node: str, d: str) -> None:
                ranks = [r.rank for r in m.ranks if (r.node, r.runtime_dir) == (node, d)]
                try:
                    ans = await hs[node].op("acks", {"runtime_dir": d, "deployment_id": m.deployment_id,
                                                     "job_id": m.job_id, "ranks": ranks}, timeout=30)
                except ClusterctlError:
                    return
                for k, ack in ans.get("acks", {}).items():
                    if isinstance(ack, dict) and isinstance(ack.get("epoch"), int) and ack["epoch"] >= epoch:
                        acks[int(k)] = ack

            await asyncio.gather(*(one(n, d) for n, d in places))
            if all(a is not None for a in acks.values()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(ACK_POLL)
    finally:
        await close_all(hs)
    applied = sorted({x for a in acks.values() if a for x in a.get("applied", [])})
    return {"job_id": m.job_id, "deployment_id": m.deployment_id, "epoch": epoch, "requests": requests,
            "waited": wait > 0, "all_acked": all(a is not None for a in acks.values()) if wait > 0 else None,
            "acks": {str(k): (None if a is None else {"epoch": a["epoch"], "applied": a.get("applied", []),
                                                       "at": a.get("at")}) for k, a in acks.items()},
            "cancelled": applied, "seconds": round(time.monotonic() - t0, 3)}


async def cancel_command(state, target: str, ssh: SshOptions, *, requests: list[str] | None,
                         wait: float = 0.0) -> list[dict]:
    jobs = resolve_jobs(state, target)
    results = list(await asyncio.gather(*(cancel_job(m, ssh, requests, wait=wait) for m in jobs)))
    missing = [(r["job_id"], k) for r in results if r["waited"] for k, a in r["acks"].items() if a is None]
    if missing:
        names = ", ".join(f"rank {k} of {j}" for j, k in missing)
        err = CancelNotAcked(f"cancel epoch not acked within {wait:g} s by {names}",
                             hint="clusterctl status shows whether those ranks still run")
        err.results = results
        raise err
    return results
