"""The front's own answers follow the edge's rules (protocol/httpedge.py) as rank 0's do: a real front (its
server on loopback, its follower over an empty state dir, so nothing serves) given the rules a job's contract
would give it: with allowed origins ``*``, every answer says ``Access-Control-Allow-Origin: *``, with an
``Origin`` header or without one (tests/rank/api/test_edge.py asks rank 0 the same)."""

from __future__ import annotations

import asyncio
import http.client
import json

from clusterctl.connect.nodes import SshOptions
from clusterctl.front.follow import Follower
from clusterctl.front.proxy import Front, make_server
from clusterctl.protocol.httpedge import Access, Cors, Keys
from clusterctl.statedir.state import StateDir

KEY = "front-edge-key-0123456789"


def ask(port: int, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


async def answers(tmp_path, origins: tuple[str, ...], requests: list) -> list:
    front = Front(Follower(StateDir(tmp_path), "c", SshOptions(), log=lambda msg: None))
    front.follower.last_rules = Access(Keys.of({"default": KEY}), Cors(origins))  # as a contract would say
    server = front.server = make_server(front)
    await server.listen("127.0.0.1", 0)
    try:
        return [await asyncio.to_thread(ask, server.port, *r) for r in requests]
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
