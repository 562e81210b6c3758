"""The front's client to rank 0: HTTP/1.1 over a small pool of kept-alive connections, each response parsed by
httptools (llhttp, the parser of Node.js) and handed over as its bytes arrive.

Why not aiohttp's client, which the front used first: on a request that rank 0 answers in a fraction of a
millisecond, aiohttp's client machinery (request and response objects, timers, the connector's bookkeeping) was
about two thirds of the front's own CPU time per request (bench/front.py, docs/dependencies.md). Here a request
is one write of its head and body, and the answer is parsed in place as it is read.

Two failures are told apart, because only one of them makes resending safe (front/proxy.py):

- ``NotSent``: rank 0 was never reached (the connection refused, or not made in ``CONNECT_S``);
- ``Lost``: the connection broke (or rank 0's answer did not parse) after the request was written: it may have
  run, so it is never sent again.

An idle connection is kept ``IDLE_S`` at most (well under rank 0's own 30 s) so that a request is not written
into a connection rank 0 is closing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from typing import AsyncIterator, Callable
from urllib.parse import urlsplit

import httptools

CONNECT_S = 5.0
IDLE_S = 5.0
HIGH_WATER = 1 << 20  # bytes of an answer held before reading from rank 0 pauses (a slow client)


class NotSent(ConnectionError):
    """Rank 0 was never reached: the request can be sent again."""


class Lost(ConnectionError):
    """The connection broke after the request was written: it may have run."""


@functools.lru_cache(maxsize=64)
def address(endpoint: str) -> tuple[str, int]:
    """``http://host:port`` (``[v6]:port`` too) as the (host, port) to connect to."""
    u = urlsplit(endpoint)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ValueError(f"not an http://host:port endpoint: {endpoint!r}")
    return u.hostname, u.port


