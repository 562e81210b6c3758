"""The supervisors of a state dir as ``teardown`` meets them (docs/heal.md, "Teardown of a supervised
deployment"): found by their state file (``<state>/heal/<cluster>.json``) and their lock
(``<state>/locks/heal-<cluster>.lock``), stopped by process identity (pid, start time, boot id) before the
teardown, so no heal or rejoin brings back what it tears down.

A supervisor is stopped with SIGTERM and waited for (its lock released: the kernel drops a flock only when its
holder is gone); the lock is then held by the teardown until it is done, so a supervisor restarted meanwhile
(systemd) exits 75 instead of launching again. One that cannot be stopped from here (another machine's, one
that does not end in time, one starting whose state file is not written yet) makes the teardown refuse with
exit 75, naming it and how to stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass

from clusterctl.errors import Busy, ClusterctlError
from clusterctl.statedir import healfile
from clusterctl.statedir.healfile import SupervisorState
from clusterctl.statedir.manifest import manifest_store, now_iso
from clusterctl.locks import Lock
from clusterctl.node.procs import Identity, signal_process
from clusterctl.statedir.state import StateDir

STOP_TIMEOUT = 60.0  # a supervisor cancels its step at once; its cleanup (a launch cut short) takes seconds


@dataclass
class Held:
    """A cluster's supervision, stopped (or found stopped) and held off while the teardown runs."""

    cluster: str
    doc: SupervisorState  # its last state file
    lock: Lock
    pid: int | None  # the supervisor this teardown stopped (None: none was running)

    @property
    def targets(self) -> set[str]:
        """What the supervisor last ran: the teardown's targets too."""
        return {x for x in (self.doc.deployment, self.doc.job) if x is not None}


def _cluster_of(state: StateDir, ref: str) -> str | None:
    """The cluster a deployment id, deployment file or job id belongs to (None when unknown)."""
    with contextlib.suppress(ClusterctlError, OSError):
        return state.load_deployment(ref)[1].deployment.cluster
    if state.launches.is_dir():
        for _, m in manifest_store(state).all()[0]:
            if m.job_id == ref:
                return _cluster_of(state, m.deployment_id)
    return None


def _matches(doc: SupervisorState, ref: str | None, cluster: str | None) -> bool:
    return ref is None or ref in (doc.deployment, doc.original, doc.job) \
        or (cluster is not None and doc.cluster == cluster)


async def hold_supervisors(state: StateDir, ref: str | None, *, log=lambda msg: None,
                           timeout: float = STOP_TIMEOUT) -> list[Held]:
    """Every supervision of ``ref``'s cluster (all of them when ``ref`` is None) stopped and held off: the
    caller tears down, then calls ``release``. Busy (75) when one cannot be stopped from here."""

    cluster = _cluster_of(state, ref) if ref is not None else None
    held: list[Held] = []
    try:
        for doc in healfile.read_all(state):
            if _matches(doc, ref, cluster) and doc.cluster is not None:
                held.append(await _hold(state, doc, log, timeout))
        _refuse_starting(state, ref, cluster, {h.cluster for h in held})
    except BaseException:
        release(state, held, stopped=False)
        raise
    return held


async def _hold(state: StateDir, doc: SupervisorState, log, timeout: float) -> Held:
    c = doc.cluster
    lock = Lock(state.heal_lock(c))
    with contextlib.suppress(Busy):
        return Held(c, doc, lock.acquire(), None)  # nobody supervises it now
    sup = doc.supervisor
    pid = sup.pid if sup else "?"
    how = f"stop it (systemctl stop / launchctl bootout its unit, or kill {pid} on {sup.host if sup else '?'})" \
          " and run teardown again"
    if sup is None or sup.host != socket.gethostname() or sup.pid == os.getpid() or not doc.supervisor_alive():
        raise Busy(f"cluster {c} is supervised by pid {pid}" + (f" on {sup.host}" if sup else "")
                   + ", which teardown cannot stop from here", hint=how)
    ident = Identity(pid=sup.pid, start_time=sup.start_time, nonce=None, boot_id=sup.boot_id)
    log(f"stopping the supervisor of cluster {c} (pid {sup.pid}) first: no heal may relaunch what is torn down")
    if signal_process(ident, signal.SIGTERM) != "alive":
        raise Busy(f"cluster {c}: its supervision lock {lock.path} is held, not by pid {pid} of its state file "
                   "(a supervisor starting?)", hint="wait until its state file names it, then run teardown again")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # until its lock is free: the kernel drops it as the process ends
        with contextlib.suppress(Busy):
            lock.acquire()
            return Held(c, healfile.read(healfile.path_of(state, c)) or doc, lock, sup.pid)
        await asyncio.sleep(0.1)  # never time.sleep: the caller's node sessions run on this loop
    raise Busy(f"the supervisor of cluster {c} (pid {sup.pid}) did not stop within {timeout:g} s", hint=how)


def _refuse_starting(state: StateDir, ref: str | None, cluster: str | None, seen: set[str]) -> None:
    """A supervisor that has not written its state file yet (its first launch under way) still holds its lock."""
    folder = state.locks
    for p in sorted(folder.glob("heal-*.lock")) if folder.is_dir() else []:
        c = p.name[len("heal-"):-len(".lock")]
        if c in seen or (ref is not None and c != cluster):
            continue
        try:
            Lock(p).acquire().release()
        except Busy:
            raise Busy(f"cluster {c} has a supervisor starting (lock {p} held; its pid is not written yet)",
                       hint="wait until it serves (its state file appears), then run teardown again; or stop it "
                            "first") from None


def release(state: StateDir, held: list[Held], *, stopped: bool = True) -> None:
    """After the teardown: each stopped supervision's state file says so (``degraded``, nothing serving), and
    its lock is let go."""
    for h in held:
        try:
            if stopped and (h.pid or h.doc.state != "degraded" or h.doc.job):  # news to tell
                say_stopped(state, h.doc, "supervision stopped by teardown"
                            + (f" (supervisor pid {h.pid})" if h.pid else ""))
        finally:
            h.lock.release()


def say_stopped(state: StateDir, doc: SupervisorState, reason: str) -> None:
    """The state file of a supervision that ended with nothing serving: ``degraded``, no job, ``reason``."""
    out = doc.model_copy(update={"state": "degraded", "since": now_iso(), "job": None, "leaving_out": None,
                                 "updated_at": now_iso(), "reason": reason})
    with contextlib.suppress(ClusterctlError, OSError):
        healfile.write(state, out)


def dead_heals(state: StateDir) -> list[tuple[SupervisorState, Lock]]:
    """The heals whose supervisor died in them (state ``healing``, its process gone here), each with its
    cluster's supervision lock, held: no successor starts while the caller (``reap``) rolls it back."""
    out = []
    for doc in healfile.read_all(state):
        if doc.state != "healing" or doc.supervisor_alive() is not False or doc.cluster is None:
            continue
        with contextlib.suppress(Busy):
            out.append((doc, Lock(state.heal_lock(doc.cluster)).acquire()))
    return out
