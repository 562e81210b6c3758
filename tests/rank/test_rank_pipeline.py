"""Real pipelines of 2 and 3 rank processes on loopback, uneven splits: identical output to one process, cheap idle
followers that are called to meetings, a stop agreed by all ranks."""

from __future__ import annotations

import json
import re
import signal
import time

import psutil
import pytest

from rankharness import RankCluster, reference_tokens, tiny_model_path

pytestmark = pytest.mark.slow  # every test here starts real ranks

PROMPTS = ["def main(argv):", "import sys\nclass Foo"]


def _defs(n: int) -> str:
    """A prompt of n small functions: 17-20 tokens each (n=12: 208 tokens, 36: 664, 60: 1,120)."""
    return "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(n))


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


@pytest.fixture(scope="module", params=[[6, 2], [1, 5, 2]], ids=["2ranks-6-2", "3ranks-1-5-2"])
def cluster(request, model, tmp_path_factory):
    split = request.param
    # the prompt cache on: every test below that repeats a prompt prefix also checks a cache hit changes nothing
    c = RankCluster(tmp_path_factory.mktemp("pipe"), model, split, tag=f"pipe{len(split)}",
                    overrides={"prompt_cache_tokens": 4096})
    c.up()
    yield c
    c.stop()


def _complete(c, **body):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 200, out
    return out["choices"][0]


def test_each_rank_holds_only_its_layers(cluster):
    ms = [cluster.marker(r) for r in range(cluster.world)]
    assert [(m.start_layer, m.end_layer) for m in ms] == \
        [(sum(cluster.layer_counts[r + 1:]), sum(cluster.layer_counts[r:])) for r in range(cluster.world)]
    assert all(m.state == "serving" for m in ms)
    assert ms[0].endpoint == cluster.url and all(m.endpoint is None for m in ms[1:])
    assert [m.env["MLX_RANK"] for m in ms] == [str(r) for r in range(cluster.world)]


def test_greedy_output_is_token_identical_to_one_process(cluster, model):
    for p in PROMPTS:
        got = _complete(cluster, prompt=p, max_tokens=40, temperature=0, return_token_ids=True)
        assert got["token_ids"] == reference_tokens(model, p, 40), p


def test_sampling_with_a_shared_seed_agrees_with_one_process(cluster, model):
    got = _complete(cluster, prompt=PROMPTS[0], max_tokens=24, temperature=0.9, seed=1234, return_token_ids=True)
    assert got["token_ids"] == reference_tokens(model, PROMPTS[0], 24, temperature=0.9, seed=1234)
    other = _complete(cluster, prompt=PROMPTS[0], max_tokens=24, temperature=0.9, seed=99, return_token_ids=True)
    assert other["token_ids"] != got["token_ids"]


def test_openai_streaming_chat_through_the_pipeline(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model="default_model", messages=messages, max_tokens=16, temperature=0)
    parts = [ev.choices[0].delta.content or "" for ev in client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=16, temperature=0, stream=True) if ev.choices]
    assert "".join(parts) == plain.choices[0].message.content


BATCH_PROMPTS = ["def main(argv):", "import sys\nclass Foo", "x", "for i in range(10):\n    print(i)\n",
                 "The quick brown fox jumps over the lazy dog. " * 3, "#", "while True:", "return None  # done"]


@pytest.mark.parametrize("n", [1, 4, 8])
def test_concurrent_requests_are_batched_and_each_matches_one_process(cluster, model, n):
    """n clients at once, prompts and lengths all different: every answer is token-identical to the same request
    served by one plain mlx-lm process, and (n > 1) the generations ran at the same time."""
    import threading

    jobs = [(BATCH_PROMPTS[i], 12 + 5 * i) for i in range(n)]
    want = {p: reference_tokens(model, p, m) for p, m in jobs}
    got, spans, errors = {}, {}, []

    def run(p, m):
        try:
            got[p], spans[p] = _stream_ids(cluster, prompt=p, max_tokens=m, temperature=0, return_token_ids=True)
        except Exception as e:  # surfaced below with the prompt
            errors.append((p, repr(e)))

    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert got == want
    deadline = time.monotonic() + 10  # every rank lets the requests go (a teardown would find them busy)
    while any(cluster.marker(r).active_requests for r in range(cluster.world)):
        assert time.monotonic() < deadline, [cluster.marker(r).active_requests for r in range(cluster.world)]
        time.sleep(0.1)
    if n > 1:  # served one after another, no request's tokens would flow while another's do: every request's
        # span (first text to last event) overlaps another's. (Not "all began before the first ended": while rows
        # decode a joining prompt is cut to what 2 decode steps cost, so the 8th short prompt may join late.)
        for p, (first, end) in spans.items():
            assert any(f < end and first < e for q, (f, e) in spans.items() if q != p), (p, spans)


