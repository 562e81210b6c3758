"""The front's clients' side: aiohttp's low-level HTTP/1.1 server (``web.Server``: no router, no middleware; the
front routes by itself), set up for the front. aiohttp parses requests (llhttp), keeps connections alive, answers
pipelined requests in order, frames answers (Content-Length, chunked, close-delimited for HTTP/1.0) and lingers
after a refusal; what is here is what the front promises on top (docs/front.md):

- the body is read only when the handler asks for it (``Body``), which the front does after the key check: a
  request without a key is answered from its head, and aiohttp then reads and drops what the client still sends
  for ``LINGER_S`` (in buffers of 64 KiB) before it closes the connection;
- its refusals in OpenAI's error shape (protocol/httpedge.py), with the CORS headers of the current rules, counted
  (``refused``): a request that does not parse (400), a request line over ``MAX_LINE`` (414), a header over
  ``MAX_FIELD`` or a head over ``MAX_HEAD`` (431), ``CONNECT`` (405), a body over ``max_body`` (413, declared or
  counted as it arrives), a body that has not arrived whole in ``BODY_S`` (408); a failing handler is 500; each
  closes the connection;
- at most ``MAX_IDLE`` connections that answer no request that asked for its body: past it the longest-open
  one is closed (the bound on what peers without a key can hold open);
- ``Expect: 100-continue`` answered when the body is asked for; an ``Upgrade`` answered as plain HTTP/1.1, then
  the connection closes;
- ``Server: clusterctl`` on every answer (not the library and its version);
- a client that leaves cancels its handler (the front then closes its request to rank 0, which cancels it);
- ``sweep`` (the front's watcher calls it) cuts off a client that has read nothing of its answer for ``STALL_S``.
"""

from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus
from typing import Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import ERROR as UNPARSED  # the stand-in request aiohttp answers a parse error for

from clusterctl.protocol.httpedge import (BODY_S, LINGER_S, MAX_HEAD, MAX_IDLE, body_too_large, body_too_slow,
                                          error_document, error_type, head_too_large, is_too_large)

MAX_LINE = 64 << 10  # the request line, bytes (414 beyond)
MAX_FIELD = 16 << 10  # one header, name and value, bytes (431 beyond)
MAX_HEADERS = 256  # headers of one request (400 beyond)
KEEPALIVE_S = 75.0  # an idle kept-alive connection, or a head that has not arrived, is closed after this long
STALL_S = 60.0  # a client that reads nothing of its answer for this long is cut off (its request ends)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

Body = Callable[[], Awaitable[bytes]]  # the request's body, read whole within the bounds when awaited (once)
Handler = Callable[[web.BaseRequest, Body], Awaitable[web.StreamResponse]]


