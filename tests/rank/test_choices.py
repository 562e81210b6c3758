"""n choices (OpenAI's ``n``, issue 44.2) on the session's shared 2-rank clusters, both decode schedules: each
choice its own index, finish_reason, logprobs and grammar; seeded choice i the same whatever n; usage counting the
prompt once and every choice; streams interleaving choices by index; the prompt processed once (the ranks'
counter of prompt tokens processed, not timing); the operator's limit; a client leaving cancels every row."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankharness import reference_tokens, tiny_model_path

pytestmark = pytest.mark.slow

# 20-odd tokens: long enough to be shared (choices.shareable), short enough for the shared clusters' 128-token context
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
CHAT = [{"role": "user", "content": "Count from one to ten, please."}]


def post(c, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out


def stream(c, path: str, body: dict) -> list:
    """The stream's events in order: each chunk's JSON, and "[DONE]"."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    lines = r.read().decode().splitlines()
    conn.close()
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def processed(c) -> float:
    """Rank 0's counter of prompt tokens the ranks processed."""
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "clusterctl_prompt_tokens_processed_total":
                return s.value
    raise AssertionError("no clusterctl_prompt_tokens_processed_total in /metrics")


def ids(choices: list) -> list[list[int]]:
    assert [ch["index"] for ch in choices] == list(range(len(choices)))
    return [ch["token_ids"] for ch in choices]


def test_greedy_choices_are_n_copies_of_the_single_answer_and_usage_counts_each(cluster):
    status, one = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                    "return_token_ids": True, "logprobs": 2})
    assert status == 200, one
    status, three = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                      "return_token_ids": True, "logprobs": 2, "n": 3})
    assert status == 200, three
    assert len(three["choices"]) == 3
    assert ids(three["choices"]) == ids(one["choices"]) * 3
    for ch in three["choices"]:
        assert ch["text"] == one["choices"][0]["text"] and ch["finish_reason"] == one["choices"][0]["finish_reason"]
        assert ch["logprobs"]["tokens"] == one["choices"][0]["logprobs"]["tokens"]
        assert len(ch["logprobs"]["top_logprobs"]) == len(ch["token_ids"])
    u = three["usage"]
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == sum(len(t) for t in ids(three["choices"])) == 3 * one["usage"]["completion_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_seeded_choice_i_is_the_same_whatever_n(cluster):
    def sampled(n: int) -> list[list[int]]:
        status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.5,
                                                        "seed": 77, "n": n, "return_token_ids": True})
        assert status == 200, out
        return ids(out["choices"])

    one, two, four = sampled(1), sampled(2), sampled(4)
    assert two == four[:2] and one == four[:1]
    assert len({tuple(t) for t in four}) > 1  # the choices are samples of their own, not copies
    # choice 0 draws what the request alone draws: what one mlx-lm process seeded with 77 draws (lockstep too)
    assert four[0] == reference_tokens(tiny_model_path(), PROMPT, 10, temperature=1.5, seed=77)


def test_the_prompt_is_processed_once_for_all_its_choices(cluster):
    status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert status == 200, out
    n_prompt = out["usage"]["prompt_tokens"]
    before = processed(cluster)
    status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.8,
                                                    "n": 4})
    assert status == 200 and len(out["choices"]) == 4, out
    # the prompt once (its prompt row), then each choice its last token alone: not 4 times the prompt
    assert processed(cluster) - before == n_prompt + 4


