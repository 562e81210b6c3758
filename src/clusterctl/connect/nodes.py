"""One handle per node for the coordinator: its transport, its runtime dir, and node operations over it.

Node operations (clusterctl.node.nodeops) go through one ``OpSession`` per node and command: one process on the
node (one SSH channel, one Python start-up) answers every request of a launch, a teardown or a sync, concurrently.
``NodeHandle.ask`` sends an op's request model and returns its answer model (protocol/nodeops.py).
Small files of a remote node are read and written through the same session; a local node's directly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from clusterctl.errors import (CannotWrite, ClusterctlError, ConfigError, Exit, IntegrityError, MissingInput,
                               RemoteCommandFailed, UsageError, pydantic_line)
from clusterctl.connect.localnode import LocalTransport
from clusterctl.connect.transport import CommandTimedOut, Pipe, Transport
from clusterctl.protocol.nodespec import Node
from clusterctl.connect import fdlimit
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.node.markerops import look_at_markers
from clusterctl.protocol.nodeops import (Answer, BadAnswer, ProbeAnswer, ProbeRequest, ReadRequest, Request, TailRequest,
                                        WaitMarkersAnswer, WaitMarkersRequest, WatchedRank, WriteRequest,
                                        parse_answer)

NODEOP_TIMEOUT = 120.0
SESSION_CLOSE_WAIT = 2.0  # after stdin EOF: the node's session ends at once unless a request is still running
MARKER_POLL = 0.02  # a local node's markers, read in-process
_KINDS = {"MissingInput": MissingInput, "IntegrityError": IntegrityError, "CannotWrite": CannotWrite}


@dataclass(frozen=True)
class Connector:
    """What opens a node's transport: the real ones (LocalTransport for the coordinator's own node, SshTransport
    for the others). Every command reaches its nodes through the ``SshOptions`` it is given, which carries its
    connector; a test hands in a fake one instead (connect/faketransport.py: ``FakeConnector``)."""

    def transport(self, node: Node, ssh: SshOptions, *, keeper_grace: float = 10.0) -> Transport:
        return make_transport(node.name, local=node.is_local, target=ssh_target(node, ssh),
                              python=node_python(node), keeper_grace=keeper_grace)


@dataclass
class SshOptions:
    """Operator-level SSH choices (flags); everything else comes from cluster.toml via ssh_policy. ``connector``
    opens each node's transport (the real one unless a test gives its fake)."""

    known_hosts: Path | None = None
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0
    connector: Connector = field(default_factory=Connector)


def node_python(node: Node) -> str:
    # A local node runs the coordinator's own interpreter unless cluster.toml names another one.
    if node.is_local and node.python == "python3":
        return sys.executable
    return node.python


def ssh_target(node: Node, ssh: SshOptions):
    """The SshTarget of a remote node (None for a local one): the one source of its SSH options."""
    if node.is_local:
        return None
    from pydantic import ValidationError

    try:
        return SshTarget(host=node.host, port=node.port, user=node.user,
                         identity_file=Path(node.identity_file) if node.identity_file else None,
                         known_hosts=ssh.known_hosts, accept_new_host_keys=ssh.accept_new_host_keys,
                         connect_timeout=ssh.connect_timeout)
    except ValidationError as e:
        raise ConfigError(f"node {node.name}: {pydantic_line(e, 'ssh', plain=True)}") from None


def make_transport(node_name: str, *, local: bool, target, python: str, keeper_grace: float = 10.0) -> Transport:
    """LocalTransport for the coordinator's own node, SshTransport (lazily connected) for the others."""
    if local:
        return LocalTransport(node=node_name, python=python, keeper_grace=keeper_grace)
    if target is None:
        raise UsageError(f"node {node_name} is not local and has no ssh target")
    from clusterctl.connect.sshnode import SshTransport  # asyncssh is imported only when a node needs it

    return SshTransport(node_name, target, python=python, keeper_grace=keeper_grace)


