"""Rank 0's HTTP plumbing: one request handler class per server (``make_handler``) that reads bodies within
bounds, answers JSON and server-sent events, maps every error to OpenAI's shape in one place (``error``), adds the
CORS headers the operator allowed, notices clients that left, counts each request's outcome once, and hands every
request to its route (routes.py).

What a peer can hold before it shows a key (protocol/httpedge.py): a head of at most ``MAX_HEAD`` bytes, whole
within the server's timeout of the connection's start (or of its last answer); the routes decide from the head,
and a body is read only by a route that passed the key check, within ``MAX_BODY`` and ``BODY_S``, a buffer at a
time. A body left unread is dropped for at most ``LINGER_S`` after the answer; then the connection closes. The
server (``RankHTTPServer``) serves at most its capacity plus ``MAX_IDLE`` connections; one more is told 503."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from clusterctl.protocol.httpedge import (BODY_S, CHALLENGE, LINGER_S, MAX_BODY, MAX_HEAD, MAX_IDLE, body_too_large,
                                          body_too_slow, error_document, error_type, head_too_large, is_too_large,
                                          rank_outcome)
from clusterctl.rank.api import routes
from clusterctl.rank.api.wire import UNAUTHORIZED, ApiError


CHUNK = 64 << 10  # a body is read (or dropped) this much at a time


class HeadTooLarge(http.client.LineTooLong):
    """The head passed MAX_HEAD (http.server answers a LineTooLong with 431)."""

    def __init__(self):
        http.client.HTTPException.__init__(self, head_too_large())


class _HeadReader:
    """The connection's reader while a head arrives: its lines count against ``MAX_HEAD``, and each read may wait
    only what is left of the head's deadline (http.server's timeout bounds one read, not the head)."""

    def __init__(self, raw, sock: socket.socket, deadline: float):
        self.raw, self.sock, self.deadline, self.left = raw, sock, deadline, MAX_HEAD

    def readline(self, size: int = -1) -> bytes:
        limit = min(size, self.left + 1) if size >= 0 else self.left + 1
        line = bytearray()
        while len(line) < limit and not line.endswith(b"\n"):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the head did not arrive in time")
            self.sock.settimeout(left)
            got = self.raw.peek(1)[:limit - len(line)]  # what is buffered, or one read's worth
            if not got:
                break
            end = got.find(b"\n")
            line += self.raw.read(len(got) if end < 0 else end + 1)
        self.left -= len(line)
        if self.left < 0:
            raise HeadTooLarge()
        return bytes(line)


class Handler(BaseHTTPRequestHandler):
    """The request handler of one server: ``make_handler`` gives it the server's ``api`` and its route table."""

    protocol_version = "HTTP/1.1"
    server_version = "clusterctl"
    sys_version = ""
    # TCP_NODELAY: a response is several small writes (headers, body; a stream's chunks). With Nagle, a write
    # waits for the ACK of the one before, which the client delays (up to 40 ms, more under load).
    disable_nagle_algorithm = True
    # a buffered writer: an answer's head and body leave in one write (http.server flushes it after each request;
    # a stream flushes each event itself), so whoever reads it (the front, a client) wakes once, not twice
    wbufsize = -1
    api = None  # the server's Api (set by make_handler)

    def log_message(self, fmt, *args):  # quiet: no request logs on stderr (prompts are private)
        pass

    # -- one outcome per request, counted once it is over: the status sent, unless a route says better (a
    # stream that ended in an error or a cancel, a client that left); None: not counted (/health, /metrics)
    outcome: str | None = None

    body_left = False  # the request declared a body that no route read: dropped after the answer, then close

    def handle_one_request(self):
        self.outcome, self.body_left, raw = None, False, self.rfile
        self.rfile = _HeadReader(raw, self.connection, time.monotonic() + self.timeout)
        try:
            super().handle_one_request()
            if self.body_left:  # what no route read is not taken for the next request: dropped, then close
                self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True  # the client left before the answer went out, or its head never came
        finally:
            self.rfile = raw
            if self.outcome is not None:
                self.api.metrics.request_done(self.outcome)

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the head is read: what follows is the body, read by the routes that may
        self.rfile = self.rfile.raw if isinstance(self.rfile, _HeadReader) else self.rfile
        self.connection.settimeout(self.timeout)
        if ok:
            self.body_left = self.declares_body()
        return ok

    def finish(self):
        try:
            super().finish()
        except OSError:  # the client left: what was buffered for it cannot be sent (not an error of ours)
            self.rfile.close()
        if self.body_left:
            self.linger()

    def linger(self) -> None:
        """The answer is out: what the client still sends is dropped (a buffer at a time, for at most LINGER_S)
        so that it reads the answer rather than a reset; then the connection closes."""
        deadline = time.monotonic() + LINGER_S
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(CHUNK):
                    return
        except OSError:
            return

    def send_response(self, code, message=None):
        self.outcome = rank_outcome(code)
        super().send_response(code, message)

    def end_headers(self):
        for k, v in self.api.cors_headers(self.headers.get("Origin") if self.headers is not None else None).items():
            self.send_header(k, v)
        super().end_headers()

    # -- routing: every method goes through the table
    def _route(self):
        path = self.path.split("?", 1)[0]
        self.dispatch(self.api, self, self.command, path)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _route

    # -- answers
    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a request line or header too long, too many headers, a malformed
        request line) as OpenAI-style JSON errors, never its HTML page."""
        self.close_connection = self.body_left = True  # what the client sent after the refused part is dropped
        if isinstance(explain, str) and explain == head_too_large():
            message, explain = explain, None
        if not str(getattr(self, "request_version", "")).startswith("HTTP/1."):
            self.request_version = "HTTP/1.1"  # unparsed request: still answer with a status line
        if not hasattr(self, "headers"):
            self.headers = None
        if code == HTTPStatus.NOT_IMPLEMENTED and self.tenant() is None:
            # an unknown method (http.server says 501 only for a parsed request) is one more route: without
            # the key the caller learns nothing, not even which methods exist
            self.error(UNAUTHORIZED)
            return
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        self.error(ApiError(code, message or phrase, type=error_type(code)))

    def json(self, status: int, obj: dict, extra: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":
            self.wfile.write(data)

    def error(self, e: ApiError) -> None:
        """The one place an error becomes an HTTP answer (the document and the rules: protocol/httpedge.py)."""
        extra = dict(CHALLENGE) if e.status == 401 else {}
        if e.status >= 500 or e.status in (429, 408, 411, 413) or self.close_connection:
            extra["Connection"] = "close"
            self.close_connection = True
        if e.retry_after is not None:
            extra["Retry-After"] = str(e.retry_after)
        self.json(e.status, error_document(e.message, type=e.type, param=e.param, code=e.code), extra)

    def no_content(self, extra: dict | None = None) -> None:
        self.send_response(204)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def raw(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        """A stream's status line and headers, sent at once (before the first token: a long prompt must not
        trip a client's or a proxy's first-byte timeout)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True

    def sse(self, obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def keepalive(self) -> None:
        """A comment line: clients ignore it, it keeps the connection (and any proxy on it) from idling out."""
        self.wfile.write(b": keepalive\n\n")
        self.wfile.flush()

    # -- the caller and the body
    def tenant(self) -> str | None:
        return self.api.tenant(self.headers.get("Authorization") if self.headers is not None else None)

    def declares_body(self) -> bool:
        n = self.headers.get("Content-Length")
        return "Transfer-Encoding" in self.headers or (n is not None and n.strip() not in ("", "0"))

    def drain_body(self) -> None:
        """A route that answers without the body (a refusal, a preflight): it is not read (a peer without a key
        never has a body read); what arrives of it is dropped after the answer, and the connection closes."""
        if self.body_left:
            self.close_connection = True

    def body(self) -> dict:
        try:
            n = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise ApiError(411, "Content-Length is required")
        if is_too_large(n):
            self.close_connection = True
            raise ApiError(413, body_too_large(MAX_BODY))
        raw = self._read(n)
        if len(raw) < n:
            self.close_connection = True
            raise ApiError(400, f"the request body ended after {len(raw)} of {n} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _read(self, n: int) -> bytes:
        """``n`` bytes of body (fewer if the client closed), whole within BODY_S: a client that dribbles its body
        holds a thread and its bytes no longer than that (each read also within the server's timeout)."""
        deadline, buf = time.monotonic() + BODY_S, bytearray()
        try:
            while len(buf) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(min(self.timeout, left))
                chunk = self.rfile.read1(min(n - len(buf), CHUNK))
                if not chunk:
                    break
                buf += chunk
        except (TimeoutError, OSError):
            self.close_connection = True
            raise ApiError(408, body_too_slow(BODY_S)) from None
        finally:
            self.connection.settimeout(self.timeout)
        self.body_left = False
        return bytes(buf)

    def client_gone(self) -> bool:
        """The client closed its side (EOF or reset) while we wait: it will never read the answer."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


BUSY = b"HTTP/1.1 503 Service Unavailable\r\nServer: clusterctl\r\nContent-Type: application/json\r\n" \
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"


class RankHTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` of them (the server's capacity of requests plus
    ``MAX_IDLE``): one more is told 503 (with Retry-After) and closed at once, without a thread."""

    daemon_threads = True
    max_connections = 128 + MAX_IDLE

    def __init__(self, *args, **kwargs):
        self.open_connections, self._count = 0, threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._count:
            full = self.open_connections >= self.max_connections
            self.open_connections += 0 if full else 1
        if not full:
            super().process_request(request, client_address)
            return
        doc = json.dumps(error_document("too many connections", type=error_type(503),
                                        code="service_unavailable")).encode()
        try:
            request.setblocking(False)
            request.send(BUSY % (len(doc), doc))
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.open_connections -= 1


def make_handler(api):
    """The handler class of ``api``'s server."""
    # a client that sends (or reads) nothing for this long loses its connection: a slow or stalled client can
    # hold a thread, never the server
    return type("Handler", (Handler,), {"api": api, "timeout": api.spec.http_timeout_s,
                                        "dispatch": staticmethod(routes.dispatch)})
