"""Rank 0's /metrics (rank/metrics.py, docs/metrics.md): scraped from one real rank process (world of one)
with prometheus_client's own parser while requests are served; the Metrics object and the open switch in-process."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clusterctl.rank.cancelfile import cancel_here
from clusterctl.rank.metrics import LADDER_STAGES, OPEN_ENV, OUTCOMES, Metrics
from rankharness import RankCluster, tiny_model_path

KEY = "sk-metrics-key"
PROMPT = "def main(argv):"
# every metric docs/metrics.md names, as the parser names the families (counters without _total)
FAMILIES = {
    "clusterctl_requests", "clusterctl_prompt_tokens", "clusterctl_completion_tokens",
    "clusterctl_time_to_first_token_seconds", "clusterctl_time_per_output_token_seconds",
    "clusterctl_prompt_cache_hits", "clusterctl_prompt_cache_hit_tokens", "clusterctl_cancel_acks",
    "clusterctl_cancel_requests", "clusterctl_cancel_ack_errors", "clusterctl_cancel_epoch", "clusterctl_peer_ladder",
    "clusterctl_batch_slots", "clusterctl_queue_slots", "clusterctl_queue_depth", "clusterctl_batch_occupancy",
    "clusterctl_serving", "clusterctl_rank_step_seconds", "clusterctl_rank_idle_share", "clusterctl_rank_rss_bytes",
    "clusterctl_overlap_runs_ended", "clusterctl_overlap_revivals",
}


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    c = RankCluster(tmp_path_factory.mktemp("metrics"), tiny_model_path(), [8], api_key=KEY, tag="metrics")
    with c.up():
        yield c


def _conn(c, timeout=60):
    return http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)


def _scrape_raw(c, key=KEY) -> tuple[int, str, str]:
    conn = _conn(c)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    return r.status, r.getheader("Content-Type") or "", body


def _parse(text: str) -> dict:
    """{(sample name, ((label, value), ...)): value} and the family names under the key "families"."""
    out, families = {}, set()
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    out["families"] = families
    return out


def scrape(c) -> dict:
    status, _, text = _scrape_raw(c)
    assert status == 200, text
    return _parse(text)


def v(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _post(c, body, key=KEY):
    conn = _conn(c)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out


def _until(c, check, what, timeout=10.0) -> dict:
    """Scrape until ``check(metrics)`` holds: the HTTP thread counts a request just after its last write."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(c)
        if check(m):
            return m
        assert time.monotonic() < deadline, f"{what}: never seen"
        time.sleep(0.05)


def _stream(c, max_tokens=3000):
    """A long streaming request, its first chunk read: (connection, response, request id)."""
    conn = _conn(c)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200
    first = json.loads(r.readline().decode()[6:])
    return conn, r, first["id"]


@pytest.mark.slow
def test_metrics_need_the_key_and_every_documented_metric_is_there(rank):
    before = scrape(rank)
    assert _scrape_raw(rank, key=None)[0] == 401
    assert _scrape_raw(rank, key="wrong")[0] == 401
    status, ctype, text = _scrape_raw(rank)
    assert status == 200 and ctype.startswith("text/plain")
    m = _parse(text)
    assert FAMILIES <= m["families"], FAMILIES - m["families"]
    assert {o for o in OUTCOMES if ("clusterctl_requests_total", (("outcome", o),)) in m} == set(OUTCOMES)
    assert v(m, "clusterctl_serving") == 1 and v(m, "clusterctl_batch_slots") == 8
    assert v(m, "clusterctl_queue_slots") == 64
    assert v(m, "clusterctl_rank_rss_bytes", rank="0") > 10 << 20  # a loaded rank: tens of MB at least
    assert v(m, "clusterctl_prompt_cache_hits_total") == 0
    # scrapes, refused or not, are not API requests
    assert all(v(m, "clusterctl_requests_total", outcome=o) == v(before, "clusterctl_requests_total", outcome=o)
               for o in OUTCOMES)


