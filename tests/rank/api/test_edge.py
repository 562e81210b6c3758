"""Rank 0 applies the edge's rules (protocol/httpedge.py) as the front does: its HTTP server in this process
(no ranks: it answers 503 while loading, which is enough to see the headers), allowed origins ``*``: every
answer says ``Access-Control-Allow-Origin: *``, with an ``Origin`` header or without one
(tests/front/test_front_edge.py asks the front the same); the 413 and 401 documents in OpenAI's shape."""

from __future__ import annotations

import http.client
import json

import pytest

from clusterctl.protocol.httpedge import MAX_BODY, body_too_large
from clusterctl.protocol.rankspec import parse_rank_spec
from clusterctl.rank.api.service import Api
from clusterctl.rank.engine.requestqueue import RequestQueue

KEY = "sk-edge-key-0123456789"


@pytest.fixture
def api(tmp_path):
    spec = parse_rank_spec(dict(
        deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m", start_layer=0,
        end_layer=8, layer_counts=[8], num_layers=8, hostfile=None, http_port=0, api_key=KEY, cors_origins=["*"],
        runtime_dir=str(tmp_path), marker_path=str(tmp_path / "m.json"), gate_path=str(tmp_path / "gate")))
    api = Api(spec, RequestQueue(), model_name="m")
    api.start()
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
