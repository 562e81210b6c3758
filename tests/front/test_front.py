"""The front door (front/proxy.py) on a real 2-rank local launch of the tiny model: forwarding with the official
`openai` client, keys and CORS at the front, a rank 0 lost mid-answer, 503 + Retry-After while nothing serves,
the front following a new job at an unchanged URL, the heal supervisor's word, and bad --front values.

One module: two jobs of the same cluster (two deployments) launched at once, one with --front: the front follows
one, then the other when the first one's rank 0 is SIGKILLed, then says 503 when both are gone."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from cliutil import run as cli_in  # in-process: no interpreter start per call
from launchutil import cli, local_cluster, manifests, start_cli, wait_gone

pytestmark = pytest.mark.slow

KEY = "front-test-key-0123456789"
ORIGIN = "https://app.example"
NO_EOS = {"0": -100, "2": -100}  # the tiny model's end tokens banned: an answer runs until it is cut


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    def __init__(self, tmp, tiny):
        self.tmp = tmp
        self.env = {"CLUSTERCTL_STATE_DIR": str(tmp / "state"), "FRONT_KEY": KEY}
        c = local_cluster(tmp, (4, 4))
        self.deps = [str(tmp / "dep1.json"), str(tmp / "dep2.json")]
        for dep, ctx in zip(self.deps, ("2048", "1024")):  # two deployments of cluster t
            cli("plan", "-c", str(c), "-m", str(tiny), "--context", ctx, "-o", dep, "-q", env=self.env, check=True)
        self.dep = self.deps[0]
        self.port = _free_port()
        self.front = f"127.0.0.1:{self.port}"

    def launch_both(self) -> list[dict]:
        """Both deployments at once; the first one's launch starts the front (the second knows of no front)."""
        procs = [start_cli("launch", dep, "--detach", "--json", "--timeout", "180", "--api-key-env", "FRONT_KEY",
                           "--cors-origin", ORIGIN, *(["--front", self.front] if i == 0 else []), env=self.env)
                 for i, dep in enumerate(self.deps)]
        docs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            docs.append(json.loads(out))
        return docs

    def following(self) -> str | None:
        """The job the front forwards to, as its /metrics says."""
        import re

        st, _, body = self.request("GET", "/metrics")
        assert st == 200
        found = re.findall(rb'clusterctl_front_following\{job="([^"]+)"\} 1\.0', body)
        return found[0].decode() if found else None

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                key: str | None = KEY):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
             **(headers or {})}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, dict(r.getheaders()), data

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=f"http://{self.front}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def d(tmp_path_factory, tiny):
    d = Deployment(tmp_path_factory.mktemp("front"), tiny)
    d.jobs = d.launch_both()
    # the front follows the newest job once its watcher has seen it (it may follow the first one ready until then)
    newest = max(manifests(d.tmp / "state"), key=lambda m: (m["created_at"], m["job_id"]))["job_id"]
    deadline = time.monotonic() + 10
    while d.following() != newest and time.monotonic() < deadline:
        time.sleep(0.1)
    yield d
    cli("teardown", "--force", env=d.env)
    cli("front", "--stop", env=d.env)


def test_openai_client_through_the_front_stream_and_not(d):
    client = d.openai()
    r = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 and r.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == r.choices[0].message.content
    assert client.completions.create(model="default_model", prompt="hi", max_tokens=3).choices[0].text is not None
    assert [m.id for m in client.models.list()]
    st, _, body = d.request("GET", "/models")  # the routes without /v1, as rank 0 serves them
    assert st == 200 and json.loads(body)["data"]
    st, _, body = d.request("GET", "/upstream/health", key=None)  # rank 0's own /health
    assert st == 200 and json.loads(body) == {"status": "ok"}
    st, _, body = d.request("GET", "/health", key=None)
    assert st == 200 and json.loads(body)["status"] == "ok"


