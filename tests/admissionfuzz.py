"""A fuzzer of what a client can send rank 0 (issue 30): sampling values at and past the model's limits, request
sizes past the planned context and the byte cap, seeds, stops and cache salts, streamed or not, and response
formats, costly ones among them (issue 41: compiles of seconds, masks that allow what the parser refuses, strings
no answer closes). Every answer must be a 200 within the planned context or a 4xx in OpenAI's error shape (or a 503
``grammar_busy`` while costly compiles hold the workers), a 200 with a grammar must parse, and no rank may end.

With ``Target.tools`` (a model whose template calls tools and thinks, tests/toolmodels.py) chat requests also get
a response_format, tools and a tool_choice, with thinking on or off, and the answer must be usable: JSON content
that parses, a forced call in ``tool_calls``, no call markup in the content under "none", nothing in the
reasoning alone (issue 41: structured output landed in the reasoning of thinking templates).

Used by tests/rank/api/test_rank_admission.py and tests/rank/api/test_api_tools.py (fixed seeds, a few dozen requests) and
bench/faults.py (a random seed)."""

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
    tools: list | None = None  # the model calls tools (and may think): constrained chat requests too
    marker: str = "<tool_call>"  # its call's opening marker


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


SCHEMAS = [
    {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}},
    {"type": "object", "additionalProperties": False, "required": ["name", "tags"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}}}},
    {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}, "why": {"type": "string"}}},
]
TOOLS = [  # what a fuzzed constrained request offers the model (bench/faults.py; the tests pass their own)
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["color", "ok"],
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}}}}},
]
ROOMY = 48  # max_tokens from which every constrained answer here fits whole (its shortest form, and a reasoning end)


def _constrained(rng: random.Random, t: Target, body: dict) -> dict:
    """A chat body's response_format or tools and tool_choice, thinking on or off (the template opens a think
    block when on), and a budget that is tight or roomy."""
    body["max_tokens"] = rng.choice([1, 3, 12, 24, ROOMY, 80])
    body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.6}
    if rng.random() < 0.4:
        schema = rng.choice(SCHEMAS)
        body["response_format"] = rng.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema, "strict": rng.random() < 0.5}}])
        return body
    body["tools"] = t.tools
    choice = rng.choice(["auto", "none", "required", "function", None])
    if choice == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": rng.choice(t.tools)["function"]["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    if rng.random() < 0.4:
        body["parallel_tool_calls"] = rng.random() < 0.5
    if choice in ("auto", "none", None) and rng.random() < 0.5:  # push the model towards a call's markup
        body["temperature"] = 1.5
    return body


def request(rng: random.Random, t: Target) -> tuple[str, dict]:
    if t.tools and rng.random() < 0.6:
        body = {"stream": rng.random() < 0.4, "seed": rng.randrange(1 << 20), "temperature": rng.choice([0, 1.0]),
                "messages": [{"role": "user", "content": rng.choice(["Hello", "add 2 and 3", "JSON please"])}]}
        return "/v1/chat/completions", _constrained(rng, t, body)
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


def _message(body: dict, data: str) -> tuple[dict, str]:
    """The chat answer's (first choice's) message and finish_reason, a stream's deltas added up."""
    if not body.get("stream"):
        choice = json.loads(data)["choices"][0]
        return choice["message"], choice["finish_reason"]
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for event in events(data):
        for c in event.get("choices", []):
            if c.get("index", 0) != 0:  # (n choices: each is checked alike; the first stands for them)
                continue
            d = c.get("delta") or {}
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            msg["tool_calls"] += d.get("tool_calls") or []
            finish = c.get("finish_reason") or finish
    return msg, finish


def check_constrained(t: Target, body: dict, data: str) -> str | None:
    """What is wrong with a 200 to a constrained chat request (None: nothing): the answer a client parses."""
    msg, finish = _message(body, data)
    content, calls = msg.get("content") or "", msg.get("tool_calls") or []
    roomy = body["max_tokens"] >= ROOMY
    choice = body.get("tool_choice", "auto" if body.get("tools") else None)
    if body.get("tools") and choice == "none" and (t.marker in content or calls):
        return "call markup or a call under tool_choice none"
    if choice in ("required",) or isinstance(choice, dict):
        if t.marker in content:
            return "a forced call's markup in the content"
        if roomy and not calls:
            return f"a forced call with room for it made none (finish {finish}, content {content!r})"
        if calls and finish not in ("tool_calls", "length"):
            return f"calls made, finish {finish}"
    if "response_format" in body and (roomy or finish == "stop"):
        try:
            json.loads(content)
        except ValueError:
            return f"JSON content that does not parse (finish {finish}): {content[:120]!r}, reasoning " \
                   f"{(msg.get('reasoning_content') or '')[:80]!r}"
    return None


def check(t: Target, path: str, body: dict, status: int, data: str) -> str | None:
    """None when the answer is one rank 0 may give; else what is wrong with it."""
    what = f"{path} {json.dumps(body)[:300]} -> {status} {data[:300]}"
    if status == 503 and (body.get("response_format") is not None or body.get("tools")) \
            and _code(data) == "grammar_busy":
        return None  # costly compiles hold every grammar worker: come back later (Retry-After)
    if status == 200 and path.endswith("/chat/completions") and ("response_format" in body or "tools" in body):
        try:
            bad = check_constrained(t, body, data)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            bad = f"an answer not in OpenAI's shape ({type(e).__name__}: {e})"
        if bad:
            return f"{bad}: {what}"
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
