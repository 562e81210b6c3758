"""Rank 0's OpenAI-compatible API, served by one real rank process (world of one) on a fresh loopback port."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from rankharness import RankCluster, reference_tokens, tiny_model_path

pytestmark = pytest.mark.slow  # every test here starts real ranks

KEY = "sk-test-key-123"
PROMPT = "def main(argv):"


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


@pytest.fixture(scope="module")
def rank(model, tmp_path_factory):
    c = RankCluster(tmp_path_factory.mktemp("serve"), model, [8], api_key=KEY,
                    env={"MLX_MAX_OPS_PER_BUFFER": "7"}, spec_env={"JACCL_TIMEOUT_ACTION": "abort"}, tag="serve")
    c.start()
    c.wait_state("ready")
    c.before_gate = _get(c, "/health")
    time.sleep(0.3)
    c.still_ready = c.marker(0).state
    c.open_gate()
    c.wait_state("serving")
    yield c
    c.stop()


def _conn(c: RankCluster) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)


def _get(c, path, key=KEY):
    conn = _conn(c)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    return r.status, body


def _post(c, path, body, key=KEY, raw=None):
    conn = _conn(c)
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=data, headers=headers)
    r = conn.getresponse()
    out = r.read()
    conn.close()
    return r.status, json.loads(out) if out.startswith(b"{") else out


def _sse(c, path, body):
    """The parsed `data:` events of a streaming response, with the time each arrived."""
    conn = _conn(c)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    events = []
    for line in r:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[6:].decode()
            events.append((time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)))
    conn.close()
    return events


def test_health_is_503_until_the_gate_opens_then_200(rank):
    assert rank.before_gate == (503, {"status": "ready"})
    assert rank.still_ready == "ready"
    assert _get(rank, "/health", key=None) == (200, {"status": "ok"})


def test_marker_identity_endpoint_and_effective_env(rank):
    m = rank.marker(0)
    p = psutil.Process(rank.procs[0].pid)
    assert (m.pid, m.pgid, m.rank, m.state) == (p.pid, p.pid, 0, "serving")
    assert m.start_time == pytest.approx(p.create_time())
    assert m.endpoint == rank.url and m.nonce == "nonce-serve" and m.error is None
    assert m.env["MLX_MAX_OPS_PER_BUFFER"] == "7"  # the operator's value beat our default
    assert m.env["JACCL_TIMEOUT_ACTION"] == "abort"  # so did the contract's
    assert m.env["MLX_MAX_MB_PER_BUFFER"] == "512" and m.env["JACCL_PROGRESS_TIMEOUT_MS"] == "30000"
    assert "MLX_HOSTFILE" not in m.env and "MLX_RANK" not in m.env  # a world of one has no hostfile
    assert all(KEY not in " ".join(psutil.Process(p.pid).cmdline()) for p in rank.procs)


def test_api_key_is_required_on_v1_routes(rank):
    assert _get(rank, "/v1/models", key=None)[0] == 401
    assert _get(rank, "/v1/models", key="wrong")[0] == 401
    status, body = _post(rank, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = _get(rank, "/v1/models")
    assert status == 200 and body["data"][0]["id"] == rank.model_path.name


@pytest.mark.parametrize("key", [None, "", "sk-test-key-124", KEY + "x", "Basic " + KEY], ids=repr)
def test_every_route_but_health_refuses_a_missing_or_wrong_key(rank, key):
    """Not even a 404 or 405 without the key: an unauthenticated caller learns nothing but /health."""
    assert _get(rank, "/health", key=key)[0] == 200
    for path in ("/v1/models", f"/v1/models/{rank.model_path.name}", "/nope", "/v1/embeddings"):
        assert _get(rank, path, key=key)[0] == 401, path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/health"):
        assert _post(rank, path, {"prompt": "x", "max_tokens": 1}, key=key)[0] == 401, path
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "BREW", "PROPFIND"):  # known to http.server or not
        conn = _conn(rank)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        conn.request(method, "/v1/completions", body=b"{}", headers=headers)
        r = conn.getresponse()
        assert r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key", method
        assert r.getheader("WWW-Authenticate") == "Bearer", method
        conn.close()
    for method, status in (("DELETE", 405), ("BREW", 501)):  # with the key: which methods exist, as JSON
        conn = _conn(rank)
        conn.request(method, "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == status and r.getheader("Content-Type") == "application/json", method
        assert json.loads(r.read())["error"]["message"], method
        conn.close()


def test_rank_0_listens_only_on_its_http_host(rank):
    listening = [c for c in psutil.Process(rank.procs[0].pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == rank.http_port]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"], listening


def _nice_by_thread(pid: int) -> dict[int, int]:
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out[int(t.name)] = int((t / "stat").read_text().rsplit(")", 1)[1].split()[16])
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice values are a Linux feature")
def test_the_compute_threads_yield_to_the_control_plane(rank):
    """The main thread (step loop) and MLX's threads run at the contract's compute_nice (default 10); the HTTP
    server's threads, request threads started since included, stay at the priority the rank started with."""
    pid = rank.procs[0].pid
    before = _nice_by_thread(pid)
    assert before[pid] == 10
    tens = [t for t, n in before.items() if n == 10 and t != pid]
    zeros = [t for t, n in before.items() if n == 0]
    assert tens, "no MLX thread was reniced"
    assert len(zeros) >= 4, before  # signals, heartbeat, watchdog, http, probes
    assert set(before.values()) == {0, 10}, before
    conn = _conn(rank)  # a streaming request: its handler thread is new, and must not inherit the compute's nice
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 200, "stream": True,
                                                             "temperature": 0}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    r.readline()  # the first event: the handler thread is running
    during = _nice_by_thread(pid)
    conn.close()
    new = set(during) - set(before)
    assert any(during[t] == 0 for t in new), (new, during)  # the request's thread is not reniced


