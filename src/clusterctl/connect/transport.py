"""The transport seam: what the coordinator does on one node, whatever the way there.

``Transport`` is the protocol, the same verbs for every kind of node (as pyinfra's connectors): ``run`` a command
(argv, never a shell line), ``start`` a long-lived process, ``open_pipe`` a command whose stdin and stdout the
caller keeps line by line, ``ask`` a node operation (its request model in, its answer model out: over the node's
op session, opsession.py), the node's small files (``read_file``, ``write_file``, ``read_tail``) and its ranks'
markers (``wait_markers``), ``close``. Its implementations are ``LocalTransport`` (localnode.py, this machine: its
files and markers read and written directly), ``SshTransport`` (sshnode.py, one asyncssh connection per node) and
``FakeTransport`` (faketransport.py, unit tests), the last two answering the file verbs by node operations; a
``nodes.Connector`` picks one per node. Everything above them (start, foreground, sync) talks to ``Transport``
only, so it never asks which kind of node it has, builds a shell command or touches asyncssh itself.

This module holds what they share: results and errors, the one builder of a remote command line
(``shell_command_line``), and ``StartedProcess``. Long-lived processes always go through the keeper
(``python -m clusterctl.node.keeper``), locally and over SSH alike: the process lives exactly as long as the
keeper's stdin stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from clusterctl.atomic import strict_loads
from clusterctl.errors import ClusterctlError, HostUnreachable, IntegrityError, RemoteCommandFailed, UsageError
from clusterctl.protocol.identity import ChildInfo  # the keeper's one JSON line
from clusterctl.protocol.nodeops import Answer, Request, WaitMarkersAnswer, WatchedRank

TAIL_BYTES = 65536
STDERR_TAIL_CHARS = 2000
START_TIMEOUT = 30.0  # the keeper must report its child within this (python start + psutil import on a slow node)
KILL_WAIT = 5.0
NODEOP_TIMEOUT = 120.0
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def stderr_tail(self) -> str:
        return _tail_text(self.stderr)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandTimedOut(RemoteCommandFailed):
    """A command did not finish within its timeout (it was killed locally; see docs/ssh.md for remote)."""


@runtime_checkable
class Transport(Protocol):
    node: str
    python: str

    async def run(self, argv: list[str], *, input: bytes | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, check: bool = False) -> CommandResult: ...

    async def start(self, argv: list[str], *, env: dict[str, str] | None = None,
                    grace: float | None = None) -> "StartedProcess": ...

    async def open_pipe(self, argv: list[str], *, env: dict[str, str] | None = None) -> "Pipe": ...

    async def ask(self, req: Request, *, timeout: float = NODEOP_TIMEOUT, paced: bool = False) -> Answer: ...

    async def read_file(self, path: str, *, limit: int = 65536) -> bytes: ...

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None: ...

    async def read_tail(self, path: str, limit: int, *, timeout: float = NODEOP_TIMEOUT) -> tuple[int, bytes]: ...

    async def wait_markers(self, paths: list[str], states: set[str], timeout: float,
                           watch: list[WatchedRank | None] | None = None) -> WaitMarkersAnswer: ...

    async def close(self) -> None: ...


class Pipe(Protocol):
    """A running command's stdin (ours to write, then close) and stdout (lines); stderr read separately."""

    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    async def readline(self) -> bytes: ...  # b"" at the end
    async def read_stderr(self, n: int) -> bytes: ...  # b"" at the end
    def close_stdin(self) -> None: ...
    async def wait(self) -> int | None: ...
    def kill(self) -> None: ...


# ---------------------------------------------------------------------------------------------- helpers

def _tail_text(data: bytes, chars: int = STDERR_TAIL_CHARS) -> str:
    return data[-chars * 2:].decode("utf-8", "replace")[-chars:].strip()


