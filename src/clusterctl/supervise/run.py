"""The supervised run of a command: ``launch --heal`` and ``supervise`` (cli), around supervise/loop.py's
Supervisor: the first job (launched or taken over), ready said once, the loop until a stop, and what a stop
leaves (docs/heal.md)."""

from __future__ import annotations

import asyncio

from clusterctl.statedir import healfile
from clusterctl.supervise.policy import HealPolicy
from clusterctl.supervise.loop import Supervisor
from clusterctl.launch.foreground import start_unless_stopped, stop_on_signals
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.locks import Lock
from clusterctl.statedir.state import StateDir


async def run_supervised(o, state: StateDir, ref: str, opts: LaunchOptions, policy: HealPolicy, *,
                         take_over: bool) -> int:
    """``launch --heal`` (``take_over`` False: launched here in the foreground; a stop tears it down verified)
    and ``supervise`` (True: the running detached job, or a detached launch; relaunches detached; a stop leaves
    the job serving). One supervisor per cluster (``<state>/locks/heal-<cluster>.lock``). Returns the exit
    code."""

    stop = stop_on_signals()
    sup = Supervisor(state, ref, opts, policy, log=o.info, detach=take_over,
                     event=(lambda s: o.event("heal", s.model_dump(mode="json"))) if o.json else (lambda s: None))
    lock = Lock(state.heal_lock(sup.cluster)).acquire(what=f"supervision of cluster {sup.cluster}")
    try:
        if not await _started(o, sup, stop, take_over):
            return 130
        await sup.run(stop)
        if take_over:
            o.info(f"supervisor stopped; job {sup.job.manifest.job_id if sup.job else '-'} left as it is")
            return 0
        ok = await sup.stop()
        (o.info if ok else o.error)("every rank confirmed gone" if ok else "teardown could not confirm every rank "
                                    "gone (see the lines above)")
        return 0 if ok else 1
    finally:
        lock.release()


async def _started(o, sup: Supervisor, stop: asyncio.Event, take_over: bool) -> bool:
    """The first job (taken over or launched), or False when a stop came first (what started was stopped)."""
    starting = await start_unless_stopped(sup.take_over if take_over else sup.launch_first, stop)
    if starting is None:
        o.error("interrupted; everything it started was stopped")
        return False
    starting.result()
    if sup.job is None:  # supervise: the launch failed; the loop heals
        return True
    m = sup.job.manifest
    sup.phase("serving")
    sup.save(force=True)
    if o.json:
        o.event("ready", {"job_id": m.job_id, "deployment_id": m.deployment_id, "endpoint": m.endpoint,
                          "heal": sup.snapshot().model_dump(mode="json")})
    elif not o.quiet:
        o.line(m.endpoint)
        o.info(f"job {m.job_id}: {len(m.ranks)} rank(s) ready at {m.endpoint}, supervised (heal state: "
               f"{healfile.path_of(sup.state, sup.cluster)}; Ctrl-C to stop)")
    return True
