"""Tools and reasoning through real ranks (issue 31 a, g): a tiny model whose chat template renders tools, tool-call
history and a think block (tests/toolmodels.py), served on 2 ranks."""

from __future__ import annotations

import http.client
import json

import pytest

from rankharness import RankCluster

pytestmark = pytest.mark.slow  # every test here starts real ranks

from toolmodels import tool_model

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
HISTORY = [{"role": "user", "content": "what is 2+3?"},
           {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "id": "call_1", "function": {
               "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "content": "5", "tool_call_id": "call_1"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tool_model(tmp_path_factory.mktemp("toolmodel") / "m")


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    c = RankCluster(tmp_path_factory.mktemp("tools"), folder, [4, 4], tag="tools")
    c.up()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tok(folder):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(folder)


def chat(c, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({"max_tokens": 6, "temperature": 0, **body}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 200, out
    return out


def prompt_tokens(tok, messages, **kw) -> int:
    return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw),
                          add_special_tokens=False))


def test_tools_and_tool_call_history_reach_the_template(cluster, tok):
    plain = chat(cluster, {"messages": HISTORY[:1]})
    with_tools = chat(cluster, {"messages": HISTORY[:1], "tools": TOOLS})
    assert with_tools["usage"]["prompt_tokens"] == prompt_tokens(tok, HISTORY[:1], tools=TOOLS) \
        > plain["usage"]["prompt_tokens"]
    history = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}, {**HISTORY[2], "name": "add"}]
    out = chat(cluster, {"messages": HISTORY, "tools": TOOLS})
    assert out["usage"]["prompt_tokens"] == prompt_tokens(tok, history, tools=TOOLS)


def test_reasoning_is_split_out_and_chat_template_kwargs_turn_it_off(cluster):
    thinking = chat(cluster, {"messages": HISTORY[:1]})["choices"][0]["message"]
    assert thinking.get("reasoning_content") and not thinking["content"], thinking
    plain = chat(cluster, {"messages": HISTORY[:1], "chat_template_kwargs": {"enable_thinking": False}})
    message = plain["choices"][0]["message"]
    assert message["content"] and "reasoning_content" not in message, message
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"messages": HISTORY[:1], "max_tokens": 6, "temperature": 0, "stream": True}))
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in conn.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking["reasoning_content"]


