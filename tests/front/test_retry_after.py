"""Every 503 a client can get says when to come back (docs/api.md, docs/front.md: ``Retry-After`` on every 503):
rank 0's own (loading, draining after SIGTERM, its /health), the front's (no rank 0, a heal, rank 0 refusing the
connection) and rank 0's passed on by the front. A real front on loopback, its follower over a state dir with no
job, forwarding to a real rank 0 API in this process (rank/api/service.py: no ranks, so it answers 503 while
loading, then while stopping). Issue 49: a 503 without ``Retry-After`` came through the front mid-heal: rank 0's
"not serving (stopping)" carried none, and the front passed it on as it was."""

from __future__ import annotations

import asyncio
import http.client

from testports import free_port

from clusterctl.connect.nodes import Connector
from clusterctl.front.follow import Follower, Target
from clusterctl.front.proxy import Front, make_server
from clusterctl.protocol.httpedge import Access, Cors, Keys
from clusterctl.protocol.rankspec import parse_rank_spec
from clusterctl.rank.api.phase import Phase
from clusterctl.rank.api.service import Api
from clusterctl.rank.api.wire import ApiError
from clusterctl.rank.engine.requestqueue import RequestQueue
from clusterctl.statedir import healfile
from clusterctl.statedir.manifest import this_coordinator
from clusterctl.statedir.state import StateDir

KEY = "sk-retry-after-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def ask(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers=AUTH)
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, r.getheader("Retry-After")


def rank0(tmp_path) -> Api:
    spec = parse_rank_spec(dict(
        deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m", start_layer=0,
        end_layer=8, layer_counts=[8], num_layers=8, hostfile=None, http_port=free_port(), api_key=KEY,
        cors_origins=[], runtime_dir=str(tmp_path), marker_path=str(tmp_path / "m.json"),
        gate_path=str(tmp_path / "gate")))
    api = Api(spec, RequestQueue(), model_name="m")
    api.start()
    return api


def test_every_503_says_retry_after(tmp_path):
    api, state = rank0(tmp_path), StateDir(tmp_path / "state")
    rules = Access(Keys.of({"default": KEY}), Cors(()))

    async def go() -> dict[str, tuple[int, str | None]]:
        front = Front(Follower(state, "c", Connector(), log=lambda msg: None))
        server = front.server = make_server(front)
        await server.listen("127.0.0.1", free_port())
        got = {}

        async def at(what: str, port: int, method: str, path: str, body: bytes | None = None) -> None:
            got[what] = await asyncio.to_thread(ask, port, method, path, body)

        def follow(endpoint: str) -> None:
            front.follower.target, front.healthy = Target("j", "d", endpoint, rules), True

        try:
            await at("front: no job seen yet", server.port, "GET", "/v1/models")
            front.follower.last_rules = rules  # a job was seen once: its rules stay in force
            await at("front: no rank 0", server.port, "POST", "/v1/chat/completions", CHAT)
            await at("front: /health, nothing serves", server.port, "GET", "/health")
            follow(f"http://127.0.0.1:{free_port()}")  # rank 0 gone mid-heal: its port refuses
            await at("front: rank 0 refuses", server.port, "POST", "/v1/chat/completions", CHAT)
            await at("rank 0: loading", api.port, "POST", "/v1/chat/completions", CHAT)
            await at("rank 0: /health, loading", api.port, "GET", "/health")
            follow(f"http://127.0.0.1:{api.port}")
            await at("front: rank 0 loading", server.port, "POST", "/v1/chat/completions", CHAT)
            api.state.to(Phase.STOPPING)  # SIGTERM: the heal's teardown
            await at("rank 0: draining", api.port, "POST", "/v1/chat/completions", CHAT)
            await at("front: rank 0 draining", server.port, "POST", "/v1/chat/completions", CHAT)
            healfile.write(state, healfile.SupervisorState(state="healing", reason="rank 1 on b dead", deployment="d",
                                                           cluster="c", supervisor=this_coordinator()))
            front.follower.target, front.healthy = None, False
            await front.refresh()
            await at("front: healing", server.port, "POST", "/v1/chat/completions", CHAT)
        finally:
            await server.close(grace=0.5)
            await front.pool.close()
        return got

    try:
        got = asyncio.run(go())
    finally:
        api.stop(timeout=0.1)
    assert {what: status for what, (status, _) in got.items()} == {what: 503 for what in got}, got
    assert [what for what, (_, retry) in got.items() if not (retry or "").isdigit()] == [], got
    assert got["front: healing"][1] == "5" and got["front: no rank 0"][1] == "2"
    assert ApiError(503, "made anywhere").retry_after is not None  # the one builder of rank 0's errors
