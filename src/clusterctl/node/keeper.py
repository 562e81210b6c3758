"""The keeper: ties a long-lived process on a node to the channel that started it.

``python -m clusterctl.node.keeper [--grace S] -- ARGV...`` starts ARGV in its own session (so the whole group
can be signalled), prints ONE JSON line ``{"pid", "pgid", "start_time", "boot_id"}`` describing the child, then
forwards the child's stdout/stderr. When its own stdin reaches EOF (the coordinator closed the channel or died),
its parent dies, or it gets SIGTERM, it stops the group: SIGCONT+SIGTERM, a grace, then SIGKILL. A line
``kill`` on stdin skips the grace. It exits with the child's status (128+N when the child died of signal N).

Why: without a pty, OpenSSH neither forwards signals nor hangs up a remote command when the client dies, so
the remote side has to notice on its own. The same code runs for local ranks (stdin is then a pipe from us).

It needs nothing heavier than the standard library and psutil (process identity: protocol/identity.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

from clusterctl.protocol.identity import ChildInfo, boot_id, start_time_of as process_start_time
from clusterctl.protocol.runtimefiles import KEEPER_PID_ENV as PID_ENV

DEFAULT_GRACE = 10.0
GRACE_ENV = "CLUSTERCTL_KEEPER_GRACE"
KILL_DEADLINE = 5.0  # after SIGKILL, how long to re-send it before reporting a survivor
POLL = 0.2
DRAIN_S = 10.0  # after the child exits, how long its output may take to reach EOF before we exit anyway
EXIT_CANNOT_START = 127


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in group ``pgid`` (a zombie answers kill(0) but is dead)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def kill_group_if_same(pid: int, pgid: int, start_time: float | None, boot: str | None) -> bool:
    """SIGKILL group ``pgid`` only while its leader is still the process reported (same boot, same start
    time): a pid reused by an unrelated process is never signalled. Returns whether it signalled."""
    if start_time is None or boot != boot_id() or process_start_time(pid) != start_time:
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _forward(src, dst_fd: int) -> None:
    # Keep draining the child even after our side of the channel broke, or it would block on a full pipe.
    broken = False
    while True:
        try:
            chunk = src.read1(65536) if hasattr(src, "read1") else src.read(65536)
        except OSError:
            return
        if not chunk:
            return
        if not broken:
            try:
                _write_all(dst_fd, chunk)
            except OSError:
                broken = True


class _Keeper:
    def __init__(self, argv: list[str], grace: float):
        self.argv = argv
        self.grace = grace
        self.wake = threading.Event()
        self.stop_requested = False
        self.kill_requested = False
        self.ppid = os.getppid()

    def _watch_stdin(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                self.stop_requested = True
                self.wake.set()
                return
            buf = (buf + chunk)[-64:]
            if b"kill\n" in buf:
                self.kill_requested = True
                self.wake.set()

    def _on_term(self, signum, frame) -> None:
        self.stop_requested = True
        self.wake.set()

    def _stop(self, child: subprocess.Popen, pgid: int, grace: float) -> None:
        # SIGCONT first: a stopped process only handles SIGTERM once continued.
        _signal_group(pgid, signal.SIGCONT)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.kill_requested:
            if child.poll() is not None and not group_alive(pgid):
                return
            self.wake.wait(POLL)
            self.wake.clear()
        self._kill(child, pgid)

    def _kill(self, child: subprocess.Popen, pgid: int) -> None:
        deadline = time.monotonic() + KILL_DEADLINE
        delay = 0.05
        while True:
            _signal_group(pgid, signal.SIGKILL)
            if child.poll() is not None and not group_alive(pgid):
                return
            if time.monotonic() > deadline:
                _note(f"process group {pgid} survived SIGKILL for {KILL_DEADLINE:.0f} s")
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # Ctrl-C in the coordinator's terminal must not orphan the child
        signal.signal(signal.SIGTERM, self._on_term)
        env = dict(os.environ)
        env.pop(GRACE_ENV, None)
        env[PID_ENV] = str(os.getpid())
        try:
            child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, env=env)
        except OSError as e:
            _note(f"cannot start {self.argv[0]!r}: {e.strerror or e}")
            return EXIT_CANNOT_START
        pgid = child.pid  # start_new_session: the child leads its own session and group
        info = ChildInfo(pid=child.pid, pgid=pgid, start_time=process_start_time(child.pid), boot_id=boot_id())
        try:
            _write_all(1, (json.dumps(info.model_dump()) + "\n").encode())
        except OSError:
            self.stop_requested = True
        forwarders = [threading.Thread(target=_forward, args=(child.stdout, 1), daemon=True),
                      threading.Thread(target=_forward, args=(child.stderr, 2), daemon=True)]
        for t in forwarders:
            t.start()
        threading.Thread(target=self._watch_stdin, daemon=True).start()
        threading.Thread(target=lambda: (child.wait(), self.wake.set()), daemon=True).start()

        while True:
            if self.kill_requested:
                self._kill(child, pgid)
                break
            if self.stop_requested or os.getppid() != self.ppid:
                self._stop(child, pgid, self.grace)
                break
            if child.poll() is not None:
                # The child exited on its own; leftovers in its group get the same TERM-grace-KILL treatment.
                if group_alive(pgid):
                    self._stop(child, pgid, self.grace)
                break
            self.wake.wait(POLL * 2.5)
            self.wake.clear()

        status = child.wait()
        # the child's last output is forwarded before we exit (our daemon threads die with us): its pipes end at
        # once unless a process that left its group still holds them, hence a deadline, not a short timeout
        # (1 s lost a child's whole output on a loaded machine)
        deadline = time.monotonic() + DRAIN_S
        for t in forwarders:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return status if status >= 0 else 128 - status


def _note(message: str) -> None:
    try:
        _write_all(2, f"clusterctl-keeper: {message}\n".encode())
    except OSError:
        pass


def _grace_from_env() -> float:
    try:
        return float(os.environ.get(GRACE_ENV, DEFAULT_GRACE))
    except ValueError:
        return DEFAULT_GRACE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusterctl.node.keeper",
                                     description="Run a command tied to this process's stdin.")
    parser.add_argument("--grace", type=float, default=None,
                        help=f"seconds between SIGTERM and SIGKILL (env {GRACE_ENV}, default {DEFAULT_GRACE:g})")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (use: keeper [--grace S] -- ARGV...)")
    grace = args.grace if args.grace is not None else _grace_from_env()
    return _Keeper(command, max(0.0, grace)).run()


if __name__ == "__main__":
    sys.exit(main())
