"""LocalTransport: the Transport of the coordinator's own node, asyncio subprocesses on this machine, with the
same semantics as SshTransport (sshnode.py) and no network in between. Started processes go through the keeper
here too; commands and pipes run in their own session, so a Ctrl-C in the operator's terminal reaches only the
coordinator; node operations go through an op session here too (opsession.NodeOps), but the node's small files
and its ranks' markers are read and written directly, in this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field

from clusterctl.atomic import atomic_write_bytes, read_capped
from clusterctl.errors import IntegrityError, MissingInput, RemoteCommandFailed
from clusterctl.connect.opsession import NodeOps
from clusterctl.connect.transport import (ChildInfo, CommandResult, CommandTimedOut, ProcStreams, StartedProcess,
                                         check_argv, keeper_argv, keeper_env, raise_for_status, stop_all)
from clusterctl.node.keeper import kill_group_if_same
from clusterctl.node.markerops import look_at_markers
from clusterctl.protocol.nodeops import WaitMarkersAnswer, WatchedRank

PIPE_LINE_LIMIT = 256 << 20  # one answer line of a pipe (a node op's answer; REQUEST_LIMIT is 64 MiB)
MARKER_POLL = 0.02  # the markers, read in-process


class _LocalChannel(ProcStreams):
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def close_stdin(self) -> None:
        if not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        with contextlib.suppress(Exception):
            await self.proc.stdin.wait_closed()

    async def wait_exit(self) -> int:
        rc = await self.proc.wait()
        return rc if rc >= 0 else 128 - rc

    def abort(self) -> None:
        if not self.proc.stdin.is_closing():
            self.proc.stdin.close()

    async def force_kill(self, info: ChildInfo) -> None:
        kill_group_if_same(info.pid, info.pgid, info.start_time, info.boot_id)


class _LocalPipe:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)

    async def drain(self) -> None:
        await self.proc.stdin.drain()

    async def readline(self) -> bytes:
        return await self.proc.stdout.readline()

    async def read_stderr(self, n: int) -> bytes:
        return await self.proc.stderr.read(n)

    def close_stdin(self) -> None:
        if not self.proc.stdin.is_closing():
            self.proc.stdin.close()

    async def wait(self) -> int | None:
        return await self.proc.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


@dataclass
class LocalTransport(NodeOps):
    """Runs on this machine. Same semantics as SshTransport, without a network in between."""

    node: str = "local"
    python: str = field(default_factory=lambda: sys.executable)
    keeper_grace: float = 10.0
    _started: list[StartedProcess] = field(default_factory=list, init=False, repr=False)

    async def run(self, argv: list[str], *, input: bytes | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, check: bool = False) -> CommandResult:
        check_argv(argv, env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, **env} if env else None, start_new_session=True)
        except OSError as e:
            result = CommandResult(list(argv), 127, b"", f"{argv[0]}: {e.strerror or e}\n".encode())
            return raise_for_status(self.node, result) if check else result
        try:
            async with asyncio.timeout(timeout):
                out, err = await proc.communicate(input)
        except TimeoutError:
            # Its own session: kill everything the command started, not just the command.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise CommandTimedOut(f"{shlex.join(argv)[:200]} timed out after {timeout:g} s on {self.node}",
                                  host=self.node, argv=list(argv)) from None
        result = CommandResult(list(argv), proc.returncode, out, err)
        return raise_for_status(self.node, result) if check else result

    async def start(self, argv: list[str], *, env: dict[str, str] | None = None,
                    grace: float | None = None) -> StartedProcess:
        check_argv(argv, env)
        grace = self.keeper_grace if grace is None else grace
        kargv = keeper_argv(self.python, argv, grace)
        try:
            proc = await asyncio.create_subprocess_exec(
                *kargv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, **keeper_env(env)})
        except OSError as e:
            raise RemoteCommandFailed(f"cannot run {self.python} on {self.node}: {e.strerror or e}",
                                      host=self.node, argv=kargv) from None
        sp = StartedProcess(self.node, list(argv), _LocalChannel(proc), grace)
        await sp._begin()
        self._started = [p for p in self._started if p.returncode is None] + [sp]
        return sp

    # The node's small files and markers, here directly (a remote node's through its op session: NodeOps)
    async def read_file(self, path: str, *, limit: int = 65536) -> bytes:
        try:
            return await asyncio.to_thread(read_capped, path, limit=limit, what="file")
        except (MissingInput, IntegrityError) as e:
            raise type(e)(f"{e.message} (on {self.node})") from None

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        await asyncio.to_thread(atomic_write_bytes, path, bytes(data), mode=mode)

    async def wait_markers(self, paths: list[str], states: set[str], timeout: float,
                           watch: list[WatchedRank | None] | None = None) -> WaitMarkersAnswer:
        deadline = time.monotonic() + timeout
        while True:
            look, settled = look_at_markers(paths, states, watch)
            if settled or time.monotonic() >= deadline:
                return look
            await asyncio.sleep(MARKER_POLL)

    async def open_pipe(self, argv: list[str], *, env: dict[str, str] | None = None) -> _LocalPipe:
        check_argv(argv, env)
        try:
            # its own session: a Ctrl-C in the operator's terminal reaches the coordinator, which may still need
            # this pipe to tear down what it started
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, **env} if env else None, start_new_session=True, limit=PIPE_LINE_LIMIT)
        except OSError as e:
            raise RemoteCommandFailed(f"cannot run {argv[0]} on {self.node}: {e.strerror or e}", host=self.node,
                                      argv=list(argv)) from None
        return _LocalPipe(proc)

    async def close(self) -> None:
        await self.close_session()
        started, self._started = self._started, []
        await stop_all(started)