class OpSession:
    """The coordinator's end of ``python -m clusterctl.node.nodeops session`` on one node: requests by id,
    answers matched as they arrive, any number in flight. When the process ends every waiting request fails
    with the last line it wrote to stderr."""

    def __init__(self, node: str, pipe: Pipe, argv: list[str]):
        self.node, self.pipe, self.argv = node, pipe, argv
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = 0
        self.ended: str | None = None
        self.stderr = bytearray()
        self.readers = [asyncio.ensure_future(self._answers()), asyncio.ensure_future(self._errors())]

    async def _errors(self) -> None:
        while chunk := await self.pipe.read_stderr(65536):
            self.stderr += chunk
            del self.stderr[:-8192]

    async def _answers(self) -> None:
        try:
            while line := await self.pipe.readline():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                fut = self.pending.pop(msg.get("id"), None) if isinstance(msg, dict) else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except Exception as e:  # a broken pipe or connection ends the session like EOF does
            self.ended = f"{type(e).__name__}: {e}"
        await asyncio.wait([self.readers[1]], timeout=1.0)
        tail = self.stderr.decode("utf-8", "replace").strip().splitlines()
        self.ended = self.ended or (tail[-1] if tail else "the node's session ended")
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(self._failed(self.ended))
        self.pending.clear()

    def _failed(self, why: str) -> RemoteCommandFailed:
        return RemoteCommandFailed(f"node {self.node}: node operations failed: {why}", host=self.node,
                                   argv=self.argv, stderr_tail=self.stderr.decode("utf-8", "replace")[-2000:])

    @property
    def alive(self) -> bool:
        return self.ended is None

    async def call(self, op: str, req: dict, timeout: float | None) -> dict:
        if self.ended is not None:
            raise self._failed(self.ended)
        self.ids += 1
        rid = self.ids
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            try:
                self.pipe.write(json.dumps({"id": rid, "op": op, "req": req}).encode() + b"\n")
                await self.pipe.drain()
            except (BrokenPipeError, ConnectionError) as e:
                # the process is gone: its stderr says why better than the broken pipe does
                await asyncio.wait([self.readers[0]], timeout=2.0)
                raise self._failed(self.ended or str(e) or type(e).__name__) from None
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise CommandTimedOut(f"{op} timed out after {timeout:g} s on {self.node}", host=self.node,
                                  argv=[*self.argv, op],
                                  hint="the operation may still be running on the node") from None
        finally:
            self.pending.pop(rid, None)

    async def close(self) -> None:
        self.pipe.close_stdin()
        try:
            async with asyncio.timeout(SESSION_CLOSE_WAIT):
                await self.pipe.wait()
        except TimeoutError:
            # a request still running there: end our side now (over SSH the node finishes it on its own)
            self.pipe.kill()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SESSION_CLOSE_WAIT):
                    await self.pipe.wait()
        for t in self.readers:
            t.cancel()