class Refused(Exception):
    """The body was not given: the listener's refusal (its status and message) answers the request."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class HeadTooLarge(HttpProcessingError):
    def __init__(self):
        super().__init__(code=431, message=head_too_large())


def _size(message) -> int:
    """About the bytes of a parsed head: its request line and every header as sent."""
    return len(message.method) + len(message.path) + 12 + sum(len(k) + len(v) + 4 for k, v in message.raw_headers)


class _HeadBound:
    """aiohttp's request parser, fed through a count of the bytes of the head that is arriving: between requests
    (the connection waits for one) everything that comes is a head, and one that passes ``MAX_HEAD`` before it
    ends is refused (aiohttp's parser bounds each header and their number, not their sum)."""

    def __init__(self, parser, conn: "_Connection"):
        self._parser, self._conn = parser, conn

    def feed_data(self, data: bytes):
        conn = self._conn
        if conn.head_bytes < 0:  # refused: what follows is dropped until the connection closes
            return (), False, b""
        waiting = conn._waiter is not None and not conn._waiter.done()
        conn.head_bytes = conn.head_bytes + len(data) if waiting else 0
        out = self._parser.feed_data(data)
        over = conn.head_bytes > MAX_HEAD
        if out[0]:  # a head ended in this data (what follows it is a body or the next request): its own size
            over = over and _size(out[0][0][0]) > MAX_HEAD
            conn.head_bytes = 0
        if over:
            conn.head_bytes = -1
            raise HeadTooLarge()
        return out

    def __getattr__(self, name):
        return getattr(self._parser, name)


class _Request(web.BaseRequest):
    async def _prepare_hook(self, response: web.StreamResponse) -> None:  # every answer, aiohttp's own too
        response.headers["Server"] = self.protocol.listener.name


class _Connection(web.RequestHandler):
    """aiohttp's connection, with the front's refusals and a clock for a client that reads nothing."""

    def __init__(self, manager: "_Server", **kwargs):
        super().__init__(manager, **kwargs)
        self.listener: Listener = manager.listener
        self.stalled_at: float | None = None  # since when the client has not read what was written to it
        self.asked = False  # a request whose handler asked for its body (after the key check) is being answered
        self.head_bytes = 0  # of the head arriving now
        self._parser = _HeadBound(self._parser, self)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.stalled_at = time.monotonic()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.stalled_at = None

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse, or a handler that failed: OpenAI's shape, the connection closed."""
        if request.writer.output_size > 0:  # an answer was begun: nothing else can be said on this connection
            raise ConnectionError("the answer was begun; the connection is cut")
        if isinstance(exc, HeadTooLarge):
            status, text = 431, exc.message
        elif isinstance(exc, LineTooLong):  # args: (line, limit, size); the limit tells the request line apart
            too_long_line = len(exc.args) > 1 and exc.args[1] == MAX_LINE
            status, text = (414, "request line too long") if too_long_line else (
                431, f"a request header over {MAX_FIELD} bytes")
        elif isinstance(exc, HttpProcessingError):
            status, text = 400, f"the request does not parse as HTTP/1.1: {exc.message}"
        elif status == 500 and exc is not None:
            self.log_exception("the front's handler failed", exc_info=exc)
            text = f"the front failed: {type(exc).__name__}: {exc}"
        else:
            text = message or HTTPStatus(status).phrase
        return self.listener.refusal(request, status, text, count=status < 500)


class _Server(web.Server):
    def __init__(self, listener: "Listener", handler, **kwargs):
        super().__init__(handler, **kwargs)
        self.listener = listener

    def __call__(self) -> _Connection:
        return _Connection(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler, transport) -> None:
        """Past ``MAX_IDLE`` connections that answer no request that asked for its body, the longest-open of them
        is closed (an idle kept-alive one, a head still arriving, a refusal lingering, the new one itself)."""
        super().connection_made(handler, transport)
        if len(self._connections) <= MAX_IDLE:
            return
        idle = [c for c in self._connections if not getattr(c, "asked", False)  # (a closed one stays listed
                and c.transport is not None and not c.transport.is_closing()]  # until its task has ended)
        if len(idle) > MAX_IDLE:
            oldest = idle[0]  # the dict keeps the order connections came in
            oldest.force_close()
            if oldest.transport is not None:
                oldest.transport.close()


class Listener:
    """``handler(request, body)`` answers every request (``await body()`` gives its body, read whole within the
    bounds, or ends the handler with the listener's refusal: ``Refused``);
    ``refused(status)`` is told of the listener's own refusals (for counting); ``refusal_headers(headers)`` gives
    headers to add to them (CORS)."""

    def __init__(self, handler: Handler, *, name: str, max_body: int,
                 refused: Callable[[int], None] = lambda status: None,
                 refusal_headers: Callable[[Mapping[str, str]], Mapping[str, str]] = lambda headers: {}):
        self.handler, self.name, self.max_body = handler, name, max_body
        self.refused, self.refusal_headers = refused, refusal_headers
        self._server: _Server | None = None
        self._tcp: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        return self._tcp.sockets[0].getsockname()[1]

    async def listen(self, host: str, port: int) -> None:
        self._server = _Server(self, self._handle, request_factory=self._request, handler_cancellation=True,
                               keepalive_timeout=KEEPALIVE_S, lingering_time=LINGER_S, max_line_size=MAX_LINE,
                               max_field_size=MAX_FIELD, max_headers=MAX_HEADERS, access_log=None,
                               auto_decompress=False)
        self._tcp = await asyncio.get_running_loop().create_server(self._server, host, port, reuse_address=True)

    def _request(self, message, payload, protocol, writer, task) -> _Request:
        if message is UNPARSED:  # aiohttp's stand-in says HTTP/1.0: the refusal is said in HTTP/1.1, as the rest
            message = message._replace(version=HttpVersion11)
        return _Request(message, payload, protocol, writer, task, asyncio.get_running_loop(),
                        client_max_size=self.max_body)

    def refusal(self, request, status: int, message: str, *, count: bool = True) -> web.Response:
        """An answer of the listener's own, in OpenAI's shape; the connection closes after it."""
        if count:
            self.refused(status)
        headers = {"Content-Type": "application/json", **self.refusal_headers(request.headers)}
        resp = web.Response(status=status, headers=headers,
                            body=json.dumps(error_document(message, type=error_type(status))).encode())
        resp.force_close()
        return resp

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "CONNECT":
            return self.refusal(request, 405, "CONNECT is not served here")
        conn = request.protocol

        async def body() -> bytes:
            conn.asked = True  # from now on this connection is not one that holds nothing but a head
            return await self._read(request)

        try:
            resp = await self.handler(request, body)
        except Refused as e:
            return self.refusal(request, e.status, e.message)
        finally:
            conn.asked = False
        if "Upgrade" in request.headers:  # no protocol but HTTP/1.1 here: what follows on the connection is not read
            resp.force_close()
        return resp

    async def _read(self, request: web.BaseRequest) -> bytes:
        """The body, whole, within ``max_body`` (declared or counted) and ``BODY_S``; else Refused."""
        declared = request.content_length
        if declared is not None and is_too_large(declared, self.max_body):
            raise Refused(413, body_too_large(self.max_body))
        if not request.body_exists:  # nothing to wait for (most GETs): no timer
            return b""
        if request.version >= HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(CONTINUE)
        try:
            async with asyncio.timeout(BODY_S):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Refused(413, body_too_large(self.max_body)) from None
        except TimeoutError:
            raise Refused(408, body_too_slow(BODY_S)) from None

    def sweep(self) -> None:
        """Cut off the clients that have read nothing of their answer for ``STALL_S`` (their handlers end)."""
        if self._server is None:
            return
        now = time.monotonic()
        for conn in self._server.connections:
            if isinstance(conn, _Connection) and conn.stalled_at is not None and now - conn.stalled_at > STALL_S:
                if conn.transport is not None:
                    conn.transport.abort()

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening; the answers being given get ``grace`` seconds to end, then every connection closes."""
        if self._tcp is not None:
            self._tcp.close()
        if self._server is not None:
            self._server.pre_shutdown()
            await self._server.shutdown(grace)
        if self._tcp is not None:
            await self._tcp.wait_closed()
