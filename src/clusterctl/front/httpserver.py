"""The front's HTTP/1.1 server: client connections parsed by httptools (llhttp, the parser of Node.js), each
request handed whole to one async handler, answers written as bytes.

Why not aiohttp's server, which the front used first: on a request rank 0 answers at once, its per-request
machinery (request and response objects, header multidicts, timers, the payload writer) was a third of the front's
own CPU time per request, and a request that waits ~30 ms on rank 0 finds the caches cold, which makes every
instruction dearer (bench/front.py, docs/dependencies.md). The parsing (request lines, headers, Content-Length and
chunked bodies, keep-alive) is the library's; what is here is the connection's bookkeeping:

- requests on one connection are answered in order, one at a time (pipelined ones wait, reading paused);
- a head over ``MAX_HEAD`` bytes is 431, a body over ``max_body`` is 413 (declared or counted as it arrives, the
  connection closed), a request that does not parse is 400, all in OpenAI's error shape with ``Server``;
- ``Expect: 100-continue`` is answered; HTTP/1.0 clients get close-delimited streams and no keep-alive;
- a client that leaves cancels its handler (the front then closes its request to rank 0, which cancels it);
- ``sweep`` (called by the front's watcher) closes connections idle past ``KEEPALIVE_S`` and those whose request
  has not arrived whole in ``REQUEST_S``;
- a slow reader pauses the writer (``send`` waits for the transport to drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import unquote

import httptools

from clusterctl.protocol.httpedge import body_too_large, error_document, error_type

MAX_HEAD = 64 << 10  # request line and headers, bytes
KEEPALIVE_S = 75.0  # an idle kept-alive connection is closed after this long (aiohttp's and nginx's default)
REQUEST_S = 300.0  # a request (head and body) must arrive whole in this long
LINGER_S = 2.0  # after a refusal, what the client still sends is dropped this long before the connection closes
STALL_S = 60.0  # a client that reads nothing of its answer for this long is cut off (its request ends)
PIPELINE = 4  # requests read ahead of their answers on one connection before reading pauses
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Gone(ConnectionError):
    """The client's connection closed: nothing more can be sent to it."""


def error_doc(status: int, message: str, *, code: str | None = None) -> dict:
    """OpenAI's error shape (protocol/httpedge.py), its type by the status."""
    return error_document(message, type=error_type(status), code=code)


_date = [0, ""]


def http_date() -> str:
    """The Date header's value, formatted once a second."""
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, formatdate(now, usegmt=True)
    return _date[1]


def _dated(headers) -> list:
    headers = list(headers)
    if not any(k.lower() == "date" for k, _ in headers):
        headers.append(("Date", http_date()))
    return headers