def _stream_ids(c, **body) -> tuple[list[int], tuple[float, float]]:
    """A streaming completion: (token ids, (time of the first text, time of the last event))."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    first, ids = None, None
    for line in r:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"][0]
        if first is None and ch.get("text"):
            first = time.monotonic()
        if ch.get("finish_reason"):
            ids = ch["token_ids"]
    end = time.monotonic()
    conn.close()
    return ids, (first if first is not None else end, end)


def test_idle_followers_sleep_instead_of_spinning(cluster):
    procs = [psutil.Process(p.pid) for p in cluster.procs]
    time.sleep(0.5)  # let the idle schedule slow down
    before = [p.cpu_times() for p in procs]
    t0 = time.monotonic()
    time.sleep(2.0)
    dt = time.monotonic() - t0
    use = [((a.user + a.system) - (b.user + b.system)) / dt for a, b in zip((p.cpu_times() for p in procs), before)]
    # a rank waiting inside a collective spins a whole core (1.0); sleeping between meetings costs a few %
    assert max(use) < 0.3, use


def test_an_idle_deployment_costs_almost_no_cpu(cluster):
    """No request in flight: every rank blocks (no meetings on a short schedule, no accept loop that looks for a
    shutdown 50 times a second, a heartbeat a second, a watchdog that wakes once a second, rank 0's cancel file
    looked at four times a second after the first seconds), so all ranks together use under 1 % of a core (issue
    42's bound); a request is then served at once (the rank that has it calls the others)."""
    _complete(cluster, prompt="x", max_tokens=2, temperature=0)
    procs = [psutil.Process(p.pid) for p in cluster.procs]
    time.sleep(1.0)
    before = sum(t.user + t.system for t in (p.cpu_times() for p in procs))
    t0 = time.monotonic()
    time.sleep(10.0)
    used = (sum(t.user + t.system for t in (p.cpu_times() for p in procs)) - before) / (time.monotonic() - t0)
    # 2 ranks: issue 42's 1 % (0.5-0.7 % measured beside a load average of 13-18); 3 ranks on these 2 cores probe
    # more peers (1.1 % in one run there, above 1 % in another); the code before the idle work: 3.6 % and 9.0 %
    bound = 0.01 if cluster.world == 2 else 0.015
    assert used <= bound, f"{cluster.world} idle ranks used {used:.2%} of a core"
    assert _complete(cluster, prompt="x", max_tokens=2, temperature=0)["finish_reason"] == "length"


@pytest.mark.parametrize("split, who", [([6, 2], 0), ([1, 5, 2], 1)], ids=["2ranks-rank0", "3ranks-follower"])
def test_a_stop_signal_to_one_rank_stops_all_ranks_cleanly(model, tmp_path, split, who):
    # its own ranks: the module's `cluster` is shared by the other tests, in whatever order they run
    with RankCluster(tmp_path, model, split, tag="stop") as c:
        c.up()
        c.signal(who, signal.SIGTERM)
        codes = [c.wait_exit(r, 20) for r in range(c.world)]
        assert codes == [0] * c.world, [c.logs(r) for r in range(c.world)]
        assert all(c.marker(r).state == "stopping" for r in range(c.world))


def test_idle_ranks_call_each_other_to_meetings(model, tmp_path):
    """A request to an idle deployment, and a stop, do not wait for the idle schedule (a meeting every 10 s):
    the rank that has the work calls the others to the next meeting over the peer-probe port. While both
    micro-batches are busy, overlapped ranks do not meet: short requests arriving one after another join and leave
    between two slots (a meeting would drain the pipeline), and every answer is still identical to one process.
    (One meeting at most while busy: if the second long request comes after the first run's first slot, the
    empty micro-batch sat the run out and a meeting places the newcomer.)"""
    import threading

    with RankCluster(tmp_path, model, [4, 4], tag="wake") as c:
        c.up()
        for prompt in PROMPTS:
            time.sleep(0.7)  # idle, past a scheduled meeting
            assert _complete(c, prompt=prompt, max_tokens=2, temperature=0)["finish_reason"] == "length"
        time.sleep(0.7)
        jobs = [(BATCH_PROMPTS[i], m, d) for i, (m, d) in enumerate([(80, 0), (80, 0), (3, 0.15), (5, 0.25), (4, 0.35)])]
        got = {}

        def run(p, m, delay):
            time.sleep(delay)
            got[(p, m)] = _stream_ids(c, prompt=p, max_tokens=m, temperature=0, return_token_ids=True)[0]

        threads = [threading.Thread(target=run, args=j) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == {(p, m): reference_tokens(model, p, m) for p, m, _ in jobs}
        time.sleep(0.7)  # idle again (the last answer can come before the ranks have met after it)
        c.signal(0, signal.SIGTERM)
        assert [c.wait_exit(r, 20) for r in range(2)] == [0, 0], [c.logs(r) for r in range(2)]
        pattern = r"stopped \((\d+) wake-up call\(s\) sent, (\d+) heard; (\d+) meeting\(s\) while busy\)"
        counts = [re.search(pattern, c.logs(r)) for r in range(2)]
        assert all(counts), [c.logs(r) for r in range(2)]
        assert int(counts[0][1]) >= 4  # rank 0 called rank 1 for each request to an idle deployment and the stop
        assert int(counts[1][2]) >= 1  # and rank 1 left its sleep for a call
        busy = [int(m[3]) for m in counts]
        assert busy[0] == busy[1] <= 1, [c.logs(r) for r in range(2)]


@pytest.mark.parametrize("split", [[8], [5, 3]], ids=["1rank", "2ranks-5-3"])
def test_embedding_offload_keeps_output_identical(model, tmp_path, split):
    # the rank running layer 0 reads embedding rows from SSD (clusterctl.ple); the others use a shape-only
    # stand-in, since they receive activations instead of embedding tokens
    with RankCluster(tmp_path, model, split, overrides={"embedding_offload": True}, tag="offload") as c:
        c.up()
        got = _complete(c, prompt=PROMPTS[1], max_tokens=24, temperature=0, return_token_ids=True)
        assert got["token_ids"] == reference_tokens(model, PROMPTS[1], 24)


def test_the_last_rank_connects_only_after_the_others_announce_their_join(model, tmp_path):
    """MLX's ring starts with the last rank's connect to rank 0; a connect before rank 0 listens is refused and
    retried after 1 s (then 2, 4, 8 s). Here the last rank's gate opens first: it must wait (no connect in MLX's
    log) until rank 0's gate opens and rank 0 announces itself; then the ring joins without a retry."""
    gates = {r: tmp_path / f"gate{r}" for r in range(3)}
    with RankCluster(tmp_path, model, [3, 3, 2], env={"MLX_RING_VERBOSE": "1"},
                     per_rank={r: {"gate_path": str(g)} for r, g in gates.items()}, tag="order") as c:
        c.start()
        c.wait_state("ready", 120)
        gates[2].write_text("go\n")
        gates[1].write_text("go\n")
        deadline = time.monotonic() + 30
        while "joining the ring" not in c.log_path(2).read_text(errors="replace"):
            assert time.monotonic() < deadline, c.logs(2)
            time.sleep(0.05)
        time.sleep(1.5)
        log2 = c.log_path(2).read_text(errors="replace")
        assert "connecting to" not in log2 and c.marker(2).state == "ready", c.logs(2)
        gates[0].write_text("go\n")
        c.wait_state("serving", 60)
        logs = "".join(c.logs(r) for r in range(3))
        # what the order promises: the last rank's connect to rank 0 is not retried. (Rank 1's connect to the last
        # rank can still meet MLX's own race, the last rank listening only after its connect: 1 red CI run.)
        assert "Attempt" not in c.logs(2) and "joining anyway" not in logs, logs
        assert _complete(c, prompt=PROMPTS[0], max_tokens=4, temperature=0)["finish_reason"] == "length"


def _sampled(c, prompt: str, seed: int, n: int = 20) -> list[int]:
    return _complete(c, prompt=prompt, max_tokens=n, temperature=0.9, seed=seed, return_token_ids=True)["token_ids"]


def test_a_seeded_request_gives_the_same_tokens_whatever_else_is_in_the_batch(cluster, model):
    """Each request samples from its own random stream (seeded by its seed): alone, or among three other sampled
    requests that joined first, it gets the same tokens -- and alone, the tokens one process gives."""
    import threading

    alone = _sampled(cluster, PROMPTS[1], 4321)
    assert alone == reference_tokens(model, PROMPTS[1], 20, temperature=0.9, seed=4321)
    others, errors = [], []

    def other(i):
        try:
            others.append(_sampled(cluster, BATCH_PROMPTS[2 + i], 10 + i, n=60))
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # they are decoding when ours joins
    together = _sampled(cluster, PROMPTS[1], 4321)
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert together == alone


def test_requests_join_leave_and_disconnect_while_others_are_in_flight(cluster, model):
    """Requests of different lengths arrive at random times while others decode, one client hangs up mid-stream
    and one stops at a stop string: every finished answer is still token-identical to one process."""
    import http.client
    import random
    import threading

    rnd = random.Random(5)
    jobs = [(BATCH_PROMPTS[i % len(BATCH_PROMPTS)] + " " * (i // len(BATCH_PROMPTS)), rnd.randint(3, 40),
             rnd.uniform(0, 1.2)) for i in range(10)]
    got, errors = {}, []

    def run(p, m, delay):
        time.sleep(delay)
        try:
            got[(p, m)] = _stream_ids(cluster, prompt=p, max_tokens=m, temperature=0, return_token_ids=True)[0]
        except Exception as e:
            errors.append((p, repr(e)))

    def hang_up():
        time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        for _ in range(4):
            r.readline()
        conn.close()  # rank 0 notices at its next write and drops the request at the next meeting

    threads = [threading.Thread(target=run, args=j) for j in jobs] + [threading.Thread(target=hang_up)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert got == {(p, m): reference_tokens(model, p, m) for p, m, _ in jobs}
    text = _complete(cluster, prompt=PROMPTS[1], max_tokens=30, temperature=0)["text"]
    assert len(text) > 6, text
    stop = text[3:6]  # a stop string from the middle of the text ends it at its first match
    cut = _complete(cluster, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop])
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.find(stop)]


LOCKSTEP_LONG = _defs(36)  # 664 tokens: 3 chunks in lockstep, whose batch generator cuts fixed PREFILL_CHUNKs


def test_the_lockstep_schedule_still_serves_identically(model, tmp_path):
    """--schedule lockstep: every step on every rank together (the old behaviour, kept for the benchmark and for
    operators who want it). A long prompt's chunks (a first, a middle and a last one of PREFILL_CHUNK columns at
    most) skip the final all_sum (their logits are never used) and flow through the stages: the same tokens."""
    from mlx_lm import load

    from clusterctl.rank.engine.scheduler import PREFILL_CHUNK

    assert len(load(str(model))[1].encode(LOCKSTEP_LONG)) > 2 * PREFILL_CHUNK
    with RankCluster(tmp_path, model, [5, 3], overrides={"schedule": "lockstep"}, tag="lock") as c:
        c.up()
        for p in [*PROMPTS, LOCKSTEP_LONG]:
            assert _complete(c, prompt=p, max_tokens=24, temperature=0, return_token_ids=True)["token_ids"] == \
                reference_tokens(model, p, 24)
        assert "decode schedule lockstep" in c.logs(0)


def test_rank_0_reports_every_rank_s_step_time_idle_share_and_rss(cluster):
    """The meetings carry each rank's recent numbers to rank 0, which serves them at /metrics, labelled by rank."""
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    _complete(cluster, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    time.sleep(0.6)  # an idle meeting or two after the request
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    body = r.read().decode()
    assert r.status == 200, body
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    ranks = [str(r) for r in range(cluster.world)]
    rss = {s.labels["rank"]: s.value for s in fams["clusterctl_rank_rss_bytes"].samples}
    assert sorted(rss) == ranks and all(v > 50 << 20 for v in rss.values()), rss
    idle = {s.labels["rank"]: s.value for s in fams["clusterctl_rank_idle_share"].samples}
    assert sorted(idle) == ranks and all(0 <= v <= 1 for v in idle.values()), idle
    step = {s.labels["rank"]: s.value for s in fams["clusterctl_rank_step_seconds"].samples}
    assert sorted(step) == ranks and all(0 < v < 5 for v in step.values()), step


def _metric(c, name: str) -> float:
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)


def test_a_second_turn_reuses_the_first_turn_s_kv_and_answers_identically(cluster, model):
    """A conversation's second request starts with the first one's prompt and answer: the ranks compute only the
    new suffix (rank 0 counts the hit), and the tokens are those of one process computing it all; four such
    requests at once, each a different continuation of the same cached turn, too."""
    import threading

    from mlx_lm import load

    _, tok = load(str(model))
    first = "import numpy as np\n" * 12
    answer = _complete(cluster, prompt=first, max_tokens=16, temperature=0, return_token_ids=True)["token_ids"]
    before = _metric(cluster, "clusterctl_prompt_cache_hit_tokens_total")
    second = tok.decode(tok.encode(first) + answer) + "\ndef f(x):"
    got = _complete(cluster, prompt=second, max_tokens=16, temperature=0, return_token_ids=True)["token_ids"]
    assert got == reference_tokens(model, second, 16)
    assert _metric(cluster, "clusterctl_prompt_cache_hit_tokens_total") - before >= len(tok.encode(first))
    tails = ["\nclass A:", "\nx = 1", "\nfor i in y:", "\n# done"]
    prompts = [second + t for t in tails]
    got, errors = {}, []

    def run(p):
        try:
            got[p] = _complete(cluster, prompt=p, max_tokens=12, temperature=0, return_token_ids=True)["token_ids"]
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert got == {p: reference_tokens(model, p, 12) for p in prompts}


LONG = _defs(12)  # 208 tokens: 7 prompt chunks (of 32 columns) on 2 stages and on 3 (prefill_chunk)


def test_a_long_prompt_in_chunks_is_token_identical_to_one_process(cluster, model):
    """A prompt of several chunks on this pipeline (``prefill_chunk``: their hidden states flow through the stages
    chunk by chunk, more chunks than stages), then a second turn whose first part the prompt cache gives and whose
    rest, several chunks too, is computed: both as one process computes them whole."""
    from mlx_lm import load

    from clusterctl.rank.engine.scheduler import prefill_chunk

    _, tok = load(str(model))
    n = len(tok.encode(LONG))
    assert n > 3 * prefill_chunk(n, cluster.world)
    got = _complete(cluster, prompt=LONG, max_tokens=12, temperature=0, return_token_ids=True)["token_ids"]
    assert got == reference_tokens(model, LONG, 12)
    before = _metric(cluster, "clusterctl_prompt_cache_hit_tokens_total")
    second = tok.decode(tok.encode(LONG) + got) + "\n" + LONG.replace("x", "y")
    rest = len(tok.encode(second)) - n - len(got) - 1  # columns the cache cannot give (the last is the first step's)
    assert rest > 2 * prefill_chunk(rest, cluster.world)
    again = _complete(cluster, prompt=second, max_tokens=12, temperature=0, return_token_ids=True)["token_ids"]
    assert again == reference_tokens(model, second, 12)
    assert _metric(cluster, "clusterctl_prompt_cache_hit_tokens_total") - before >= len(tok.encode(LONG))


# the stream's tokens: 17-19 of its 375 text events (of 400 tokens) came before the first long answer (2 and 3
# ranks, load 4.6 on 2 cores), so 200 outlast the joins with room for a slow start of the joining clients
STREAMED = 200


def test_running_streams_keep_decoding_while_long_prompts_join(cluster, model):
    """A stream decodes; two long prompts of different lengths join meanwhile. The prompts are processed a budget
    per slot between the stream's steps (so the stream's tokens keep coming while they are: before, a joining
    prompt held every stream for the whole prompt), and all three answers are those of one process."""
    import threading

    from mlx_lm import load

    from clusterctl.rank.engine.scheduler import DECODE_BUDGET

    _, tok = load(str(model))
    # prompts no other test sent: the prompt cache (on in this module) must not give them a prefix; long enough
    # that the shorter is many DECODE_BUDGETs (12), which the threshold below tells from a whole prompt at once
    other = _defs(60).replace("return", "yield")
    short, longs = "import os\n", [other, other[: len(other) * 2 // 3].replace("x", "z")]
    events: list[tuple[float, str]] = []  # (time, who): each text event of the stream; each long one's answer
    lock = threading.Lock()
    got, errors = {}, []

    def stream():
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "prompt": short, "max_tokens": STREAMED, "temperature": 0, "return_token_ids": True, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            with lock:
                events.append((time.monotonic(), "stream"))
            if ch.get("finish_reason"):
                got[short] = ch["token_ids"]
        conn.close()

    def long(p):
        try:
            got[p], (first, _) = _stream_ids(cluster, prompt=p, max_tokens=8, temperature=0, return_token_ids=True)
            with lock:
                events.append((first, p))
        except Exception as e:
            errors.append(repr(e))

    t = threading.Thread(target=stream)
    t.start()
    while not events:
        time.sleep(0.01)
    sent = time.monotonic()
    threads = [threading.Thread(target=long, args=(p,)) for p in longs]
    for th in threads:
        th.start()
    for th in [*threads, t]:
        th.join(300)
    assert not errors, errors
    first_long = min(when for when, who in events if who != "stream")
    assert max(when for when, who in events if who == "stream") > first_long, "the stream ended first: make it longer"
    during = sum(1 for when, who in events if who == "stream" and sent < when < first_long)
    chunks = len(tok.encode(longs[1])) // DECODE_BUDGET
    assert during >= chunks // 2, (during, chunks, sent, [(round(w - sent, 3), who[:5]) for w, who in events])  # whole prompts at once: 2 or 3 stream events in between
    assert got[short] == reference_tokens(model, short, STREAMED)
    for p in longs:
        assert got[p] == reference_tokens(model, p, 8), p


def test_a_request_arriving_while_a_micro_batch_is_parked_joins_without_ending_the_run(cluster, model):
    """One stream decodes, alone in its micro-batch: the others sit the run out (parked). A request arrives: it
    joins a parked micro-batch at its next slot, which comes back into the run, and the run goes on (no meeting,
    no drained pipeline: before, the arrival ended the run). Read from /metrics while the stream still decodes: no
    run ended, one micro-batch revived; both answers are one process's."""
    import http.client
    import threading

    _complete(cluster, prompt="x", max_tokens=2, temperature=0)
    time.sleep(1.0)  # that run ended (a slot after its answer) and was counted
    ended0 = _metric(cluster, "clusterctl_overlap_runs_ended_total")
    revived0 = _metric(cluster, "clusterctl_overlap_revivals_total")
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "return_token_ids": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    events, got = [], {}

    def read():
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(time.monotonic())
                ch = json.loads(line[6:])["choices"][0]
                if ch.get("finish_reason"):
                    got["stream"] = ch["token_ids"]

    reader = threading.Thread(target=read)
    reader.start()
    while len(events) < 3:
        time.sleep(0.01)
    joined = _complete(cluster, prompt=PROMPTS[1], max_tokens=6, temperature=0, return_token_ids=True)
    ended1 = _metric(cluster, "clusterctl_overlap_runs_ended_total")
    revived1 = _metric(cluster, "clusterctl_overlap_revivals_total")
    scraped = time.monotonic()
    reader.join(300)
    conn.close()
    assert events[-1] > scraped, "the stream ended before the scrape: make it longer"
    assert (ended1 - ended0, revived1 - revived0) == (0, 1)
    assert joined["token_ids"] == reference_tokens(model, PROMPTS[1], 6)
    assert got["stream"] == reference_tokens(model, PROMPTS[0], 300)
