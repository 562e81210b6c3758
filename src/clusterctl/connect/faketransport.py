"""A fake node for unit tests, beside the real transports (localnode.py: this machine, sshnode.py: SSH).

``FakeTransport`` is an in-memory ``Transport`` of a remote node; its ``open_pipe`` answers the node-op session
protocol (opsession.OpSession: JSON lines ``{"id", "op", "req"}`` in, ``{"id", "answer"|"error"}`` out) from a
``ScriptedOps``: one function per op, each given the request and returning the answer. So the real
``NodeOps``/``OpSession`` code runs, and a teardown, reap, cancel or status decision is tested in
milliseconds without sshd or ranks. Files written through the handle (``read``/``write`` ops) live in
``ScriptedOps.files``. Every request is recorded in ``ScriptedOps.calls``. ``run`` and ``start`` (a foreground
rank through its keeper) are answered by the ops ``run`` and ``start`` the same way; a started process runs until
its stdin closes. ``SimulatedNode`` (launch/fakecluster.py) is a healthy node that a whole launch can run on.

    ops = ScriptedOps({"sweep": lambda req: {"results": [{"pid": 7, "status": "gone"}]}})
    ssh = fake_ssh({"a": ops})            # every handle of node "a" made with ``ssh`` talks to ``ops``
    report = asyncio.run(teardown_command(state, job_id, ssh, grace=1))
    assert ops.ops() == ["sweep", "clean"]

The fake is a parameter, never a patched global: ``FakeConnector`` is a ``nodes.Connector``, what every command
is handed as its ``ssh`` (``LaunchOptions(ssh=fake_ssh(...))`` for a launch or a supervisor).

An op function may be ``async`` (to hold an answer back), may return the op's answer model (protocol/nodeops.py)
or its JSON object, may raise ``NodeOpError`` (the node reports an error of that kind, as nodeops does), and an op
without a function answers "unknown op"; answers are checked on the coordinator's side like a real node's
(``NodeOps.ask``). ``ScriptedOps.cut()`` takes
the whole node away (its open sessions end, a new connection is refused with ``HostUnreachable``, as a node
that went down or whose link was cut); ``restore()`` brings it back.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from clusterctl.errors import HostUnreachable
from clusterctl.connect.opsession import NodeOps
from clusterctl.connect.transport import (CommandResult, CommandTimedOut, StartedProcess, check_argv, keeper_argv,
                                         raise_for_status, shell_command_line, stop_all)
from clusterctl.connect import nodes
from clusterctl.protocol.nodeops import Answer


class NodeOpError(Exception):
    """Raised by a scripted op: the node answers ``{"error": message, "kind": kind}``."""

    def __init__(self, message: str, kind: str = "ClusterctlError"):
        super().__init__(message)
        self.message, self.kind = message, kind


@dataclass
class ScriptedOps:
    """What one fake node answers, op by op; ``files`` backs the ``read`` and ``write`` ops."""

    answers: dict[str, Callable[[dict], Any]] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    calls: list[tuple[str, dict]] = field(default_factory=list)
    bytes_in: int = 0  # what the coordinator sent this node (op requests)
    sessions: int = 0  # op sessions opened to this node (each would be an SSH channel and a Python start-up)
    pids: int = 4000
    reachable: bool = True  # False: cut off (``cut``); every connection to it is refused
    open_pipes: set = field(default_factory=set, repr=False)  # its op sessions open now (ScriptedPipe)

    def cut(self) -> None:
        """The node goes away: every open session to it ends, every new one is refused until ``restore``."""
        self.reachable = False
        for pipe in list(self.open_pipes):
            pipe.kill()

    def restore(self) -> None:
        self.reachable = True

    def refuse(self, node: str) -> None:
        """Raise what connecting to a node that is cut off raises (sshnode.py: the connection fails)."""
        if not self.reachable:
            raise HostUnreachable(f"cannot reach {node}: connection refused (the fake node is cut off)", host=node)

    def _op_run(self, req: dict) -> dict:
        """``transport.run``, unless scripted: exit 0, no output."""
        return {"returncode": 0, "stdout": "", "stderr": ""}

    def _op_start(self, req: dict) -> dict:
        """``transport.start`` (a foreground process through the keeper), unless scripted: a new pid that runs
        until its stdin closes. The answer is the keeper's report (pid, pgid, start_time, boot_id)."""
        self.pids += 1
        return {"pid": self.pids, "pgid": self.pids, "start_time": 1.0, "boot_id": "fake-boot"}

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]

    async def answer(self, op: str, req: dict) -> dict:
        self.calls.append((op, req))
        fn = self.answers.get(op) or getattr(self, f"_op_{op}", None)
        if fn is None:
            raise NodeOpError(f"unknown op {op}", "UsageError")
        got = fn(req)
        got = await got if inspect.isawaitable(got) else got
        return got.wire() if isinstance(got, Answer) else got

    def _op_read(self, req: dict) -> dict:
        data = self.files.get(req["path"])
        if data is None:
            raise NodeOpError(f"file not found: {req['path']}", "MissingInput")
        return {"data": base64.b64encode(data[: int(req.get("limit", 65536))]).decode()}

    def _op_write(self, req: dict) -> dict:
        self.files[req["path"]] = base64.b64decode(req["data"])
        return {"ok": True}

    def put_json(self, path: str, doc: dict) -> None:
        self.files[path] = json.dumps(doc).encode()


