"""The front's clients' side (front/listener.py: aiohttp's server as the front sets it up) on a real socket:
keep-alive and pipelining in order, streams chunked or close-delimited, the listener's own refusals in OpenAI's
shape with the headers the front adds, Expect: 100-continue, HEAD, a client that leaves cancelling its handler, a
failing handler, the slow-body bound and the cut-off of a client that reads nothing; what a caller holds when the
handler answers from the head (as the front answers one without a key): a head within its bound, a body never
read, a connection among at most MAX_IDLE."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from clusterctl.front import listener
from clusterctl.front.listener import MAX_FIELD, MAX_LINE, Listener
from clusterctl.protocol.httpedge import MAX_HEAD, body_too_slow, head_too_large

BIG = 32 << 20  # an answer no socket buffer holds


class Running:
    """A Listener on 127.0.0.1 in its own event loop thread; the handler answers by path."""

    def __init__(self, max_body: int = 1000):
        self.loop = asyncio.new_event_loop()
        self.loop_errors: list[dict] = []  # "never retrieved" exceptions and the like: none expected
        self.loop.set_exception_handler(lambda loop, ctx: self.loop_errors.append(ctx))
        self.cancelled = threading.Event()
        self.refusals: list[int] = []
        self.seen: list[tuple[str, str, str, bytes]] = []
        self.server = Listener(self.handle, name="clusterctl", max_body=max_body, refused=self.refusals.append,
                               refusal_headers=lambda headers: {"X-Origin": headers.get("Origin", "-")})
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.listen("127.0.0.1", 0))
        self.port = self.server.port

    def call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def handle(self, req: web.BaseRequest, read) -> web.StreamResponse:
        if req.path == "/nobody":  # answered from the head, as the front answers a caller without a key
            return web.json_response({"path": req.path})
        body = await read() if callable(read) else read  # (bytes: the listener before issue 49, for old-tree runs)
        raw = req.raw_path
        self.seen.append((req.method, raw if raw.startswith("/") else req.rel_url.raw_path_qs, req.path, body))
        if req.path == "/stream":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)
            for i in range(3):
                await resp.write(b"data: %d\n\n" % i)
            await resp.write_eof()
            return resp
        if req.path == "/forever":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if req.path == "/slow":
            await asyncio.sleep(0.2)
        if req.path == "/boom":
            raise RuntimeError("bug")
        if req.path == "/big":
            return web.Response(body=b"z" * BIG)
        return web.json_response({"path": req.path, "len": len(body), "auth": req.headers.get("Authorization")})

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def close(self) -> None:
        self.call(self.server.close(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        assert self.loop_errors == []


@pytest.fixture
def srv():
    s = Running()
    yield s
    s.close()


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    return out


def test_keep_alive_answers_with_server_date_and_length(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    for i in range(3):
        conn.request("POST", f"/a%5Fb?i={i}", body=b"x" * i, headers={"Authorization": "Bearer k"})
        r = conn.getresponse()
        doc = json.loads(r.read())
        assert r.status == 200 and doc == {"path": "/a_b", "len": i, "auth": "Bearer k"}
        assert r.getheader("Server") == "clusterctl" and r.getheader("Date") and r.getheader("Connection") is None
    conn.close()
    assert [t for _, t, _, _ in srv.seen] == ["/a%5Fb?i=0", "/a%5Fb?i=1", "/a%5Fb?i=2"]  # the target as sent


def test_pipelined_requests_are_answered_in_order(srv):
    with srv.connect() as s:
        s.sendall(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\nGET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /two HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = read_all(s)
    assert data.index(b'"/one"') < data.index(b"data: 0") < data.index(b"data: 2") < data.index(b'"/two"')
    assert data.count(b"HTTP/1.1 200 OK") == 3 and b"Transfer-Encoding: chunked" in data


def test_a_stream_is_chunked_for_http11_and_close_delimited_for_http10(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", "/stream")
    r = conn.getresponse()
    assert r.getheader("Transfer-Encoding") == "chunked" and r.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    conn.request("GET", "/again")  # the connection is still good after a stream
    assert json.loads(conn.getresponse().read())["path"] == "/again"
    conn.close()
    with srv.connect() as s:
        s.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
        data = read_all(s)
    head, body = data.split(b"\r\n\r\n", 1)
    assert b"chunked" not in head and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_http10_keep_alive_is_said_and_kept(srv):
    with srv.connect() as s:
        s.sendall(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        head = s.recv(4096)
        assert b"Connection: keep-alive" in head
        s.sendall(b"GET /b HTTP/1.0\r\n\r\n")
        rest = read_all(s)
    assert b'"/b"' in rest


def test_a_request_that_does_not_parse_is_400_in_openais_shape(srv):
    with srv.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        data = read_all(s)
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 Bad Request") and b"Server: clusterctl" in head
    assert b"Connection: close" in head
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and "does not parse" in err["message"]
    assert srv.refusals == [400] and srv.seen == []


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_too_large_is_413_and_the_client_reads_it(srv, chunked):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    body = b"y" * 5000  # the server's bound is 1000 bytes
    if chunked:
        conn.putrequest("POST", "/big")
        conn.putheader("Origin", "o")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for i in range(0, len(body), 500):
            conn.send(b"%x\r\n%s\r\n" % (500, body[i:i + 500]))
        conn.send(b"0\r\n\r\n")
    else:
        conn.request("POST", "/big", body=body, headers={"Origin": "o"})
    r = conn.getresponse()
    assert r.getheader("X-Origin") == "o"  # the refusal carries the headers the front adds (CORS)
    assert r.status == 413 and json.loads(r.read())["error"]["message"] == "request body over 1000 bytes"
    assert r.getheader("Server") == "clusterctl"
    conn.close()
    assert srv.refusals == [413] and srv.seen == []


def test_a_header_too_large_is_431_and_a_request_line_414(srv):
    with srv.connect() as s:
        s.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"v" * (MAX_FIELD + 10) + b"\r\n\r\n")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 431 ") and srv.seen == []
    with srv.connect() as s:
        s.sendall(b"GET /" + b"p" * (MAX_LINE + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 414 ") and srv.seen == [] and srv.refusals == [431, 414]


def test_expect_100_continue_is_answered(srv):
    with srv.connect() as s:
        s.sendall(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"abc")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200 OK") and b'"len": 3' in head


def test_head_gets_the_length_and_no_body(srv):
    with srv.connect() as s:
        s.sendall(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = read_all(s)
    first, second = data.split(b"HTTP/1.1 200 OK")[1:]
    length = int(first.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    assert first.endswith(b"\r\n\r\n") and length == len(b'{"path": "/h", "len": 0, "auth": null}')
    assert b'"/g"' in second


@pytest.mark.parametrize("pipelined", [b"", b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"])
def test_a_client_that_leaves_cancels_its_handler(srv, pipelined):
    """Also with a request behind it, read but not answered: reading goes on, so the leaving is seen."""
    with srv.connect() as s:
        s.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n" + pipelined)
        deadline = time.monotonic() + 5
        while not srv.seen and time.monotonic() < deadline:
            time.sleep(0.01)
    assert srv.cancelled.wait(5) and [p for _, _, p, _ in srv.seen] == ["/forever"]


def test_a_failing_handler_is_500_and_the_connection_closes(srv):
    with srv.connect() as s:
        s.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 500 ") and b"Connection: close" in data
    assert "RuntimeError: bug" in json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]


def test_a_body_that_does_not_arrive_in_time_is_408(srv, monkeypatch):
    """However it trickles in: a byte every 20 ms, never the whole body before the deadline."""
    monkeypatch.setattr(listener, "BODY_S", 0.3)
    with srv.connect() as s:
        s.sendall(b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        t0 = time.monotonic()
        s.settimeout(0.02)
        data = b""
        while not data and time.monotonic() - t0 < 5:
            try:
                s.send(b"a")
                data = s.recv(65536)
            except TimeoutError:
                continue
        s.settimeout(10)
        while b"}}" not in data:  # the whole document (not the close, LINGER_S later)
            data += s.recv(65536)
    assert data.startswith(b"HTTP/1.1 408 ") and srv.seen == [] and srv.refusals == [408]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"] == body_too_slow(0.3)


def test_a_client_that_reads_nothing_is_cut_off_by_the_sweep(srv, monkeypatch):
    monkeypatch.setattr(listener, "STALL_S", 0.2)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: no window to grow into
    s.settimeout(10)
    s.connect(("127.0.0.1", srv.port))
    with s:
        s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")  # 32 MiB, not read
        time.sleep(0.6)

        async def sweep():
            srv.server.sweep()

        srv.call(sweep())
        time.sleep(0.2)
        got = len(read_all(s))  # what the kernel held for it, then the reset
    assert 0 < got < BIG


def test_absolute_form_targets_and_connect(srv):
    with srv.connect() as s:
        s.sendall(b"GET http://front.example/a%5Fb?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        data = read_all(s)
    assert srv.seen == [("GET", "/a%5Fb?x=1", "/a_b", b"")]
    assert b"HTTP/1.1 405 " in data and srv.refusals == [405]


def test_an_upgrade_is_answered_as_http11_and_the_connection_closes(srv):
    with srv.connect() as s:
        s.sendall(b"GET /u HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n\x00\x01junk")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in data and b'"/u"' in data


def test_one_endless_header_is_refused_before_it_ends(srv):
    with srv.connect() as s:
        s.sendall(b"GET / HTTP/1.1\r\nX-Long: ")
        for _ in range(50):  # no line end ever: the parser would hold it all
            try:
                s.sendall(b"v" * 1000)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 431 ") and srv.seen == []


def test_a_refusal_behind_an_answer_is_sent_after_it(srv):
    """A request that does not parse, pipelined behind one being answered. (Sent in the same segment as the good
    one, aiohttp's parser drops both and answers the 400 alone.)"""
    with srv.connect() as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 5
        while not srv.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        s.sendall(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 200 OK") and b'"/slow"' in data
    assert data.index(b'"/slow"') < data.index(b"HTTP/1.1 400 Bad Request")
    assert srv.refusals == [400]


def test_an_idle_connection_is_closed_after_the_keepalive(monkeypatch):
    monkeypatch.setattr(listener, "KEEPALIVE_S", 0.3)
    srv = Running()
    try:
        with srv.connect() as s:
            s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert read_all(s) == b"" and time.monotonic() - t0 < 5
    finally:
        srv.close()


def test_a_head_over_the_bound_is_431_though_each_header_is_within_its_own(srv):
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * (MAX_FIELD - 100)) for i in range(MAX_HEAD // MAX_FIELD + 1))
    with srv.connect() as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 431 ") and srv.seen == [] and srv.refusals == [431]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"] == head_too_large()


def test_a_body_the_handler_does_not_ask_for_is_not_read_and_the_connection_closes(monkeypatch):
    """Answered from the head; what the client sends after is dropped for LINGER_S at most, then the close."""
    monkeypatch.setattr(listener, "LINGER_S", 0.3)
    srv = Running()
    try:
        with srv.connect() as s:
            s.sendall(b"POST /nobody HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (4 << 20))
            t0 = time.monotonic()
            head = s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200 ") and b'"/nobody"' in head and time.monotonic() - t0 < 2
            s.sendall(b"x" * (1 << 20))  # dropped as it comes, never answered as a request
            assert read_all(s) == b"" and time.monotonic() - t0 < 2.3
    finally:
        srv.close()


def test_past_max_idle_connections_the_longest_open_idle_ones_are_closed(srv, monkeypatch):
    """Idle connections count, one whose handler asked for its body does not; a burst of new ones closes as many
    of the longest-open (one closing is not counted again while its task ends)."""
    monkeypatch.setattr(listener, "MAX_IDLE", 2, raising=False)
    busy = srv.connect()
    busy.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.monotonic() + 5
    while not srv.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.loop.call_soon_threadsafe(time.sleep, 0.5)  # the loop busy: the four wait in the kernel's accept queue,
    idle = [srv.connect() for _ in range(4)]  # then are taken in this order, in one go (a burst)
    try:
        for s in idle[:2]:
            s.settimeout(2)
            assert read_all(s) == b""  # closed
        for s in idle[2:]:
            s.sendall(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert not srv.cancelled.is_set()  # the busy one is still being answered
    finally:
        for s in (busy, *idle):
            s.close()