def test_tool_choice_none_never_opens_a_call(cluster, tok):
    start = tok.tool_call_start_tokens[0]
    off = {"messages": HISTORY[:1], "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False},
           "logit_bias": {str(start): 100}}
    forced = chat(cluster, off)["choices"][0]  # "auto": the model is pushed into a call it cannot finish
    assert "<tool_call>" in (forced["message"]["content"] or ""), forced
    banned = chat(cluster, {**off, "tool_choice": "none"})["choices"][0]
    assert "<tool_call>" not in (banned["message"]["content"] or "") and not banned["message"].get("tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_fields_are_refused_by_name(cluster, body, param):
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"messages": HISTORY[:1], "max_tokens": 2, **body}))
    r = conn.getresponse()
    out = json.loads(r.read())
    assert r.status == 400 and out["error"]["param"] == param, out


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_always_parses_and_fits_the_function(cluster, choice):
    """tool_choice required (or one function): the model's call markup is constrained by the grammar, so even a
    random-weight model calls the tool with arguments that parse and validate; with one call allowed (a named
    function, or parallel_tool_calls false) the answer ends after it: finish tool_calls, or length where the
    budget closed a number the model was still writing (the finish rule: test_tools.py's
    test_a_whole_forced_call_finishes_tool_calls_whatever_the_budget tells them apart)."""
    import jsonschema

    for seed in range(3):
        out = chat(cluster, {"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": choice, "max_tokens": 80,
                             "temperature": 1.0, "seed": seed, "chat_template_kwargs": {"enable_thinking": False},
                             "parallel_tool_calls": False})
        c = out["choices"][0]
        assert c["finish_reason"] in ("tool_calls", "length") and c["message"]["content"] is None, c
        [call] = c["message"]["tool_calls"]
        assert call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_the_openai_client_gets_tool_calls_and_reasoning_stream_and_not(cluster):
    """The official client, as agent frameworks call it: a forced call comes back as typed ``tool_calls`` (stream:
    ``delta.tool_calls`` pieces that add up to the same call), finish ``tool_calls``; the history with the call and
    its result is accepted back; reasoning arrives as ``reasoning_content``; template arguments via extra_body."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="unused", max_retries=0)
    args = dict(model="m", messages=HISTORY[:1], tools=TOOLS, temperature=1.0, seed=5, max_tokens=80,
                tool_choice={"type": "function", "function": {"name": "add"}},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    out = client.chat.completions.create(**args)
    [call] = out.choices[0].message.tool_calls
    # tool_calls, or length where the budget closed a number the random model was still writing (the finish rule)
    assert out.choices[0].finish_reason in ("tool_calls", "length") and call.function.name == "add" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    name, pieces, ids, finish = None, [], set(), None
    for ch in client.chat.completions.create(stream=True, **args):
        for c in ch.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                name = tc.function.name or name
                pieces.append(tc.function.arguments or "")
                ids |= {tc.id} - {None}
    assert finish == out.choices[0].finish_reason and name == "add" and len(ids) == 1
    assert json.loads("".join(pieces)) == json.loads(call.function.arguments)  # the same seed, the same call
    history = [HISTORY[0], out.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    assert client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4).choices
    thinking = client.chat.completions.create(model="m", messages=HISTORY[:1], max_tokens=6, temperature=0)
    assert thinking.choices[0].message.model_extra.get("reasoning_content")


PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["color", "ok"],
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def test_structured_output_and_forced_calls_on_a_template_that_opens_think(cluster):
    """issue 41 (5, 6): the generation prompt opens <think>; a response_format's JSON comes back in content (the
    reasoning closed within max_tokens, finish length since the budget closed it), a required call in tool_calls;
    a required call with parallel calls allowed finishes tool_calls once its calls close, nothing cut in content."""
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    for seed in range(3):
        for stream in (False, True):
            body = {"messages": HISTORY[:1], "response_format": rf, "max_tokens": 40, "temperature": 1.0,
                    "seed": seed, "stream": stream}
            msg, finish = stream_or_not(cluster, body)
            assert msg["reasoning_content"] and finish == "length", msg
            jsonschema.validate(json.loads(msg["content"]), PERSON)
        msg, finish = stream_or_not(cluster, {"messages": HISTORY[:1], "tools": [TOOLS[0], PICK], "max_tokens": 48,
                                              "tool_choice": "required", "temperature": 1.0, "seed": seed})
        assert msg["tool_calls"] and not msg["content"] and finish in ("tool_calls", "length"), msg
        msg, finish = stream_or_not(cluster, {"messages": HISTORY[:1], "tools": [PICK], "max_tokens": 80,
                                              "tool_choice": "required", "temperature": 1.0, "seed": seed,
                                              "chat_template_kwargs": {"enable_thinking": False}})
        assert finish == "tool_calls" and msg["tool_calls"] and not msg["content"], msg


def stream_or_not(c, body: dict) -> tuple[dict, str]:
    """The message (a stream's deltas added up) and finish_reason of a chat answer."""
    import admissionfuzz

    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    assert r.status == 200, data
    msg, finish = admissionfuzz._message(body, data)
    return {"content": msg.get("content") or "", "reasoning_content": msg.get("reasoning_content") or "",
            "tool_calls": msg.get("tool_calls") or []}, finish


def test_fuzzed_constrained_requests_on_a_thinking_template(cluster, folder):
    """tests/admissionfuzz.py with tools, response_format and thinking on and off (a fixed seed): every answer
    usable as the request shaped it (bench/faults.py runs the plain fuzzer with a random seed)."""
    import admissionfuzz

    from clusterctl.rank.api.admission import limits_for
    from mlx_lm.utils import load_tokenizer

    limits = limits_for(json.loads((folder / "config.json").read_text()), load_tokenizer(folder), None)
    target = admissionfuzz.Target(port=cluster.http_port, vocab=limits.vocab, context=limits.context,
                                  token_bytes=limits.token_bytes, tools=[TOOLS[0], PICK])
    def alive() -> None:
        for r, p in enumerate(cluster.procs):
            assert p.poll() is None, f"rank {r} exited {p.returncode}\n{cluster.logs(r)}"

    tally = admissionfuzz.run(target, seed=41, n=40, alive=alive)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.ok >= 20, tally


def test_each_of_n_choices_makes_its_own_forced_call(cluster):
    """n choices (choices.py): every choice has its own grammar and splitter, so each one's call parses, fits the
    function and ends its choice alone (one call allowed), streamed or not."""
    import jsonschema

    body = {"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "n": 3,
            "temperature": 1.0, "seed": 4, "chat_template_kwargs": {"enable_thinking": False},
            "parallel_tool_calls": False}
    out = chat(cluster, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for c in out["choices"]:
        assert c["finish_reason"] in ("tool_calls", "length"), c  # length: the budget closed an argument
        [call] = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    args, finish = {}, {}
    for line in lines:
        if line.startswith("data: {"):
            [c] = json.loads(line[6:])["choices"]
            for call in c["delta"].get("tool_calls") or []:
                args[c["index"]] = args.get(c["index"], "") + (call.get("function") or {}).get("arguments", "")
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert finish == {c["index"]: c["finish_reason"] for c in out["choices"]}  # each choice's own, as not streamed
    assert [json.loads(args[i]) for i in range(3)] == \
        [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) for c in out["choices"]]