class ScriptedPipe:
    """The fake node's end of an op session: each request line is answered by ``ScriptedOps``, concurrently."""

    def __init__(self, ops: ScriptedOps):
        self.ops = ops
        ops.open_pipes.add(self)
        self.lines: collections.deque[bytes] = collections.deque()
        self.waiter: asyncio.Future | None = None  # a readline waiting for a line or the end
        self.tasks: set[asyncio.Task] = set()
        self.closed = asyncio.Event()
        self.returncode: int | None = None

    def write(self, data: bytes) -> None:
        self.ops.bytes_in += len(data)
        for line in data.splitlines():
            msg = json.loads(line)
            t = asyncio.ensure_future(self._answer(msg))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _answer(self, msg: dict) -> None:
        try:
            out = {"id": msg["id"], "answer": await self.ops.answer(msg["op"], msg.get("req") or {})}
        except NodeOpError as e:
            out = {"id": msg["id"], "error": e.message, "kind": e.kind}
        self.lines.append(json.dumps(out).encode() + b"\n")
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    async def readline(self) -> bytes:
        # a plain future, no task: a readline cancelled (a session's reader is, when its handle closes) leaves
        # nothing pending behind
        while not self.lines:
            if self.closed.is_set():
                return b""
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.lines.popleft()

    async def read_stderr(self, n: int = 65536) -> bytes:
        await self.closed.wait()
        return b""

    def close_stdin(self) -> None:
        self.kill()

    def kill(self) -> None:
        self.ops.open_pipes.discard(self)
        for t in list(self.tasks):
            t.cancel()
        self.returncode = 0
        self.closed.set()
        self._wake()

    async def wait(self) -> int:
        await self.closed.wait()
        return 0


class FakeChannel:
    """The keeper's channel of a fake started process: its report line, then nothing until its stdin closes
    (exit 143, as the keeper's TERM) or it is told ``kill`` (137). ``exit(rc)`` ends it from the node's side."""

    def __init__(self, report: dict, ops: ScriptedOps, argv: list[str]):
        self.ops, self.argv, self.info = ops, argv, report
        self.out = [json.dumps(report).encode() + b"\n"]
        self.rc: int | None = None
        self.done = asyncio.Event()

    def exit(self, rc: int) -> None:
        if self.rc is None:
            self.rc = rc
            self.ops.calls.append(("exit", {"argv": self.argv, "returncode": rc}))
        self.done.set()

    async def read_stdout(self, n: int) -> bytes:
        if self.out:
            return self.out.pop(0)
        await self.done.wait()
        return b""

    async def read_stderr(self, n: int) -> bytes:
        await self.done.wait()
        return b""

    async def write_stdin(self, data: bytes) -> None:
        if data.strip() == b"kill":
            self.exit(137)

    async def close_stdin(self) -> None:
        self.exit(143)

    async def wait_exit(self) -> int:
        await self.done.wait()
        return self.rc

    def abort(self) -> None:
        self.exit(143)

    async def force_kill(self, info) -> None:
        self.exit(137)