class Request:
    """One request, whole: its method, target (as sent), decoded path, query, headers and body. The handler
    answers through ``respond`` (a whole answer) or ``start``/``send``/``end`` (a stream)."""

    __slots__ = ("conn", "method", "target", "path", "query", "headers", "_h", "body", "http11", "keep_alive",
                 "_started", "_chunked", "_ended")

    def __init__(self, conn: "Connection", method: str, target: str, headers: list[tuple[str, str]],
                 lookup: dict[str, str], http11: bool, keep_alive: bool):
        if not target.startswith("/") and "://" in target:  # absolute-form: its path and query are the target
            u = httptools.parse_url(target.encode("utf-8", "surrogateescape"))
            target = (u.path or b"/").decode("utf-8", "surrogateescape") + (
                "?" + u.query.decode("utf-8", "surrogateescape") if u.query else "")
        self.conn, self.method, self.target, self.headers, self._h = conn, method, target, headers, lookup
        path, _, self.query = target.partition("?")
        self.path = unquote(path) if "%" in path else path
        self.body = b""
        self.http11, self.keep_alive = http11, keep_alive
        self._started = self._chunked = self._ended = False

    def header(self, name: str) -> str | None:
        """A header's value (``name`` in lower case); the last one if sent several times."""
        return self._h.get(name)

    @property
    def gone(self) -> bool:
        return self.conn.closed

    @property
    def answered(self) -> bool:
        return self._ended

    def _head(self, status: int, headers, extra: str) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nServer: {self.conn.server.name}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        if self.conn.server.closing:
            self.keep_alive = False  # the server is stopping: no request after this one
        if not self.keep_alive:
            lines.append("Connection: close\r\n")
        elif not self.http11:
            lines.append("Connection: keep-alive\r\n")  # an HTTP/1.0 client that asked for it is told it stays
        lines.append(extra)
        return "".join(lines).encode("utf-8", "surrogateescape")

    def respond(self, status: int, headers, body: bytes = b"", *, length: int | None = None,
                close: bool = False) -> None:
        """The whole answer in one write: ``headers`` (pairs; ``Date`` added unless among them) and ``body``
        (not sent to a HEAD; ``length`` is then the Content-Length to declare). ``close``: the connection closes
        after it."""
        if self._started:
            raise RuntimeError("answered already")
        self._started = self._ended = True
        if close:
            self.keep_alive = False
        n = len(body) if length is None else length
        bodiless = status < 200 or status in (204, 304)  # answers that carry no body and say no length
        head = self._head(status, _dated(headers), "\r\n" if bodiless else f"Content-Length: {n}\r\n\r\n")
        self.conn.write(head if self.method == "HEAD" else head + body)

    def json(self, status: int, doc: dict, headers=(), **kw) -> None:
        self.respond(status, [("Content-Type", "application/json"), *headers], json.dumps(doc).encode(), **kw)

    def start(self, status: int, headers) -> None:
        """A stream's head, sent at once: chunked to an HTTP/1.1 client, close-delimited to an HTTP/1.0 one."""
        if self._started:
            raise RuntimeError("answered already")
        self._started = True
        self._chunked = self.http11 and self.method != "HEAD"
        if not self._chunked:
            self.keep_alive = False
        self.conn.write(self._head(status, _dated(headers), "Transfer-Encoding: chunked\r\n\r\n" if self._chunked
                                   else "\r\n"))

    def write(self, data: bytes) -> None:
        """Part of a stream, written now (``conn.paused`` says when the client reads slower than it is written).
        ``Gone`` if it left."""
        if data and self.method != "HEAD":
            self.conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    async def send(self, data: bytes) -> None:
        """Part of a stream; waits while the client reads slower than it is written. ``Gone`` if it left."""
        self.write(data)
        await self.conn.drain()

    def end(self) -> None:
        """The stream's end (a close-delimited one ends when the connection closes, after this)."""
        if self._started and not self._ended:
            self._ended = True
            if self._chunked and not self.conn.closed:
                self.conn.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection: httptools' callbacks build each request, one task answers them in order."""

    def __init__(self, server: "Server"):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reading = True
        self.stopped = False  # reading stopped for good: the connection closes once its answers are out
        self.last = time.monotonic()  # the last byte in or the last answer out: for the keep-alive bound
        self.began: float | None = None  # when the request being read began (None between requests)
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task | None = None
        self.refused = False  # the server refused: nothing more is read, the connection closes
        self._refusal: bytes | None = None  # a refusal waiting for the answers before it to be written
        self._writable: asyncio.Future | None = None
        self.on_writable: Callable[[], None] | None = None  # told when a paused writer may write again
        self.stalled_at: float | None = None  # since when the client has not read what was written to it
        self.closing_at: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._url: list[bytes] = []
        self._headers: list[tuple[str, str]] = []
        self._lookup: dict[str, str] = {}
        self._size = 0
        self._head_bytes = 0
        self._in_head = False
        self._body: list[bytes] = []
        self._req: Request | None = None

    # ---- the transport ---------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.conns.discard(self)
        self.resume_writing()  # a writer waiting to drain wakes, and finds the connection closed
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its handler stops (and closes what it asked of rank 0)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()
            self.stalled_at = time.monotonic()

    def resume_writing(self) -> None:
        self.stalled_at = None
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self.on_writable is not None:
            self.on_writable()

    @property
    def paused(self) -> bool:
        """The client reads slower than it is written (the transport's buffer is past its high-water mark)."""
        return self._writable is not None and not self._writable.done()

    def data_received(self, data: bytes) -> None:
        if self.refused or self.stopped:
            return
        self.last = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._stop_reading()  # the requests before it are answered; the upgrade is not (no protocol but 1.1)
        except httptools.HttpParserError as e:
            if not (self.refused or self.stopped):  # else: bytes after a request that closes the connection
                self.refuse(400, f"the request does not parse as HTTP/1.1: {e}")
            return
        if self._in_head:  # httptools holds a header line until its end: bound what it holds
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self.refuse(431, f"request headers over {MAX_HEAD} bytes")

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise Gone("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._writable is not None and not self._writable.done():
            await self._writable
        if self.closed:
            raise Gone("the client closed the connection")

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.closing_at = time.monotonic()
            self.transport.close()

    def _stop_reading(self) -> None:
        if self.reading and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self.reading, self.stopped = False, True
        if self.task is None and not self.queue:
            self.close()

    def refuse(self, status: int, message: str) -> None:
        """An answer from the server itself (after the answers before it), then the connection closes."""
        if self.refused:
            return
        self.refused = True
        self.server.refused(status)
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nServer: {self.server.name}\r\n"
                f"Date: {http_date()}\r\nContent-Type: application/json\r\nConnection: close\r\n")
        body = json.dumps(error_doc(status, message)).encode()
        head += "".join(f"{k}: {v}\r\n" for k, v in self.server.refusal_headers(self._lookup))
        self._refusal = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        if self.task is None:
            self._send_refusal()

    def _send_refusal(self) -> None:
        data, self._refusal = self._refusal, None
        if data is None or self.closed or self.transport is None or self.transport.is_closing():
            self.close()
            return
        self.transport.write(data)
        # a lingering close: what the client still sends is read and dropped for a while, so that it reads
        # this answer rather than a reset (closing on unread bytes resets the connection)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    # ---- httptools' callbacks ----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.began = time.monotonic()
        self._reset()
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._size += len(url)
        self._url.append(url)
        if self._size > MAX_HEAD:
            self.refuse(414, "request line too long")
            raise httptools.HttpParserCallbackError("refused")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._size += len(name) + len(value) + 4
        if self._size > MAX_HEAD:
            self.refuse(431, f"request headers over {MAX_HEAD} bytes")
            raise httptools.HttpParserCallbackError("refused")
        k, v = name.decode("latin-1"), value.decode("utf-8", "surrogateescape")
        self._headers.append((k, v))
        self._lookup[k.lower()] = v

    def on_headers_complete(self) -> None:
        p = self.parser
        self._in_head, self._size = False, 0
        method = p.get_method().decode("latin-1")
        if method == "CONNECT":
            self.refuse(405, "CONNECT is not served here")
            raise httptools.HttpParserCallbackError("refused")
        target = b"".join(self._url).decode("utf-8", "surrogateescape")
        self._req = Request(self, method, target, self._headers, self._lookup, p.get_http_version() == "1.1",
                            p.should_keep_alive() and not p.should_upgrade())
        declared = self._lookup.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.server.max_body:
            self.refuse(413, body_too_large(self.server.max_body))
            raise httptools.HttpParserCallbackError("refused")
        if (self._lookup.get("expect", "").lower() == "100-continue" and self._req.http11 and self.task is None
                and not self.queue):
            self.transport.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            self.refuse(413, body_too_large(self.server.max_body))
            raise httptools.HttpParserCallbackError("refused")
        self._body.append(body)

    def on_message_complete(self) -> None:
        req, self._req, self.began = self._req, None, None
        if req is None:
            return
        req.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._reset()
        self.queue.append(req)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._answer())
        if not req.keep_alive:
            self._stop_reading()  # nothing after it is read: the connection closes once it is answered
        elif len(self.queue) >= PIPELINE and self.reading:  # pipelined this deep: reading waits for answers
            self.transport.pause_reading()
            self.reading = False

    # ---- answering -------------------------------------------------------------------------------------------

    async def _answer(self) -> None:
        try:
            while self.queue and not self.closed:
                req = self.queue.popleft()
                await self.server.answer(req)
                self.last = time.monotonic()
                if not req.keep_alive or not req.answered:
                    self.close()
                    return
                try:
                    await self.drain()  # the next answer waits for the client to read this one
                except Gone:
                    return
                if not self.reading and not self.stopped and not self.refused and not self.closed:
                    self.reading = True
                    self.transport.resume_reading()
            if self.refused:
                self._send_refusal()
            elif self.stopped:
                self.close()
        finally:
            self.task = None


