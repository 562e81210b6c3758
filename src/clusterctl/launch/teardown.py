"""Verified teardown of a job: ``clusterctl teardown``, a foreground launch's end, a failed launch, the reaper.

On every node, concurrently, one ``sweep`` node op stops that node's ranks (node/procs.py: TERM with CONT to each
process group, the grace, KILL, verify, re-KILL with backoff) and whatever the job's runtime markers recorded,
every process checked by pid, start time and the job's nonce before any signal. Only when every rank is confirmed
gone are the node files removed (``clean``), the report saved under ``<state>/reports/`` and the launch manifest
removed; otherwise the survivors are named (rank, host, pid) and the manifest stays for a retry. The command
first asks a live foreground coordinator to stop, holds the deployment's lock, and leaves a busy deployment alone
unless forced.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.errors import Busy, ClusterctlError, HostUnreachable, IntegrityError, MissingInput
from clusterctl.statedir.manifest import LaunchManifest, ManifestStore, coordinator_alive, job_ref, manifest_store
from clusterctl.statedir.state import StateDir
from clusterctl.connect.nodes import Connector, NodeHandle, close_all, handles
from clusterctl.atomic import atomic_write_json, read_json
from clusterctl.launch.quiescence import refuse_activity
from clusterctl.launch.supervisors import hold_supervisors, release
from clusterctl.locks import Lock
from clusterctl.node.procs import signal_process, status_of
from clusterctl.protocol.nodeops import CleanRequest, SweepRequest

DEFAULT_GRACE = 10.0


@dataclass
class RankOutcome:
    rank: int
    node: str
    host: str
    pid: int | None
    status: str  # gone | survived | permission-denied | unreachable | not-started
    detail: str = ""

    @property
    def confirmed(self) -> bool:
        return self.status in ("gone", "not-started")

    def to_json(self) -> dict:
        return {"rank": self.rank, "node": self.node, "host": self.host, "pid": self.pid, "status": self.status,
                "detail": self.detail}


@dataclass
class TeardownReport:
    job_id: str
    deployment_id: str
    ranks: list[RankOutcome] = field(default_factory=list)
    extra: list[dict] = field(default_factory=list)  # other processes of the job found by the sweep
    manifest_removed: bool = False

    @property
    def ok(self) -> bool:
        return all(r.confirmed for r in self.ranks) and all(e["status"] == "gone" for e in self.extra)

    def survivors(self) -> list[str]:
        out = [f"rank {r.rank} on {r.node} ({r.host}) pid {r.pid}: {r.status}{': ' + r.detail if r.detail else ''}"
               for r in self.ranks if not r.confirmed]
        out += [f"pid {e['pid']} on {e['node']}: {e['status']}" for e in self.extra if e["status"] != "gone"]
        return out

    def to_json(self) -> dict:
        return {"job_id": self.job_id, "deployment_id": self.deployment_id, "ok": self.ok,
                "survivors": self.survivors(),
                "manifest_removed": self.manifest_removed, "ranks": [r.to_json() for r in self.ranks],
                "extra": self.extra}




def reports_dir(store: ManifestStore) -> Path:
    return StateDir(store.folder.parent).reports


def save_report(store: ManifestStore, report: TeardownReport) -> None:
    try:
        atomic_write_json(reports_dir(store) / f"{report.job_id}.json", report.to_json(), mode=0o600)
    except Exception:
        pass  # the report is a courtesy; the verified teardown already happened


def load_report(store: ManifestStore, m: LaunchManifest) -> TeardownReport | None:
    try:
        doc = read_json(reports_dir(store) / f"{m.job_id}.json", limit=1 << 20, what="teardown report")
        r = TeardownReport(job_id=m.job_id, deployment_id=m.deployment_id, manifest_removed=True,
                           extra=list(doc.get("extra") or []))
        r.ranks = [RankOutcome(int(x["rank"]), str(x["node"]), str(x["host"]), x.get("pid"), str(x["status"]),
                               str(x.get("detail", ""))) for x in doc.get("ranks") or []]
        return r
    except Exception:
        return None


async def stop_job(m: LaunchManifest, hs: dict[str, NodeHandle], *, grace: float) -> TeardownReport:
    report = TeardownReport(job_id=m.job_id, deployment_id=m.deployment_id)
    by_node: dict[str, list] = {}
    for r in m.ranks:
        by_node.setdefault(r.node, []).append(r)

    async def one(node: str, recs: list) -> None:
        h = hs[node]
        extra = [r.identity(m.nonce) for r in recs if r.pid]
        try:
            # only this node's ranks: nodes that are one machine share the runtime dir (one TERM per rank)
            ans = await h.ask(SweepRequest(runtime_dir=recs[0].runtime_dir, job_id=m.job_id, nonce=m.nonce,
                                           grace=grace, extra=extra, ranks=[r.rank for r in recs]),
                              timeout=grace + 60)
        except ClusterctlError as e:
            for r in recs:
                report.ranks.append(RankOutcome(r.rank, r.node, r.host, r.pid,
                                                "unreachable" if r.pid or isinstance(e, HostUnreachable) else "unreachable",
                                                e.message))
            return
        by_pid = {x.pid: x for x in ans.results}
        for r in recs:
            if r.pid is None and r.state == "pending":
                # never reported a pid: the sweep still stopped anything its marker recorded
                report.ranks.append(RankOutcome(r.rank, r.node, r.host, None, "not-started"))
                continue
            x = by_pid.pop(r.pid, None)
            if x is None or x.status in ("gone", "not-ours"):
                report.ranks.append(RankOutcome(r.rank, r.node, r.host, r.pid, "gone",
                                                x.detail if x and x.status == "not-ours" else ""))
            else:
                report.ranks.append(RankOutcome(r.rank, r.node, r.host, r.pid, x.status, x.detail))
        for pid, x in by_pid.items():
            st = "gone" if x.status in ("gone", "not-ours") else x.status
            report.extra.append({"node": node, "pid": pid, "status": st, "detail": x.detail})

    await asyncio.gather(*(one(n, recs) for n, recs in by_node.items()))
    report.ranks.sort(key=lambda r: r.rank)
    return report


async def clean_job(m: LaunchManifest, hs: dict[str, NodeHandle]) -> None:
    dirs = {(r.node, r.runtime_dir) for r in m.ranks}
    await asyncio.gather(*(hs[n].ask(CleanRequest(runtime_dir=d, job_id=m.job_id)) for n, d in dirs),
                         return_exceptions=True)


async def teardown_job(m: LaunchManifest, store: ManifestStore, ssh: Connector, *,
                       grace: float = DEFAULT_GRACE, hs: dict[str, NodeHandle] | None = None,
                       before_clean=None) -> TeardownReport:
    """Stop every rank verified; only then remove the node files and the manifest. ``before_clean``: awaited
    once the ranks are stopped, before their files go (a failed launch keeps their logs there)."""
    own = hs is None
    hs = hs or handles(m.nodes, ssh)
    try:
        report = await stop_job(m, hs, grace=grace)
        if before_clean is not None:
            await before_clean()
        if report.ok:
            await clean_job(m, hs)
            report.manifest_removed = True
            save_report(store, report)  # before the manifest goes: whoever asked can still read the outcome
            store.remove(m.job_id)
        return report
    finally:
        if own:
            await close_all(hs)


BUSY_HINT = "wait for the requests to finish (--drain SECONDS), cancel them, or stop anyway with --force"
MALFORMED_HINT = "inspect the file; stop its ranks by hand if they run, then remove it"


def malformed_line(bad) -> str:
    return "malformed launch manifest(s), kept and not acted on: " + "; ".join(f"{p}: {why}" for p, why in bad)


async def teardown_command(state: StateDir, ref: str | None, ssh: Connector, *, grace: float = DEFAULT_GRACE,
                           force: bool = False, drain: float = 0.0, log=lambda msg: None,
                           malformed: list | None = None, supervisors: bool = False) -> list[TeardownReport]:
    """Tear down the jobs of a deployment (or one job). A live foreground coordinator is asked to stop first
    (SIGTERM, identity-checked), then everything is verified here under the deployment's lock. Manifests that
    cannot be trusted are never acted on: they go to ``malformed`` (manifest, error) while the sound jobs are
    stopped; when there is no sound job, that is an IntegrityError (65).

    A job whose ranks report requests in flight (quiescence ``busy``) is not touched unless ``force``;
    ``drain`` seconds let it go idle first. Unknown activity (a rank unreachable or stale) does not block a
    teardown: stopping broken deployments is what teardown is for.

    ``supervisors`` (``clusterctl teardown``): the cluster's supervisor is stopped first and held off until the
    teardown is done (launch/supervisors.py), and what it last ran is torn down too (a heal's new job)."""

    malformed = malformed if malformed is not None else []
    store = manifest_store(state)
    ref = job_ref(state, ref) if ref is not None else None
    good, bad = _select(state, store, ref)
    hs_of: dict = {}  # one session per node for the checks and the stop
    try:
        if not force and good:  # before the supervisor is stopped: a refused teardown leaves it supervising
            hs_of = {m.job_id: handles(m.nodes, ssh) for _, m in good}
            await refuse_activity([m for _, m in good], ssh, refuse=("busy",), hints={"busy": BUSY_HINT},
                                  drain=drain, log=log, hs_of=hs_of)
        # a supervisor of the cluster would heal or rejoin what this tears down: stopped first, held off until done
        held = await hold_supervisors(state, ref, log=log) if supervisors else []
        try:
            good, bad = _select(state, store, ref, set().union(*(h.targets for h in held)))
            if ref is not None and not good and not bad:
                if held:
                    log(f"supervision of cluster {', '.join(h.cluster for h in held)} stopped; nothing of it was "
                        "running")
                    return []
                raise MissingInput(f"no launch of {ref!r} in {state.launches}")
            if bad and not good:
                # never act on a manifest we cannot trust, and never pretend there was nothing to do
                raise IntegrityError(malformed_line(bad), hint=MALFORMED_HINT)
            # the jobs whose manifests are sound are stopped all the same; the caller reports the others (exit 1)
            malformed[:] = [{"manifest": str(p), "error": why} for p, why in bad]
            jobs = [m for _, m in good]
            hs_of.update({m.job_id: handles(m.nodes, ssh) for m in jobs if m.job_id not in hs_of})
            return await _teardown_jobs(state, store, jobs, ssh, hs_of, grace=grace, log=log)
        finally:
            release(state, held)
    finally:
        await asyncio.gather(*(close_all(hs) for hs in hs_of.values()))


def _select(state: StateDir, store, ref: str | None, also: set[str] = frozenset()) -> tuple[list, list]:
    """The sound and the malformed manifests of ``ref`` (every one when None) or of what ``also`` names."""
    good, bad = store.all() if state.launches.is_dir() else ([], [])
    if ref is None:
        return good, bad
    names = {ref} | set(also)
    return ([(p, m) for p, m in good if names & {m.job_id, m.deployment_id}],
            [(p, why) for p, why in bad if any(p.stem == n or p.stem.startswith(n + "-") for n in names)])


async def _teardown_jobs(state: StateDir, store, jobs, ssh: Connector, hs_of: dict, *, grace: float, log) -> list:
    import os
    import signal as _signal
    import time

    reports = []
    for m in jobs:
        c = m.coordinator
        if not c.detached and c.pid != os.getpid() and coordinator_alive(c):
            ident = c.identity()
            log(f"asking coordinator pid {c.pid} of job {m.job_id} to stop")
            signal_process(ident, _signal.SIGTERM)
            deadline = time.monotonic() + grace + 60
            while time.monotonic() < deadline and status_of(ident) == "alive":
                await asyncio.sleep(0.1)  # never time.sleep here: the node sessions' keepalives run on this loop
        lock = Lock(state.deployment_lock(m.deployment_id))
        try:
            lock.acquire(blocking=False, what=f"deployment {m.deployment_id}")
        except Busy:
            raise Busy(f"deployment {m.deployment_id} is busy (its coordinator is still stopping or a reap is running)",
                       hint="try again in a moment") from None
        try:
            if not store.path(m.job_id).exists():
                # the coordinator tore it down itself: report what it verified
                reports.append(load_report(store, m) or TeardownReport(
                    job_id=m.job_id, deployment_id=m.deployment_id, manifest_removed=True))
                continue
            store.key = state.keyring.signing_key()
            reports.append(await teardown_job(m, store, ssh, grace=grace, hs=hs_of[m.job_id]))
        finally:
            lock.release()
    return reports