def test_choices_that_echo_and_score_their_prompt_each_score_all_of_it(cluster):
    """echo with logprobs and n: each choice's prompt logprobs are the single answer's (a choice that scores its
    prompt processes it: a shared prompt's KV carries no logits to score from)."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    status, one = post(cluster, "/v1/completions", body)
    assert status == 200, one
    status, out = post(cluster, "/v1/completions", {**body, "n": 2})
    assert status == 200 and len(out["choices"]) == 2, out
    want = one["choices"][0]["logprobs"]["token_logprobs"]
    assert want[0] is None and all(isinstance(x, float) for x in want[1:]), want
    for c in out["choices"]:
        assert c["text"] == one["choices"][0]["text"], (c, one)
        got = c["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(want), (got, want)
        assert max(abs(a - b) for a, b in zip(got[1:], want[1:])) < 2e-3, (got, want)


def test_a_stream_interleaves_the_choices_by_index_and_ends_after_all(cluster):
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "n": 3, "stream_options": {"include_usage": True}}
    status, whole = post(cluster, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"})
    assert status == 200, whole
    events = stream(cluster, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(len(e["choices"]) == 1 for e in chunks[:-1]) and chunks[-1]["choices"] == []
    texts, roles, finishes = {}, {}, {}
    for e in chunks[:-1]:
        ch = e["choices"][0]
        i = ch["index"]
        assert i not in finishes, "a chunk of a choice after its finish_reason"
        roles.setdefault(i, ch["delta"].get("role"))
        texts[i] = texts.get(i, "") + (ch["delta"].get("content") or "")
        if ch["finish_reason"] is not None:
            finishes[i] = ch["finish_reason"]
    assert set(roles) == set(finishes) == {0, 1, 2} and set(roles.values()) == {"assistant"}
    assert [texts[i] for i in range(3)] == [ch["message"]["content"] for ch in whole["choices"]]
    assert [finishes[i] for i in range(3)] == [ch["finish_reason"] for ch in whole["choices"]]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert len({e["id"] for e in chunks}) == 1


def test_each_choice_gets_its_own_grammar(cluster):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    status, out = post(cluster, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 24, "temperature": 1.0, "seed": 3, "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}})
    assert status == 200, out
    for ch in out["choices"]:
        assert isinstance(json.loads(ch["message"]["content"])["n"], int), ch


@pytest.mark.parametrize("body, param", [({"n": 9}, "n"), ({"n": 0}, "n"), ({"n": 2, "best_of": 3}, "best_of")])
def test_n_past_the_operators_limit_is_refused_naming_it(cluster, body, param):
    status, out = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
    assert status == 400 and out["error"]["param"] == param, out
    assert out["error"]["type"] == "invalid_request_error"


def test_a_client_leaving_a_stream_cancels_every_choice(cluster):
    data = json.dumps({"prompt": PROMPT, "max_tokens": 100, "temperature": 1.0, "n": 3, "stream": True,
                       "stop": "\x00never"}).encode()
    s = socket.create_connection(("127.0.0.1", cluster.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    got = b""
    while got.count(b"data: {") < 3:
        got += s.recv(65536)
    s.close()
    deadline = time.monotonic() + 15
    while any(cluster.marker(r).active_requests for r in range(cluster.world)):
        assert time.monotonic() < deadline, [cluster.marker(r).active_requests for r in range(cluster.world)]
        time.sleep(0.05)


def test_the_openai_client_reads_n_choices(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    r = client.chat.completions.create(model="tiny-model-test", messages=CHAT, max_tokens=6, n=2, temperature=0.9,
                                       seed=5)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens > 0
    assert all(c.message.role == "assistant" and c.finish_reason in ("stop", "length") for c in r.choices)
    got = {}
    for chunk in client.completions.create(model="tiny-model-test", prompt=PROMPT, max_tokens=5, n=2, stream=True,
                                           temperature=0):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert set(got) == {0, 1} and got[0] == got[1]


def test_tensor_parallel_ranks_share_the_prompt_among_the_choices_too(tmp_path):
    """Each rank keeps its own heads' share of the prompt's KV; the choices match the single answer (greedy) and
    seeded choice 0 matches the request alone."""
    from rankharness import RankCluster

    with RankCluster(tmp_path, tiny_model_path(), [8, 8], tag="chtp", tensor=True).up() as c:
        test_greedy_choices_are_n_copies_of_the_single_answer_and_usage_counts_each(c)
        test_the_prompt_is_processed_once_for_all_its_choices(c)
        test_seeded_choice_i_is_the_same_whatever_n(c)
