"""The foreground of a launch: the launcher lease, the stop signals, and supervision until a stop or a rank
failure, then a verified teardown.

``run_foreground`` is what ``clusterctl launch`` (and a replan's relaunch) runs: start the job, say it is ready,
and in the foreground stay until Ctrl-C / SIGTERM / SIGHUP or a rank's exit. Ctrl-C while the ranks load
cancels the launch, which tears down what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from dataclasses import dataclass, field
from types import SimpleNamespace

from clusterctl.errors import ClusterctlError, Exit
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.statedir.manifest import LaunchManifest, ManifestStore
from clusterctl.protocol.runtimefiles import Lease, encode_lease
from clusterctl.connect.nodes import NodeHandle, close_all
from clusterctl.launch.teardown import TeardownReport, reports_dir, teardown_job
from clusterctl.connect.transport import StartedProcess
from clusterctl.locks import Lock
from clusterctl.launch.ranklogs import keep_logs, last_lines


@dataclass
class Running:
    """A launched job: the manifest, the node handles, and (in the foreground) each rank's keeper process."""

    manifest: LaunchManifest
    store: ManifestStore
    hs: dict[str, NodeHandle]
    procs: dict[int, StartedProcess]
    lock: Lock
    opts: LaunchOptions
    lease_task: asyncio.Task | None = None
    failure: str | None = None
    failed_rank: dict | None = None  # the rank whose exit ended supervision: rank, node, exit_code, detail
    waiters: dict[int, asyncio.Task] = field(default_factory=dict)  # one wait() per foreground rank
    report: TeardownReport | None = None
    logs: object | None = None  # ranklogs.KeptLogs of a job that ended for a rank's exit

    def watch(self, rank: int, p: StartedProcess) -> None:
        self.procs[rank] = p
        self.waiters[rank] = asyncio.ensure_future(p.wait())

    def exited(self, rank: int) -> bool:
        t = self.waiters.get(rank)
        return t is not None and t.done()

    @property
    def endpoint(self) -> str | None:
        return self.manifest.endpoint

    def to_json(self) -> dict:
        """What ``launch --json`` prints once every rank is ready (and its ``ready`` event)."""
        m = self.manifest
        return {"job_id": m.job_id, "deployment_id": m.deployment_id, "endpoint": m.endpoint, "state": m.state,
                "manifest": str(self.store.path(m.job_id)),
                "ranks": [{"rank": r.rank, "node": r.node, "host": r.host, "pid": r.pid, "state": r.state}
                          for r in m.ranks]}

    async def supervise(self, stop: asyncio.Event) -> int:
        """Stay in the foreground until asked to stop or a rank dies; then tear down verified. Returns exit code."""
        waits = {t: r for r, t in self.waiters.items()}
        stopper = asyncio.ensure_future(stop.wait())
        code = 0
        try:
            done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
            exited = [(waits[t], t) for t in done if t in waits]
            if exited:  # several at one look: the one a signal ended is the cause (the others lost it), else rank order
                self._rank_exited(*min(exited, key=lambda e: (not _by_signal(e[1]), e[0])))
                code = int(Exit.FAILED)
        finally:
            stopper.cancel()
        report = await self.teardown(before_clean=self._keep_logs if self.failed_rank else None)
        if not report.ok:
            code = int(Exit.FAILED)
        self.report = report
        return code

    def _rank_exited(self, r: int, t: asyncio.Task) -> None:
        rc = t.result() if not t.exception() else None
        tail = [ln.strip() for ln in last_lines(self.procs[r].stderr_tail, 1)]
        node = self.manifest.ranks[r].node
        self.failure = f"rank {r} on {node} exited with code {rc}" + (f": {tail[-1]}" if tail else "")
        self.failed_rank = {"rank": r, "node": node, "exit_code": rc, "detail": tail[-1] if tail else ""}

    async def _keep_logs(self) -> None:
        """A rank's exit ended the job: every rank's log into ``<state>/reports/<job>/`` (launch/ranklogs.py)."""

        try:
            self.logs = await keep_logs(self, reports_dir(self.store) / self.manifest.job_id)
        except (OSError, ClusterctlError):
            return
        self.logs.failing = self.failed_rank["rank"]

    async def teardown(self, before_clean=None, *, lost_nodes: frozenset[str] = frozenset()) -> TeardownReport:
        """Stop every rank verified (keepers first, then the sweep); ``before_clean`` runs once they are stopped,
        before the job's node files are removed (teardown.teardown_job). ``lost_nodes``: nodes that do not
        answer (the supervisor's heal): their keepers are not waited for, their channel is dead; the sweep
        reports their ranks as unconfirmed."""
        if self.lease_task:
            self.lease_task.cancel()
        for p in self.procs.values():
            await p.close_stdin()  # the keeper TERMs, waits its grace, KILLs
        self.manifest.state = "stopping"
        with contextlib.suppress(ClusterctlError):
            self.store.save(self.manifest)
        waiting = [t for r, t in self.waiters.items() if self.manifest.ranks[r].node not in lost_nodes]
        if waiting:
            # Let the keepers finish their own stop first, so no rank gets a second SIGTERM from the sweep
            # (a second signal means "exit at once" to a rank); the sweep then verifies and catches stragglers.
            await asyncio.wait([asyncio.shield(t) for t in waiting], timeout=self.opts.grace + 5)
        try:
            return await teardown_job(self.manifest, self.store, self.opts.ssh, grace=self.opts.grace, hs=self.hs,
                                      before_clean=before_clean)
        finally:
            for t in waiting:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(t), timeout=self.opts.grace + 5)
            await close_all(self.hs)
            self.lock.release()