def _head(method: str, target: str, host: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    # header text as the front's server decoded it (utf-8, undecodable bytes kept as surrogates): the same bytes
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


class Response:
    """One answer of rank 0: ``status`` and ``headers`` once the head has arrived, the body through ``read`` or
    ``chunks``. ``release`` gives the connection back to the pool if the answer was read to its end (else closes
    it); ``close`` always closes it."""

    def __init__(self, pool: "Pool", conn: "_Conn", method: str):
        self._pool, self._conn, self._method = pool, conn, method
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self._head = asyncio.get_running_loop().create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._more: asyncio.Future | None = None
        self._framed = False  # a Content-Length or chunked body: its end is known (else it ends with the connection)
        self._complete = False  # the whole answer arrived
        self._reusable = False
        self._error: Lost | None = None
        self._sink: Callable[[bytes], None] | None = None

    @property
    def content_type(self) -> str:
        for k, v in self.headers:
            if k.lower() == "content-type":
                return v.split(";", 1)[0].strip().lower()
        return ""

    # ---- what the connection tells it ----------------------------------------------------------------------------

    def _on_head(self, status: int) -> None:
        self.status = status
        for k, v in self.headers:
            if k.lower() == "content-length" or (k.lower() == "transfer-encoding" and "chunked" in v.lower()):
                self._framed = True
        if not self._head.done():
            self._head.set_result(None)
        if self._method == "HEAD":  # no body follows, whatever Content-Length says; the parser would wait for one
            self._on_complete(False)

    def _on_body(self, data: bytes) -> None:
        if self._complete:
            return
        if self._sink is not None:
            self._sink(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _on_complete(self, keep_alive: bool) -> None:
        if not self._complete:
            self._complete, self._reusable = True, keep_alive
            self._wake()

    def _on_eof(self, why: str) -> None:
        if self._complete:
            return
        if self._head.done() and not self._framed:
            self._on_complete(False)  # a body that ends with the connection (a stream) has ended
            return
        self._error = Lost(why)
        if not self._head.done():
            self._head.set_exception(self._error)
        self._wake()

    def _wake(self) -> None:
        if self._more is not None and not self._more.done():
            self._more.set_result(None)

    # ---- what the front asks of it -------------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ``Lost`` if the connection breaks before its end."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered <= HIGH_WATER // 2:
                    self._conn.resume()
                yield data
                continue
            if self._complete:
                return
            await self._arrival()

    async def pipe(self, sink: Callable[[bytes], None]) -> None:
        """Hand the body to ``sink`` as it arrives, from the connection's own callback (no task switch per
        piece), and return once it has all arrived; ``Lost`` if the connection breaks first. ``pause`` and
        ``resume`` hold back what rank 0 sends while the sink cannot take more."""
        while self._chunks:
            data = self._chunks.popleft()
            self._buffered -= len(data)
            sink(data)
        self._sink = sink
        self.resume()
        while not self._complete:
            await self._arrival()

    async def _arrival(self) -> None:
        """Wait for more of the answer (or its end); ``Lost`` if the connection broke."""
        if self._error is not None:
            raise self._error
        self._more = asyncio.get_running_loop().create_future()
        await self._more

    def pause(self) -> None:
        self._conn.pause()

    def resume(self) -> None:
        self._conn.resume()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def release(self) -> None:
        conn, self._conn.response = self._conn, None
        if self._complete and self._reusable and not self._chunks:
            self._pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        self._conn.response = None
        self._conn.close()
        if not self._complete and self._error is None:
            self._error = Lost("closed before its end")  # a pipe waiting on it returns
            self._wake()


class _Conn(asyncio.Protocol):
    """One connection to rank 0, carrying one request at a time."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None:  # bytes nobody asked for: the connection can't be trusted with another request
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            r._on_eof(f"rank 0's answer did not parse: {e}")
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.response is not None:
            self.response._on_eof(f"the connection to rank 0 broke: {exc or 'closed by rank 0'}")

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            # values as the front's server decodes a client's (utf-8, undecodable bytes kept): the same bytes out
            self.response.headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._on_head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._on_body(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._on_complete(self.parser.should_keep_alive())

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed and not self.transport.is_reading():
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Kept-alive connections to rank 0 endpoints (whichever the front follows), one request on each at a time."""

    def __init__(self, *, idle_s: float = IDLE_S, connect_s: float = CONNECT_S):
        self.idle_s, self.connect_s = idle_s, connect_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def request(self, endpoint: str, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes = b"") -> Response:
        """Send one request and wait for the head of its answer. ``NotSent`` or ``Lost`` when it fails."""
        key = address(endpoint)
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(key)
        resp = conn.response = Response(self, conn, method)
        host = f"[{key[0]}]:{key[1]}" if ":" in key[0] else f"{key[0]}:{key[1]}"
        try:
            conn.transport.write(_head(method, target, host, headers, body))
            await resp._head
        except BaseException:
            resp.close()  # lost, or the caller cancelled: the connection is in an unknown state
            raise
        return resp

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(key), *key), self.connect_s)
        except asyncio.TimeoutError:
            raise NotSent(f"no connection to {key[0]}:{key[1]} in {self.connect_s:g} s") from None
        except OSError as e:
            raise NotSent(f"cannot connect to {key[0]}:{key[1]}: {e.strerror or e}") from None
        return conn

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    def _put(self, conn: _Conn) -> None:
        if conn.closed or conn.transport is None:
            return
        conn.idle_since = time.monotonic()
        conn.parser = httptools.HttpResponseParser(conn)
        self._idle.setdefault(conn.key, []).append(conn)

    def sweep(self) -> None:
        """Close the connections idle too long (a job the front no longer follows leaves them behind)."""
        now = time.monotonic()
        for key in list(self._idle):
            keep = [c for c in self._idle[key] if not c.closed and now - c.idle_since < self.idle_s]
            for c in self._idle[key]:
                if c not in keep:
                    c.close()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
