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
import json
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import unquote

import httptools

MAX_HEAD = 64 << 10  # request line and headers, bytes
KEEPALIVE_S = 75.0  # an idle kept-alive connection is closed after this long (aiohttp's and nginx's default)
REQUEST_S = 300.0  # a request (head and body) must arrive whole in this long
LINGER_S = 2.0  # after a refusal, what the client still sends is dropped this long before the connection closes
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Gone(ConnectionError):
    """The client's connection closed: nothing more can be sent to it."""


def error_doc(status: int, message: str, *, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": None, "code": code}}


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
        head = self._head(status, _dated(headers), "\r\n" if status == 204 else f"Content-Length: {n}\r\n\r\n")
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

    async def send(self, data: bytes) -> None:
        """Part of a stream; waits while the client reads slower than it is written. ``Gone`` if it left."""
        if not data or self.method == "HEAD":
            return
        self.conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
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
        self.refused = False  # a refusal was sent: nothing more is read, the connection closes
        self._writable: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self._url: list[bytes] = []
        self._headers: list[tuple[str, str]] = []
        self._lookup: dict[str, str] = {}
        self._size = 0
        self._body: list[bytes] = []
        self._req: Request | None = None

    # ---- the transport ---------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.conns.discard(self)
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(Gone("the client closed the connection"))
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its handler stops (and closes what it asked of rank 0)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

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

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise Gone("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise Gone("the client closed the connection")
        if self._writable is not None and not self._writable.done():
            await self._writable

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _stop_reading(self) -> None:
        if self.reading and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self.reading, self.stopped = False, True
        if self.task is None and not self.queue:
            self.close()

    def refuse(self, status: int, message: str) -> None:
        """An answer from the server itself, then the connection closes (what remains of the request unread)."""
        self.refused = True
        self.server.refused(status)
        if self.task is None and not self.closed:
            head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nServer: {self.server.name}\r\n"
                    f"Date: {http_date()}\r\nContent-Type: application/json\r\nConnection: close\r\n")
            body = json.dumps(error_doc(status, message)).encode()
            head += "".join(f"{k}: {v}\r\n" for k, v in self.server.refusal_headers(self._lookup))
            self.transport.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            # a lingering close: what the client still sends is read and dropped for a while, so that it reads
            # this answer rather than a reset (closing on unread bytes resets the connection)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, self.close)
        # else an answer is being written: the connection closes once it is (the refusal would cut into it)

    # ---- httptools' callbacks ----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.began = time.monotonic()
        self._reset()

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
        self._req = Request(self, p.get_method().decode("latin-1"),
                            b"".join(self._url).decode("utf-8", "surrogateescape"), self._headers, self._lookup,
                            p.get_http_version() == "1.1", p.should_keep_alive())
        declared = self._lookup.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.server.max_body:
            self.refuse(413, f"request body over {self.server.max_body} bytes")
            raise httptools.HttpParserCallbackError("refused")
        if (self._lookup.get("expect", "").lower() == "100-continue" and self._req.http11 and self.task is None
                and not self.queue):
            self.transport.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body + MAX_HEAD:
            self.refuse(413, f"request body over {self.server.max_body} bytes")
            raise httptools.HttpParserCallbackError("refused")
        self._body.append(body)

    def on_message_complete(self) -> None:
        req, self._req, self.began = self._req, None, None
        if req is None:
            return
        req.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        if len(req.body) > self.server.max_body:
            self.refuse(413, f"request body over {self.server.max_body} bytes")
            raise httptools.HttpParserCallbackError("refused")
        self._reset()
        self.queue.append(req)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._answer())
            if not req.keep_alive:
                self._stop_reading()  # nothing more is read from a connection this answer closes
        elif self.reading:  # pipelined: the next waits for the one being answered, and so does reading
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
            if self.refused or self.stopped:
                self.close()
            elif not self.closed and not self.reading and not self.stopped:
                self.reading = True
                self.transport.resume_reading()
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
        self._server: asyncio.base_events.Server | None = None

    async def answer(self, req: Request) -> None:
        """The handler's answer; one it failed to give is a 500 (or, once begun, a cut connection)."""
        try:
            await self.handler(req)
        except Gone:
            return
        except Exception as e:  # noqa: BLE001 - a bug in a handler answers 500, it does not end the server
            if not req._started and not req.gone:
                req.json(500, error_doc(500, f"the front failed: {type(e).__name__}: {e}"), close=True)
            return
        if req._started and not req._ended:
            req.end()

    async def listen(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host, port, reuse_address=True)

    def sweep(self) -> None:
        """Close the connections idle past the keep-alive bound, and those whose request is too slow to arrive."""
        now = time.monotonic()
        for c in list(self.conns):
            if c.task is not None:
                continue
            if c.began is not None and now - c.began > REQUEST_S:
                c.refuse(408, f"the request did not arrive whole in {REQUEST_S:g} s")
            elif c.began is None and now - c.last > KEEPALIVE_S:
                c.close()

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening; the answers being given get ``grace`` seconds to end, then every connection closes."""
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
