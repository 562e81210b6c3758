"""A fake node for unit tests, beside the real transports (transport.py: local, sshnode.py: SSH).

``FakeTransport`` is an in-memory ``Transport`` of a remote node; its ``open_pipe`` answers the node-op session
protocol (nodes.OpSession: JSON lines ``{"id", "op", "req"}`` in, ``{"id", "answer"|"error"}`` out) from a
``ScriptedOps``: one function per op, each given the request and returning the answer. So the real
``NodeHandle``/``OpSession`` code runs, and a teardown, reap, cancel or status decision is tested in
milliseconds without sshd or ranks. Files written through the handle (``read``/``write`` ops) live in
``ScriptedOps.files``. Every request is recorded in ``ScriptedOps.calls``.

    ops = ScriptedOps({"sweep": lambda req: {"results": [{"pid": 7, "status": "terminated"}]}})
    with fake_nodes({"a": ops}):          # every handle of node "a" made from now on talks to ``ops``
        report = asyncio.run(teardown_command(state, job_id, SshOptions(), grace=1))
    assert ops.ops() == ["sweep", "clean"]

An op function may be ``async`` (to hold an answer back), may raise ``NodeOpError`` (the node reports an error
of that kind, as nodeops does), and an op without a function answers "unknown op".
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from clusterctl.launch.transport import CommandResult


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

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]

    async def answer(self, op: str, req: dict) -> dict:
        self.calls.append((op, req))
        fn = self.answers.get(op) or getattr(self, f"_op_{op}", None)
        if fn is None:
            raise NodeOpError(f"unknown op {op}", "UsageError")
        got = fn(req)
        return await got if inspect.isawaitable(got) else got

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
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        self.closed = asyncio.Event()
        self.returncode: int | None = None

    def write(self, data: bytes) -> None:
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
        await self.lines.put(json.dumps(out).encode() + b"\n")

    async def drain(self) -> None:
        await asyncio.sleep(0)

    async def readline(self) -> bytes:
        get = asyncio.ensure_future(self.lines.get())
        closed = asyncio.ensure_future(self.closed.wait())
        done, _ = await asyncio.wait([get, closed], return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            closed.cancel()
            return get.result()
        get.cancel()
        return b""

    async def read_stderr(self, n: int = 65536) -> bytes:
        await self.closed.wait()
        return b""

    def close_stdin(self) -> None:
        self.kill()

    def kill(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        self.returncode = 0
        self.closed.set()

    async def wait(self) -> int:
        await self.closed.wait()
        return 0


class FakeTransport:
    """An in-memory remote node: node operations answered by ``ops``; nothing is ever run or started."""

    is_local = False

    def __init__(self, node: str, ops: ScriptedOps, python: str = "python3"):
        self.node, self.ops, self.python = node, ops, python
        self.pipes: list[ScriptedPipe] = []

    async def run(self, argv: list[str], *, input: bytes | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, check: bool = False) -> CommandResult:
        raise NotImplementedError("FakeTransport runs no commands: script the node operation instead")

    async def start(self, argv: list[str], *, env: dict[str, str] | None = None, grace: float | None = None):
        raise NotImplementedError("FakeTransport starts no processes")

    async def open_pipe(self, argv: list[str], *, env: dict[str, str] | None = None) -> ScriptedPipe:
        pipe = ScriptedPipe(self.ops)
        self.pipes.append(pipe)
        return pipe

    async def close(self) -> None:
        for p in self.pipes:
            p.kill()


@contextlib.contextmanager
def fake_nodes(script: dict[str, ScriptedOps]):
    """Every node handle made inside (``nodes.handles``) for a node named in ``script`` talks to its fake."""
    from clusterctl.launch import nodes

    real = nodes.transport_for

    def transport_for(node, ssh, *, keeper_grace: float = 10.0):
        if node.name in script:
            return FakeTransport(node.name, script[node.name])
        return real(node, ssh, keeper_grace=keeper_grace)

    nodes.transport_for = transport_for
    try:
        yield script
    finally:
        nodes.transport_for = real
