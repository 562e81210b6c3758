"""A node's operations, over one process there: the op session, and the node-op verbs every transport has.

``OpSession`` is the coordinator's end of ``python -m clusterctl.node.nodeops session`` on one node: one process
(one SSH channel, one Python start-up) answers every request of a launch, a teardown or a sync, concurrently.
``NodeOps`` is what each transport mixes in (localnode.py, sshnode.py, faketransport.py): ``ask`` sends an op's
request model and returns its answer model (protocol/nodeops.py) over the session it opens through its own
``open_pipe``, on first use and again when the last one ended; and the file verbs of the ``Transport`` protocol as
node operations (``read_file``, ``write_file``, ``read_tail``, ``wait_markers``), which is how a remote node
answers them (a local one reads and writes its small files and markers itself: localnode.py). ``PACER`` spreads a
fan-out of requests over turns of the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json

from clusterctl.connect import fdlimit
from clusterctl.connect.transport import NODEOP_TIMEOUT, CommandTimedOut, Pipe
from clusterctl.errors import CannotWrite, IntegrityError, MissingInput, RemoteCommandFailed
from clusterctl.protocol.nodeops import (Answer, BadAnswer, ReadRequest, Request, TailRequest, WaitMarkersAnswer,
                                        WaitMarkersRequest, WatchedRank, WriteRequest, parse_answer)

SESSION_CLOSE_WAIT = 2.0  # after stdin EOF: the node's session ends at once unless a request is still running
_KINDS = {"MissingInput": MissingInput, "IntegrityError": IntegrityError, "CannotWrite": CannotWrite}


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


class NodeOps:
    """Node operations over one op session, for the transport that mixes this in (it has ``node``, ``python``
    and ``open_pipe``). The session opens on first use and again after it ended; ``ops_idle`` says whether a
    request is in flight (fdlimit.SLOTS may then close the connection: sshnode.py)."""

    _ops: OpSession | None = None
    _ops_lock: asyncio.Lock | None = None
    _ops_busy: int = 0  # node operations in flight

    def _ops_guard(self) -> asyncio.Lock:
        if self._ops_lock is None:
            self._ops_lock = asyncio.Lock()
        return self._ops_lock

    async def session(self) -> OpSession:
        """This node's op session, started on first use (and again if the last one ended)."""
        async with self._ops_guard():
            if self._ops is None or not self._ops.alive:
                argv = [self.python, "-m", "clusterctl.node.nodeops", "session"]
                self._ops = OpSession(self.node, await self.open_pipe(argv), argv)
            return self._ops

    def ops_idle(self) -> bool:
        return self._ops_busy == 0

    async def ask(self, req: Request, *, timeout: float = NODEOP_TIMEOUT, paced: bool = False) -> Answer:
        """Run one node operation and return its answer model (``req.answer``); BadAnswer when the node's answer
        is not one. ``paced``: the caller already had its turn of PACER (to build a costly request in it)."""
        self._ops_busy += 1
        try:
            if not paced:
                await PACER.turn()
            sess = await self.session()
            msg = await sess.call(req.op, req.wire(), timeout)
        finally:
            self._ops_busy -= 1
            if not self._ops_busy:
                fdlimit.SLOTS.poke()
        return parse_answer(req, self._answer(req.op, msg, sess), node=self.node, argv=sess.argv)

    def _answer(self, op: str, msg: dict, sess: OpSession) -> dict:
        """The answer object of a session's reply, or the error it reports raised with its kind."""
        if "error" in msg:
            kind = _KINDS.get(msg.get("kind"))
            if kind is not None:
                raise kind(f"{msg['error']} (on {self.node})")
            raise RemoteCommandFailed(f"node {self.node}: {op} failed: {msg['error']}", host=self.node,
                                      argv=[*sess.argv, op])
        doc = msg.get("answer")
        if not isinstance(doc, dict):
            raise RemoteCommandFailed(f"node {self.node}: {op} failed: no answer", host=self.node,
                                      argv=[*sess.argv, op])
        if "error" in doc and len(doc) == 1:
            raise RemoteCommandFailed(f"node {self.node}: {op} failed: {doc['error']}", host=self.node,
                                      argv=[*sess.argv, op])
        return doc

    async def close_session(self) -> None:
        sess, self._ops = self._ops, None
        if sess is not None:
            with contextlib.suppress(Exception):
                await sess.close()

    # ---- the file verbs as node operations (a remote node's way)

    async def read_file(self, path: str, *, limit: int = 65536) -> bytes:
        """A small regular file of the node (not through a symlink)."""
        return base64.b64decode((await self.ask(ReadRequest(path=path, limit=limit))).data)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Replace a file on the node atomically."""
        # encoded in its own turn of the pacer: a 1,000-node hostfile is ~38 KB, 1,000 of them ~100 ms of encoding
        await PACER.turn()
        await self.ask(WriteRequest(path=path, data=base64.b64encode(bytes(data)).decode(), mode=mode), paced=True)

    async def read_tail(self, path: str, limit: int, *, timeout: float = NODEOP_TIMEOUT) -> tuple[int, bytes]:
        """A log's size on the node and its last ``limit`` bytes."""
        ans = await self.ask(TailRequest(path=path, limit=limit), timeout=timeout)
        return ans.size, base64.b64decode(ans.data)

    async def wait_markers(self, paths: list[str], states: set[str], timeout: float,
                           watch: list[WatchedRank | None] | None = None) -> WaitMarkersAnswer:
        """The markers at ``paths`` once all are in ``states``, one failed or a watched rank's process is gone
        (node/markerops.look_at_markers), or as they are after ``timeout``: one marker document (or None) and one
        ``Exited`` (or None) per path. The node long-polls (at most 30 s a request)."""
        req = WaitMarkersRequest(paths=paths, states=sorted(states), timeout=timeout, watch=watch)
        ans = await self.ask(req, timeout=timeout + 30.0)
        if len(ans.markers) != len(paths):
            raise BadAnswer(f"node {self.node}: wait_markers answered {len(ans.markers)} marker(s) for "
                            f"{len(paths)} path(s)", host=self.node)
        ans.exited = (ans.exited + [None] * len(paths))[:len(paths)]  # a node from before ``exited``: none
        return ans
