"""Rank 0's HTTP plumbing: one request handler class per server (``make_handler``) that reads bodies within
bounds, answers JSON and server-sent events, maps every error to OpenAI's shape in one place (``error``), adds the
CORS headers the operator allowed, notices clients that left, counts each request's outcome once, and hands every
request to its route (routes.py)."""

from __future__ import annotations

import json
import select
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

from clusterctl.protocol.httpedge import (CHALLENGE, MAX_BODY, body_too_large, error_document, error_type,
                                          is_too_large, rank_outcome)
from clusterctl.rank.api import routes
from clusterctl.rank.api.wire import UNAUTHORIZED, ApiError


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

    def handle_one_request(self):
        self.outcome = None
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left before the buffered answer went out
        finally:
            if self.outcome is not None:
                self.api.metrics.request_done(self.outcome)

    def finish(self):
        try:
            super().finish()
        except OSError:  # the client left: what was buffered for it cannot be sent (not an error of ours)
            self.rfile.close()

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
        self.close_connection = True
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

    def drain_body(self) -> None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = 0
        if 0 < n and not is_too_large(n):
            try:
                self.rfile.read(n)
            except (TimeoutError, OSError):
                self.close_connection = True
        else:
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
        try:
            raw = self.rfile.read(n)
        except (TimeoutError, OSError):
            self.close_connection = True
            raise ApiError(408, f"the request body did not arrive within {self.api.spec.http_timeout_s:g} s") from None
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


def make_handler(api):
    """The handler class of ``api``'s server."""
    # a client that sends (or reads) nothing for this long loses its connection: a slow or stalled client can
    # hold a thread, never the server
    return type("Handler", (Handler,), {"api": api, "timeout": api.spec.http_timeout_s,
                                        "dispatch": staticmethod(routes.dispatch)})