@pytest.mark.slow
def test_an_ok_request_moves_outcome_tokens_and_latency_histograms(rank):
    m0 = scrape(rank)
    status, body = _post(rank, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert status == 200
    usage = body["usage"]
    m1 = _until(rank, lambda m: v(m, "clusterctl_requests_total", outcome="ok")
                > v(m0, "clusterctl_requests_total", outcome="ok"), "the ok request")
    d = lambda name, **kw: v(m1, name, **kw) - v(m0, name, **kw)  # noqa: E731
    assert d("clusterctl_requests_total", outcome="ok") == 1
    assert d("clusterctl_prompt_tokens_total") == usage["prompt_tokens"] > 0
    assert d("clusterctl_completion_tokens_total") == usage["completion_tokens"] > 0
    assert d("clusterctl_time_to_first_token_seconds_count") == 1
    assert 0 < d("clusterctl_time_to_first_token_seconds_sum") < 30
    if usage["completion_tokens"] >= 2:  # a time per output token needs a second token
        assert d("clusterctl_time_per_output_token_seconds_count") == 1
    assert all(d("clusterctl_requests_total", outcome=o) == 0 for o in OUTCOMES if o != "ok")


@pytest.mark.slow
def test_refusals_count_as_4xx_the_missing_key_included(rank):
    m0 = scrape(rank)
    assert _post(rank, {"prompt": PROMPT, "max_tokens": 2, "n": 9})[0] == 400
    assert _post(rank, {"prompt": PROMPT, "max_tokens": 2}, key=None)[0] == 401
    m1 = _until(rank, lambda m: v(m, "clusterctl_requests_total", outcome="4xx")
                >= v(m0, "clusterctl_requests_total", outcome="4xx") + 2, "two refusals")
    assert v(m1, "clusterctl_requests_total", outcome="4xx") - v(m0, "clusterctl_requests_total", outcome="4xx") == 2
    assert v(m1, "clusterctl_requests_total", outcome="ok") == v(m0, "clusterctl_requests_total", outcome="ok")
    assert v(m1, "clusterctl_prompt_tokens_total") == v(m0, "clusterctl_prompt_tokens_total")  # never generated


@pytest.mark.slow
def test_a_client_that_leaves_is_cancelled_and_the_batch_shows_it_while_it_runs(rank):
    m0 = scrape(rank)
    conn, r, rid = _stream(rank)
    m = _until(rank, lambda m: v(m, "clusterctl_batch_occupancy") == 1, "the stream in the batch")
    assert v(m, "clusterctl_queue_depth") == 0
    r.close()  # the client goes away mid-stream
    conn.close()
    m1 = _until(rank, lambda m: v(m, "clusterctl_requests_total", outcome="cancelled")
                > v(m0, "clusterctl_requests_total", outcome="cancelled"), "the cancelled request")
    assert v(m1, "clusterctl_requests_total", outcome="cancelled") \
        - v(m0, "clusterctl_requests_total", outcome="cancelled") == 1
    assert v(m1, "clusterctl_requests_total", outcome="ok") == v(m0, "clusterctl_requests_total", outcome="ok")
    assert v(m1, "clusterctl_requests_total", outcome="5xx") == v(m0, "clusterctl_requests_total", outcome="5xx")
    assert v(m1, "clusterctl_time_to_first_token_seconds_count") \
        - v(m0, "clusterctl_time_to_first_token_seconds_count") == 1
    m2 = _until(rank, lambda m: v(m, "clusterctl_batch_occupancy") == 0, "an empty batch")
    assert v(m2, "clusterctl_cancel_acks_total") == v(m0, "clusterctl_cancel_acks_total")  # no cancel file


@pytest.mark.slow
def test_a_cancel_file_is_acked_and_counted(rank):
    m0 = scrape(rank)
    conn, r, rid = _stream(rank)
    cancel_here(str(rank.root), "dep", "job-metrics", [rid], consumed=int(v(m0, "clusterctl_cancel_epoch")))
    finish = None
    for line in r:  # the stream ends with finish_reason "cancelled", then [DONE]
        if line.startswith(b"data: {"):
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    conn.close()
    assert finish == "cancelled"
    m1 = _until(rank, lambda m: v(m, "clusterctl_requests_total", outcome="cancelled")
                > v(m0, "clusterctl_requests_total", outcome="cancelled"), "the cancelled request")
    assert v(m1, "clusterctl_cancel_acks_total") - v(m0, "clusterctl_cancel_acks_total") == 1
    assert v(m1, "clusterctl_cancel_requests_total") - v(m0, "clusterctl_cancel_requests_total") == 1
    assert v(m1, "clusterctl_cancel_epoch") > v(m0, "clusterctl_cancel_epoch")
    assert v(m1, "clusterctl_completion_tokens_total") > v(m0, "clusterctl_completion_tokens_total")
    assert v(m1, "clusterctl_requests_total", outcome="ok") == v(m0, "clusterctl_requests_total", outcome="ok")


# ---- in-process: the Metrics object and the open switch

def _api(tmp_path, monkeypatch, open_env: str | None):
    from clusterctl.rank.api.service import Api
    from clusterctl.rank.engine.requestqueue import RequestQueue
    from clusterctl.protocol.rankspec import parse_rank_spec

    if open_env is None:
        monkeypatch.delenv(OPEN_ENV, raising=False)
    else:
        monkeypatch.setenv(OPEN_ENV, open_env)
    spec = parse_rank_spec(dict(
        deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m", start_layer=0,
        end_layer=8, layer_counts=[8], num_layers=8, hostfile=None, http_port=0, api_key=KEY,
        runtime_dir=str(tmp_path), marker_path=str(tmp_path / "m.json"), gate_path=str(tmp_path / "gate")))
    api = Api(spec, RequestQueue(), model_name="m")
    api.start()
    return api


@pytest.mark.parametrize("open_env, status", [(None, 401), ("0", 401), ("1", 200)])
def test_the_operator_may_open_metrics_without_the_key_and_each_server_has_its_own_registry(
        tmp_path, monkeypatch, open_env, status):
    apis = [_api(tmp_path, monkeypatch, open_env) for _ in range(2)]  # two servers, one process
    try:
        for api in apis:
            conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            text = r.read().decode()
            conn.close()
            assert r.status == status
            if status == 200:
                m = _parse(text)
                assert v(m, "clusterctl_serving") == 0  # still loading: /metrics answers all the same
            conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
            conn.request("GET", "/v1/models")  # the API itself keeps its key
            assert conn.getresponse().status == 401
            conn.close()
    finally:
        for api in apis:
            api.stop(timeout=0.1)


def test_ladder_acks_cache_and_per_rank_stats():
    m = Metrics(max_batch=4, max_queue=2, queue_depth=lambda: 3, occupancy=lambda: 2)
    m.watch_peers([1, 2])
    got = _parse(m.render()[0].decode())
    assert all(v(got, "clusterctl_peer_ladder_total", stage=s, peer=p) == 0 and
               ("clusterctl_peer_ladder_total", (("peer", p), ("stage", s))) in got
               for s in LADDER_STAGES for p in ("1", "2"))
    assert "clusterctl_rank_step_seconds" in got["families"] and \
        not [k for k in got if k != "families" and k[0] == "clusterctl_rank_step_seconds"]  # no steps yet
    for stage in ("suspect", "abort", "recovered"):
        m.ladder(stage, 2)
    m.cancel_acked(5, 3)
    m.ack_failed()
    m.cache_hit(100)
    m.set_rank_stats(0, 0.05, 0.75, None)  # rank 0's own, as its meetings report it; RSS from this process
    m.set_rank_stats(1, 0.04, 0.25, 123 << 20)
    got = _parse(m.render()[0].decode())
    assert v(got, "clusterctl_peer_ladder_total", stage="abort", peer="2") == 1
    assert v(got, "clusterctl_peer_ladder_total", stage="lost", peer="2") == 0
    assert v(got, "clusterctl_cancel_acks_total") == 1 and v(got, "clusterctl_cancel_requests_total") == 3
    assert v(got, "clusterctl_cancel_epoch") == 5 and v(got, "clusterctl_cancel_ack_errors_total") == 1
    assert v(got, "clusterctl_prompt_cache_hits_total") == 1
    assert v(got, "clusterctl_prompt_cache_hit_tokens_total") == 100
    assert (v(got, "clusterctl_queue_depth"), v(got, "clusterctl_batch_occupancy")) == (3, 2)
    assert v(got, "clusterctl_rank_step_seconds", rank="0") == pytest.approx(0.05)
    assert v(got, "clusterctl_rank_idle_share", rank="0") == pytest.approx(0.75, abs=0.03)
    assert v(got, "clusterctl_rank_rss_bytes", rank="0") > 0
    assert (v(got, "clusterctl_rank_step_seconds", rank="1"), v(got, "clusterctl_rank_idle_share", rank="1"),
            v(got, "clusterctl_rank_rss_bytes", rank="1")) == (0.04, 0.25, 123 << 20)
    # OpenMetrics for a scraper that asks for it
    body, ctype = m.render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")