class Server:
    """``handler`` answers every request; ``refused(status)`` is told of the server's own refusals (for counting);
    ``refusal_headers(lookup)`` gives headers to add to them (CORS)."""

    def __init__(self, handler: Handler, *, name: str, max_body: int,
                 refused: Callable[[int], None] = lambda status: None,
                 refusal_headers: Callable[[dict], list] = lambda lookup: []):
        self.handler, self.name, self.max_body = handler, name, max_body
        self.refused, self.refusal_headers = refused, refusal_headers
        self.conns: set[Connection] = set()
        self.closing = False
        self._server: asyncio.base_events.Server | None = None

    async def answer(self, req: Request) -> None:
        """The handler's answer; one it failed to give is a 500 (or, once begun, a cut connection)."""
        try:
            await self.handler(req)
            if req._started and not req._ended:
                req.end()
        except Gone:
            return
        except Exception as e:  # noqa: BLE001 - a bug in a handler answers 500, it does not end the server
            if not req._started:
                with contextlib.suppress(Gone):
                    req.json(500, error_doc(500, f"the front failed: {type(e).__name__}: {e}"), close=True)

    async def listen(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host, port, reuse_address=True)

    def sweep(self) -> None:
        """Close the connections idle past the keep-alive bound, and those whose request is too slow to arrive."""
        now = time.monotonic()
        for c in list(self.conns):
            if (c.stalled_at is not None and now - c.stalled_at > STALL_S) or (
                    c.closing_at is not None and now - c.closing_at > LINGER_S + STALL_S):
                c.transport.abort()  # a client that reads nothing: cut off (its handler is cancelled)
                continue
            if c.task is not None:
                continue
            if c.began is not None and now - c.began > REQUEST_S:
                c.refuse(408, f"the request did not arrive whole in {REQUEST_S:g} s")
            elif c.began is None and now - c.last > KEEPALIVE_S:
                c.close()

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening; the answers being given get ``grace`` seconds to end, then every connection closes."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for c in list(self.conns):
            if c.task is None:
                c.close()
        deadline = time.monotonic() + grace
        while any(c.task is not None for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            if c.task is not None:
                c.task.cancel()
            c.close()
        if self._server is not None:
            await self._server.wait_closed()
