"""A fuzzer of what a client can send rank 0 (issue 30): sampling values at and past the model's limits, request
sizes past the planned context and the byte cap, seeds, stops and cache salts, streamed or not, and response
formats, costly ones among them (issue 41: compiles of seconds, masks that allow what the parser refuses, strings
no answer closes). Every answer must be a 200 within the planned context or a 4xx in OpenAI's error shape (or a 503
``grammar_busy`` while costly compiles hold the workers), a 200 with a grammar must parse, and no rank may end.

Used by tests/test_fuzz_admission.py (a fixed seed, a few dozen requests) and bench/faults.py (a random seed)."""

from __future__ import annotations

import http.client
import json
import random
from dataclasses import dataclass, field

TINY = 5e-324  # the smallest float above zero


@dataclass
class Target:
    port: int
    vocab: int  # the logits' width
    context: int  # the plan's per-request context
    token_bytes: int  # the most bytes one token stands for (rank 0's byte cap: context x this)
    key: str | None = None


@dataclass
class Tally:
    ok: int = 0
    refused: int = 0
    by_status: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _values(t: Target) -> dict[str, list]:
    v, c = t.vocab, t.context
    return {
        "temperature": [0, 0.0, TINY, 1e-45, 1e-39, 1e-38, 1e-6, 0.7, 2, 2.0000001, -1e-9, 1e308, float("inf"),
                        "0.5", True, None],
        "top_k": [-1, 0, 1, v - 1, v, v + 1, 1 << 20, (1 << 20) + 1, 1 << 63, 2.5, None],
        "top_p": [-0.0, 0, 1e-9, 0.5, 1, 1.0000001, None],
        "min_p": [0, TINY, 0.5, 1, 1.5, -0.1, None],
        "repetition_penalty": [0, TINY, 0.5, 1, 10, 10.01, None],
        "seed": [0, -1, -(1 << 63), -(1 << 63) - 1, (1 << 63) - 1, 1 << 63, 1 << 64, 3.0, None],
        "max_tokens": [0, 1, 2, 3, c - 1, c, c + 1, 1 << 31, 1 << 63, -1, None],
        "stop": [None, "", "x", ["a", "b"], ["a"] * 5, [""], [1], "\n"],
        "cache_salt": [None, "", "s", "s" * 1024, "s" * 1025, 7],
        "n": [None, 1, 2],
        "logprobs": [None, 0, 5, 20, 21, True],  # with a grammar: -inf on every forbidden token (issue 41)
        "top_logprobs": [None, 0, 5, 20],
    }


def costly_schemas(tag: str) -> list[tuple[str, dict]]:
    """Eight schemas a hostile key holder sends (``tag``, a few letters, varies their names, so no cache helps):
    compiles of seconds under the 64 KiB cap, a grammar whose mask allows what its parser refuses, strings no answer
    can close."""
    def props(i: int, n: int) -> dict:  # 1,500 properties: 51 KB
        return {"type": "object", "additionalProperties": False,
                "properties": {f"{tag}{i}{k}": {"type": "integer"} for k in range(n)}}

    def recursive(i: int) -> dict:
        name = f"n{tag}{i}"
        return {"$defs": {name: {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"$ref": f"#/$defs/{name}"}, "b": {"$ref": f"#/$defs/{name}"}}}}, "$ref": f"#/$defs/{name}"}

    return [*((f"properties {i}", props(i, 1500)) for i in range(4)),
            *((f"recursive {i}", recursive(i)) for i in range(2)),
            *((f"endless string {i}", {"type": "object", "required": [f"s{tag}{i}"], "properties": {
                f"s{tag}{i}": {"type": "string", "minLength": 10 ** 9}}}) for i in range(2))]


def _response_format(rng: random.Random):
    """Mostly none; else a plain format, a bad one, or (rarely: each costs a compile worker seconds) a costly one."""
    x = rng.random()
    if x < 0.75:
        return None
    if x < 0.9:
        return rng.choice([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
            {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["yes", "no"]}}}])
    if x < 0.95:
        return rng.choice([{"type": "xml"}, "json", {"type": "json_schema"},
                           {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}, "strict": True}])
    _, schema = rng.choice(costly_schemas("".join(rng.choice("abcdefghij") for _ in range(3))))
    return {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}


