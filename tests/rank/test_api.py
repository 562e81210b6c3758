"""Rank 0's OpenAI API beyond the basics (issue 31), on 2 real ranks of each decode schedule and on one rank:
every sampling control per request (the same greedy tokens as one mlx-lm process with the same settings), fields
that cannot be honoured refused by name, model names, paths without /v1, CORS, usage details. (A stream's
headers at once and its keepalive comments while it waits: test_rank_serve.py, the 429 test.)"""

from __future__ import annotations

import http.client
import json

import pytest

from rankharness import RankCluster, tiny_model_path

pytestmark = pytest.mark.slow  # every test here runs against the shared real ranks

PROMPT = "def main(argv):"
MODEL_ID = "tiny-model-test"


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


# ``cluster``: the session's shared 2-rank clusters, one per schedule (conftest.py)


def call(c: RankCluster, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        out = json.loads(raw) if raw else None
    except ValueError:
        out = raw
    return r.status, out, r


def reference(model_path, prompt: str, max_tokens: int, **procs) -> list[int]:
    """One mlx-lm process, greedy, with mlx-lm's own logits processors for these settings (EOS excluded)."""
    return [t for t, _, _ in reference_logprobs(model_path, prompt, max_tokens, **procs)]


def tokens_of(c, body: dict) -> list[int]:
    status, out, _ = call(c, "POST", "/v1/completions", {"prompt": PROMPT, "temperature": 0,
                                                          "return_token_ids": True, **body})
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def test_penalties_and_logit_bias_give_one_mlx_lm_process_tokens(cluster, model):
    """Each control per request, as mlx-lm's own processors apply it in one process. The tiny model never repeats
    a token on its own, so a logit_bias of 6 on token 7 makes it repeat, and each penalty then changes the
    answer (none is accepted and ignored)."""
    plain = tokens_of(cluster, {"max_tokens": 10})
    assert plain == reference(model, PROMPT, 10)
    assert tokens_of(cluster, {"max_tokens": 10, "logit_bias": {str(plain[0]): -100}}) \
        == reference(model, PROMPT, 10, logit_bias={plain[0]: -100.0}) != plain
    forced = {"logit_bias": {7: 6.0}}
    repeated = tokens_of(cluster, {"max_tokens": 10, "logit_bias": {"7": 6}})
    assert repeated == reference(model, PROMPT, 10, **forced) and repeated.count(7) >= 5
    for body in ({"presence_penalty": 2.0}, {"frequency_penalty": 1.0, "frequency_context_size": 8},
                 {"repetition_penalty": 1.8}, {"presence_penalty": -0.5, "repetition_penalty": 1.8}):
        got = tokens_of(cluster, {"max_tokens": 10, "logit_bias": {"7": 6}, **body})
        assert got == reference(model, PROMPT, 10, **forced, **body) and got != repeated, body
    assert tokens_of(cluster, {"max_tokens": 4, "logit_bias": {"7": 100}}) == [7, 7, 7, 7]


@pytest.mark.parametrize("field, value", [
    ("best_of", 3), ("suffix", "x"), ("n", 9), ("xtc_probability", 0.5), ("functions", []),
    ("modalities", ["text", "audio"]), ("num_draft_tokens", 2),
])
def test_fields_that_cannot_be_honoured_are_refused_by_name(cluster, field, value):
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
    assert status == 400 and out["error"]["param"] == field, out


@pytest.mark.parametrize("bias", [{"-1": 5}, {"2048": 5}, {"abc": 1}, {"3": 101}, {"3": "x"},
                                  {str(i): 1 for i in range(301)}, [1]])
def test_bad_logit_bias_is_refused(cluster, bias):
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert status == 400 and out["error"]["param"] == "logit_bias", out


def test_model_names_paths_without_v1_and_usage_details(cluster):
    for name in (MODEL_ID, "default_model", "my-alias"):
        status, out, _ = call(cluster, "POST", "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and out["model"] == MODEL_ID, out
        assert out["system_fingerprint"].startswith("fp_")
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    status, out, _ = call(cluster, "POST", "/v1/completions", {"model": "gpt-4o", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model", out
    status, out, _ = call(cluster, "POST", "/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and out["object"] == "text_completion"
    status, out, _ = call(cluster, "POST", "/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and out["object"] == "chat.completion"
    assert call(cluster, "GET", "/models")[1]["data"][0]["id"] == MODEL_ID
    assert call(cluster, "GET", "/v1/models/my-alias")[0] == 200
    status, out, _ = call(cluster, "GET", "/v1/models/gpt-4o")  # OpenAI's answer, word for word
    assert (status, out) == (404, {"error": {"message": "The model 'gpt-4o' does not exist", "type":
                                             "invalid_request_error", "param": "model", "code": "model_not_found"}})
    assert call(cluster, "GET", "/v1/embeddings")[0] == 404


def test_cors_for_the_allowed_origin_only_and_a_preflight_without_a_key(cluster):
    status, _, r = call(cluster, "OPTIONS", "/v1/chat/completions",
                        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert status == 204 and r.getheader("Access-Control-Allow-Origin") == "https://app.example"
    assert "POST" in r.getheader("Access-Control-Allow-Methods")
    assert "Authorization" in r.getheader("Access-Control-Allow-Headers")
    status, _, r = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                        headers={"Origin": "https://app.example"})
    assert status == 200 and r.getheader("Access-Control-Allow-Origin") == "https://app.example"
    _, _, r = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                   headers={"Origin": "https://evil.example"})
    assert r.getheader("Access-Control-Allow-Origin") is None


def reference_logprobs(model_path, prompt: str, max_tokens: int, **procs) -> list[tuple[int, float, list]]:
    """(token, its logprob, the top 3 (id, logprob)) per token, as one mlx-lm process computes them."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from rankharness import _loaded

    m, tok = _loaded(str(model_path))
    out = []
    for r in stream_generate(m, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0),
                             logits_processors=make_logits_processors(**procs)):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            break
        lp = r.logprobs
        top = mx.argsort(-lp)[:3].tolist()
        out.append((r.token, lp[r.token].item(), [(i, lp[i].item()) for i in top]))
    return out


def _close(got: list[dict], want, tol=2e-3) -> None:
    assert [e["id"] for e in got] == [t for t, _, _ in want]
    for e, (t, lp, top) in zip(got, want):
        assert abs(e["logprob"] - lp) < tol, (e, lp)
        assert [a["id"] for a in e["top_logprobs"]] == [i for i, _ in top[:len(e["top_logprobs"])]]
        for a, (_, v) in zip(e["top_logprobs"], top):
            assert abs(a["logprob"] - v) < tol


def test_logprobs_equal_one_mlx_lm_process_stream_and_not(cluster, model):
    want = reference_logprobs(model, PROMPT, 6)
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                                "logprobs": 3})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and len(lp["token_logprobs"]) == 6 and len(lp["text_offset"]) == 6
    assert all(abs(a - w[1]) < 2e-3 for a, w in zip(lp["token_logprobs"], want))
    assert all(len(t) == 3 for t in lp["top_logprobs"])
    # chat, stream and not: the chosen token's logprob and the top 3, as one process has them
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    want = reference_logprobs(model, text, 5)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    status, out, _ = call(cluster, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    _close(out["choices"][0]["logprobs"]["content"], want)
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    entries = []
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("data: {"):
            lp = json.loads(line[6:])["choices"][0]["logprobs"] if json.loads(line[6:])["choices"] else None
            entries += lp["content"] if lp else []
    conn.close()
    _close(entries, want)
    # after the processors: the distribution the token was drawn from
    want = reference_logprobs(model, PROMPT, 4, logit_bias={7: 6.0}, presence_penalty=1.0)
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                                "logprobs": 0, "logit_bias": {"7": 6},
                                                                "presence_penalty": 1.0})
    assert all(abs(a - w[1]) < 2e-3 for a, w in zip(out["choices"][0]["logprobs"]["token_logprobs"], want)), out


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"logprobs": "yes"}), ("/v1/chat/completions", {"top_logprobs": 3}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}), ("/v1/completions", {"logprobs": 21}),
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 2}),
])
def test_bad_logprobs_are_refused(cluster, path, body):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": PROMPT}
    status, out, _ = call(cluster, "POST", path, {**base, "max_tokens": 2, **body})
    assert status == 400 and out["error"]["param"] in ("logprobs", "top_logprobs"), out


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["colour", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_always_parses_and_validates(cluster, stream):
    """A random-weight model, constrained: every answer parses and validates, sampled or greedy, stream or not, in
    every schedule; the schema's required fields are there even when max_tokens is tight."""
    import jsonschema

    for i, schema in enumerate(SCHEMAS[:1] if stream else SCHEMAS):
        for temperature, max_tokens in ((0, 60), (1.0, 60), (0.7, 24)):
            body = {"messages": [{"role": "user", "content": "give me json"}], "max_tokens": max_tokens,
                    "temperature": temperature, "seed": i, "stream": stream,
                    "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                               "strict": True}}}
            if stream:
                conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
                conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                             headers={"Content-Type": "application/json"})
                text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                               for line in conn.getresponse().read().decode().splitlines()
                               if line.startswith("data: {"))
                conn.close()
            else:
                status, out, _ = call(cluster, "POST", "/v1/chat/completions", body)
                assert status == 200, out
                text = out["choices"][0]["message"]["content"]
            jsonschema.validate(json.loads(text), schema)
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 1,
                                                                "response_format": {"type": "json_object"}})
    assert status == 200 and isinstance(json.loads(out["choices"][0]["text"]), dict), out


def test_structured_output_whose_shortest_answer_cannot_fit_max_tokens_is_refused(cluster):
    """A schema whose shortest answer is longer than max_tokens could only be forced from its first token and cut
    (invalid JSON after the compute): a 400 naming max_tokens at admission; with room, the same schema is served."""
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "strict": True, "schema": {
        "type": "object", "required": ["colour", "count"], "additionalProperties": False,
        "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer"}}}}}
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                                "response_format": fmt})
    assert status == 400 and out["error"]["param"] == "max_tokens" and "max_tokens" in out["error"]["message"], out
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "temperature": 0,
                                                                "response_format": fmt})
    assert status == 200 and set(json.loads(out["choices"][0]["text"])) == {"colour", "count"}, out


