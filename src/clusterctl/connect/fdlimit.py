"""Open files: the coordinator holds one SSH connection (one socket) per node for a whole command.

A shell's soft RLIMIT_NOFILE is often 256 (macOS) or 1024 (Linux), well under what hundreds of nodes need,
while the hard limit is far higher. So the CLI raises its soft limit toward the hard one at start
(``raise_nofile``). When even that cannot cover every node, ``SLOTS`` hands out connections in waves: a node that
needs one while all are taken closes an idle node's connection (no request in flight, nothing started through
it), or waits for one to become idle, and the command says so once. A connection that still fails with EMFILE
is reported as what it is (``too_many_open_files``), never as an unreachable node.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import sys

from clusterctl.errors import ClusterctlError, Exit

RESERVE = 64  # files the coordinator needs besides its connections: state dir, locks, pipes, asyncssh's own
# a connection's socket, and a key or known_hosts file read while its handshake runs
FDS_PER_CONNECTION = 2
CEILING = 1 << 16  # the most this asks for: enough for thousands of nodes, far from a kernel's maximum
EMFILE = (errno.EMFILE, errno.ENFILE)


def raise_nofile(want: int = CEILING) -> tuple[int, int]:
    """Raise the soft open-file limit toward the hard one (at most ``want``); returns (soft, hard) after.
    macOS may report an unlimited hard limit that the kernel caps lower (kern.maxfilesperproc): smaller values
    are tried then. Never lowers the limit, never raises."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft == resource.RLIM_INFINITY or soft >= top:
        return soft, hard
    for target in (top, 24576, 10240, 4096):
        if target <= soft or target > top:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target, hard
        except (ValueError, OSError):
            continue
    return soft, hard


def open_fds() -> int:
    """How many descriptors this process has open now (0 when the system does not say)."""
    import os

    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return CEILING if soft == resource.RLIM_INFINITY else soft


def too_many_open_files(what: str) -> ClusterctlError:
    return ClusterctlError(
        f"too many open files on this machine while {what} (the open-file limit is {soft_limit()})",
        hint="raise it (`ulimit -n 65536` in the shell that runs clusterctl, or the hard limit in "
             "/etc/security/limits.conf or launchctl limit maxfiles); docs/scale.md", exit_code=Exit.UNAVAILABLE)


def is_emfile(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in EMFILE


def say(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)


class ConnectionSlots:
    """How many connections may be open at once, process-wide. A holder is an object with ``idle() -> bool``
    and ``async evict()`` (close its connection; reopened on its next use)."""

    def __init__(self, limit: int | None = None, fds_per_connection: int = FDS_PER_CONNECTION):
        self.fixed, self.fds_per_connection = limit, fds_per_connection
        self.holders: list = []  # least recently used first
        self.waiters: list[asyncio.Future] = []
        self.told = False
        self.loop = None
        self.base: int | None = None  # descriptors open before the first connection (files, the loop's own)

    @property
    def limit(self) -> int:
        if self.fixed is not None:
            return self.fixed
        base = open_fds() if self.base is None else self.base
        return max(4, (soft_limit() - RESERVE - base) // self.fds_per_connection)

    def _same_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # a new command (asyncio.run): what an earlier loop held is gone with it
            self.loop, self.holders, self.waiters, self.base = loop, [], [], open_fds()

    async def acquire(self, holder) -> None:
        self._same_loop()
        while True:
            if holder in self.holders:
                return
            if len(self.holders) < self.limit:
                self.holders.append(holder)
                return
            if not self.told:
                self.told = True
                say(f"more nodes than connections the open-file limit allows at once ({soft_limit()}: "
                    f"{self.limit} connections); connecting in waves (docs/scale.md)")
            victim = next((h for h in self.holders if h.idle()), None)
            if victim is not None:
                self.holders.remove(victim)
                await victim.evict()
                continue
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self.waiters:
                    self.waiters.remove(fut)

    def release(self, holder) -> None:
        if holder in self.holders:
            self.holders.remove(holder)
        self.poke()

    def touch(self, holder) -> None:
        if holder in self.holders and self.holders[-1] is not holder:
            self.holders.remove(holder)
            self.holders.append(holder)

    def poke(self) -> None:
        """A holder became idle or left: let one waiter look again."""
        while self.waiters:
            fut = self.waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return

    def __len__(self) -> int:
        return len(self.holders)


SLOTS = ConnectionSlots()