def _prompt(rng: random.Random, t: Target):
    cap = t.context * t.token_bytes
    return rng.choice([
        "Hello", "def f():", "", "é" * 20,
        [5] * rng.choice([1, t.context - 2, t.context - 1, t.context, t.context + 1, 500]),
        [t.vocab - 1], [t.vocab], [-1],
        "x" * (cap - 1), "x" * (cap + 1), "word " * (t.context // 2),
        "hello world " * 340_000,  # ~4 MB: a legal body that once held rank 0's step loop for seconds
    ])


def request(rng: random.Random, t: Target) -> tuple[str, dict]:
    values = _values(t)
    body: dict = {}
    # one to three fields at or past their limits, the rest left out (so that most requests are legal)
    for name in rng.sample(sorted(values), rng.choice([1, 1, 2, 3])):
        x = rng.choice(values[name])
        if x is not None:
            body[name] = x
    # mostly cheap: a few tokens unless max_tokens itself is fuzzed
    body.setdefault("max_tokens", rng.choice([1, 2, 4]))
    body["stream"] = rng.random() < 0.4
    prompt = _prompt(rng, t) if rng.random() < 0.3 else rng.choice(["Hello", "def f():"])
    rf = _response_format(rng)
    if rf is not None:
        body["response_format"] = rf
    if rng.random() < 0.5:
        if not isinstance(prompt, str):
            prompt = "Hello"
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def send(t: Target, path: str, body: dict, timeout: float = 120) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if t.key:
        headers["Authorization"] = f"Bearer {t.key}"
    # non-finite numbers are not JSON, but clients (Python's json) send them: rank 0 must refuse them cleanly
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    r = conn.getresponse()
    data = r.read().decode("utf-8", "replace")
    conn.close()
    return r.status, data


def events(data: str) -> list[dict]:
    """The JSON objects of a stream's ``data:`` lines (``[DONE]`` and anything not an object left out)."""
    out = []
    for line in data.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            try:
                doc = json.loads(line[6:])
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


def check(t: Target, path: str, body: dict, status: int, data: str) -> str | None:
    """None when the answer is one rank 0 may give; else what is wrong with it."""
    what = f"{path} {json.dumps(body)[:300]} -> {status} {data[:300]}"
    if status == 503 and body.get("response_format") is not None and _code(data) == "grammar_busy":
        return None  # costly compiles hold every grammar worker: come back later (Retry-After)
    if 400 <= status < 500:
        try:
            err = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            return f"a {status} not in OpenAI's error shape: {what}"
        return None if isinstance(err.get("message"), str) and err["message"] else f"no message: {what}"
    if status != 200:
        return f"status {status}: {what}"
    if body.get("stream"):
        if not data.rstrip().endswith("data: [DONE]"):
            return f"a stream that did not end with [DONE]: {what}"
        try:
            for line in data.splitlines():
                if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                    json.loads(line[6:], parse_constant=_not_json)
        except ValueError as e:
            return f"a stream event that is not strict JSON ({e}): {what}"
        if any("error" in event for event in events(data)):  # an error event (not a token whose text is "error")
            return f"a stream that failed: {what}"
        return None
    try:
        doc = json.loads(data, parse_constant=_not_json)
        usage = doc["usage"]
    except (ValueError, KeyError, TypeError):
        return f"a 200 without usage (or not strict JSON): {what}"
    if usage["total_tokens"] > t.context:
        return f"served past the planned context of {t.context}: {what}"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        choice = doc["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        try:
            json.loads(text)
        except (ValueError, TypeError):
            if choice["finish_reason"] != "length":  # only a budget too small for the schema may cut it
                return f"structured output that does not parse: {what}"
    return None


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _code(data: str):
    try:
        return json.loads(data)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def run(t: Target, seed: int, n: int, *, alive=None) -> Tally:
    """``n`` requests drawn from ``seed``; ``alive()`` (raising when a rank ended) is called every 8 requests."""
    rng = random.Random(seed)
    tally = Tally()
    for i in range(n):
        path, body = request(rng, t)
        try:
            status, data = send(t, path, body)
        except (OSError, http.client.HTTPException) as e:
            tally.failures.append(f"seed {seed} #{i}: {type(e).__name__}: {e} for {path} "
                                  f"{json.dumps(body)[:300]}")
            break
        tally.by_status[status] = tally.by_status.get(status, 0) + 1
        if status == 200:
            tally.ok += 1
        else:
            tally.refused += 1
        bad = check(t, path, body, status, data)
        if bad:
            tally.failures.append(f"seed {seed} #{i}: {bad}")
        if alive is not None and i % 8 == 7:
            alive()
    if alive is not None:
        alive()
    return tally