@pytest.mark.parametrize("fmt", [
    {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
    "json",
])
def test_bad_response_formats_are_refused(cluster, fmt):
    status, out, _ = call(cluster, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                                "response_format": fmt})
    assert status == 400 and out["error"]["param"] == "response_format", out


def strict_loads(text: str):
    """JSON as JavaScript's JSON.parse and Go's encoding/json read it: Infinity, -Infinity and NaN refused."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_a_grammar_are_json_and_list_only_allowed_tokens(cluster, stream):
    """A grammar leaves -inf on every token it forbids: the answer (every event of a stream) still parses as strict
    JSON, every value is finite, and no alternative is a forbidden token (-9999.0, OpenAI's floor, would be one)."""
    body = {"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 20, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}}}
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    assert r.status == 200, raw
    if stream:
        docs = [strict_loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        entries = [e for d in docs if d["choices"] and d["choices"][0].get("logprobs")
                   for e in d["choices"][0]["logprobs"]["content"]]
        text = "".join(d["choices"][0]["delta"].get("content") or "" for d in docs if d["choices"])
    else:
        out = strict_loads(raw)
        entries, text = out["choices"][0]["logprobs"]["content"], out["choices"][0]["message"]["content"]
    assert json.loads(text) in ("yes", "no") and entries, raw[:400]
    for e in entries:
        assert e["logprob"] > -9999.0 and e["top_logprobs"], e
        assert all(a["logprob"] > -9999.0 for a in e["top_logprobs"]), e
        assert len(e["top_logprobs"]) < 20  # the enum allows few tokens at each step, never 20
