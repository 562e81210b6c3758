"""The supervisor: keep a deployment serving through the loss of a rank or a node (docs/heal.md).

Every ``POLL_S`` it looks at the job's ranks as ``status`` does (each rank's marker and its process,
identity-checked, on its node; a foreground rank's keeper) with a short timeout per node. A rank that is not up
(dead, stale, failed, stopping, its node unreachable) for the policy's grace is a loss (supervise/policy.py decides;
this module only acts):

  heal     every rank torn down verified (launch/teardown.py), the nodes to blame left out, the nodes that
           answer a probe replanned with ``replan``'s own rules (launch/replan.py: propose, write_new, record:
           a history entry of kind ``heal``, so ``replan --to`` goes back), and relaunched on the same HTTP port.
           A plan that does not fit, or nothing that answers: ``degraded`` with the reason.
  rejoin   the lost nodes are probed; once every one has answered well for the policy's time, at a moment with
           no request in flight (or after the drain deadline), back to the original deployment (kind
           ``rejoin``).

The state goes to ``<state>/heal/<cluster>.json`` (launch/healfile.py) at every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass

from clusterctl.errors import Busy, ClusterctlError, MissingInput
from clusterctl.statedir import healfile
from clusterctl.supervise.policy import Book, HealNodes, HealPolicy, culprits, heal_nodes, state_doc
from clusterctl.supervise.watch import LOOK_TIMEOUT, look_at, probe_nodes, rank_record
from clusterctl.statedir.manifest import manifest_store, now_iso, this_coordinator
from clusterctl.connect.nodes import close_all, handles
from clusterctl.launch.quiescence import STALE_AFTER, judge
from clusterctl.launch.replan import PlanChange, changes_of, deployment_ref, lock_for, propose, record, write_new
from clusterctl.launch.reaper import live_jobs
from clusterctl.launch.start import launch
from clusterctl.launch.teardown import teardown_command
from clusterctl.statedir.state import StateDir

POLL_S = 1.0
PROBE_EVERY_S = 2.0
UNREACHABLE_CONNECT = 1.0  # the teardown's connection to a node that stopped answering
SAVE_EVERY_S = 5.0


@dataclass
class Job:
    """The supervised job: its manifest and, launched here in the foreground, its Running (keepers, lease)."""

    manifest: object
    running: object | None = None


class Supervisor:
    def __init__(self, state: StateDir, ref: str, opts, policy: HealPolicy, *, log=lambda msg: None, detach: bool = False,
                 event=lambda doc: None, clock=time.monotonic):
        _, loaded = state.load_deployment(ref)
        dep = loaded.deployment
        self.state, self.ref, self.opts, self.log, self.event, self.clock = state, ref, opts, log, event, clock
        self.detach = detach  # relaunches: detached (``supervise``) or in the foreground (``launch --heal``)
        self.cluster, self.original, self.current = dep.cluster, dep.deployment_id, dep.deployment_id
        self.node_order = [r.node for r in dep.ranks]
        self.book = Book(policy, phase_since=clock())
        self.since_iso = now_iso()
        self.job: Job | None = None
        self.hs: dict = {}  # sessions for looking at the job, opened per job
        self.pending: HealNodes | None = None  # whom the next heal asks and leaves out (said, then planned)
        self.leftovers: list[str] = []  # jobs whose teardown could not be verified: retried
        self.idle = False
        self.unreachable: dict[str, bool] = {}  # node -> its last look got no answer
        self.last_probe = float("-inf")
        self.held = False  # the reason already says the budget holds the heal back
        self.unfinished: dict | None = None  # the state file of a predecessor that died healing
        self._saved: tuple[dict, float] | None = None
        self.me = this_coordinator().model_dump(mode="json")  # who writes the state file (its pid, start time)
        self._resume()

    def _resume(self) -> None:
        """A supervisor restarted (systemd) after a heal: the original deployment and the lost nodes from the
        state file it left, when it names the deployment that is current now; the HTTP host and port the
        cluster serves on (every relaunch binds them, whoever supervises); and a heal it did not finish (it
        died ``healing``): the nodes it was leaving out, so this one finishes the heal (``take_over``)."""
        doc = healfile.read(healfile.path_of(self.state, self.cluster))
        if not doc or doc.get("cluster") != self.cluster:
            return
        port, host = doc.get("http_port"), doc.get("http_host")
        if self.opts.http_port is None and isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            self.opts = self.opts.model_copy(update={"http_port": port})
        if not self.opts.http_host and isinstance(host, str) and host:
            self.opts = self.opts.model_copy(update={"http_host": host})
        if doc.get("deployment") != self.current or not isinstance(doc.get("original"), str):
            return
        with contextlib.suppress(ClusterctlError):
            _, loaded = self.state.load_deployment(doc["original"])
            self.original = doc["original"]
            self.node_order = [r.node for r in loaded.deployment.ranks]
            self.book.lost = [n for n in doc.get("lost_nodes") or [] if n in self.node_order]
            self.book.heals = int(doc.get("heals") or 0)
            out = doc.get("leaving_out")
            if doc.get("state") == "healing" and isinstance(out, list):
                self.pending = heal_nodes(self.node_order, self.book.lost, out)
                self.unfinished = doc

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
            await self._close_looks()

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
            lost = await self.look(now)
            if lost:
                await self.lose(*lost)
                return
        elif self.pending is not None:
            await self.heal(now)
            return
        if not self.book.lost:
            return
        if now - self.last_probe >= PROBE_EVERY_S:
            self.last_probe = now
            await self.probe_lost(now)
        if self.book.rejoin_now(self.clock(), idle=self.job is None or self.idle):  # idle: as of this look
            await self.rejoin()

    # ---- phase and state file -------------------------------------------------------------------------------
    def phase(self, name: str, reason: str | None = None) -> None:
        self.held = False  # a new word: the budget's hold is said again when it still holds
        before = self.book.phase
        if self.book.set_phase(self.clock(), name, reason):
            if name != before:
                self.since_iso = now_iso()
            self.log(f"heal: {name}" + (f": {reason}" if reason else ""))
            self.save(force=True)
            self.event(self.doc())

    def doc(self) -> dict:
        return {**state_doc(self.book, self.clock(), since_iso=self.since_iso, deployment=self.current,
                            job=self.job.manifest.job_id if self.job else None, cluster=self.cluster,
                            original=self.original),
                # where the cluster serves, and the nodes a heal under way leaves out: a successor (this one
                # killed) relaunches on the same host and port and finishes the heal
                "http_host": self.opts.http_host or None, "http_port": self.opts.http_port,
                "leaving_out": list(self.pending.leave_out) if self.pending is not None else None,
                "supervisor": self.me, "updated_at": now_iso()}

    def save(self, force: bool = False) -> None:
        doc, now = self.doc(), self.clock()
        key = {k: v for k, v in doc.items() if k not in ("updated_at", "degraded_seconds")}
        if not force and self._saved and self._saved[0] == key and now - self._saved[1] < SAVE_EVERY_S:
            return
        try:
            healfile.write(self.state, self.cluster, doc)
        except (ClusterctlError, OSError) as e:
            self.log(f"warning: heal state not written: {e}")
            return
        self._saved = (key, now)

    # ---- looking at the job ---------------------------------------------------------------------------------
    async def look(self, now: float) -> tuple[list[str], str] | None:
        """One look at every rank; the nodes to blame and why, once something has been down for the grace."""

        m = self.job.manifest
        markers, procs = await self._markers_and_procs(m)
        ranks = [rank_record(r, markers.get(r.rank), procs.get(r.rank), self.job.running) for r in m.ranks]
        self.idle = judge(m, markers).state == "idle"
        down = [x for x in ranks if x["state"] != "up"]
        # down since the look began (a node that let it time out has not answered since then), or since its
        # last heartbeat (a frozen rank: its age on its node's clock), judged now
        silent = {x["node"]: now - x["silent_s"] for x in down if x.get("silent_s")}
        self.book.seen_down(now, {x["node"] for x in down}, since=silent)
        now = self.clock()
        if not self.book.due(now):
            return None
        first = min(self.book.down_since.values())
        blame = culprits(ranks, insist=now - first >= self.book.policy.grace_s + STALE_AFTER)
        if not blame:
            return None  # only ranks that followed a lost peer so far: the one that left shows itself soon
        return blame, "; ".join(f"rank {x['rank']} on {x['node']} {x['state']}" for x in down)

    async def _markers_and_procs(self, m) -> tuple[dict, dict]:
        if not self.hs:
            self.hs = handles(m.nodes, self.opts.ssh)
        return await look_at(m, self.hs, self.unreachable)

    async def _close_looks(self) -> None:
        hs, self.hs = self.hs, {}
        with contextlib.suppress(Exception):
            await asyncio.wait_for(close_all(hs), LOOK_TIMEOUT)

    # ---- probing nodes --------------------------------------------------------------------------------------
    async def probe(self, names: list[str]) -> dict[str, bool]:
        """Each node: does it answer a probe (on a session of its own) with its runtime dir usable and the
        model folder of the original deployment there?"""

        _, loaded = self.state.load_deployment(self.original)
        return await probe_nodes(loaded.deployment, names, self._ssh())

    async def probe_lost(self, now: float) -> None:
        for n, ok in (await self.probe(list(self.book.lost))).items():
            self.book.probed(now, n, ok)

    # ---- acting ---------------------------------------------------------------------------------------------
    async def lose(self, blame: list[str], why: str) -> None:
        """The job lost a rank or a node: stop every rank verified; the next step heals without ``blame``, as
        said and recorded first (one value: a successor finishes the heal if this one dies in the teardown)."""
        plan = self.pending = heal_nodes(self.node_order, self.book.lost, blame)
        self.phase("healing", f"{why}; {plan.words()}")
        await self.stop_job(unreachable=frozenset(n for n in blame if self.unreachable.get(n)))

    def _ssh(self, within: float = LOOK_TIMEOUT):
        """SSH options for a node that may not answer: connect within ``within`` seconds."""
        return dataclasses.replace(self.opts.ssh, connect_timeout=min(self.opts.ssh.connect_timeout, within))

    async def stop_job(self, unreachable: frozenset[str] = frozenset()) -> bool:
        """Every rank of the job stopped verified; False (the job noted, retried later) when not confirmed.
        ``unreachable``: nodes whose sessions stopped answering: the teardown asks them over new ones, which
        give up within LOOK_TIMEOUT, instead of waiting on a dead connection."""
        job, self.job = self.job, None
        await self._close_looks()
        if job is None:
            return True
        m = job.manifest
        try:
            if job.running is not None:
                self._fresh_handles(job.running, unreachable)
                report = await job.running.teardown(lost_nodes=unreachable)
            else:
                [report] = await teardown_command(self.state, m.job_id, self._ssh(), grace=self.opts.grace,
                                                  force=True, log=self.log)
        except ClusterctlError as e:
            self.log(f"heal: teardown of job {m.job_id}: {e.message}")
            self.leftovers.append(m.job_id)
            return False
        if not report.ok:  # ranks on a node that does not answer: that node is left out; retried later
            self.log(f"heal: teardown of job {m.job_id} could not confirm: {'; '.join(report.survivors())}")
            self.leftovers.append(m.job_id)
        return report.ok

    def _fresh_handles(self, running, nodes: frozenset[str]) -> None:
        if not nodes:
            return
        old = {n: running.hs[n] for n in nodes if n in running.hs}
        # it has just not answered for the grace: one more second to connect, then its ranks are "unreachable"
        # (the job's manifest is kept, its teardown retried once the node answers again)
        running.hs.update(handles([n for n in running.manifest.nodes if n.name in old], self._ssh(UNREACHABLE_CONNECT)))
        asyncio.ensure_future(_quietly(close_all(old)))  # a dead connection: not awaited

    async def retry_leftovers(self) -> None:
        for job_id in list(self.leftovers):
            try:
                reports = await teardown_command(self.state, job_id, self.opts.ssh, grace=self.opts.grace,
                                                 force=True, log=self.log)
            except MissingInput:  # no manifest left: nothing of it to stop
                reports = []
            except ClusterctlError:
                continue
            if all(r.ok for r in reports):
                self.leftovers.remove(job_id)

    async def heal(self, now: float) -> None:
        """Replan on the nodes that answer (the blamed ones left out) and relaunch, when the budget allows. A
        loss that blames every node of the job found no culprit: every one is asked, those that answer serve
        again (the same plan when all do: a relaunch, no plan change, nothing spent from the budget)."""

        plan = self.pending
        if not plan.ask:  # every node is lost: nothing to heal onto; the rejoin probes bring them back
            self.pending = None
            self.phase("degraded", f"every node is lost ({', '.join(self.book.lost)}), probed for the rejoin")
            return
        asked, no_culprit = list(plan.ask), plan.no_culprit
        if not no_culprit and self._held(now):
            return
        # a node that answered the last look of the lost job just now needs no probe of its own (one SSH
        # connection and one Python start-up less before the relaunch); the others are asked
        fresh = {n for n in asked if self.unreachable.get(n) is False}
        self.unreachable = {}
        answers = await self.probe([n for n in asked if n not in fresh]) if set(asked) - fresh else {}
        nodes = [n for n in asked if n in fresh or answers.get(n)]
        leave_out = [n for n in asked if n not in nodes] if no_culprit else list(plan.leave_out)
        if no_culprit and leave_out and self._held(self.clock()):
            return
        self.book.healed(now, leave_out, plan_change=bool(leave_out))
        lost = ", ".join(self.book.lost) or "none"
        if not nodes:
            self.pending = self._retry()  # tried again after the backoff
            self.phase("degraded", f"no node answers a probe ({', '.join(asked)}; lost: {lost})")
            return
        try:
            p = await asyncio.to_thread(propose, self.state, self.ref, PlanChange(nodes=nodes))
        except ClusterctlError as e:
            self.pending = None  # nothing to do until a lost node is back: the rejoin probes it
            self.phase("degraded", f"the model does not fit on {', '.join(nodes)} ({lost} lost): {e.message}")
            return
        if await self.apply(p, "heal"):
            self.pending = None
            self.phase("serving", f"on {', '.join(nodes)}; {lost} lost, probed for the rejoin" if self.book.lost
                       else f"on {', '.join(nodes)}; relaunched (no node to blame)")
        else:
            self.pending = self._retry()
            if not leave_out:  # a relaunch that failed: the next one waits for the backoff like any other
                self.book.changes.append(now)

    def _retry(self) -> HealNodes:
        """A heal tried again (after the backoff): every node of the job not lost is asked."""
        return heal_nodes(self.node_order, self.book.lost)

    def _held(self, now: float) -> bool:
        """The budget holds a plan change back: ``degraded``, said once (a countdown would rewrite the state
        file), what went wrong staying in front (a failed launch, the loss)."""
        wait = self.book.wait(now)
        if wait <= 0:
            return False
        if not self.held:
            said = self.book.reason or "not serving"
            self.phase("degraded", f"{said}; no heal for {wait:.0f} s: {self.book.why_waiting(now)}")
            self.held = True
        return True

    async def rejoin(self) -> None:
        """Every lost node answered well for long enough: back to the original deployment."""

        lost = list(self.book.lost)
        self.phase("healing", f"rejoin: {', '.join(lost)} healthy again; back to {self.original}")
        try:
            p = await asyncio.to_thread(propose, self.state, self.ref, PlanChange(to=self.original))
        except ClusterctlError as e:
            self.phase("degraded", f"rejoin to {self.original} refused: {e.message}")
            return
        await self.stop_job()
        await self.retry_leftovers()
        self.book.rejoined(self.clock())
        if await self.apply(p, "rejoin"):
            self.phase("serving")
            return
        self.book.lost = lost  # back on the survivors at the next step (after the backoff)
        self.pending = self._retry()

    async def apply(self, p, kind: str) -> bool:
        """Swap in the new deployment (unless it is the current one), record it in the history as ``kind``,
        launch it. False (and ``degraded`` with the reason) when that fails."""

        try:
            lock = lock_for(self.state, p)
        except Busy as e:
            self.phase("degraded", f"{kind} waits: {e.message}")
            return False
        try:
            unchanged = p.diff.nothing_to_do
            if not unchanged:
                await asyncio.to_thread(lambda: write_new(self.state, p).commit())
            ref = deployment_ref(p)
            self.ref, self.current = ref, p.new.deployment_id
            self.save(force=True)  # the state file names what now is current (a successor resumes from it)
            job = None
            try:
                job = self.job = await self.launch(ref)
            except ClusterctlError as e:
                self.phase("degraded", f"{kind} to {p.new.deployment_id} did not launch: {e.message}")
                return False
            finally:  # the file names the new deployment now, so does the history: also when a stop cut the launch
                if not unchanged:  # short (teardown, SIGTERM), after which ``launch FILE`` starts that deployment
                    record(self.state, p, changes=changes_of(p), relaunched=job and job.manifest.job_id, kind=kind)
            return True
        finally:
            lock.release()

    async def launch(self, ref: str) -> Job:
        opts = self.opts.model_copy(update={"detach": self.detach})
        running = await launch(ref, self.state, opts, log=self.log)
        if self.opts.http_port is None and running.manifest.http_port:  # every relaunch binds the same port
            self.opts = self.opts.model_copy(update={"http_port": running.manifest.http_port})
        return Job(running.manifest, None if self.detach else running)

    async def take_over(self) -> None:
        """``supervise``: the deployment's running job, or a new detached launch when none runs."""

        store = manifest_store(self.state)
        jobs = await live_jobs(store, self.opts.ssh, self.current) if self.state.launches.is_dir() else []
        for m in jobs:
            if not m.coordinator.detached:
                raise Busy(f"job {m.job_id} is supervised by its own coordinator (pid {m.coordinator.pid})",
                           hint="stop it, launch it with --detach, then supervise it")
        if self.unfinished is not None:
            await self._finish_heal(jobs)
            return
        if not self.opts.http_host:  # "": the running job's host (else the default), as replan keeps it
            host = (jobs[0].endpoint or "").split("://", 1)[-1].rpartition(":")[0].strip("[]") if jobs else ""
            self.opts = self.opts.model_copy(update={"http_host": host or "127.0.0.1"})
        if jobs:
            self.job = Job(jobs[0])
            if self.opts.http_port is None:
                self.opts = self.opts.model_copy(update={"http_port": jobs[0].http_port})
            self.log(f"supervising job {jobs[0].job_id} of deployment {self.current}")
            return
        self.log(f"deployment {self.current} is not running: launching it")
        try:
            self.job = await self.launch(self.ref)
        except ClusterctlError as e:  # e.g. restarted while a node is away: heal onto the nodes that answer
            self.phase("degraded", f"deployment {self.current} did not launch: {e.message}")
            self.pending = self._retry()

    async def _finish_heal(self, jobs: list) -> None:
        """Its predecessor died healing (SIGKILL, a crash): what is left of the lost job, or of a relaunch cut
        short, is torn down verified; the next step heals without the nodes it was leaving out, on the
        cluster's recorded host and port."""
        doc, self.unfinished = self.unfinished, None
        pid = (doc.get("supervisor") or {}).get("pid", "?")
        self.phase("healing", f"{doc.get('reason') or 'a heal'}; finishing it (supervisor pid {pid} died during it)")
        if isinstance(doc.get("job"), str) and doc["job"] not in {m.job_id for m in jobs}:
            self.leftovers.append(doc["job"])  # its ranks may all be gone: its manifest still is to be cleared
        for m in jobs:
            self.job = Job(m)
            await self.stop_job()
        await self.retry_leftovers()


async def _quietly(aw) -> None:
    """Close what may hang (a dead connection) in the background, within LOOK_TIMEOUT, never an error."""
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(aw, LOOK_TIMEOUT)