# ---- the launcher lease -------------------------------------------------------------------------------------------

async def renew_leases(hs: dict[str, NodeHandle], paths: dict[str, str], duration: float, seq: int) -> None:
    """Write the lease (``seq`` bumped by each renewal) on every node; a node that fails is retried next time."""
    body = encode_lease(Lease(holder=f"{socket.gethostname()}:{os.getpid()}", seq=seq, duration_s=duration))
    await asyncio.gather(*(hs[node].write_file(path, body) for node, path in paths.items()), return_exceptions=True)


async def lease_loop(hs: dict[str, NodeHandle], paths: dict[str, str], duration: float) -> None:
    seq = 0
    while True:
        await asyncio.sleep(duration / 3)
        seq += 1
        await renew_leases(hs, paths, duration, seq)


# ---- stop signals and the foreground run --------------------------------------------------------------------------

def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


def stop_on_signals() -> asyncio.Event:
    """An event Ctrl-C, SIGTERM and SIGHUP set (on the running loop)."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    return stop


async def start_unless_stopped(start, stop: asyncio.Event):
    """Run ``start()`` until it ends or ``stop`` is set, whichever comes first. A stop first cancels it (what it
    started, it stops) and returns None once it has ended so; else its task, done (``.result()`` raises what it
    raised). ``stop`` is cleared either way, for what runs after."""
    starting = asyncio.ensure_future(start())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not starting.done():
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            return None
    stop.clear()
    return starting


async def run_foreground(o, start, detach: bool, *, ready_extra: dict | None = None) -> int:
    """Start a launch (``start()`` -> Running), print it ready through the output ``o``, and in the foreground
    supervise it until a stop or a rank failure. Returns the exit code."""
    stop = stop_on_signals()
    starting = await start_unless_stopped(start, stop)
    if starting is None:
        o.error("launch interrupted; everything it started was stopped")
        return 130
    try:
        running = starting.result()
    except ClusterctlError as e:
        _say_rank_log(o, e)
        raise
    doc = running.to_json()
    _say_ready(o, running, doc, detach, ready_extra)
    if detach:
        return 0
    code = await running.supervise(stop)
    _say_stopped(o, running, doc, code)
    return code


def _say_rank_log(o, e) -> None:
    """Before a failed launch's error line: the failing rank's last lines (printable, see launch/ranklogs.py)
    and where every rank's log was kept. --json carries them in the error document instead."""
    logs = getattr(e, "logs", None)
    f = logs.of(logs.failing) if logs is not None else None
    if f is None or not f.tail or o.json or o.quiet:
        return
    o.info(f"rank {f.rank} on {f.node}, last {len(f.tail)} line(s) of its log ({f.file}):")
    for line in f.tail:
        o.info(f"  {line}")


def _say_ready(o, running: Running, doc: dict, detach: bool, ready_extra: dict | None) -> None:
    if o.json and detach:
        o.data({**(ready_extra or {}), **doc} if ready_extra else doc)
    elif o.json:
        if ready_extra:
            o.event("replanned", ready_extra)
        o.event("ready", doc)  # then one line per later event: docs/cli.md, "launch --json"
    elif not o.quiet:
        o.line(running.endpoint)
        o.info(f"job {doc['job_id']}: {len(doc['ranks'])} rank(s) ready at {running.endpoint}"
               + ("" if detach else " (Ctrl-C to stop)"))


def _say_stopped(o, running: Running, doc: dict, code: int) -> None:
    if running.failure:
        logs = running.logs
        if logs is not None:
            _say_rank_log(o, SimpleNamespace(logs=logs))
        o.error(running.failure + (f"; rank logs kept in {logs.folder}" if logs is not None else ""))
        if o.json:
            o.event("rank_failed", {"job_id": doc["job_id"], **running.failed_rank,
                                    **({"logs": logs.to_json()} if logs is not None else {})})
    report = running.report
    if o.json:
        o.event("teardown", {**report.to_json(), "reason": "rank_failed" if running.failure else "stopped",
                             "exit_code": code})
    if not report.ok:
        o.error("teardown could not confirm: " + "; ".join(report.survivors()))
    else:
        o.info(f"job {doc['job_id']}: stopped, every rank confirmed gone")


def _by_signal(t: asyncio.Task) -> bool:
    """A rank's wait ended with the exit status of a signal (negative, or 128 + the signal as a shell reports it)."""
    rc = t.result() if not t.cancelled() and t.exception() is None else None
    return rc is not None and (rc < 0 or rc > 128)