def check_argv(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Refuse what cannot be passed faithfully: non-strings, NUL bytes, bad env names."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise UsageError(f"a command must be a non-empty list of strings, got {argv!r}")
    for a in argv:
        if "\0" in a:
            raise UsageError(f"a command argument contains a NUL byte: {a!r}")
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise UsageError(f"bad environment variable name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise UsageError(f"bad value for environment variable {k}")
    if env and ("=" in argv[0] or argv[0].startswith("-")):
        # `env` would read it as an assignment or an option
        raise UsageError(f"command name {argv[0]!r} cannot be run with an environment prefix")


def shell_command_line(argv: list[str], env: dict[str, str] | None = None, *, exec_: bool = False) -> str:
    """The one way a remote command line is built: every element through shlex.quote, env as `env K=V`."""
    check_argv(argv, env)
    words = (["env", *(f"{k}={v}" for k, v in env.items())] if env else []) + list(argv)
    line = " ".join(shlex.quote(w) for w in words)
    return f"exec {line}" if exec_ else line


def keeper_argv(python: str, argv: list[str], grace: float) -> list[str]:
    return [python, "-m", "clusterctl.node.keeper", "--grace", f"{grace:g}", "--", *argv]


def keeper_env(env: dict[str, str] | None) -> dict[str, str]:
    # Without a pty Python block-buffers its output; a rank's error would only show up at exit.
    return {"PYTHONUNBUFFERED": "1", **(env or {})}


def raise_for_status(node: str, result: CommandResult) -> CommandResult:
    if result.returncode != 0:
        raise RemoteCommandFailed(
            f"{shlex.join(result.argv)[:200]} failed on {node} with exit code {result.returncode}"
            + (f": {result.stderr_tail.splitlines()[-1]}" if result.stderr_tail else ""),
            host=node, argv=list(result.argv), returncode=result.returncode, stderr_tail=result.stderr_tail)
    return result


# ---------------------------------------------------------------------------------------------- started processes

class _Channel(Protocol):
    """What StartedProcess needs from a local pipe set or an SSH channel."""

    async def read_stdout(self, n: int) -> bytes: ...
    async def read_stderr(self, n: int) -> bytes: ...
    async def write_stdin(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    async def wait_exit(self) -> int: ...
    def abort(self) -> None: ...  # close our side; the keeper sees EOF and stops its group
    async def force_kill(self, info: ChildInfo) -> None: ...  # SIGKILL the group now, identity-checked


class ProcStreams:
    """The stream calls a local subprocess and an asyncssh process answer alike (``proc``'s stdin, stdout and
    stderr): the part of ``_Channel`` both transports share."""

    proc: object

    async def read_stdout(self, n: int) -> bytes:
        return await self.proc.stdout.read(n)

    async def read_stderr(self, n: int) -> bytes:
        return await self.proc.stderr.read(n)

    async def write_stdin(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()


class _Tail:
    def __init__(self, size: int = TAIL_BYTES):
        self.size = size
        self.buf = bytearray()

    def add(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > self.size:
            del self.buf[: len(self.buf) - self.size]


class StartedProcess:
    """A process started through the keeper. Its output is always drained into 64 KiB tail buffers."""

    def __init__(self, node: str, argv: list[str], channel: _Channel, grace: float = 10.0):
        self.node = node
        self.argv = argv
        self.grace = grace
        self.info: ChildInfo | None = None
        self.returncode: int | None = None
        self._chan = channel
        self._out = _Tail()
        self._err = _Tail()
        self._pumps: list[asyncio.Task] = []
        self._done: asyncio.Task | None = None
        self._stdin_closed = False

    @property
    def stdout_tail(self) -> bytes:
        return bytes(self._out.buf)

    @property
    def stderr_tail(self) -> bytes:
        return bytes(self._err.buf)

    async def _pump(self, read, tail: _Tail) -> None:
        with contextlib.suppress(Exception):
            while True:
                chunk = await read(65536)
                if not chunk:
                    return
                tail.add(chunk)

    async def _begin(self, timeout: float = START_TIMEOUT) -> "StartedProcess":
        self._pumps.append(asyncio.ensure_future(self._pump(self._chan.read_stderr, self._err)))
        buf, line = b"", None
        try:
            async with asyncio.timeout(timeout):
                while line is None:
                    chunk = await self._chan.read_stdout(65536)
                    if not chunk:
                        break
                    buf += chunk
                    # A chatty shell rc file may print before the keeper does: keep such lines as output.
                    while line is None and b"\n" in buf:
                        first, buf = buf.split(b"\n", 1)
                        if first.startswith(b'{"pid"'):
                            line = first
                        else:
                            self._out.add(first + b"\n")
                    if len(buf) > TAIL_BYTES:
                        self._out.add(buf)
                        buf = b""
        except Exception as e:
            self._chan.abort()
            await self._settle_pumps()
            if isinstance(e, ClusterctlError):
                raise
            if isinstance(e, TimeoutError):
                raise RemoteCommandFailed(
                    f"the keeper on {self.node} did not report its child within {timeout:g} s", host=self.node,
                    argv=self.argv, stderr_tail=_tail_text(self.stderr_tail)) from None
            raise HostUnreachable(f"lost {self.node} while starting {self.argv[0]}: {e or type(e).__name__}",
                                  host=self.node) from None
        if line is None:
            self._out.add(buf)
            rc = await self._exit_after_failure()
            tail = _tail_text(self.stderr_tail)
            raise RemoteCommandFailed(
                f"could not start {self.argv[0]} on {self.node}" + (f": {tail.splitlines()[-1]}" if tail else ""),
                host=self.node, argv=self.argv, returncode=rc, stderr_tail=tail)
        try:
            self.info = ChildInfo.model_validate(strict_loads(line, source=f"keeper report from {self.node}"))
        except (ValueError, IntegrityError) as e:
            self._chan.abort()
            await self._settle_pumps()
            raise IntegrityError(f"unexpected keeper report from {self.node}: {line[:200]!r} ({e})") from None
        self._out.add(buf)
        self._pumps.append(asyncio.ensure_future(self._pump(self._chan.read_stdout, self._out)))
        return self

    async def _exit_after_failure(self) -> int | None:
        try:
            async with asyncio.timeout(KILL_WAIT):
                rc = await self._chan.wait_exit()
                await self._settle_pumps()
                return rc
        except (TimeoutError, ClusterctlError):
            self._chan.abort()
            return None

    async def _settle_pumps(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await asyncio.gather(*self._pumps, return_exceptions=True)
        for t in self._pumps:
            t.cancel()

    async def _finish(self) -> int:
        rc = await self._chan.wait_exit()
        await self._settle_pumps()
        self.returncode = rc
        return rc

    async def wait(self) -> int:
        """Wait for the keeper to exit; its status is the child's (128+N for signal N).

        Raises HostUnreachable when the connection to the node was lost before an exit status arrived.
        """
        if self._done is None:
            self._done = asyncio.ensure_future(self._finish())
        return await asyncio.shield(self._done)

    async def close_stdin(self) -> None:
        """Ask for a stop: the keeper sends SIGCONT+SIGTERM to the group, waits its grace, then SIGKILL."""
        if self._stdin_closed:
            return
        self._stdin_closed = True
        with contextlib.suppress(Exception):
            await self._chan.close_stdin()

    async def kill(self, *, timeout: float = KILL_WAIT) -> None:
        """Best effort immediate stop: the keeper SIGKILLs the group now; if it does not exit, cut it off."""
        if not self._stdin_closed:
            with contextlib.suppress(Exception):
                await self._chan.write_stdin(b"kill\n")
            await self.close_stdin()
        else:
            # The keeper already got EOF and is inside its grace; kill the group from outside.
            with contextlib.suppress(ClusterctlError):
                await self._chan.force_kill(self.info)
        try:
            async with asyncio.timeout(timeout):
                await self.wait()
        except (TimeoutError, ClusterctlError):
            with contextlib.suppress(ClusterctlError):
                await self._chan.force_kill(self.info)
            self._chan.abort()


async def stop_all(started: list[StartedProcess]) -> None:
    """Close every keeper's stdin and wait for them: each gets its grace, then a forced stop."""
    live = [sp for sp in started if sp.returncode is None]
    for sp in live:
        await sp.close_stdin()
    if not live:
        return
    limit = max(sp.grace for sp in live) + KILL_WAIT * 2
    waits = [asyncio.ensure_future(sp.wait()) for sp in live]
    _, pending = await asyncio.wait(waits, timeout=limit)
    for sp, w in zip(live, waits):
        if w in pending:
            await sp.kill()
        elif not w.cancelled():
            w.exception()  # a lost connection was already reported to whoever waits; do not warn twice


__all__ = ["CommandResult", "CommandTimedOut", "ChildInfo", "Transport", "Pipe", "StartedProcess",
           "shell_command_line", "keeper_argv", "keeper_env", "check_argv", "raise_for_status", "stop_all"]