class FakeTransport(NodeOps):
    """An in-memory remote node: node operations answered by ``ops`` (its files and markers too, as a remote
    node's are: opsession.NodeOps); ``run`` and ``start`` too (the ops ``run`` and ``start``: the request is
    ``{"argv", "env", "input"}``), nothing real ever runs."""

    def __init__(self, node: str, ops: ScriptedOps, python: str = "python3", keeper_grace: float = 10.0):
        self.node, self.ops, self.python, self.keeper_grace = node, ops, python, keeper_grace
        self.pipes: list[ScriptedPipe] = []
        self.started: list = []

    async def run(self, argv: list[str], *, input: bytes | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, check: bool = False) -> CommandResult:
        check_argv(argv, env)
        self.ops.refuse(self.node)
        self.ops.bytes_in += len(shell_command_line(argv, env)) + len(input or b"")
        try:
            async with asyncio.timeout(timeout):
                ans = await self.ops.answer("run", {"argv": list(argv), "env": env or {},
                                                    "input": (input or b"").decode("utf-8", "replace")})
        except TimeoutError:
            raise CommandTimedOut(f"{argv[0]} timed out after {timeout:g} s on {self.node}", host=self.node,
                                  argv=list(argv)) from None
        result = CommandResult(list(argv), int(ans.get("returncode", 0)), str(ans.get("stdout", "")).encode(),
                               str(ans.get("stderr", "")).encode())
        return raise_for_status(self.node, result) if check else result

    async def start(self, argv: list[str], *, env: dict[str, str] | None = None,
                    grace: float | None = None) -> StartedProcess:
        check_argv(argv, env)
        self.ops.refuse(self.node)
        grace = self.keeper_grace if grace is None else grace
        self.ops.bytes_in += len(shell_command_line(keeper_argv(self.python, argv, grace), env))
        report = await self.ops.answer("start", {"argv": list(argv), "env": env or {}})
        sp = StartedProcess(self.node, list(argv), FakeChannel(report, self.ops, list(argv)), grace)
        await sp._begin()
        self.started = [p for p in self.started if p.returncode is None] + [sp]
        return sp

    async def open_pipe(self, argv: list[str], *, env: dict[str, str] | None = None) -> ScriptedPipe:
        self.ops.refuse(self.node)
        pipe = ScriptedPipe(self.ops)
        self.ops.sessions += 1
        self.pipes.append(pipe)
        return pipe

    async def close(self) -> None:
        await self.close_session()
        started, self.started = self.started, []
        await stop_all(started)
        for p in self.pipes:
            p.kill()


@dataclass
class FakeConnector(nodes.Connector):
    """Opens a ``FakeTransport`` for every node named in ``script`` (its ``ScriptedOps``), the real transport
    (with the SSH choices of ``nodes.Connector``) for any other node."""

    script: dict[str, ScriptedOps] = field(default_factory=dict)

    def transport(self, node, *, keeper_grace: float = 10.0):
        ops = self.script.get(node.name)
        if ops is None:
            return super().transport(node, keeper_grace=keeper_grace)
        return FakeTransport(node.name, ops, keeper_grace=keeper_grace)


def fake_ssh(script: dict[str, ScriptedOps], **options) -> FakeConnector:
    """The ``FakeConnector`` of ``script`` (any SSH choice of ``nodes.Connector`` in ``options``): hand it to a
    command as its ``ssh``."""
    return FakeConnector(script=script, **options)
