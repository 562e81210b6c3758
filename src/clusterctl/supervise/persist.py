"""What the supervisor knows, and the one file it is (docs/heal.md, "The state file"). ``Supervision`` holds the
deployment it supervises and the one it heals back to, the job, the book (supervise/policy.py), the heal under
way and where the cluster serves (``Address``); ``snapshot`` is all of it as the heal file says it
(statedir/healfile.py's SupervisorState), written at every change of phase and every SAVE_EVERY_S while only the
time degraded moves; a successor resumes from the file its predecessor left. The verbs act on a Supervision:
supervise/watch.py looks, heal.py heals, rejoin.py goes back, loop.py runs them."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

from clusterctl.connect.nodes import Connector
from clusterctl.errors import ClusterctlError
from clusterctl.launch.foreground import Running
from clusterctl.launch.jobplan import LaunchOptions
from clusterctl.statedir import healfile
from clusterctl.statedir.healfile import SupervisorState
from clusterctl.statedir.manifest import LaunchManifest, now_iso, this_coordinator
from clusterctl.statedir.state import StateDir
from clusterctl.supervise.policy import Book, HealNodes, HealPolicy, heal_nodes
from clusterctl.supervise.watch import LOOK_TIMEOUT, Watch, probe_nodes

SAVE_EVERY_S = 5.0


@dataclass
class Job:
    """The supervised job: its manifest and, launched here in the foreground, its Running (keepers, lease)."""

    manifest: LaunchManifest
    running: Running | None = None


@dataclass(frozen=True)
class Address:
    """Where the cluster serves: rank 0's HTTP host and port, which every relaunch binds, whoever supervises (the
    same URL across heals). Resolved once, as the supervision starts (``resolve``); a port nobody named is the
    first launch's (``pinned``)."""

    host: str
    port: int | None

    @classmethod
    def resolve(cls, opts: LaunchOptions, recorded: SupervisorState | None, running: LaunchManifest | None) -> Address:
        """Each of host and port from the flags (``opts``; host "": not given), else from the state file a
        predecessor left (``recorded``), else from the running job's (``running``); no host at all: loopback."""
        running_host = (running.endpoint or "").split("://", 1)[-1].rpartition(":")[0].strip("[]") if running else ""
        host = opts.http_host or (recorded.http_host if recorded else None) or running_host or "127.0.0.1"
        ports = (opts.http_port, recorded.http_port if recorded else None, running.http_port if running else None)
        return cls(host, next((p for p in ports if p is not None), None))

    def pinned(self, m: LaunchManifest) -> Address:
        """After a launch of ``m``: a port nobody named is the one it bound, for every relaunch after it."""
        return self if self.port is not None or not m.http_port else dataclasses.replace(self, port=m.http_port)


