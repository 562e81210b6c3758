"""`clusterctl cancel`: cancel requests on a running deployment through cancel files (launch/cancelfile.py).

The coordinator reads the job's cancel files on its nodes, writes one with a larger epoch on every node, and with
``wait`` reads the ranks' acks until each one has consumed that epoch. Nothing here touches a collective: the ranks apply the cancel at their own next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time

from clusterctl.errors import ClusterctlError, Exit, MissingInput
from clusterctl.launch.manifest import ManifestStore
from clusterctl.launch.nodes import SshOptions, close_all, handles

ACK_POLL = 0.02


class CancelNotAcked(ClusterctlError):
    exit_code = Exit.FAILED


def resolve_jobs(state, target: str) -> list:
    """Launch manifests of a job id, a deployment id, or the deployment FILE that `launch` was given."""
    from clusterctl.launch.manifest import job_ref

    ref = job_ref(state, target)
    store = ManifestStore(state.launches, None, state.keyring.public_keys() if state.launches.is_dir() else [])
    good, _ = store.all() if state.launches.is_dir() else ([], [])
    jobs = [m for _, m in good if ref in (m.job_id, m.deployment_id)]
    if not jobs:
        raise MissingInput(f"no launch of {target!r} in {state.launches}", hint="clusterctl status lists what runs")
    return jobs


async def cancel_job(m, ssh: SshOptions, requests: list[str] | None, *, wait: float) -> dict:
    """Write the job's cancel file on each of its nodes, then (``wait``) read every rank's ack until each has
    consumed the new epoch. Reads and writes go straight through the transport (no node operation to start)."""
    from pydantic import ValidationError

    from clusterctl.launch.cancelfile import CancelAck, CancelFile, ack_path, cancel_path

    hs = handles(m.nodes, ssh)
    t0 = time.monotonic()
    try:
        places = sorted({(r.node, r.runtime_dir) for r in m.ranks})
        found = await asyncio.gather(*(hs[n].read_json(str(cancel_path(d, m.deployment_id))) for n, d in places))
        epochs = [doc.get("epoch") for doc in found if doc]
        epoch = 1 + max([e for e in epochs if isinstance(e, int) and not isinstance(e, bool)] or [0])
        doc = CancelFile(deployment_id=m.deployment_id, job_id=m.job_id, epoch=epoch, requests=requests,
                         created_at=time.time())
        data = json.dumps(doc.model_dump(mode="json"), indent=2).encode() + b"\n"
        await asyncio.gather(*(hs[n].write_file(str(cancel_path(d, m.deployment_id)), data, mode=0o600)
                               for n, d in places))
        acks: dict[int, dict | None] = {r.rank: None for r in m.ranks}
        deadline = t0 + wait
        while wait > 0:
            async def one(r) -> None:
                got = await hs[r.node].read_json(str(ack_path(r.runtime_dir, m.deployment_id, r.rank)))
                try:
                    ack = CancelAck.model_validate(got) if got else None
                except ValidationError:
                    return
                if ack and ack.job_id == m.job_id and ack.rank == r.rank and ack.epoch >= epoch:
                    acks[r.rank] = ack.model_dump(mode="json")

            await asyncio.gather(*(one(r) for r in m.ranks if acks[r.rank] is None))
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