class Pacer:
    """At most BURST node operations start in one turn of the event loop. A fan-out to hundreds of nodes (a
    session opened and a request sent for each) then runs as several short turns instead of one long one, and
    whatever else the loop serves (keepalives, answers, a Ctrl-C) gets a turn in between (bench/scale.py)."""

    BURST = 32

    def __init__(self):
        self.loop = None
        self.used = 0
        self.queue: collections.deque[asyncio.Future] = collections.deque()

    async def turn(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            self.loop, self.used, self.queue = loop, 0, collections.deque()
        if self.used < self.BURST and not self.queue:
            if self.used == 0:
                loop.call_soon(self._next)
            self.used += 1
            return
        fut = loop.create_future()
        self.queue.append(fut)
        await fut

    def _next(self) -> None:
        self.used = 0
        while self.queue and self.used < self.BURST:
            fut = self.queue.popleft()
            if not fut.done():
                fut.set_result(None)
                self.used += 1
        if self.used:
            self.loop.call_soon(self._next)


PACER = Pacer()


@dataclass
class NodeHandle:
    node: Node
    transport: Transport
    runtime_dir: str | None = None
    probe: ProbeAnswer | None = None
    _session: OpSession | None = field(default=None, init=False, repr=False)
    _opening: asyncio.Lock | None = field(default=None, init=False, repr=False)
    _busy: int = field(default=0, init=False, repr=False)  # node operations in flight

    @property
    def name(self) -> str:
        return self.node.name

    async def session(self) -> OpSession:
        """This node's op session, started on first use (and again if the last one ended)."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._session is None or not self._session.alive:
                argv = [self.transport.python, "-m", "clusterctl.node.nodeops", "session"]
                self._session = OpSession(self.name, await self.transport.open_pipe(argv), argv)
            return self._session

    def idle(self) -> bool:
        return self._busy == 0

    async def evict(self) -> None:
        """Close the connection to make room for another node's (fdlimit.SLOTS); the next op reopens it."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            await self.close()

    async def ask(self, req: Request, *, timeout: float = NODEOP_TIMEOUT, paced: bool = False) -> Answer:
        """Run one node operation and return its answer model (``req.answer``); BadAnswer when the node's answer
        is not one. ``paced``: the caller already had its turn of PACER (to build a costly request in it)."""
        doc = await self.op(req.op, req.wire(), timeout=timeout, paced=paced)
        sess = self._session
        return parse_answer(req, doc, node=self.name, argv=sess.argv if sess is not None else [])

    async def op(self, op: str, req: dict, *, timeout: float = NODEOP_TIMEOUT, paced: bool = False) -> dict:
        """Run one node operation (clusterctl.node.nodeops) and return its JSON answer as it came (``ask`` is
        the typed way). ``paced``: the caller already had its turn of PACER (to build a costly request in it)."""
        self._busy += 1
        try:
            if not paced:
                await PACER.turn()
            sess = await self.session()
            msg = await sess.call(op, req, timeout)
        finally:
            self._busy -= 1
            if not self._busy:
                fdlimit.SLOTS.poke()
        return self._answer(op, msg, sess)

    def _answer(self, op: str, msg: dict, sess: OpSession) -> dict:
        if "error" in msg:
            kind = _KINDS.get(msg.get("kind"))
            if kind is not None:
                raise kind(f"{msg['error']} (on {self.name})")
            raise RemoteCommandFailed(f"node {self.name}: {op} failed: {msg['error']}", host=self.name,
                                      argv=[*sess.argv, op])
        doc = msg.get("answer")
        if not isinstance(doc, dict):
            raise RemoteCommandFailed(f"node {self.name}: {op} failed: no answer", host=self.name,
                                      argv=[*sess.argv, op])
        if "error" in doc and len(doc) == 1:
            raise RemoteCommandFailed(f"node {self.name}: {op} failed: {doc['error']}", host=self.name,
                                      argv=[*sess.argv, op])
        return doc

    def path(self, name: str) -> str:
        assert self.runtime_dir, "runtime dir not resolved yet"
        return os.path.join(self.runtime_dir, name)

    async def read_file(self, path: str, *, limit: int = 65536) -> bytes:
        if self.transport.is_local:
            return await self.transport.read_file(path, limit=limit)
        import base64

        return base64.b64decode((await self.ask(ReadRequest(path=path, limit=limit))).data)

    async def read_tail(self, path: str, limit: int, *, timeout: float = NODEOP_TIMEOUT) -> tuple[int, bytes]:
        """A log's size on the node and its last ``limit`` bytes (node op ``tail``: a local node answers the same)."""
        import base64

        ans = await self.ask(TailRequest(path=path, limit=limit), timeout=timeout)
        return ans.size, base64.b64decode(ans.data)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Replace a file on the node atomically."""
        if self.transport.is_local:
            return await self.transport.write_file(path, data, mode=mode)
        import base64

        # encoded in its own turn of the pacer: a 1,000-node hostfile is ~38 KB, 1,000 of them ~100 ms of encoding
        await PACER.turn()
        await self.ask(WriteRequest(path=path, data=base64.b64encode(bytes(data)).decode(), mode=mode), paced=True)

    async def read_json(self, path: str, *, limit: int = 65536) -> dict | None:
        """A small JSON file on the node, or None when it is missing or unreadable (never raises for that)."""
        try:
            data = await self.read_file(path, limit=limit)
        except ClusterctlError:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    async def wait_markers(self, paths: list[str], states: set[str], timeout: float,
                           watch: list[WatchedRank | None] | None = None) -> WaitMarkersAnswer:
        """The markers at ``paths`` once all are in ``states``, one failed or a watched rank's process is gone
        (node/markerops.look_at_markers), or as they are after ``timeout``: one marker document (or None) and one
        ``Exited`` (or None) per path."""
        if not self.transport.is_local:
            req = WaitMarkersRequest(paths=paths, states=sorted(states), timeout=timeout, watch=watch)
            ans = await self.ask(req, timeout=timeout + 30.0)
            if len(ans.markers) != len(paths):
                raise BadAnswer(f"node {self.name}: wait_markers answered {len(ans.markers)} marker(s) for "
                                f"{len(paths)} path(s)", host=self.name)
            ans.exited = (ans.exited + [None] * len(paths))[:len(paths)]  # a node from before ``exited``: none
            return ans
        deadline = time.monotonic() + timeout
        while True:
            look, settled = look_at_markers(paths, states, watch)
            if settled or time.monotonic() >= deadline:
                return look
            await asyncio.sleep(MARKER_POLL)

    async def close(self) -> None:
        sess, self._session = self._session, None
        if sess is not None:
            with contextlib.suppress(Exception):
                await sess.close()
        try:
            await self.transport.close()
        except Exception:
            pass


def handles(nodes: list[Node], ssh: SshOptions, *, keeper_grace: float = 10.0,
            runtime_dirs: dict[str, str] | None = None) -> dict[str, NodeHandle]:
    out = {}
    for n in nodes:
        h = out[n.name] = NodeHandle(n, ssh.connector.transport(n, ssh, keeper_grace=keeper_grace),
                                     runtime_dir=(runtime_dirs or {}).get(n.name) or n.runtime_dir)
        if hasattr(h.transport, "owner"):
            h.transport.owner = h  # the connection is idle when no op is in flight (fdlimit.SLOTS)
    return out


async def close_all(hs: dict[str, NodeHandle]) -> None:
    await asyncio.gather(*(h.close() for h in hs.values()), return_exceptions=True)


class NodePool:
    """Node handles kept across the looks of one command (``status --watch``, ``reap`` over several jobs): one
    connection and one op session per node, reopened only when it dropped (NodeHandle.session)."""

    def __init__(self, ssh: SshOptions, *, keeper_grace: float = 10.0):
        self.ssh, self.keeper_grace = ssh, keeper_grace
        self.kept: dict[tuple, NodeHandle] = {}

    def handles(self, nodes: list[Node]) -> dict[str, NodeHandle]:
        out = {}
        for n in nodes:
            key = (n.name, n.host, n.port, n.user, n.identity_file, n.python, n.runtime_dir, n.is_local)
            if key not in self.kept:
                self.kept[key] = handles([n], self.ssh, keeper_grace=self.keeper_grace)[n.name]
            out[n.name] = self.kept[key]
        return out

    async def close(self) -> None:
        kept, self.kept = self.kept, {}
        await asyncio.gather(*(h.close() for h in kept.values()), return_exceptions=True)


def first_error_code(errors: list[BaseException]):
    """One exit code for several per-node errors: the shared one, or 1 (failed on at least one host)."""

    codes = {getattr(e, "exit_code", Exit.FAILED) for e in errors}
    return codes.pop() if len(codes) == 1 else Exit.FAILED


__all__ = ["NodeHandle", "NodePool", "SshOptions", "handles", "close_all", "Connector", "make_transport", "node_python", "IntegrityError"]


def probe_memory(nodes: list[Node], ssh: SshOptions) -> dict[str, float]:
    """Total RAM (GiB) of remote nodes, probed concurrently over SSH (for `plan --probe`)."""
    async def go() -> dict[str, float]:
        hs = handles(nodes, ssh)
        try:
            answers = await asyncio.gather(*(h.ask(ProbeRequest()) for h in hs.values()))
        finally:
            await close_all(hs)
        return {name: round(a.mem_total / (1 << 30), 3) for name, a in zip(hs, answers)}

    return asyncio.run(go())
