"""The front's own answers follow the edge's rules (protocol/httpedge.py) as rank 0's do: a real front (its
server on loopback, its follower over an empty state dir, so nothing serves) given the rules a job's contract
would give it: with allowed origins ``*``, every answer says ``Access-Control-Allow-Origin: *``, with an
``Origin`` header or without one (tests/rank/api/test_edge.py asks rank 0 the same); a caller without a key is
answered from its head, its body never read (nor invited, with ``Expect: 100-continue``)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

from clusterctl.connect.nodes import Connector
from clusterctl.front.follow import Follower
from clusterctl.front.proxy import Front, make_server
from clusterctl.protocol.httpedge import MAX_BODY, Access, Cors, Keys, body_too_large
from clusterctl.statedir.state import StateDir

KEY = "front-edge-key-0123456789"


def ask(port: int, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


def raw(port: int, data: bytes) -> tuple[bytes, float]:
    """The front's answer to ``data`` (its head and as many bytes as it declares; what came in 5 s) and how long
    it took."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        t0, out = time.monotonic(), b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                head, _, body = out.partition(b"\r\n\r\n")
                if _ and len(body) >= int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]):
                    break
        except (TimeoutError, ConnectionResetError, IndexError):
            pass
    return out, time.monotonic() - t0


async def answers(tmp_path, origins: tuple[str, ...], requests: list, send=ask) -> list:
    front = Front(Follower(StateDir(tmp_path), "c", Connector(), log=lambda msg: None))
    front.follower.last_rules = Access(Keys.of({"default": KEY}), Cors(origins))  # as a contract would say
    server = front.server = make_server(front)
    await server.listen("127.0.0.1", 0)
    try:
        return [await asyncio.to_thread(send, server.port, *r) for r in requests]
    finally:
        await server.close(grace=0.5)
        await front.pool.close()


def test_any_origin_is_said_on_the_fronts_own_answers_with_or_without_an_origin_header(tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    got = asyncio.run(answers(tmp_path, ("*",), [
        ("GET", "/health", {}),  # the front's own health: nothing serves
        ("GET", "/v1/models", {}),  # no key: 401
        ("GET", "/v1/models", auth),  # the key, nothing to forward to: 503
        ("GET", "/v1/models", {**auth, "Origin": "https://app.example"}),
        ("OPTIONS", "/v1/chat/completions", {}),  # a preflight needs no key
    ]))
    assert [st for st, _, _ in got] == [503, 401, 503, 503, 204]
    assert all(h.get("Access-Control-Allow-Origin") == "*" and "Vary" not in h for _, h, _ in got), got
    assert got[1][1]["WWW-Authenticate"] == "Bearer" and json.loads(got[1][2])["error"]["code"] == "invalid_api_key"
    assert json.loads(got[2][2])["error"]["code"] == "service_unavailable" and "Retry-After" in got[2][1]
    assert got[4][1]["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"


def test_listed_origins_only_and_nothing_without_an_origin_header(tmp_path):
    got = asyncio.run(answers(tmp_path, ("https://app.example",), [
        ("GET", "/v1/models", {"Origin": "https://app.example"}),
        ("GET", "/v1/models", {"Origin": "https://evil.example"}),
        ("GET", "/v1/models", {}),
    ]))
    assert [st for st, _, _ in got] == [401, 401, 401]
    assert got[0][1]["Access-Control-Allow-Origin"] == "https://app.example" and got[0][1]["Vary"] == "Origin"
    assert "Access-Control-Allow-Origin" not in got[1][1] and "Access-Control-Allow-Origin" not in got[2][1]


def test_a_caller_without_a_key_is_401_from_its_head_and_its_body_is_never_read(tmp_path):
    """Each declares a body and sends one byte of it: the front once read (or waited 300 s for) the whole body
    before it looked at the key, and told a keyless caller 413 for a body declared too large."""
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
    got = asyncio.run(answers(tmp_path, (), [
        (post % MAX_BODY + b"\r\n{",),
        (post % (MAX_BODY + 1) + b"\r\n{",),
        (post % 10 + b"Expect: 100-continue\r\n\r\n",),  # the body is not invited: no 100 Continue
        (post % (MAX_BODY + 1) + f"Authorization: Bearer {KEY}\r\n\r\n".encode(),),  # the key: 413 from the head
    ], send=raw))
    for data, took in got[:3]:
        assert data.startswith(b"HTTP/1.1 401 ") and took < 4, data[:100]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_api_key"
    data, took = got[3]
    assert data.startswith(b"HTTP/1.1 413 ") and took < 4 and b"Connection: close" in data
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"] == body_too_large()
