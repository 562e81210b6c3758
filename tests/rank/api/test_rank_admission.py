"""Admission on rank 0 against real ranks: every sampling value checked against the model, no request's values or
size able to end a rank, the planned context enforced, prompts prepared off the step loop (issue 30)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from rankharness import RankCluster, tiny_model_path

pytestmark = pytest.mark.slow  # every test here starts real ranks

PROMPT = "def main(argv):"
VOCAB = 2048  # the tiny model's
CONTEXT = 128  # the plan's per-request context in the shared clusters (conftest.py SHARED_CONTEXT)
CONTEXT_WORDS = f"planned context of {CONTEXT} tokens"


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


# ``cluster``: the session's shared 2-rank clusters, one per decode schedule (conftest.py): a planned context of
# SHARED_CONTEXT tokens and a short ladder (a step loop held for 8 s by a client's prompt would end the deployment)


def post(c: RankCluster, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out


def alive(c: RankCluster) -> None:
    """Every rank process still runs and rank 0 still serves."""
    for r, p in enumerate(c.procs):
        assert p.poll() is None, f"rank {r} exited {p.returncode}\n{c.logs(r)}"
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


@pytest.mark.parametrize("top_k", [VOCAB - 1, VOCAB + 1, 1 << 20])
def test_top_k_at_or_past_the_vocabulary_keeps_every_token_and_ends_no_rank(cluster, top_k):
    status, out = post(cluster, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0.7,
                                                    "top_k": top_k, "seed": 11})
    assert status == 200, out
    if top_k >= VOCAB:  # no top-k at all: the same tokens as without one
        status, plain = post(cluster, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0.7,
                                                          "seed": 11})
        assert plain["choices"][0]["text"] == out["choices"][0]["text"]
    alive(cluster)


def test_the_planned_context_is_enforced(cluster):
    status, out = post(cluster, "/v1/completions", {"prompt": [5] * 501, "max_tokens": 2000})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert CONTEXT_WORDS in out["error"]["message"]
    status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": CONTEXT})
    assert status == 400 and out["error"]["param"] == "max_tokens" and CONTEXT_WORDS in out["error"]["message"]
    status, out = post(cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200}],
                                                         "max_tokens": 4})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    status, out = post(cluster, "/v1/completions", {"prompt": [5] * 40, "max_tokens": CONTEXT - 40})
    assert status == 200 and out["usage"]["total_tokens"] <= CONTEXT, out
    alive(cluster)


def test_huge_prompts_are_refused_unread_and_never_hold_the_step_loop(cluster):
    if cluster.overrides["schedule"] != "overlap":
        pytest.skip("admission does not depend on the schedule: one is enough")
    """Eight 4 MB prompts at once (legal bodies) while a stream decodes: each gets its 400 at once, the stream
    finishes, and no rank's ladder fires (its deadline is 8 s here; one such prompt used to hold rank 0's step loop
    for 5-7 s, eight of them past 30 s)."""
    big = "hello world " * 340_000  # 4.08 MB
    results, errors = [], []

    def one():
        try:
            results.append(post(cluster, "/v1/completions", {"prompt": big, "max_tokens": 4}))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    stream = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
    stream.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 40,
                                                               "temperature": 0, "stream": True}),
                   headers={"Content-Type": "application/json"})
    resp = stream.getresponse()
    assert resp.status == 200
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    body = resp.read().decode()
    stream.close()
    assert not errors, errors
    assert len(results) == 8 and all(s == 400 and o["error"]["code"] == "context_length_exceeded"
                                     for s, o in results), results[:1]
    from admissionfuzz import events

    assert body.rstrip().endswith("data: [DONE]") and not any("error" in e for e in events(body)), body[-400:]
    alive(cluster)


def test_near_zero_temperature_is_greedy_and_seeds_are_not_folded(cluster):
    greedy = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[1]
    for t in (1e-45, 1e-39, 1e-7):
        status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": t,
                                                        "seed": 1})
        assert status == 200 and out["choices"][0]["text"] == greedy["choices"][0]["text"], (t, out)

    def sampled(seed):
        status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.5,
                                                        "seed": seed, "return_token_ids": True})
        assert status == 200, out
        return out["choices"][0]["token_ids"]

    # 5 and 5 + 2^31 (or 2^40) used to be the same seed: folded modulo 2^31
    five = sampled(5)
    assert five == sampled(5)
    assert five != sampled(5 + (1 << 31)) or five != sampled(5 + (1 << 40))
    assert sampled(-1) == sampled(-1)
    status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": 1 << 63})
    assert status == 400 and out["error"]["param"] == "seed", out
    alive(cluster)


def test_a_client_that_leaves_while_queued_frees_its_admission_slot_at_once(model, tmp_path):
    """max_batch 1, max_queue 1: one request decodes, a second waits; its client leaves; a third is admitted
    (it waits in the queue) instead of a 429, while the first still decodes."""
    c = RankCluster(tmp_path, model, [8], overrides={"max_batch": 1, "max_queue": 1}, tag="leave")
    with c.up():
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
        first = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
        first.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = first.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        s = socket.create_connection(("127.0.0.1", c.http_port))
        data = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        deadline = time.monotonic() + 10
        while len(c.marker(0).active_requests) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.close()  # the queued request's client leaves
        deadline = time.monotonic() + 5
        while len(c.marker(0).active_requests) > 1:
            assert time.monotonic() < deadline, "the queued request still holds its slot"
            time.sleep(0.05)
        third = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
        third.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        r.close()
        first.close()  # the first leaves too: the third gets the batch
        r3 = third.getresponse()
        assert r3.status == 200, r3.read()
        third.close()


def _hit_tokens(c: RankCluster, key: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("clusterctl_prompt_cache_hit_tokens_total"))


def test_tenants_and_cache_salts_partition_the_prompt_cache(model, tmp_path):
    """Two keys, two tenants: a prompt one tenant sent is never a cache hit for the other (the hit counter of
    /metrics, readable by every key holder, used to confirm another client's secret prefix token by token); a
    cache_salt splits one tenant's requests the same way; a wrong key is still refused."""
    keys = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
    c = RankCluster(tmp_path, model, [8], overrides={"api_keys": keys, "prompt_cache_tokens": 4096}, tag="tenants")
    with c.up():
        def ask(key: str, salt: str | None = None) -> None:
            body = {"prompt": "the employee id of the secret account is 4711 and the pin", "max_tokens": 2,
                    "temperature": 0, **({"cache_salt": salt} if salt else {})}
            conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            r = conn.getresponse()
            assert r.status == 200, r.read()
            r.read()
            conn.close()

        ask(keys["alice"])
        base = _hit_tokens(c, keys["bob"])
        ask(keys["bob"])  # the same prompt, another tenant: no reuse
        assert _hit_tokens(c, keys["bob"]) == base
        ask(keys["alice"])  # the same tenant: reused
        hit = _hit_tokens(c, keys["alice"])
        assert hit > base
        ask(keys["alice"], salt="s1")  # the same tenant, another salt: no reuse
        assert _hit_tokens(c, keys["alice"]) == hit
        ask(keys["alice"], salt="s1")
        assert _hit_tokens(c, keys["alice"]) > hit
        status, out = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})  # no key
        assert status == 401, out


def test_fuzzed_requests_get_a_200_within_the_context_or_a_clean_4xx_and_end_no_rank(cluster):
    """tests/admissionfuzz.py with a fixed seed (bench/faults.py runs it with a random one)."""

    import admissionfuzz

    from clusterctl.rank.api.admission import limits_for
    from mlx_lm.utils import load_tokenizer

    limits = limits_for(json.loads((cluster.model_path / "config.json").read_text()),
                        load_tokenizer(cluster.model_path), CONTEXT)
    target = admissionfuzz.Target(port=cluster.http_port, vocab=VOCAB, context=CONTEXT,
                                  token_bytes=limits.token_bytes)
    tally = admissionfuzz.run(target, seed=30, n=48, alive=lambda: alive(cluster))
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.ok >= 5 and tally.refused >= 5, tally  # both kinds of answer were exercised