def test_greedy_completion_matches_one_process_mlx_lm(rank, model):
    status, body = _post(rank, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                    "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == reference_tokens(model, PROMPT, 24)
    assert choice["finish_reason"] == "length" and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 24
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 24


def test_streaming_completion_equals_the_plain_one_and_reports_usage(rank):
    req = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    plain = _post(rank, "/v1/completions", req)[1]["choices"][0]["text"]
    events = _sse(rank, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == plain
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def test_stop_strings_cut_the_text_in_both_modes(rank):
    req = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    full = _post(rank, "/v1/completions", req)[1]["choices"][0]["text"]
    stop = full[12:15]
    cut = full[:full.index(stop)]
    body = _post(rank, "/v1/completions", {**req, "stop": [stop]})[1]
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == (cut, "stop")
    events = _sse(rank, "/v1/completions", {**req, "stop": stop})
    text = "".join(e["choices"][0]["text"] for _, e in events[:-1])
    assert text == cut and events[-2][1]["choices"][0]["finish_reason"] == "stop"


def test_openai_client_chat_and_completions_streaming_and_not(rank):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=rank.url + "/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model="tiny-model-test", messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 12
    streamed = client.chat.completions.create(model="tiny-model-test", messages=messages, max_tokens=12, temperature=0,
                                              stream=True)
    parts, finish = [], None
    for ev in streamed:
        parts.append(ev.choices[0].delta.content or "")
        finish = ev.choices[0].finish_reason or finish
    assert "".join(parts) == chat.choices[0].message.content and finish == "length"
    comp = client.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=8, temperature=0)
    streamed = client.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(ev.choices[0].text for ev in streamed) == comp.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=rank.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_curl_against_rank_0(rank):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    base = ["curl", "-sS", "--noproxy", "*", "-H", f"Authorization: Bearer {KEY}", "-H",
            "Content-Type: application/json"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    out = subprocess.run(base + ["-d", body, rank.url + "/v1/completions"], capture_output=True, timeout=60)
    assert json.loads(out.stdout)["usage"]["completion_tokens"] == 2
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    out = subprocess.run(base + ["-N", "-d", body, rank.url + "/v1/chat/completions"], capture_output=True,
                         timeout=60)
    lines = [ln for ln in out.stdout.decode().splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "x", "n": 9}, 400, "n must be between 1 and 8"),
    ({"prompt": PROMPT, "max_tokens": 4090}, 400, "context"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1, 99999]}, 400, "vocabulary"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": 3}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(rank, body, status, words):
    got, err = _post(rank, "/v1/completions", body)
    assert got == status and words in err["error"]["message"]


def test_malformed_bodies_and_routes(rank):
    assert _post(rank, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert _post(rank, "/v1/chat/completions", {"messages": []})[0] == 400
    assert _post(rank, "/v1/embeddings", {"input": "x"})[0] == 404
    assert _get(rank, "/nope")[0] == 404


def test_concurrent_requests_are_decoded_together_and_never_mixed(rank, model):
    """Three streams at once share the batch (their generations overlap in time), and each gets exactly the
    tokens it gets alone."""
    prompts = ["import os\n", "class Foo(object):", "for i in range(10):"]
    want = {p: reference_tokens(model, p, 24) for p in prompts}
    results: dict = {}

    def run(p):
        events = _sse(rank, "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0,
                                                "return_token_ids": True})
        last = events[-2][1]["choices"][0]
        text_times = [t for t, e in events[:-1] if e["choices"] and e["choices"][0]["text"]]
        results[p] = (last["token_ids"], text_times[0], text_times[-1])

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(120)
    assert {p: r[0] for p, r in results.items()} == want
    spans = sorted((r[1], r[2]) for r in results.values())
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), f"generations never overlapped: {spans}"