def test_the_key_is_enforced_at_the_front_and_cors_preflight_answers(d):
    for key in (None, "wrong-key-0123456789abc"):
        st, h, body = d.request("POST", "/v1/chat/completions", {"messages": []}, key=key)
        assert st == 401 and h.get("WWW-Authenticate") == "Bearer"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert d.request("GET", "/metrics", key=key)[0] == 401
    st, h, _ = d.request("OPTIONS", "/v1/chat/completions", key=None,
                         headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert st == 204 and h["Access-Control-Allow-Origin"] == ORIGIN and "POST" in h["Access-Control-Allow-Methods"]
    st, h, _ = d.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert st == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    st, h, _ = d.request("GET", "/v1/models", key=None, headers={"Origin": "https://evil.example"})
    assert st == 401 and "Access-Control-Allow-Origin" not in h
    st, _, body = d.request("GET", "/metrics")
    assert st == 200 and b'clusterctl_front_state{state="serving"} 1.0' in body


def test_what_the_front_says_of_itself_and_the_requests_it_refuses(d):
    """The Server header is clusterctl's on every answer (rank 0's, the front's own, aiohttp's refusal of a
    malformed request); a body over 4 MiB is 413 with or without a Content-Length; a percent-encoded path reaches
    rank 0 as sent."""
    st, h, _ = d.request("GET", "/v1/models")
    assert st == 200 and h["Server"] == "clusterctl"
    st, h, _ = d.request("GET", "/health", key=None)
    assert h["Server"] == "clusterctl"
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        head = s.recv(4096)
    assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request") and b"Server: clusterctl\r\n" in head, head
    big = {"prompt": "x" * (4 << 20), "max_tokens": 1}
    assert d.request("POST", "/v1/completions", big)[0] == 413
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * (1 << 20)
    try:
        for _ in range(5):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
        assert conn.getresponse().status == 413
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while the body was still being sent: also a refusal
    finally:
        conn.close()
    direct = urllib.parse.urlsplit(d.jobs[0]["endpoint"])
    conn = http.client.HTTPConnection(direct.hostname, direct.port, timeout=60)
    conn.request("GET", "/v1/models/default%5Fmodel", headers={"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    want = (r.status, r.read())
    conn.close()
    st, _, body = d.request("GET", "/v1/models/default%5Fmodel")
    assert (st, body) == want


def test_a_client_that_leaves_mid_stream_ends_its_request_on_rank_0(d):
    """The front closes its connection to rank 0 when its client has gone: rank 0 cancels the request (counted
    as cancelled, not as a finished answer of 1,000 tokens) and lists it in flight no more."""
    import re

    job = d.following()
    [m] = [m for m in manifests(d.tmp / "state") if m["job_id"] == job]
    marker = Path(m["ranks"][0]["marker_path"])

    def active() -> list:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(marker.read_text()).get("active_requests") or []
        return []

    def ended(outcome: str) -> float:
        body = d.request("GET", "/upstream/metrics")[2]
        return float(re.search(rb'^clusterctl_requests_total\{outcome="%s"\} (\S+)$' % outcome.encode(), body,
                               re.M)[1])

    before = ended("cancelled"), ended("ok")
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "once upon", "max_tokens": 1000,
                                                             "stream": True, "logit_bias": NO_EOS}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline()
    deadline = time.monotonic() + 20
    while not active() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active(), "the request never showed on rank 0"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 30
    while active() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not active()
    assert (ended("cancelled"), ended("ok")) == (before[0] + 1, before[1])
    st, _, body = d.request("GET", "/metrics")
    assert b'clusterctl_front_requests_total{outcome="client_gone"}' in body


def test_the_heal_supervisors_word_is_the_fronts_health(d):
    heal = d.tmp / "state" / "heal" / "t.json"
    heal.parent.mkdir(exist_ok=True)
    heal.write_text(json.dumps({"state": "healing", "reason": "node b lost", "since": "2026-12-05T12:00:00Z"}))
    try:
        deadline = time.monotonic() + 5
        while d.request("GET", "/health", key=None)[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        st, h, body = d.request("GET", "/health", key=None)
        assert st == 503 and json.loads(body)["status"] == "healing" and h["Retry-After"] == "5"
    finally:
        heal.unlink()
    deadline = time.monotonic() + 5
    while d.request("GET", "/health", key=None)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.request("GET", "/health", key=None)[0] == 200


def test_bad_front_values_are_one_line_and_nothing_starts(d):
    before = manifests(d.tmp / "state")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        for value, code in ((f"127.0.0.1:{taken}", 69), ("192.0.2.1:8080", 69), ("bad host:80", 2),
                            ("127.0.0.1:0", 2), ("127.0.0.1", 2)):
            p = cli_in("launch", d.dep, "--detach", "--front", value, "--timeout", "60", env=d.env)
            lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
            assert p.code == code and len(lines) == 1, (value, p.code, p.stderr)
    assert manifests(d.tmp / "state") == before


def _kill_rank0_mid_answer(d, job: dict) -> None:
    """A stream and a non-stream request in flight through the front when ``job``'s rank 0 is SIGKILLed: the
    stream ends with an error event then [DONE], the other request gets 503 with Retry-After."""
    [m] = [m for m in manifests(d.tmp / "state") if m["job_id"] == job["job_id"]]
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "once upon", "max_tokens": 1000,
                                                             "stream": True, "logit_bias": NO_EOS}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline()  # the first event (or keepalive) arrived: the request is on rank 0
    plain: list = []
    t = threading.Thread(target=lambda: plain.append(d.request("POST", "/v1/completions", {
        "prompt": "hi", "max_tokens": 1000, "logit_bias": NO_EOS})), daemon=True)
    t.start()
    deadline = time.monotonic() + 20  # both on rank 0 (its marker lists the requests in flight)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if len(json.loads(Path(m["ranks"][0]["marker_path"]).read_text()).get("active_requests") or []) >= 2:
                break
        time.sleep(0.05)
    os.kill(m["ranks"][0]["pid"], signal.SIGKILL)
    events = [json.loads(x[6:]) if x[6:] != b"[DONE]" else "[DONE]"
              for x in (line.strip() for line in r) if x.startswith(b"data: ")]
    conn.close()
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_lost", events[-3:]
    t.join(60)
    assert plain and plain[0][0] == 503 and "Retry-After" in plain[0][1], plain


def test_rank0_lost_mid_answer_the_front_follows_the_other_job_then_503(d):
    ids = {j["job_id"]: j for j in d.jobs}
    first = d.following()
    assert first in ids
    _kill_rank0_mid_answer(d, ids[first])

    # the other job of the cluster serves at the same URL
    deadline = time.monotonic() + 10
    while d.following() == first and time.monotonic() < deadline:
        time.sleep(0.1)
    other = d.following()
    assert other in ids and other != first
    r = d.openai().chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    st, _, body = d.request("GET", "/metrics")
    import re

    assert float(re.search(rb"^clusterctl_front_upstream_changes_total (\S+)$", body, re.M)[1]) >= 2
    fronts = cli_in("front", "--json", env=d.env).json()["fronts"]
    assert [(f["url"], f["cluster"], f["state"]) for f in fronts] == [(f"http://{d.front}", "t", "serving")]
    st = cli_in("status", "--json", env=d.env).json()
    assert {j["front"] for j in st["jobs"]} == {f"http://{d.front}"} and st["fronts"][0]["url"] == f"http://{d.front}"
    assert f"front http://{d.front}: cluster t" in cli_in("status", env=d.env).stderr

    # and when that one's rank 0 is lost too, nothing serves: 503 with Retry-After in OpenAI's shape
    os.kill([m for m in manifests(d.tmp / "state") if m["job_id"] == other][0]["ranks"][0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        st, h, body = d.request("GET", "/v1/models")
        if st == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert st == 503 and int(h["Retry-After"]) >= 1 and json.loads(body)["error"]["type"] == "server_error"
    st, h, body = d.request("GET", "/health", key=None)
    assert st == 503 and json.loads(body)["status"] == "unavailable" and "Retry-After" in h
    assert d.request("GET", "/v1/models", key=None)[0] == 401  # still no word without the key


def test_teardown_stops_the_front_it_started(d):
    rec = cli_in("front", "--json", env=d.env).json()["fronts"][0]
    td = cli("teardown", "--force", env=d.env)  # the killed rank 0 markers still list their requests
    assert td.returncode == 0 and "stopped" in td.stderr, td.stderr
    assert wait_gone([rec["pid"]], 10) == []
    assert cli_in("front", "--json", env=d.env).json()["fronts"] == []
