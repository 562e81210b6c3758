"""Process identity and identity-checked signalling, on the node where the processes live.

A process is ours only when pid AND start time AND the launch's nonce (env ``CLUSTERCTL_NONCE``) all match:
start times have 10 ms ticks, so pid + start time alone can match an impostor that reused the pid. A zombie counts
as dead; a process we may not inspect or signal (EPERM) counts as alive and is reported, never assumed gone.
Signals go through a pidfd where the platform has one, so the pid cannot be reused between check and kill.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

from clusterctl.protocol.identity import Identity, boot_id, start_time_of  # noqa: F401  (one copy for both sides)
from clusterctl.protocol.nodeops import Status, StopResult

NONCE_ENV = "CLUSTERCTL_NONCE"
START_TOLERANCE = 0.02
EPERM = "cannot inspect or signal it (EPERM)"


def _nonce_of(proc: psutil.Process) -> str | None:
    env = proc.environ()
    return env.get(NONCE_ENV)


def status_of(ident: Identity) -> Status:
    """alive: this is our process; dead: gone (or a zombie); foreign: the pid now belongs to someone else;
    unverifiable: something runs with that pid and start time but we may not look inside (EPERM)."""
    if ident.boot_id and boot_id() and ident.boot_id != boot_id():
        return "dead"  # the node rebooted: every process of that launch is gone
    try:
        proc = psutil.Process(ident.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "dead"
        if ident.start_time is not None and abs(proc.create_time() - ident.start_time) > START_TOLERANCE:
            return "foreign"
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "dead"
    except psutil.AccessDenied:
        return "unverifiable"
    if ident.nonce is None:
        return "alive"
    try:
        nonce = _nonce_of(proc)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "dead"
    except psutil.AccessDenied:
        return "unverifiable"
    return "alive" if nonce == ident.nonce else "foreign"


def _pidfd(pid: int) -> int | None:
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def signal_process(ident: Identity, sig: int) -> Status:
    """Send ``sig`` to the process (and its group when it leads one) only if its identity matches."""
    fd = _pidfd(ident.pid)
    try:
        st = status_of(ident)  # checked after the pidfd is open: the pidfd pins this very process
        if st != "alive":
            return st
        if sig in (signal.SIGTERM, signal.SIGINT):
            _send(ident, fd, signal.SIGCONT)  # a stopped process handles TERM only once continued
        _send(ident, fd, sig)
        return "alive"
    except PermissionError:
        return "unverifiable"
    except ProcessLookupError:
        return "dead"
    finally:
        if fd is not None:
            os.close(fd)


def _send(ident: Identity, fd: int | None, sig: int) -> None:
    # Exactly one signal per process: a rank takes a second SIGTERM as "exit now", skipping its clean stop.
    if ident.pgid and ident.pgid == ident.pid:
        try:
            os.killpg(ident.pgid, sig)  # the whole group the rank leads, the rank included
            return
        except ProcessLookupError:
            pass
    if fd is not None:
        signal.pidfd_send_signal(fd, sig)
    else:
        os.kill(ident.pid, sig)


def group_members(pgid: int, nonce: str | None) -> list[Identity]:
    """Processes still in a group whose leader may be gone, that carry the launch's nonce."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) != pgid:
                continue
            ident = Identity(pid=p.pid, start_time=p.create_time(), nonce=nonce, pgid=pgid)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
        if status_of(ident) in ("alive", "unverifiable"):
            out.append(ident)
    return out


def stop(idents: list[Identity], *, grace: float, kill_retries: int = 3) -> list[StopResult]:
    """TERM (with CONT), wait up to ``grace``, KILL, verify, re-KILL with backoff, then report per process."""
    targets: list[Identity] = []
    results: dict[int, StopResult] = {}
    for ident in idents:
        st = signal_process(ident, signal.SIGTERM)
        if st == "alive":
            targets.append(ident)
        elif st == "foreign":
            results[ident.pid] = StopResult(pid=ident.pid, status="not-ours",
                                            detail="pid belongs to another process now: not signalled")
        elif st == "unverifiable":
            results[ident.pid] = StopResult(pid=ident.pid, status="permission-denied", detail=EPERM)
        else:
            results[ident.pid] = StopResult(pid=ident.pid, status="gone", detail="")
        # children left in the group after the leader exited
        if ident.pgid and st in ("dead", "alive"):
            for m in group_members(ident.pgid, ident.nonce):
                if m.pid != ident.pid and m.pid not in {t.pid for t in targets}:
                    signal_process(m, signal.SIGTERM)
                    targets.append(m)
    deadline = time.monotonic() + grace
    pending = list(targets)
    while pending and time.monotonic() < deadline:
        pending = [t for t in pending if status_of(t) in ("alive", "unverifiable")]
        if pending:
            time.sleep(0.05)
    delay = 0.1
    for attempt in range(kill_retries + 1):
        pending = [t for t in pending if status_of(t) in ("alive", "unverifiable")]
        if not pending:
            break
        for t in pending:
            signal_process(t, signal.SIGKILL)
        wait_until = time.monotonic() + delay
        while time.monotonic() < wait_until and any(status_of(t) in ("alive", "unverifiable") for t in pending):
            time.sleep(0.02)
        delay *= 2
    for t in targets:
        st = status_of(t)
        if st in ("dead", "foreign"):
            results.setdefault(t.pid, StopResult(pid=t.pid, status="gone", detail=""))
        elif st == "unverifiable":
            results[t.pid] = StopResult(pid=t.pid, status="permission-denied", detail=EPERM)
        else:
            results[t.pid] = StopResult(pid=t.pid, status="survived",
                                       detail=f"still running after SIGKILL (state {_state(t.pid)})")
    return [results[i.pid] for i in idents if i.pid in results] + \
        [r for pid, r in results.items() if pid not in {i.pid for i in idents}]


def _state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "unknown"