def test_a_closed_stream_is_cancelled_within_a_few_tokens(rank):
    conn = _conn(rank)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    first = json.loads(r.readline().decode()[6:])
    deadline = time.monotonic() + 10
    while rank.marker(0).active_requests != [first["id"]]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 5  # 3000 tokens take far longer; a cancel lands within 16 tokens
    while rank.marker(0).active_requests:
        assert time.monotonic() < deadline, "the cancelled generation is still running"
        time.sleep(0.05)
    status, body = _post(rank, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_non_streaming_client_that_leaves_cancels_its_request_and_a_queued_one_is_dropped(rank):
    def start(body):
        conn = _conn(rank)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        return conn

    long = start({"prompt": PROMPT, "max_tokens": 3000, "temperature": 0})
    deadline = time.monotonic() + 10
    while not rank.marker(0).active_requests:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    queued = start({"prompt": "x", "max_tokens": 3000, "temperature": 0})  # a second one, beside the first
    while len(rank.marker(0).active_requests) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    queued.close()  # the second client leaves too: its request is dropped
    long.close()  # leaves after 1 s of generation: cancelled at the next step boundary
    t0 = time.monotonic()
    # bounds far below 2 x 3000 tokens' worth (tens of seconds even on an idle machine) and far above the
    # client check (0.25 s) and the marker's heartbeat (1 s): a loaded machine (3 test workers on 2 cores) once
    # took 5.03 s
    while rank.marker(0).active_requests:
        assert time.monotonic() - t0 < 10, f"still active: {rank.marker(0).active_requests}"
        time.sleep(0.05)
    status, body = _post(rank, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert time.monotonic() - t0 < 14  # served at once, not after 2 x 3000 tokens


def test_sigterm_stops_serving_and_exits_0(model, tmp_path):
    # its own rank: the module's `rank` is shared by every other test, in whatever order they run
    c = RankCluster(tmp_path, model, [8], api_key=KEY, tag="term")
    with c.up():
        assert _post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200
        c.signal(0, signal.SIGTERM)
        assert c.wait_exit(0, 15) == 0
        m = c.marker(0)
        assert m.state == "stopping" and m.error is None
        assert "stopped" in c.logs(0) and "Traceback" not in c.logs(0)


def test_past_the_batch_and_the_queue_requests_get_429_with_retry_after(model, tmp_path):
    """max_batch 2, max_queue 1: two streams decode, a third waits, a fourth is refused with 429 + Retry-After;
    when one stream's client leaves, the waiting one takes its slot."""
    c = RankCluster(tmp_path, model, [8], api_key=KEY, overrides={"max_batch": 2, "max_queue": 1}, tag="busy")
    with c.up():
        body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}
        streams = []
        for _ in range(3):
            conn = _conn(c)
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            streams.append(conn)
            time.sleep(0.2)
        first = [s.getresponse() for s in streams[:2]]
        assert all(r.status == 200 and r.readline().startswith(b"data: ") for r in first)
        deadline = time.monotonic() + 10
        while len(c.marker(0).active_requests) < 3:  # two in the batch, one accepted and waiting
            assert time.monotonic() < deadline, c.marker(0).active_requests
            time.sleep(0.05)
        status, out = _post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert status == 429 and out["error"]["type"] == "rate_limit_error", out
        conn = _conn(c)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 4}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 429 and r.getheader("Retry-After") == "1"
        r.read()
        conn.close()
        waiting = streams[2]
        sock = waiting.sock
        sock.settimeout(2.5)
        r = waiting.getresponse()  # a stream's headers come at once, queued or not
        assert r.status == 200
        assert r.readline() == b": keepalive\n"  # no slot yet: comments only, no data
        first[0].close()
        streams[0].close()  # that client leaves: its request is dropped from the batch
        sock.settimeout(20)
        line = r.readline()
        while line in (b": keepalive\n", b"\n"):
            line = r.readline()
        assert line.startswith(b"data: "), line
        for s in streams[1:]:
            s.close()


