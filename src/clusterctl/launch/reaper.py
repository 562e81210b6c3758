"""The cron reaper: find launch manifests whose coordinator is dead and reap their ranks like teardown does; roll
back a heal whose supervisor died in it (its jobs reaped, its state file ``degraded``: docs/heal.md).

A coordinator is dead when its pid is gone, is a zombie, or now belongs to another process (start time differs),
or when this host rebooted since. Manifests of live coordinators are left alone; a malformed manifest is reported
and kept, never acted on. One flock (``locks/reap.lock``) so overlapping cron runs never fight; a per-deployment
lock is taken before touching a job, so a reap never races a launch or a teardown of the same deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterctl.errors import Busy, ClusterctlError
from clusterctl.statedir.manifest import coordinator_alive, manifest_store
from clusterctl.connect.nodes import Connector, NodePool
from clusterctl.launch.look import look_at_job
from clusterctl.launch.supervisors import dead_heals, say_stopped
from clusterctl.launch.teardown import DEFAULT_GRACE, teardown_job
from clusterctl.locks import Lock, locked
from clusterctl.statedir.state import StateDir


async def ranks_alive(m, ssh: Connector, pool=None) -> bool:
    """Does any rank of the job still run? A process its node could not verify, or did not answer for, counts
    as yes (we cannot tell). ``pool`` (nodes.NodePool): the node sessions to ask over, left open."""
    started = [r for r in m.ranks if r.pid]
    if not started:
        return False
    try:
        seen = await look_at_job(m, ssh, pool=pool, markers=False)
    except Exception:
        return True
    return any(seen.procs.get(r.rank, "unverifiable") in ("alive", "unverifiable") for r in started)


async def job_is_live(m, ssh: Connector, pool=None) -> bool:
    """A job is live while its coordinator is, or (detached) while any of its ranks still runs."""
    if not coordinator_alive(m.coordinator):
        return False
    if m.coordinator.detached:
        return await ranks_alive(m, ssh, pool)
    return True


async def live_jobs(store, ssh: Connector, deployment_id: str | None = None) -> list:
    """The launch manifests in ``store`` (of ``deployment_id``, when given) whose job is live."""
    good, _ = store.all()
    return [m for _, m in good
            if (deployment_id is None or m.deployment_id == deployment_id) and await job_is_live(m, ssh)]


@dataclass
class ReapReport:
    reaped: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    malformed: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    dry_run: bool = False

    @property
    def nothing_to_do(self) -> bool:
        return not (self.reaped or self.failed or self.malformed)

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "reaped": self.reaped, "failed": self.failed,
                "malformed": self.malformed, "skipped": self.skipped}


async def reap(state: StateDir, ssh: Connector, *, grace: float = DEFAULT_GRACE, dry_run: bool = False,
               log=lambda msg: None, held: frozenset[str] = frozenset()) -> ReapReport:
    """``held``: deployment ids whose lock the caller already holds (a launch reaping its own dead jobs).
    One connection and session per node for every job on it (nodes.NodePool); the jobs' checks concurrent."""
    report = ReapReport(dry_run=dry_run)
    if not state.launches.is_dir():
        return report  # nothing was ever launched: no key, no lock needed
    pool = NodePool(ssh)
    try:
        with locked(state.locks / "reap.lock", what="reap"):
            await _reap_locked(state, ssh, pool, report, grace=grace, dry_run=dry_run, log=log, held=held)
    finally:
        await pool.close()
    return report


async def _reap_locked(state: StateDir, ssh: Connector, pool, report: ReapReport, *, grace: float, dry_run: bool, log,
                       held: frozenset[str]) -> None:
    import asyncio

    store = manifest_store(state)
    good, bad = store.all()
    for path, why in bad:
        report.malformed.append({"manifest": str(path), "error": why})
    heals = [] if dry_run else dead_heals(state)
    try:
        # a heal its supervisor died in is rolled back: the job it was tearing down (or, with none left, what
        # it was launching) is reaped, live or not
        lost = {m.job_id for _, m in good for doc, _ in heals if m.job_id == doc.job or (
            doc.job is None and m.deployment_id == doc.deployment)}
        live = await asyncio.gather(*(job_is_live(m, ssh, pool) for _, m in good))
        await _reap_jobs(state, store, ssh, pool, report, [m for (_, m), is_live in zip(good, live)
                                                            if not is_live or m.job_id in lost],
                         grace=grace, dry_run=dry_run, log=log, held=held, healing=lost)
        for doc, _ in heals:
            pid = doc.supervisor.pid if doc.supervisor else "?"
            log(f"cluster {doc.cluster}: supervisor pid {pid} died during a heal: rolled back")
            say_stopped(state, doc, f"supervisor pid {pid} died during a heal; reap tore down what it left, "
                                    "nothing serving (run supervise to serve again)")
    finally:
        for _, lock in heals:
            lock.release()


async def _reap_jobs(state: StateDir, store, ssh: Connector, pool, report: ReapReport, jobs: list, *, grace: float,
                     dry_run: bool, log, held: frozenset[str], healing: set[str]) -> None:
    for m in jobs:
        if dry_run:
            report.reaped.append({"job_id": m.job_id, "deployment_id": m.deployment_id, "dry_run": True,
                                  "ranks": [{"rank": r.rank, "node": r.node, "pid": r.pid} for r in m.ranks]})
            continue
        try:
            lock = Lock(state.deployment_lock(m.deployment_id))
            if m.deployment_id not in held:
                lock.acquire(what=f"deployment {m.deployment_id}")
        except Busy:
            report.skipped.append({"job_id": m.job_id, "reason": "deployment locked by a launch or teardown"})
            continue
        try:
            store.key = state.keyring.signing_key()
            log(f"reaping job {m.job_id} (" + ("a heal its supervisor died in left it)" if m.job_id in healing
                                               else "every rank of the detached job has exited)"
                                               if m.coordinator.detached
                                               else f"coordinator pid {m.coordinator.pid} is gone)"))
            try:
                tr = await teardown_job(m, store, ssh, grace=grace, hs=pool.handles(m.nodes))
            except ClusterctlError as e:
                report.failed.append({"job_id": m.job_id, "error": e.message})
                continue
            (report.reaped if tr.ok else report.failed).append(tr.to_json())
        finally:
            lock.release()