class Supervision:
    """One deployment's supervision: what the verbs act on and what its state file says. ``ref`` is what a
    relaunch launches (the operator's deployment file: a heal swaps what it holds); ``current`` the deployment
    that runs, ``original`` the one a rejoin goes back to; ``pending`` whom the next heal asks and leaves out
    (said, recorded, then planned); ``leftovers`` the jobs whose teardown could not be verified (retried)."""

    def __init__(self, state: StateDir, ref: str, opts: LaunchOptions, policy: HealPolicy, *,
                 log=lambda msg: None, detach: bool = False, event=lambda s: None, clock=time.monotonic):
        _, loaded = state.load_deployment(ref)
        dep = loaded.deployment
        self.state, self.ref, self.opts, self.log, self.event, self.clock = state, ref, opts, log, event, clock
        self.detach = detach  # relaunches: detached (``supervise``) or in the foreground (``launch --heal``)
        self.cluster, self.original, self.current = dep.cluster, dep.deployment_id, dep.deployment_id
        self.node_order = [r.node for r in dep.ranks]
        self.book = Book(policy, phase_since=clock())
        self.since_iso = now_iso()
        self.job: Job | None = None
        self.seen = Watch(opts.ssh, clock)
        self.address: Address | None = None  # resolved as the supervision starts (supervise/loop.py)
        self.pending: HealNodes | None = None
        self.leftovers: list[str] = []
        self.held = False  # the reason already says the budget holds the heal back
        self.last_probe = float("-inf")  # when the lost nodes were last probed for the rejoin
        self.me = this_coordinator()  # who writes the state file (its pid, start time)
        self._saved: tuple[dict, float] | None = None
        self.recorded = healfile.read(healfile.path_of(state, self.cluster))  # what a predecessor left
        self.unfinished: SupervisorState | None = None  # the state file of a predecessor that died healing
        self._resume()

    def _resume(self) -> None:
        """A supervisor restarted (systemd) after a heal: the original deployment and the lost nodes from the
        state file it left, when it names the deployment that is current now (where the cluster serves: the
        Address, as the supervision starts); and a heal it did not finish (it died ``healing``): the nodes it
        was leaving out, so this one finishes the heal (supervise/loop.py: ``take_over``)."""
        s = self.recorded
        if s is None or s.cluster != self.cluster:
            self.recorded = None
            return
        if s.deployment != self.current or s.original is None:
            return
        with contextlib.suppress(ClusterctlError):
            _, loaded = self.state.load_deployment(s.original)
            self.original = s.original
            self.node_order = [r.node for r in loaded.deployment.ranks]
            self.book.lost = [n for n in s.lost_nodes if n in self.node_order]
            self.book.heals = s.heals
            if s.state == "healing" and s.leaving_out is not None:
                self.pending = heal_nodes(self.node_order, self.book.lost, s.leaving_out)
                self.unfinished = s

    # ---- what the verbs share -------------------------------------------------------------------------------
    def launch_options(self) -> LaunchOptions:
        """The flags, on the cluster's address, detached or not as this supervisor relaunches."""
        a = self.address
        return self.opts.model_copy(update={"detach": self.detach, "http_host": a.host, "http_port": a.port})

    def ssh(self, within: float = LOOK_TIMEOUT) -> Connector:
        """SSH options for a node that may not answer: connect within ``within`` seconds."""
        return dataclasses.replace(self.opts.ssh, connect_timeout=min(self.opts.ssh.connect_timeout, within))

    async def probe(self, names: list[str]) -> dict[str, bool]:
        """Each node: does it answer a probe (on a session of its own) with its runtime dir usable and the
        model folder of the original deployment there?"""
        _, loaded = self.state.load_deployment(self.original)
        return await probe_nodes(loaded.deployment, names, self.ssh())

    # ---- phase and state file -------------------------------------------------------------------------------
    def phase(self, name: str, reason: str | None = None) -> None:
        self.held = False  # a new word: the budget's hold is said again when it still holds
        before = self.book.phase
        if self.book.set_phase(self.clock(), name, reason):
            if name != before:
                self.since_iso = now_iso()
            self.log(f"heal: {name}" + (f": {reason}" if reason else ""))
            self.save(force=True)
            self.event(self.snapshot())

    def snapshot(self) -> SupervisorState:
        """The supervision as its state file says it. Where the cluster serves and the nodes a heal under way
        leaves out too: a successor (this one killed) relaunches on the same host and port and finishes it."""
        a = self.address
        return state_of(self.book, self.clock(), since=self.since_iso, deployment=self.current,
                        job=self.job.manifest.job_id if self.job else None, cluster=self.cluster,
                        original=self.original, http_host=a.host if a else None, http_port=a.port if a else None,
                        leaving_out=list(self.pending.leave_out) if self.pending is not None else None,
                        supervisor=self.me, updated_at=now_iso())

    def save(self, force: bool = False) -> None:
        s, now = self.snapshot(), self.clock()
        key = s.model_dump(exclude={"updated_at", "degraded_seconds"})
        if not force and self._saved and self._saved[0] == key and now - self._saved[1] < SAVE_EVERY_S:
            return
        try:
            healfile.write(self.state, s)
        except (ClusterctlError, OSError) as e:
            self.log(f"warning: heal state not written: {e}")
            return
        self._saved = (key, now)


def state_of(book: Book, now: float, **rest) -> SupervisorState:
    """The state file of a supervision whose book is ``book`` at ``now``: its phase, why, the heals, the time
    degraded and the lost nodes; ``rest``: the other fields."""
    return SupervisorState(state=book.phase, reason=book.reason, heals=book.heals,
                           degraded_seconds=round(book.degraded_seconds(now), 3), lost_nodes=list(book.lost), **rest)