def _raw(c, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes."""
    import socket

    s = socket.create_connection(("127.0.0.1", c.http_port), timeout=timeout)
    try:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


def _req(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("body, status", [
    (b'{"prompt": "x", "max_tokens": -5}', 400),
    (b'{"prompt": "x", "max_tokens": 100000000000000000000}', 400),
    (b'{"prompt": "x", "temperature": NaN}', 400),
    (b'{"prompt": "x", "top_p": Infinity}', 400),
    (b'{"prompt": "\xff\xfe bad utf-8"}', 400),
    (b'[1, 2, 3]', 400),
    (b'"just a string"', 400),
    (b'[' * 100000 + b']' * 100000, 400),
    (b'{"messages": [{"role": 7, "content": "x"}]}', 400),
    (b'{"prompt": {"nested": ["x"]}}', 400),
    (b'{"prompt": "x", "stop": "' + b"s" * 100 + b'", "max_tokens": 1}', 200),
])
def test_hostile_bodies_get_4xx_json_errors_and_the_rank_keeps_serving(rank, body, status):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    out = _raw(rank, _req(path, body))
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == str(status).encode(), out[:300]
    if status >= 400:
        assert json.loads(payload)["error"]["message"]
    assert _get(rank, "/health")[0] == 200


def _head(lines: list[str], body: bytes = b"") -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@pytest.mark.parametrize("raw, status", [
    (_head(["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}", "Content-Length: abc"],
           b'{"prompt": "x"}'), 411),
    (_head(["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}", "Content-Length: -5"],
           b'{"prompt": "x"}'), 411),
    (_head(["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}", "Transfer-Encoding: chunked"],
           b'f\r\n{"prompt": "x"}\r\n0\r\n\r\n'), 411),
    (_head(["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}", "X-Big: " + "a" * 70000]), 431),
    (_head(["GET /v1/models HTTP/1.1", "Host: x", *[f"X-H{i}: v" for i in range(150)]]), 431),
    (_head(["GET /" + "a" * 70000 + " HTTP/1.1", "Host: x"]), 414),
    (_head(["GARBAGE"]), 400),
    (_head(["GET /v1/models HTTP/9.9", "Host: x"]), 505),
    (_head(["BREW /v1/models HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}"]), 501),
    (_head(["BREW /v1/models HTTP/1.1", "Host: x"]), 401),
    (_head(["GET /v1/models HTTP/1.1", "Host: x", "Authorization: Bearer \u00ff\u00fe" + KEY, "Connection: close"]), 401),
], ids=["length-abc", "length-negative", "chunked", "header-70k", "150-headers", "request-line-70k", "garbage",
        "http-9.9", "unknown-method", "unknown-method-no-key", "latin-1-key"])
def test_hostile_headers_get_4xx_json_errors_and_the_rank_keeps_serving(rank, raw, status):
    out = _raw(rank, raw)
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == str(status).encode(), out[:300]
    assert b"Content-Type: application/json" in head and json.loads(payload)["error"]["message"], out[:300]
    assert _get(rank, "/health")[0] == 200
    assert "Traceback" not in rank.logs(0)


def test_an_oversized_body_is_refused_before_it_is_read(rank):
    out = _raw(rank, (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Length: {10 << 20}\r\n\r\n").encode() + b"{" * 1024)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]


def test_a_slow_client_holds_only_its_own_connection_and_is_dropped(model, tmp_path):
    """One byte a second: the others are served meanwhile; after http_timeout_s the slow one gets 408 and its
    connection is closed (no thread held forever, no traceback in the rank's log)."""
    import socket

    c = RankCluster(tmp_path, model, [8], api_key=KEY, overrides={"http_timeout_s": 2.0}, tag="slow")
    with c.up():
        body = b'{"prompt": "x", "max_tokens": 2}'
        s = socket.create_connection(("127.0.0.1", c.http_port), timeout=20)
        head = _req("/v1/completions", body)
        s.sendall(head[:-len(body)])
        t0 = time.monotonic()
        s.sendall(body[:1])
        assert _post(c, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200  # not blocked by it
        time.sleep(1.0)
        s.sendall(body[1:2])  # a byte a second: less than the body, then nothing
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        s.close()
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        assert time.monotonic() - t0 < 10
        assert "Traceback" not in c.logs(0)


def test_logprobs_from_a_world_of_one(rank, model):
    """The lockstep batch of one rank (tensor-parallel ranks decode the same way): logprobs as one process."""
    from test_api import reference_logprobs

    want = reference_logprobs(model, PROMPT, 5)
    status, out = _post(rank, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([w[1] for w in want], abs=2e-3)
    assert [sorted(t.values(), reverse=True)[0] for t in lp["top_logprobs"]] == \
        pytest.approx([w[2][0][1] for w in want], abs=2e-3)
