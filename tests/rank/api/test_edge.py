"""Rank 0 applies the edge's rules (protocol/httpedge.py) as the front does: its HTTP server in this process
(no ranks: it answers 503 while loading, which is enough to see the headers), allowed origins ``*``: every
answer says ``Access-Control-Allow-Origin: *``, with an ``Origin`` header or without one
(tests/front/test_front_edge.py asks the front the same); the 413 and 401 documents in OpenAI's shape; what a
caller can hold before it shows a key (a body it is not asked for, a head too long or too slow, connections) and
how long a keyed body may take (protocol/httpedge.py's bounds)."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from clusterctl.protocol.httpedge import MAX_BODY, MAX_HEAD, body_too_large, body_too_slow, head_too_large
from clusterctl.rank.api import handler, service
from clusterctl.protocol.rankspec import parse_rank_spec
from clusterctl.rank.api.service import Api
from clusterctl.rank.engine.requestqueue import RequestQueue

KEY = "sk-edge-key-0123456789"


def start(tmp_path, **settings) -> Api:
    spec = parse_rank_spec(dict(
        deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m", start_layer=0,
        end_layer=8, layer_counts=[8], num_layers=8, hostfile=None, http_port=0, api_key=KEY, cors_origins=["*"],
        runtime_dir=str(tmp_path), marker_path=str(tmp_path / "m.json"), gate_path=str(tmp_path / "gate"),
        **settings))
    api = Api(spec, RequestQueue(), model_name="m")
    api.start()
    return api


@pytest.fixture
def api(tmp_path):
    api = start(tmp_path)
    yield api
    api.stop(timeout=0.1)


def ask(api, method: str, path: str, headers: dict, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


def test_any_origin_is_said_with_or_without_an_origin_header(api):
    got = [ask(api, "GET", "/health", {}), ask(api, "GET", "/v1/models", {}),
           ask(api, "GET", "/v1/models", {"Origin": "https://app.example"}),
           ask(api, "OPTIONS", "/v1/chat/completions", {})]
    assert [st for st, _, _ in got] == [503, 401, 401, 204]
    assert all(h.get("Access-Control-Allow-Origin") == "*" and "Vary" not in h for _, h, _ in got), got
    assert got[1][1]["WWW-Authenticate"] == "Bearer"
    assert json.loads(got[1][2]) == {"error": {"message": "invalid or missing API key", "type":
                                               "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    assert got[3][1]["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"


def test_a_body_over_the_edges_bound_is_413_before_it_is_read(api):
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Length", str(MAX_BODY + 1))
    conn.endheaders()  # the body is never sent: rank 0 answers on the declared length
    r = conn.getresponse()
    doc = json.loads(r.read())
    conn.close()
    assert r.status == 413 and doc["error"]["message"] == body_too_large() and r.getheader("Connection") == "close"


def answer(s: socket.socket) -> bytes:
    """What the server sends until it closes (a reset after the answer included)."""
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


def test_a_caller_without_a_key_is_401_from_its_head_and_no_body_is_read(api):
    """The body is declared (4 MiB) and never sent: the 401 comes at once (rank 0 once read the whole declared
    body first, holding 4 MiB a caller, up to its timeout); a body declared over the bound is 401 too."""
    for length in (MAX_BODY, MAX_BODY + 1):
        with socket.create_connection(("127.0.0.1", api.port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % length)
            t0 = time.monotonic()
            data = answer(s)
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in head, head
        assert json.loads(body)["error"]["code"] == "invalid_api_key" and time.monotonic() - t0 < 4


def test_a_keyed_body_that_is_dribbled_is_408_at_the_body_deadline(api, monkeypatch):
    """A byte every 50 ms keeps every read within the server's timeout: only the body's own deadline ends it."""
    monkeypatch.setattr(handler, "BODY_S", 0.5, raising=False)
    with socket.create_connection(("127.0.0.1", api.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                  b"Content-Length: 1000\r\n\r\n" % KEY.encode())
        t0, data = time.monotonic(), b""
        s.settimeout(0.05)
        while time.monotonic() - t0 < 5 and not data:
            try:
                s.send(b" ")
                data = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        s.settimeout(5)
        data += answer(s)
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"] == body_too_slow(0.5)
    assert time.monotonic() - t0 < 3


def test_a_head_over_the_bound_is_431_though_each_header_is_within_its_own(api):
    with socket.create_connection(("127.0.0.1", api.port), timeout=5) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(
            b"X-H%d: %s\r\n" % (i, b"v" * 40000) for i in range(MAX_HEAD // 40000 + 1)) + b"\r\n")
        data = answer(s)
    assert data.startswith(b"HTTP/1.1 431 "), data[:200]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"] == head_too_large()


def test_a_head_that_is_dribbled_is_closed_at_the_servers_timeout(tmp_path):
    api = start(tmp_path, http_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", api.port), timeout=5) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nX-Slow: ")
            t0, closed = time.monotonic(), False
            while time.monotonic() - t0 < 5 and not closed:
                try:
                    s.send(b"v")  # within each read's timeout, never the head's end
                except OSError:
                    closed = True
                time.sleep(0.05)
        assert closed and time.monotonic() - t0 < 3
    finally:
        api.stop(timeout=0.1)


def test_connections_past_the_bound_are_told_503_without_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "MAX_IDLE", 2, raising=False)
    api = start(tmp_path, max_batch=1, max_queue=1)  # capacity 2: 4 connections at most
    held = [socket.create_connection(("127.0.0.1", api.port), timeout=5) for _ in range(4)]
    try:
        for s in held:  # each is served (a thread each): a request on it is answered
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 503 ")  # loading: /health says 503 with its own body
        with socket.create_connection(("127.0.0.1", api.port), timeout=5) as extra:
            data = answer(extra)  # told without asking anything
        assert data.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"] == "too many connections"
        held.pop().close()
        deadline = time.monotonic() + 5
        while api.httpd.open_connections > 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, _, body = ask(api, "GET", "/health", {})  # one freed: served again
        assert status == 503 and json.loads(body) == {"status": "loading"}
    finally:
        for s in held:
            s.close()
        api.stop(timeout=0.1)
