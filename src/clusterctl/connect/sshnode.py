"""SshTransport: the Transport of a remote node over asyncssh (the only module importing asyncssh).

One connection per node, opened on first use (in waves when the open-file limit cannot cover every node:
fdlimit.py) and shared by its commands, started processes and pipes, each on its own SSH channel; at most
SHORT_CHANNELS commands at once, so sshd's MaxSessions leaves room for the rest. Command lines are built by
``transport.shell_command_line`` only. Node operations, and with them the node's files and markers, go through
its op session (a pipe: opsession.NodeOps); a keeper that outlived its grace is killed by the node operation
``kill_group`` on a channel of its own. ``close()`` ends the connection and with it every process started over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import socket
import warnings

# cryptography 51 deprecates DSA, and asyncssh names its DSA types as it is imported: five warnings on the terminal
# of every command that reaches a node, at import, whatever keys are in use (the quiet contract). Only that message.
warnings.filterwarnings("ignore", message="DSA is deprecated", category=Warning)

import asyncssh  # noqa: E402

from clusterctl.errors import ClusterctlError, ConfigError, HostUnreachable
from clusterctl.connect import fdlimit, ssh_policy
from clusterctl.connect.opsession import NodeOps
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.connect.transport import (ChildInfo, CommandResult, CommandTimedOut, ProcStreams, StartedProcess,
                                         check_argv, keeper_argv, keeper_env, raise_for_status, shell_command_line,
                                         stop_all)
from clusterctl.protocol.nodeops import KillGroupRequest

# sshd allows 10 sessions per connection by default (MaxSessions); keep room for started processes.
SHORT_CHANNELS = 4

KILL_TIMEOUT = 15.0

class _PolicyClient(asyncssh.SSHClient):
    """Routes host keys missing from known_hosts to ssh_policy, remembering why one was refused."""

    def __init__(self, target: SshTarget, known_hosts):
        self.target = target
        self.known_hosts = known_hosts
        self.refusal: ClusterctlError | None = None

    def validate_host_public_key(self, host, addr, port, key) -> bool:
        try:
            listed = asyncssh.match_known_hosts(self.known_hosts, host, addr, port if port != 22 else None)
            host_listed = bool(listed[0] or listed[1] or listed[2])
            line = key.export_public_key("openssh").decode("ascii", "replace").strip()
            ssh_policy.judge_unlisted_host_key(self.target, host_listed=host_listed, key_line=line,
                                               fingerprint=f"{key.get_algorithm()} {key.get_fingerprint()}")
            return True
        except ClusterctlError as e:
            self.refusal = e
            return False
        except Exception as e:  # never let a surprise here turn into "trusted"
            self.refusal = ssh_policy.unknown_host_key_error(self.target, f"an unreadable key ({e})")
            return False


_KNOWN_HOSTS: dict[str, tuple[tuple[int, int], asyncssh.SSHKnownHosts]] = {}


def known_hosts(spec: str | bytes):
    """A known_hosts file parsed once per command (asyncssh given a path parses it again for every connection:
    0.7 s of event loop at 256 nodes), parsed again only when the file changed (a key accepted meanwhile)."""
    if not isinstance(spec, str):
        return spec
    try:
        st = os.stat(spec)
    except OSError:
        return spec  # asyncssh reports it as it would
    stamp = (st.st_mtime_ns, st.st_size)
    got = _KNOWN_HOSTS.get(spec)
    if got is None or got[0] != stamp:
        got = _KNOWN_HOSTS[spec] = (stamp, asyncssh.read_known_hosts(spec))
    return got[1]


async def connect(target: SshTarget) -> asyncssh.SSHClientConnection:
    """Open a verified connection or raise AuthRejected (77) / HostUnreachable (69) / ConfigError."""
    kwargs = ssh_policy.asyncssh_connect_kwargs(target)
    client = None
    try:
        kwargs["known_hosts"] = known_hosts(kwargs["known_hosts"])
        client = _PolicyClient(target, kwargs["known_hosts"])
        conn, _ = await asyncssh.create_connection(lambda: client, **kwargs)
        return conn
    except asyncssh.HostKeyNotVerifiable as e:
        raise (client and client.refusal) or ssh_policy.unknown_host_key_error(target, str(e)) from None
    except asyncssh.PermissionDenied as e:
        raise ssh_policy.auth_failed_error(target, e.reason or "permission denied") from None
    except asyncssh.KeyExchangeFailed as e:
        raise ssh_policy.auth_failed_error(target, f"key exchange failed: {e.reason}") from None
    except asyncssh.KeyImportError as e:
        raise ConfigError(f"cannot use ssh key {target.identity_file}: {e}") from None
    except asyncssh.DisconnectError as e:
        raise ssh_policy.unreachable_error(target, e.reason or type(e).__name__) from None
    except socket.gaierror as e:
        raise ssh_policy.unreachable_error(target, f"cannot resolve {target.host} ({e.strerror or e})") from None
    except (TimeoutError, asyncio.TimeoutError):
        raise ssh_policy.unreachable_error(target, f"no answer within {target.connect_timeout:g} s") from None
    except ConnectionRefusedError:
        raise ssh_policy.unreachable_error(target, "connection refused") from None
    except FileNotFoundError as e:
        raise ConfigError(f"cannot read {e.filename or 'an ssh key or known_hosts file'}: {e.strerror}") from None
    except OSError as e:
        if fdlimit.is_emfile(e):  # this machine's limit, not the node: never "check that the node is up"
            raise fdlimit.too_many_open_files(f"connecting to {ssh_policy.describe(target)}") from None
        raise ssh_policy.unreachable_error(target, e.strerror or str(e)) from None


class _SshChannel(ProcStreams):
    def __init__(self, transport: "SshTransport", proc: asyncssh.SSHClientProcess):
        self.t = transport
        self.proc = proc

    async def close_stdin(self) -> None:
        self.proc.stdin.write_eof()

    async def wait_exit(self) -> int:
        await self.proc.wait_closed()
        rc = self.proc.returncode
        if rc is None:
            raise self.t._lost("the channel closed without an exit status")
        return rc if rc >= 0 else 128 - rc

    def abort(self) -> None:
        # Closing the channel closes the keeper's stdin on the node: it stops its group by itself.
        with contextlib.suppress(Exception):
            self.proc.close()

    async def force_kill(self, info: ChildInfo) -> None:
        # the one-shot entry of the node operations (a request on stdin), not the op session: this runs when
        # something on the node did not stop, and must not wait behind whatever the session is doing
        req = KillGroupRequest(pid=info.pid, pgid=info.pgid, start_time=info.start_time, boot_id=info.boot_id)
        await self.t.run([self.t.python, "-m", "clusterctl.node.nodeops", req.op],
                         input=json.dumps(req.wire()).encode(), timeout=KILL_TIMEOUT)


class _SshPipe:
    def __init__(self, transport: "SshTransport", proc: asyncssh.SSHClientProcess):
        self.transport, self.proc = transport, proc

    def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)

    async def drain(self) -> None:
        try:
            await self.proc.stdin.drain()
        except (asyncssh.DisconnectError, asyncssh.BreakReceived, OSError) as e:
            raise self.transport._lost(str(e) or type(e).__name__) from None

    async def readline(self) -> bytes:
        try:
            return await self.proc.stdout.readline()
        except (asyncssh.DisconnectError, asyncssh.BreakReceived, OSError):
            return b""

    async def read_stderr(self, n: int) -> bytes:
        try:
            return await self.proc.stderr.read(n)
        except (asyncssh.DisconnectError, asyncssh.BreakReceived, OSError):
            return b""

    def close_stdin(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write_eof()

    async def wait(self) -> int | None:
        with contextlib.suppress(asyncssh.DisconnectError, OSError):
            await self.proc.wait_closed()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.close()


class SshTransport(NodeOps):
    """A node reached over SSH. Lazily connected; ``close()`` ends the connection and with it every process
    this transport started (their keepers see EOF and stop their groups)."""

    def __init__(self, node: str, target: SshTarget, *, python: str = "python3", keeper_grace: float = 10.0):
        self.node = node
        self.target = target
        self.python = python
        self.keeper_grace = keeper_grace
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()
        self._channels = asyncio.Semaphore(SHORT_CHANNELS)
        self._started: list[StartedProcess] = []
        self._busy = 0  # commands in flight

    def __repr__(self) -> str:
        return f"SshTransport({self.node!r}, {ssh_policy.describe(self.target)})"

    def _lost(self, detail: str) -> HostUnreachable:
        return HostUnreachable(f"lost the connection to {self.node} ({ssh_policy.describe(self.target)}): {detail}",
                               host=self.target.host)

    async def connection(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._conn is not None and self._conn.is_closed():
                self._conn = None
                fdlimit.SLOTS.release(self)
            if self._conn is None:
                await fdlimit.SLOTS.acquire(self)  # waves when the open-file limit cannot cover every node
                try:
                    self._conn = await connect(self.target)
                except BaseException:
                    fdlimit.SLOTS.release(self)
                    raise
            return self._conn

    def idle(self) -> bool:
        """Nothing in flight and nothing started here: the connection may be closed and reopened later."""
        return not (any(p.returncode is None for p in self._started) or self._busy) and self.ops_idle()

    async def evict(self) -> None:
        """Close the connection to make room for another node's (fdlimit.SLOTS); the next verb reopens it."""
        async with self._ops_guard():  # not while this node's op session is being opened
            await self.close()

    async def _open(self, command: str) -> asyncssh.SSHClientProcess:
        conn = await self.connection()
        try:
            return await conn.create_process(command, encoding=None)
        except asyncssh.ChannelOpenError as e:
            raise HostUnreachable(f"{self.node} refused a new ssh session: {e.reason}", host=self.target.host,
                                  hint="sshd's MaxSessions (default 10) limits sessions per connection") from None
        except (asyncssh.DisconnectError, OSError) as e:
            raise self._lost(str(e) or type(e).__name__) from None

    async def _run_line(self, argv: list[str], command: str, *, input: bytes | None,
                        timeout: float | None) -> CommandResult:
        self._busy += 1
        try:
            return await self._run_counted(argv, command, input=input, timeout=timeout)
        finally:
            self._busy -= 1
            fdlimit.SLOTS.poke()

    async def _run_counted(self, argv: list[str], command: str, *, input: bytes | None,
                           timeout: float | None) -> CommandResult:
        async with self._channels:
            proc = await self._open(command)
            try:
                async with asyncio.timeout(timeout):
                    if input:
                        proc.stdin.write(input)
                    proc.stdin.write_eof()
                    out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
                    await proc.wait_closed()
            except TimeoutError:
                proc.close()
                raise CommandTimedOut(
                    f"{shlex.join(argv)[:200]} timed out after {timeout:g} s on {self.node}", host=self.node,
                    argv=list(argv),
                    hint="the channel was closed; a remote command that does not read stdin may still run") from None
            except (asyncssh.DisconnectError, asyncssh.BreakReceived, OSError) as e:
                raise self._lost(str(e) or type(e).__name__) from None
            finally:
                proc.close()
        rc = proc.returncode
        if rc is None:
            raise self._lost("the command ended without an exit status")
        return CommandResult(list(argv), rc if rc >= 0 else 128 - rc, out, err)

    async def run(self, argv: list[str], *, input: bytes | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, check: bool = False) -> CommandResult:
        result = await self._run_line(argv, shell_command_line(argv, env), input=input, timeout=timeout)
        return raise_for_status(self.node, result) if check else result

    async def start(self, argv: list[str], *, env: dict[str, str] | None = None,
                    grace: float | None = None) -> StartedProcess:
        check_argv(argv, env)
        grace = self.keeper_grace if grace is None else grace
        kargv = keeper_argv(self.python, argv, grace)
        # exec: the keeper's parent is sshd's session process, so a dead session shows as a ppid change too
        proc = await self._open(shell_command_line(kargv, keeper_env(env), exec_=True))
        sp = StartedProcess(self.node, list(argv), _SshChannel(self, proc), grace)
        await sp._begin()
        self._started = [p for p in self._started if p.returncode is None] + [sp]
        return sp

    async def open_pipe(self, argv: list[str], *, env: dict[str, str] | None = None) -> _SshPipe:
        check_argv(argv, env)
        return _SshPipe(self, await self._open(shell_command_line(argv, env, exec_=True)))

    async def close(self) -> None:
        """End the op session, stop everything started here (stdin EOF, grace, kill), then end the connection."""
        await self.close_session()
        started, self._started = self._started, []
        await stop_all(started)
        async with self._lock:
            conn, self._conn = self._conn, None
            fdlimit.SLOTS.release(self)
        if conn is not None:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.wait_closed()
