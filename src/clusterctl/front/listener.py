"""The front's clients' side: aiohttp's low-level HTTP/1.1 server (``web.Server``: no router, no middleware; the
front routes by itself), set up for the front. aiohttp parses requests (llhttp), keeps connections alive, answers
pipelined requests in order, frames answers (Content-Length, chunked, close-delimited for HTTP/1.0) and lingers
after a refusal; what is here is what the front promises on top (docs/front.md):

- its refusals in OpenAI's error shape (protocol/httpedge.py), with the CORS headers of the current rules, counted
  (``refused``): a request that does not parse (400), a request line over ``MAX_LINE`` (414), a header over
  ``MAX_FIELD`` (431), ``CONNECT`` (405), a body over ``max_body`` (413, declared or counted as it arrives), a body
  that has not arrived whole in ``REQUEST_S`` (408); a failing handler is 500; each closes the connection;
- ``Expect: 100-continue`` answered; an ``Upgrade`` answered as plain HTTP/1.1, then the connection closes;
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

from clusterctl.protocol.httpedge import body_too_large, error_document, error_type, is_too_large

MAX_LINE = 64 << 10  # the request line, bytes (414 beyond)
MAX_FIELD = 16 << 10  # one header, name and value, bytes (431 beyond)
MAX_HEADERS = 256  # headers of one request (400 beyond)
KEEPALIVE_S = 75.0  # an idle kept-alive connection, or a head that has not arrived, is closed after this long
REQUEST_S = 300.0  # a request's body must arrive whole in this long
LINGER_S = 2.0  # after a refusal, what the client still sends is read and dropped this long before the close
STALL_S = 60.0  # a client that reads nothing of its answer for this long is cut off (its request ends)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

Handler = Callable[[web.BaseRequest, bytes], Awaitable[web.StreamResponse]]


class _Request(web.BaseRequest):
    async def _prepare_hook(self, response: web.StreamResponse) -> None:  # every answer, aiohttp's own too
        response.headers["Server"] = self.protocol.listener.name


class _Connection(web.RequestHandler):
    """aiohttp's connection, with the front's refusals and a clock for a client that reads nothing."""

    def __init__(self, manager: "_Server", **kwargs):
        super().__init__(manager, **kwargs)
        self.listener: Listener = manager.listener
        self.stalled_at: float | None = None  # since when the client has not read what was written to it

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
        if isinstance(exc, LineTooLong):  # args: (line, limit, size); the limit tells the request line apart
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


class Listener:
    """``handler(request, body)`` answers every request whose body arrived whole within the bounds;
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
        declared = request.content_length
        if declared is not None and is_too_large(declared, self.max_body):
            return self.refusal(request, 413, body_too_large(self.max_body))
        if request.version >= HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(CONTINUE)
        if not request.body_exists:  # nothing to wait for (most GETs): no timer
            return await self._answer(request, b"")
        try:
            async with asyncio.timeout(REQUEST_S):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.refusal(request, 413, body_too_large(self.max_body))
        except TimeoutError:
            return self.refusal(request, 408, f"the request did not arrive whole in {REQUEST_S:g} s")
        return await self._answer(request, body)

    async def _answer(self, request: web.BaseRequest, body: bytes) -> web.StreamResponse:
        resp = await self.handler(request, body)
        if "Upgrade" in request.headers:  # no protocol but HTTP/1.1 here: what follows on the connection is not read
            resp.force_close()
        return resp

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
