"""The supervisor: keep a deployment serving through the loss of a rank or a node (docs/heal.md). Its start
(``take_over``: ``supervise``; ``launch_first``: ``launch --heal``), where the serving address is resolved once,
and its loop. Every ``POLL_S`` a step looks at the job's ranks as ``status`` does (supervise/watch.py: each
rank's marker and its process, identity-checked, on its node; a foreground rank's keeper) with a short timeout
per node. A rank that is not up (dead, stale, failed, stopping, its node unreachable) for the policy's grace is a
loss (supervise/policy.py decides); the step acts on it:

  heal     supervise/heal.py: every rank torn down verified, the nodes to blame left out, the nodes that answer
           a probe replanned and relaunched on the same address.
  rejoin   supervise/rejoin.py: once the lost nodes answer well again, back to the original deployment.

What the supervisor knows and the state file it writes at every change: supervise/persist.py.
"""

from __future__ import annotations

import asyncio
import contextlib

from clusterctl.errors import Busy, ClusterctlError
from clusterctl.launch.reaper import live_jobs
from clusterctl.statedir.manifest import LaunchManifest, manifest_store
from clusterctl.supervise import heal, rejoin
from clusterctl.supervise.persist import Address, Job, Supervision

POLL_S = 1.0
PROBE_EVERY_S = 2.0


class Supervisor(Supervision):
    """A Supervision, its start and its loop (``run``: one ``step`` every POLL_S until a stop)."""

    # ---- the start ------------------------------------------------------------------------------------------
    async def take_over(self) -> None:
        """``supervise``: the deployment's running job, or a new detached launch when none runs."""
        store = manifest_store(self.state)
        jobs = await live_jobs(store, self.opts.ssh, self.current) if self.state.launches.is_dir() else []
        for m in jobs:
            if not m.coordinator.detached:
                raise Busy(f"job {m.job_id} is supervised by its own coordinator (pid {m.coordinator.pid})",
                           hint="stop it, launch it with --detach, then supervise it")
        self.address = Address.resolve(self.opts, self.recorded, jobs[0] if jobs else None)
        if self.unfinished is not None:
            await self._finish_heal(jobs)
            return
        if jobs:
            self.job = Job(jobs[0])
            self.log(f"supervising job {jobs[0].job_id} of deployment {self.current}")
            return
        self.log(f"deployment {self.current} is not running: launching it")
        try:
            self.job = await heal.launch(self, self.ref)
        except ClusterctlError as e:  # e.g. restarted while a node is away: heal onto the nodes that answer
            self.phase("degraded", f"deployment {self.current} did not launch: {e.message}")
            self.pending = heal.retry(self)

    async def launch_first(self) -> None:
        """``launch --heal``: the deployment launched here in the foreground."""
        self.address = Address.resolve(self.opts, self.recorded, None)
        self.job = await heal.launch(self, self.ref)

    async def _finish_heal(self, jobs: list[LaunchManifest]) -> None:
        """Its predecessor died healing (SIGKILL, a crash): what is left of the lost job, or of a relaunch cut
        short, is torn down verified; the next step heals without the nodes it was leaving out, on the
        cluster's recorded host and port."""
        s, self.unfinished = self.unfinished, None
        pid = s.supervisor.pid if s.supervisor else "?"
        self.phase("healing", f"{s.reason or 'a heal'}; finishing it (supervisor pid {pid} died during it)")
        if s.job is not None and s.job not in {m.job_id for m in jobs}:
            self.leftovers.append(s.job)  # its ranks may all be gone: its manifest still is to be cleared
        for m in jobs:
            self.job = Job(m)
            await heal.stop_job(self)
        await heal.retry_leftovers(self)

    # ---- the loop -------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                if not await self._step_unless(stop):
                    return
                self.save()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
        finally:
            await self.seen.close()

    async def _step_unless(self, stop: asyncio.Event) -> bool:
        """One step; detached, a stop cuts it short (a launch cut short tears down what it started, a teardown
        keeps the job's manifest: the successor or ``teardown`` finishes it). In the foreground the step ends
        first: the stop's own teardown must see every rank. False: cut short."""
        if not self.detach:
            await self.step()
            return True
        step, stopper = asyncio.ensure_future(self.step()), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([step, stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if step.done():
            step.result()
            return True
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step
        self.log(f"heal: stopped during a step ({self.book.phase}); what it left is in the state file")
        return False

    async def step(self) -> None:
        now = self.clock()
        if self.job is not None:
            loss = await self.seen.look(self.job.manifest, self.job.running, self.book, now)
            if loss:
                await heal.lose(self, loss)
                return
        elif self.pending is not None:
            await heal.heal(self, now)
            return
        if not self.book.lost:
            return
        if now - self.last_probe >= PROBE_EVERY_S:
            self.last_probe = now
            await rejoin.probe_lost(self, now)
        if self.book.rejoin_now(self.clock(), idle=self.job is None or self.seen.idle):  # idle: as of this look
            await rejoin.rejoin(self)

    async def stop(self) -> bool:
        """``launch --heal`` ends: every rank torn down verified (a lost job whose node did not answer too, if
        it answers now), the state file saying nothing serves. False: not every rank confirmed gone."""
        ok = await heal.stop_job(self)
        await heal.retry_leftovers(self)
        self.phase("degraded", "stopped: the supervisor ended (launch --heal)")
        return ok and not self.leftovers
