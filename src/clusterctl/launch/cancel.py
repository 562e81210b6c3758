"""`clusterctl cancel`: cancel requests on a running deployment through cancel files (rank/cancelfile.py).

The coordinator reads the job's cancel files and acks on its nodes, writes a cancel file with a larger epoch and a
fresh nonce on every node, and with ``wait`` reads the ranks' acks until each one has applied that cancel. Nothing
here touches a collective: the ranks apply the cancel at their own next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time

from clusterctl.errors import ClusterctlError, Exit, MissingInput, UsageError
from clusterctl.statedir.manifest import job_ref, manifest_store
from clusterctl.connect.nodes import Connector, close_all, handles
from clusterctl.protocol.runtimefiles import (MAX_REQUEST_IDS, REQUEST_ID_PATTERN, CancelAck, CancelFile, EpochsUsedUp,
                                            ack_path, cancel_path, new_cancel_nonce as new_nonce, next_epoch)
from clusterctl.statedir.state import StateDir

ACK_POLL = 0.02


class CancelNotAcked(ClusterctlError):
    exit_code = Exit.FAILED


def resolve_jobs(state: StateDir, target: str) -> list:
    """Launch manifests of a job id, a deployment id, or the deployment FILE that `launch` was given."""

    ref = job_ref(state, target)
    store = manifest_store(state)
    good, _ = store.all() if state.launches.is_dir() else ([], [])
    jobs = [m for _, m in good if ref in (m.job_id, m.deployment_id)]
    if not jobs:
        raise MissingInput(f"no launch of {target!r} in {state.launches}", hint="clusterctl status lists what runs")
    return jobs


async def cancel_job(m, ssh: Connector, requests: list[str] | None, *, wait: float) -> dict:
    """Write the job's cancel file on each of its nodes, then (``wait``) read every rank's ack until each has
    applied THIS cancel. Reads and writes go through each node's handle: the transport on this machine, the
    node's op session (read, write) on a remote one.

    The new epoch is above every epoch readable in the cancel files and in the ranks' acks: a file this command
    cannot read (rank 0 could not either) must not make it reuse an epoch rank 0 already consumed. And an ack
    counts only as proof of this cancel: rank 0's must show our (epoch, nonce), the others' an epoch at least
    ours once rank 0's does (the epoch reaches them in the meeting after rank 0 applied it)."""
    from pydantic import ValidationError

    hs = handles(m.nodes, ssh)
    t0 = time.monotonic()

    async def read_ack(r) -> CancelAck | None:
        got = await hs[r.node].read_json(str(ack_path(r.runtime_dir, m.deployment_id, r.rank)))
        try:
            ack = CancelAck.model_validate(got) if got else None
        except ValidationError:
            return None
        return ack if ack and ack.job_id == m.job_id and ack.rank == r.rank else None

    try:
        places = sorted({(r.node, r.runtime_dir) for r in m.ranks})
        found = await asyncio.gather(*(hs[n].read_json(str(cancel_path(d, m.deployment_id))) for n, d in places))
        old_acks = await asyncio.gather(*(read_ack(r) for r in m.ranks))
        # only files rank 0 could have taken count (a garbled epoch of 2**40 is no reason to stop cancelling)
        epochs = [doc.epoch for doc in map(valid_cancel, found) if doc] + [a.epoch for a in old_acks if a]
        top = max(epochs or [0])
        try:
            epoch, nonce = next_epoch(top), new_nonce()  # the one epoch rule (protocol/runtimefiles.py)
        except EpochsUsedUp as e:
            raise EpochsUsedUp(f"cancel epochs of job {m.job_id} are used up (epoch {top})", hint=e.hint) from None
        doc = CancelFile(deployment_id=m.deployment_id, job_id=m.job_id, epoch=epoch, requests=requests,
                         created_at=time.time(), nonce=nonce)
        data = json.dumps(doc.model_dump(mode="json"), indent=2).encode() + b"\n"
        await asyncio.gather(*(hs[n].write_file(str(cancel_path(d, m.deployment_id)), data, mode=0o600)
                               for n, d in places))
        acks: dict[int, dict | None] = {r.rank: None for r in m.ranks}
        deadline = t0 + wait
        while wait > 0:
            pending = [r for r in m.ranks if acks[r.rank] is None]
            got = dict(zip((r.rank for r in pending), await asyncio.gather(*(read_ack(r) for r in pending))))
            a0 = got.get(0)
            if acks.get(0) is None and a0 is not None and a0.shows(epoch, nonce):
                acks[0] = a0.model_dump(mode="json")
                if a0.epoch != epoch:  # a newer cancel came after ours: our ids are in an ack already replaced
                    acks[0]["applied"] = []
            if acks.get(0) is not None:
                for r, a in got.items():
                    if r != 0 and a is not None and a.epoch >= epoch:
                        acks[r] = a.model_dump(mode="json")
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


def check_requests(requests: list[str] | None) -> None:
    """Request ids a cancel file can carry (the CLI checks the same first); UsageError naming the first that
    cannot."""
    import re

    if requests is None:
        return
    if not requests or len(requests) > MAX_REQUEST_IDS:
        raise UsageError(f"a cancel names 1 to {MAX_REQUEST_IDS} request ids, not {len(requests)}")
    for rid in requests:
        if not re.fullmatch(REQUEST_ID_PATTERN, rid):
            shown = rid if len(rid) <= 60 else f"{rid[:40]}... ({len(rid)} characters)"
            raise UsageError(f"request id {shown!r} is not valid: ids match {REQUEST_ID_PATTERN}")


def valid_cancel(doc: dict | None):
    """A cancel file's contents as CancelFile, or None when it is not one."""
    from pydantic import ValidationError

    try:
        return CancelFile.model_validate(doc) if doc else None
    except ValidationError:
        return None


async def cancel_command(state: StateDir, target: str, ssh: Connector, *, requests: list[str] | None,
                         wait: float = 0.0) -> list[dict]:
    check_requests(requests)
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
