"""Tool calls and reasoning text (rank/api/tools.py, rank/api/splitter.py) with real tokenizers: the tiny model's, with
tool-call and think markers made tokens and Qwen-style templates (tests/toolmodels.py), loaded by mlx-lm as a rank
loads them."""

import json

import jsonschema
import pytest
import toolmodels

from clusterctl.rank.api import splitter as S
from clusterctl.rank.api import tools as T
from clusterctl.rank.api.requests import ChatRequest, parse
from clusterctl.rank.engine.generation import StopMatcher

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time"}}
TOOLS = [WEATHER, TIME]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
# a reply that thinks, answers and calls twice, in the json_tools format
REPLY = ("<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
         "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n"
         "{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>")
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load

    from rankharness import tiny_model_path

    root = tmp_path_factory.mktemp("tooltok")
    return {
        "json": load(toolmodels.write_tokenizer(root / "json")),
        "xml": load(toolmodels.write_tokenizer(root / "xml", call_format="qwen3_coder")),
        "mistral": load(toolmodels.write_tokenizer(root / "mistral", call_format="mistral", thinking=False)),
        "nothink": load(toolmodels.write_tokenizer(root / "nothink", thinking=False)),
        "plain": load(tiny_model_path()),
    }


def run(splitter, pieces, finish="stop"):
    events = []
    for p in pieces:
        events += splitter.feed(p)
    events += splitter.finish(finish)
    return events


def summary(events):
    r = S.Reply().add(events)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.tool_calls]
    return r.content, r.reasoning_content, calls, r.finish_reason


def token_pieces(tok, text):
    """The text as a rank streams it: one detokenizer segment per generated token."""
    detok = tok.detokenizer
    out = []
    for t in tok.encode(text, add_special_tokens=False):
        detok.add_token(t)
        out.append(detok.last_segment)
    detok.finalize()
    out.append(detok.last_segment)
    return out


# ---- the test tokenizers are what mlx-lm recognises -------------------------------------------------------------

def test_markers_are_tokens_and_inferred(toks):
    j, x, n, p = toks["json"], toks["xml"], toks["nothink"], toks["plain"]
    assert (j.has_tool_calling, T.call_format(j), j.has_thinking) == (True, "json_tools", True)
    assert (x.has_tool_calling, T.call_format(x), x.has_thinking) == (True, "qwen3_coder", True)
    assert (n.has_tool_calling, n.has_thinking) == (True, False)
    m = toks["mistral"]
    assert (T.call_format(m), m.tool_call_start, m.tool_call_end, m.has_thinking) == (
        "mistral", "[TOOL_CALLS]", "", False)
    assert (p.has_tool_calling, p.has_thinking) == (False, False)
    assert len(j.tool_call_start_tokens) == 1 and len(j.tool_call_end_tokens) == 1
    assert len(j) == len(p)  # the weights still fit: markers took ids inside the vocabulary
    assert j.decode(j.encode(REPLY, add_special_tokens=False)) == REPLY


# ---- request side ---------------------------------------------------------------------------------------------

def chat_of(body: dict) -> T.ChatTools:
    """A chat body's tool and template fields, as rank 0 takes them (parsed, then ChatTools.of)."""
    return T.ChatTools.of(parse(ChatRequest, body))


def test_render_matches_mlx_lm_server(toks):
    """tools and tool-call history reach the template as mlx_lm.server passes them."""
    import copy

    from mlx_lm.server import process_message_content

    tok = toks["json"]
    chat = chat_of({"messages": copy.deepcopy(HISTORY), "tools": TOOLS})
    text = T.render(tok, chat)
    ref_messages = copy.deepcopy(HISTORY)
    process_message_content(ref_messages)
    assert text == tok.apply_chat_template(ref_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert json.dumps(WEATHER) in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in text  # a dict, not a string
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # the request is not changed
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.tool_call_start_tokens[0] in ids
    assert T.initial_state(tok, ids) == "reasoning"  # the generation prompt opened <think>


def test_chat_template_kwargs_and_defaults(toks):
    tok = toks["json"]
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert T.render_kwargs(tok, chat, {"enable_thinking": True, "x": 1}) == \
        {"enable_thinking": False, "x": 1, "tools": None}
    text = T.render(tok, chat)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert T.initial_state(tok, tok.encode(text, add_special_tokens=False)) == "normal"
    on = T.render(tok, chat_of({"messages": [{"role": "user", "content": "hi"}]}))
    assert on.endswith("<think>\n")  # mlx-lm's wrapper turns thinking on by default for a thinking vocabulary
    assert T.initial_state(toks["plain"], toks["plain"].encode(on)) == "normal"


def test_template_refusal_is_a_bad_request(toks):
    bad = [{"role": "user", "content": "hi"},
           {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": "[1]"}}]}]
    chat = chat_of({"messages": bad, "tools": TOOLS})
    with pytest.raises(T.ToolsError, match="chat template refused") as e:
        T.render(toks["xml"], chat)  # its template iterates the arguments' items
    assert e.value.param == "messages" and "\n" not in str(e.value)
    assert '"arguments": [1]' in T.render(toks["json"], chat)


def test_tools_refused_without_tool_calling(toks):
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    with pytest.raises(T.ToolsError, match="cannot call tools") as e:
        T.render_kwargs(toks["plain"], chat)
    assert e.value.param == "tools"
    # no tools: the plain model renders as before
    plain = chat_of({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"})
    assert T.render(toks["plain"], plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tool_choice_modes():
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_of({"messages": msgs}).choice == "none"
    auto = chat_of({"messages": msgs, "tools": TOOLS})
    assert (auto.choice, auto.parse_calls) == ("auto", True)
    none = chat_of({"messages": msgs, "tools": TOOLS, "tool_choice": "none"})
    assert (none.choice, none.parse_calls, none.tools) == ("none", False, TOOLS)
    named = chat_of({"messages": msgs, "tools": TOOLS,
                                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert (named.choice, named.function) == ("function", "get_time")
    assert chat_of({"messages": msgs, "tools": []}).tools is None
    # the answer to a call gets the called function's name (templates that render it)
    m = chat_of({"messages": HISTORY}).messages
    assert m[3]["name"] == "get_weather" and m[2]["content"] == "" and m[2]["tool_calls"][0]["id"] == "call_1"


def test_banned_token_ids(toks):
    tok = toks["json"]
    msgs = [{"role": "user", "content": "hi"}]
    none = chat_of({"messages": msgs, "tools": TOOLS, "tool_choice": "none"})
    assert T.banned_token_ids(tok, none) == [tok.tool_call_start_tokens[0]]
    assert T.banned_token_ids(tok, chat_of({"messages": msgs, "tools": TOOLS})) == []
    assert T.banned_token_ids(tok, chat_of({"messages": msgs})) == []


def test_call_constraint_schema(toks):
    tok = toks["json"]
    msgs = [{"role": "user", "content": "hi"}]
    assert T.call_constraint(tok, chat_of({"messages": msgs, "tools": TOOLS})) is None
    req = T.call_constraint(tok, chat_of({"messages": msgs, "tools": TOOLS, "tool_choice": "required"}))
    assert (req.start, req.end, req.min_calls, req.max_calls) == ("<tool_call>", "</tool_call>", 1, None)
    assert req.think == ("<think>", "</think>")
    named = T.call_constraint(tok, chat_of({
        "messages": msgs, "tools": TOOLS, "parallel_tool_calls": True,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert named.max_calls == 1
    ok = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    jsonschema.validate(ok, named.schema)
    jsonschema.validate(ok, req.schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, req.schema)
    for bad in ({"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"days": 2}},
                {"name": "get_weather", "arguments": {"city": 3}}, {"name": "get_weather"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named.schema)
    with pytest.raises(jsonschema.ValidationError):  # no parameters: an empty parameter list
        jsonschema.validate({"name": "get_time", "arguments": {"x": 1}}, req.schema)
    # what the schema accepts, the model's own parser reads back as the same call
    assert tok.tool_parser(json.dumps(ok), TOOLS) == ok
    sequential = T.call_constraint(tok, chat_of(
        {"messages": msgs, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}))
    assert sequential.max_calls == 1


def test_call_grammar_in_llguidance(toks):
    """The forced call's grammar, compiled by the grammar module's library over the model's tokens: what it
    accepts, the splitter reads as the call that was asked for."""
    import llguidance
    import llguidance.hf

    tok = toks["json"]
    lltok = llguidance.hf.from_tokenizer(tok._tokenizer, n_vocab=len(tok), eos_token=sorted(tok.eos_token_ids))
    msgs = [{"role": "user", "content": "hi"}]

    def grammar(initial, **fields):
        c = T.call_constraint(tok, chat_of({"messages": msgs, "tools": TOOLS, **fields}), initial)
        g = llguidance.LLMatcher.grammar_from_lark(c.lark())
        return lambda text: accepts(g, text)

    def accepts(g, text):
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    clock = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    required = grammar("reasoning", tool_choice="required")
    ok = "Rain?\n</think>\n\n" + weather + "\n" + clock
    assert required(ok) and required("</think>" + clock)
    s = S.OutputSplitter(tok, TOOLS, initial_state="reasoning")
    assert summary(run(s, token_pieces(tok, ok))) == ("", "Rain?", CALLS[:1] + [("get_time", {})], "tool_calls")
    for bad in (weather,  # the prompt opened the think block: it must be closed first
                "Rain?</think>Sunny.", "Rain?</think>",  # no call
                "</think>" + weather.replace("get_weather", "get_wether"),
                "</think>" + weather.replace('"city"', '"town"'),
                "</think>" + weather.replace('"name": ', '"name":'),  # the templates' JSON style
                "</think>" + weather + "\nBye."):
        assert not required(bad), bad
    named = grammar("normal", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named(weather) and named("<think>Rain?</think>" + weather)
    assert not named(clock) and not named(weather + "\n" + weather)  # one call of that function
    no_think = T.call_constraint(toks["nothink"], chat_of(
        {"messages": msgs, "tools": TOOLS, "tool_choice": "required"}))
    assert no_think.lark().startswith("start: calls\n") and no_think.think is None


def test_forced_call_refused_for_other_formats(toks):
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                  "tool_choice": "required"})
    with pytest.raises(T.ToolsError, match="qwen3_coder") as e:
        T.render_kwargs(toks["xml"], chat)
    assert e.value.param == "tool_choice"
    T.render_kwargs(toks["xml"], chat_of({"messages": chat.messages, "tools": TOOLS}))


# ---- response side --------------------------------------------------------------------------------------------

def expected_reply():
    return "Checking.", "The user wants weather.", CALLS, "tool_calls"


def test_split_anywhere_gives_the_same_reply(toks):
    tok = toks["json"]
    want = expected_reply()
    for cut in range(len(REPLY) + 1):
        got = summary(run(S.OutputSplitter(tok, TOOLS), [REPLY[:cut], REPLY[cut:]]))
        assert got == want, cut
    for cut in range(0, len(REPLY) + 1, 7):  # three pieces
        for cut2 in range(cut, len(REPLY) + 1, 5):
            got = summary(run(S.OutputSplitter(tok, TOOLS), [REPLY[:cut], REPLY[cut:cut2], REPLY[cut2:]]))
            assert got == want, (cut, cut2)
    assert summary(run(S.OutputSplitter(tok, TOOLS), list(REPLY))) == want
    assert summary(run(S.OutputSplitter(tok, TOOLS), token_pieces(tok, REPLY))) == want


def test_random_replies_random_pieces(toks):
    """Seeded random replies (reasoning, text with marker-like characters, calls) cut at random places: the
    events add up to what the reply says, whitespace dropped only next to a marker."""
    import random

    tok = toks["json"]
    rng = random.Random(31)
    alphabet = "ab <>/\n{}\"."  # no letters of a marker: the text can look like a marker start, never be one

    def text():
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))

    for _ in range(150):
        opened = rng.random() < 0.3  # the prompt opened the think block
        parts, content, reasoning, calls = [], [], "", []
        if opened or rng.random() < 0.5:
            r = text()
            parts.append(("" if opened else "<think>") + r + "</think>")
            reasoning = r.strip()
            after = True
        else:
            after = False
        for k in range(rng.randint(0, 3)):
            c = text()
            content.append(c.lstrip() if after else c)
            parts.append(c)
            name, args = rng.choice(CALLS[:1] + [("get_time", {}), ("get_weather", {"city": text()})])
            gap = rng.choice(["", "\n", " "])
            parts.append(f"<tool_call>{gap}{json.dumps({'name': name, 'arguments': args})}{gap}</tool_call>")
            content[-1] = content[-1].rstrip()
            calls.append((name, args))
            after = True
        last = text()
        content.append(last.lstrip() if after else last)
        reply = "".join(parts) + last
        want = ("".join(content), reasoning, calls, "tool_calls" if calls else "stop")
        cuts = sorted(rng.randint(0, len(reply)) for _ in range(rng.randint(1, 5)))
        pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
        initial = "reasoning" if opened else "normal"
        assert summary(run(S.OutputSplitter(tok, TOOLS, initial_state=initial), pieces)) == want, (reply, cuts)
        streamed = token_pieces(tok, reply)
        if "".join(streamed) == reply:  # mlx-lm's BPE detokenizer drops a reply's leading space
            got = summary(run(S.OutputSplitter(tok, TOOLS, initial_state=initial), streamed))
            assert got == want, reply


def test_stream_events(toks):
    tok = toks["json"]
    s = S.OutputSplitter(tok, TOOLS)
    events = run(s, token_pieces(tok, REPLY))
    kinds = [e.kind for e in events]
    assert kinds[-3:] == ["tool_call", "tool_call", "finish"] and set(kinds) == {
        "reasoning", "content", "tool_call", "finish"}
    calls = [e.value for e in events if e.kind == "tool_call"]
    assert [c["index"] for c in calls] == [0, 1]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert S.delta(events[-2]) == {"tool_calls": [calls[1]]}
    assert S.delta(S.Event("reasoning", "x")) == {"reasoning_content": "x"}
    assert S.delta(events[-1]) is None
    msg = S.Reply().add(events).message()
    assert msg["content"] == "Checking." and msg["reasoning_content"] == "The user wants weather."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert "index" not in msg["tool_calls"][0]
    assert s.feed("more") == [] and s.finish("stop") == []  # finished is finished


def test_reasoning_opened_by_the_prompt(toks):
    tok = toks["json"]
    text = T.render(tok, chat_of({"messages": [{"role": "user", "content": "hi"}]}))
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}]})
    out = "\nHmm, a greeting.\n</think>\n\nHello  there!"
    for cut in range(len(out) + 1):
        s = chat.splitter(tok, tok.encode(text, add_special_tokens=False))
        assert summary(run(s, [out[:cut], out[cut:]])) == ("Hello  there!", "Hmm, a greeting.", [], "stop")
    # cut by max_tokens while thinking: all of it is reasoning, the reason stays
    s = S.OutputSplitter(tok, None, initial_state="reasoning")
    assert summary(run(s, ["\nStill thinking </th"], "length")) == ("", "Still thinking </th", [], "length")


def test_plain_text_passes_through(toks):
    """Output without markers is the detokenized text, byte for byte, whatever the tokenizer."""
    for name in ("json", "plain"):
        tok = toks[name]
        text = "  Leading and trailing space <b>bold</b> and a lone < at the end <"
        for cut in range(0, len(text) + 1, 3):
            s = S.OutputSplitter(tok, None)
            assert summary(run(s, [text[:cut], text[cut:]])) == (text, "", [], "stop")


def test_no_tools_or_tool_choice_none_keep_markup_as_text(toks):
    tok = toks["json"]
    call = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
    assert summary(run(S.OutputSplitter(tok, None), [call])) == (call, "", [], "stop")
    none = chat_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                  "tool_choice": "none"})
    s = none.splitter(tok, [])
    assert summary(run(s, ["<think>ok</think>", call])) == (call, "ok", [], "stop")


def test_truncated_and_malformed_calls_come_back_as_content(toks):
    tok = toks["json"]
    cut = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"argu"
    s = S.OutputSplitter(tok, TOOLS, initial_state="normal")
    assert summary(run(s, token_pieces(tok, cut), "length")) == (
        "Let me look.<tool_call>\n{\"name\": \"get_weather\", \"argu", "", [], "length")
    assert s.malformed == ["\n{\"name\": \"get_weather\", \"argu"]
    # a good call then a cut one: the good one stands, the reason is still length
    good = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
    s = S.OutputSplitter(tok, TOOLS)
    content, _, calls, reason = summary(run(s, [good, "\n<tool_call>\n{\"name"], "length"))
    assert (calls, reason, content) == ([("get_time", {})], "length", "<tool_call>\n{\"name")
    # closed but not JSON, or not a call: text, the reason stays stop
    for body in ("{oops}", "[1, 2]", "{\"name\": \"f\", \"arguments\": [1]}", "{\"arguments\": {}}"):
        bad = f"<tool_call>{body}</tool_call>"
        s = S.OutputSplitter(tok, TOOLS)
        assert summary(run(s, [bad])) == (bad, "", [], "stop")
    # a call with no end marker before EOS still parses (mlx_lm.server does the same)
    s = S.OutputSplitter(tok, TOOLS)
    assert summary(run(s, ["<tool_call>{\"name\": \"get_time\", \"arguments\": {}}"]))[2:] == (
        [("get_time", {})], "tool_calls")


def test_arguments_given_as_json_text_are_not_encoded_twice(toks):
    tok = toks["json"]
    s = S.OutputSplitter(tok, TOOLS)
    events = run(s, ["<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}"
                     "</tool_call>"])
    assert summary(events)[2] == [("get_weather", {"city": "Oslo"})]


def test_parallel_tool_calls_false_stops_after_one(toks):
    tok = toks["json"]
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                  "parallel_tool_calls": False})
    s = chat.splitter(tok, [])
    events = s.feed(REPLY)
    assert s.should_stop and [e.value["function"]["name"] for e in events if e.kind == "tool_call"] == ["get_weather"]
    assert s.feed("<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>") == []
    # one block holding several calls (a JSON list; mistral's format writes them so): the first only
    clock = {"name": "get_time", "arguments": {}}
    two = f"<tool_call>{json.dumps([clock, clock])}</tool_call>"
    one = chat.splitter(tok, [])
    assert [e.value["index"] for e in one.feed(two) if e.kind == "tool_call"] == [0] and one.should_stop
    both = S.OutputSplitter(tok, TOOLS)
    assert [e.value["index"] for e in both.feed(two) if e.kind == "tool_call"] == [0, 1] and not both.should_stop
    # the rank ends generation on should_stop: whatever reason it reports, the reply is a tool call
    assert s.finish("cancelled")[-1] == S.Event("finish", "tool_calls")


def test_another_call_format_through_the_same_splitter(toks):
    """qwen3_coder's XML-like calls: the splitter knows no format; the tokenizer's parser types the values."""
    tok = toks["xml"]
    out = ("<think>x</think>Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    want = ("Sure.", "x", [("get_weather", {"city": "Paris", "days": 3})], "tool_calls")
    for cut in range(len(out) + 1):
        assert summary(run(S.OutputSplitter(tok, TOOLS), [out[:cut], out[cut:]])) == want, cut
    assert summary(run(S.OutputSplitter(tok, TOOLS), token_pieces(tok, out))) == want


def test_a_format_without_end_marker(toks):
    """mistral: after [TOOL_CALLS] the rest of the reply is calls, parsed when it ends."""
    tok = toks["mistral"]
    history = T.render(tok, chat_of({"messages": HISTORY, "tools": TOOLS}))
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}' in history
    out = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    want = ("Sure.", "", [("get_weather", {"city": "Paris"}), ("get_time", {})], "tool_calls")
    for cut in range(len(out) + 1):
        s = S.OutputSplitter(tok, TOOLS)
        head = s.feed(out[:cut]) + s.feed(out[cut:])
        assert all(e.kind == "content" for e in head)  # no call before the reply ends
        assert summary(head + s.finish("stop")) == want, cut
    cut = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"ci'
    s = S.OutputSplitter(tok, TOOLS)
    assert summary(run(s, token_pieces(tok, cut), "length")) == (cut, "", [], "length")
    # the forced call is not this module's to shape for this format
    with pytest.raises(T.ToolsError, match="mistral"):
        T.call_constraint(tok, chat_of({"messages": HISTORY, "tools": TOOLS,
                                                      "tool_choice": "required"}))


def test_stop_strings_upstream(toks):
    """The rank's StopMatcher sees the text first; what it lets through is split, its stop ends the reply."""
    tok = toks["json"]

    def through(text, stops):
        m, s, events = StopMatcher(stops), S.OutputSplitter(tok, TOOLS), []
        for piece in token_pieces(tok, text):
            kept, hit = m.feed(piece)
            events += s.feed(kept)
            if hit:
                return summary(events + s.finish("stop"))
        return summary(events + s.feed(m.flush()) + s.finish("stop"))

    assert through(REPLY, ["Checking"]) == ("", "The user wants weather.", [], "stop")
    assert through(REPLY, ["user wants"]) == ("", "The ", [], "stop")  # no marker after: kept
    # a stop string inside the second call: the first stands, the cut one is text
    content, _, calls, reason = through(REPLY, ["get_time"])
    assert (calls, reason) == ([("get_weather", {"city": "Paris"})], "tool_calls")
    assert content == "Checking.<tool_call>\n{\"name\": \""


@pytest.mark.slow
def test_tool_model_folder_serves(tmp_path):
    """The whole folder loads in mlx-lm and generates from a prompt with tools (what ranks will serve)."""
    from mlx_lm import load, stream_generate

    folder = toolmodels.tool_model(tmp_path / "m")
    model, tok = load(str(folder))
    assert tok.has_tool_calling and tok.has_thinking
    prompt = T.render(tok, chat_of({"messages": HISTORY, "tools": TOOLS}))
    ids = tok.encode(prompt, add_special_tokens=False)
    s = S.OutputSplitter(tok, TOOLS, initial_state=T.initial_state(tok, ids))
    assert model.model.embed_tokens.weight.shape[0] == len(tok) and tok.think_start_id in ids
    events, text = [], ""
    for r in stream_generate(model, tok, ids, max_tokens=8):
        events += s.feed(r.text)
        text += r.text
    reply = S.Reply().add(events + s.finish("length"))
    assert reply.finish_reason == "length" and text.strip()
    if not any(m in text for m in ("</think>", "<tool_call>")):  # random weights: the prompt's think block
        assert (reply.reasoning_content, reply.content) == (text.lstrip(), "")


# ---- constrained answers through the request pipeline (issue 41: 5, 6) -------------------------------------------
# A request built and prepared as rank 0 does (openai.RequestBuilder), its grammar compiled as a rank compiles it,
# and a scripted model in place of the weights (random logits, or a wish to write one text): what the grammar and
# the splitter make of them is the answer a client gets.

PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["color", "ok"],
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def _builder(tok):
    import json as _json

    from clusterctl.rank.api.admission import limits_for
    from clusterctl.rank.api.openai import RequestBuilder
    from clusterctl.protocol.rankspec import RankSpec
    from rankharness import tiny_model_path

    spec = RankSpec(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
                    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, http_port=1, runtime_dir="/r",
                    marker_path="/r/m", gate_path="/r/g")
    if id(tok) not in _LIMITS:  # tiny_model_path() checks the model's build (~1 s): once per tokenizer
        _LIMITS[id(tok)] = limits_for(_json.loads((tiny_model_path() / "config.json").read_text()), tok, 4096)
    return RequestBuilder(spec, _LIMITS[id(tok)])


_LIMITS: dict = {}  # each test tokenizer's admission.Limits (_builder)


_FACTORIES: dict = {}  # each test tokenizer's grammar factory (answer)


def answer(tok, body: dict, model) -> tuple[S.Reply, list[int]]:
    """The reply to ``body`` (a chat request, greedy unless it says otherwise) when ``model(tokens so far) ->
    logits`` writes it: rank 0's own sampler (its processors: logit bias, the grammar's mask) and its end of a row
    (generation.Seq: EOS, a stop string, max_tokens, the grammar's finish rule), then the request's splitter."""
    import mlx.core as mx
    import numpy as np

    from clusterctl.rank.api.admission import Preparer
    from clusterctl.rank.engine.generation import Seq, StopMatcher
    from clusterctl.rank.engine.sampling import RowSampler
    from clusterctl.rank.grammar.mask import GrammarFactory

    api_req = _builder(tok).chat(parse(ChatRequest, {"temperature": 0, **body}))
    req = Preparer(tok).prepare(api_req)
    if id(tok) not in _FACTORIES:  # one per tokenizer, as a rank has one (~1 s to make)
        _FACTORIES[id(tok)] = factory = GrammarFactory(tok)
        factory.rollout_seconds = None  # as lockstep ranks run it: the result must not depend on the machine's load
    factory = _FACTORIES[id(tok)]
    c = factory.compile_request(req.grammar, req.max_tokens) if req.grammar is not None else None
    sampler = RowSampler(req, c)
    if c is not None:
        c.seconds = None
    seq = Seq(req=req, uid=0, detok=tok.detokenizer, stops=StopMatcher(req.stop), procs=sampler.procs)
    finish = None
    while finish is None:
        t = int(sampler(mx.array(np.array(model(seq.tokens), dtype=np.float32))[None]).item())
        sampler.took(t)
        finish = seq.feed(t, eos=t in tok.eos_token_ids,
                          otherwise="length" if len(seq.tokens) + 1 >= req.max_tokens else None)
    result = seq.result(finish)
    sp = api_req.splitter
    reply = S.Reply().add(sp.feed(result.text)).add(sp.finish(result.finish_reason))
    return reply, result.tokens


def random_model(seed: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return lambda _tokens: rng.gumbel(size=vocab) * 3  # argmax of these: a sample of a random model


@pytest.mark.slow
def test_a_json_answer_follows_the_reasoning_the_prompt_opened(toks):
    """A template whose generation prompt opens <think> (DeepSeek-R1, thinking Qwen3): the JSON comes after the
    reasoning, in ``content``, within max_tokens, and parses; the reasoning is closed early enough for it. The
    finish rule: "length" when the budget closed something the model had open (here its reasoning), "stop" when
    the model ended the answer; the content parses either way."""
    tok = toks["json"]
    msgs = [{"role": "user", "content": "who?"}]
    assert T.initial_state(tok, tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                                   tokenize=False), add_special_tokens=False)) \
        == "reasoning"
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    for seed in range(6):
        for max_tokens in (20, 48):
            reply, out = answer(tok, {"messages": msgs, "response_format": rf, "max_tokens": max_tokens},
                                random_model(seed, len(tok)))
            jsonschema.validate(json.loads(reply.content), PERSON)
            assert reply.finish_reason == "length" and len(out) <= max_tokens, (seed, reply)
    # the model ends its answer itself: "stop"; without reasoning, the JSON alone
    small = {"type": "json_schema", "json_schema": {"name": "p", "schema": PICK["function"]["parameters"]}}
    for seed in range(4):
        reply, _ = answer(tok, {"messages": msgs, "response_format": small, "max_tokens": 60,
                                "chat_template_kwargs": {"enable_thinking": False}}, random_model(seed, len(tok)))
        assert reply.finish_reason == "stop" and not reply.reasoning_content, reply
        jsonschema.validate(json.loads(reply.content), PICK["function"]["parameters"])


@pytest.mark.slow
def test_a_forced_call_follows_the_reasoning_the_prompt_opened(toks):
    """tool_choice required on that template: the reasoning ends in time, the call is made (tool_calls), never
    all tokens in reasoning_content with no call."""
    tok = toks["json"]
    for seed in range(6):
        reply, out = answer(tok, {"messages": [{"role": "user", "content": "w?"}], "tools": [WEATHER, PICK],
                                  "tool_choice": "required", "max_tokens": 40}, random_model(seed, len(tok)))
        assert reply.tool_calls and not reply.content and len(out) <= 40, (seed, reply)
        for call in reply.tool_calls:
            tool = next(t for t in (WEATHER, PICK) if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


@pytest.mark.slow
def test_required_calls_finish_tool_calls_when_they_close(toks):
    """tool_choice required with parallel calls allowed: the answer ends with its calls (finish tool_calls), not
    with a further call the budget had to cut (finish length); a model's newline after a call does not commit it
    to another one."""
    tok = toks["nothink"]
    body = {"messages": [{"role": "user", "content": "pick"}], "tools": [PICK], "tool_choice": "required",
            "max_tokens": 80}
    for seed in range(6):
        reply, _ = answer(tok, body, random_model(seed, len(tok)))
        assert reply.finish_reason == "tool_calls" and reply.tool_calls and not reply.content, (seed, reply)
    # a model that ends its call with a newline, then its end token
    call = tok.encode('<tool_call>\n{"name": "pick", "arguments": {"color": "red", "ok": true}}\n</tool_call>\n',
                      add_special_tokens=False)
    reply, out = answer(tok, {**body, "max_tokens": 200}, scripted(tok, call + [tok.eos_token_id]))
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1 and len(out) == len(call), reply


def test_a_cut_forced_call_never_reaches_the_content(toks):
    tok = toks["json"]
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                  "tool_choice": "required"})
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    s = chat.splitter(tok, [])
    assert summary(run(s, token_pieces(tok, cut), "length")) == ("", "", [], "length") and s.malformed


def scripted(tok, tokens: list[int], strength: float = 50.0):
    """A model that wants to write ``tokens`` (then EOS): each step the next one is boosted, whatever came
    before; when the grammar refuses it, the model takes what it may and goes on with the same wish."""
    import numpy as np

    rng = np.random.default_rng(0)

    def logits(out):
        x = rng.normal(size=len(tok)).astype(np.float32)
        k = 0
        for t in out:  # how far into its wish the text is
            k = k + 1 if k < len(tokens) and t == tokens[k] else (1 if t == tokens[0] else 0)
        x[tokens[k] if k < len(tokens) else tok.eos_token_id] += strength
        return x

    return logits


_TEXTS: dict[int, list[str]] = {}  # each test tokenizer's token texts (wishing)


def wishing(tok, text: str, strength: float = 50.0):
    """A model that means to write ``text`` (then EOS) whatever the tokens spell it with: each step its top token
    is the longest whose text goes on with it (as a real model continues its text, not one tokenization); once the
    text so far leaves ``text`` (the grammar forced something else) it wants to end."""
    import numpy as np

    if id(tok) not in _TEXTS:
        _TEXTS[id(tok)] = tok._tokenizer.batch_decode([[i] for i in range(len(tok))])
    texts = _TEXTS[id(tok)]
    rng = np.random.default_rng(0)

    def logits(out):
        x = rng.normal(size=len(tok)).astype(np.float32)
        so_far = tok.decode(out)
        rest = text[len(so_far):] if text.startswith(so_far) else ""
        best = max((i for i, t in enumerate(texts) if t and rest.startswith(t)), key=lambda i: len(texts[i]),
                   default=tok.eos_token_id)
        x[best] += strength
        return x

    return logits


@pytest.mark.slow
def test_a_whole_forced_call_finishes_tool_calls_whatever_the_budget(tmp_path, toks):
    """issue 49 item 5: tool_choice required (and a named function), the model writing its whole call: the answer is
    ``tool_calls`` at every max_tokens that leaves the roll-out's margin, also when the budget forced the call's end
    the way the model wrote it (SmolLM2's markers of several tokens: the roll-out spells "<", "/", ... where the
    model writes "</", "tool", ...; it skips the model's newline), and when the call ends at the last token. A
    budget that closes a string the model was still writing is "length"."""
    from mlx_lm.tokenizer_utils import load

    from clusterctl.rank.grammar.mask import MARGIN

    text_markers = load(toolmodels.write_tokenizer(tmp_path / "text-markers", call_tokens=False, thinking=False))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for tok in (toks["nothink"], text_markers):
        n = len(tok.encode(call, add_special_tokens=False))
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "tool_choice": choice}
            for max_tokens in range(n + MARGIN, n + 20, 2):
                reply, out = answer(tok, {**body, "max_tokens": max_tokens}, wishing(tok, call))
                calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]
                assert (reply.finish_reason, calls) == ("tool_calls", [CALLS[0]]), (max_tokens, out, reply)
            city = "Paris, the capital of France, on the Seine"
            reply, _ = answer(tok, {**body, "max_tokens": n + MARGIN}, wishing(tok, call.replace("Paris", city)))
            cut = json.loads(reply.tool_calls[0]["function"]["arguments"])["city"]
            assert reply.finish_reason == "length" and cut and city.startswith(cut) and cut != city, reply


@pytest.mark.slow
def test_tool_choice_none_bans_call_markup_of_several_tokens(tmp_path):
    """tool_choice "none" on a template whose call marker is text of several tokens (SmolLM2's): a model set on
    calling never gets the marker out, however the tokens would spell it; under "auto" the same model calls."""
    from mlx_lm.tokenizer_utils import load

    tok = load(toolmodels.write_tokenizer(tmp_path / "text-markers", call_tokens=False))
    assert tok.has_tool_calling and len(tok.tool_call_start_tokens) > 1
    call = tok.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', add_special_tokens=False)
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": TOOLS, "max_tokens": 40,
            "chat_template_kwargs": {"enable_thinking": False}}
    auto, _ = answer(tok, body, scripted(tok, call))
    assert [c["function"]["name"] for c in auto.tool_calls] == ["get_time"]
    apart = tok.encode("<", add_special_tokens=False) + tok.encode("tool_call>{", add_special_tokens=False)
    for spelled in (call, apart):
        none, out = answer(tok, {**body, "tool_choice": "none"}, scripted(tok, spelled))
        assert "<tool_call>" not in tok.decode(out) and not none.tool_calls and none.content, none


def test_tool_choice_none_allows_no_markup_that_starts_like_a_call(tmp_path, toks):
    """issue 49 item 6: under tool_choice "none" a model set on calling (few-shot history, greedy) wrote
    "<tool_call]", its JSON and "</tool_call>" past the ban of the literal marker. On every tools template the
    repo knows (markers of one token and of several; json_tools, qwen3_coder, mistral) the answer holds no
    marker's stem anywhere, and does not start the way the opener starts; the same model's prose passes."""
    from mlx_lm.tokenizer_utils import load

    text_markers = load(toolmodels.write_tokenizer(tmp_path / "text-markers", call_tokens=False))
    body = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 24, "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": False}}
    for name, tok in [*((k, toks[k]) for k in ("json", "xml", "mistral")), ("text markers", text_markers)]:
        opener, closer = tok.tool_call_start, tok.tool_call_end or ""
        near = [opener[:-1] + "]" + ' {"name": "get_time", "arguments": {}}' + closer,
                opener[:-1] + "s" + opener[-1:] + " get_time", " " + opener[:2] + "ools: none",
                "I will call it." + closer]
        for wish in near:
            reply, out = answer(tok, body, wishing(tok, wish))
            text = tok.decode(out)
            assert not text.lstrip().startswith(opener[:2]) and not reply.tool_calls, (name, wish, text)
            assert all(m.rstrip(">]") not in text for m in (opener, closer) if m), (name, wish, text)
        reply, _ = answer(tok, body, wishing(tok, "It is sunny in Paris, < 30 C [hot]."))
        assert reply.content == "It is sunny in Paris, < 30 C [hot].", (name, reply)
    # a prompt that opened <think>: the reasoning and its end marker (one token) stay allowed
    reply, _ = answer(toks["json"], {**body, "chat_template_kwargs": {}}, wishing(toks["json"], "Hmm.</think>Sunny."))
    assert (reply.reasoning_content, reply.content) == ("Hmm.", "Sunny."), reply


@pytest.mark.slow
def test_thinking_grammars_are_admitted_and_announced_alike(toks):
    """issue 41 items 1 and 5 together: a thinking template's grammars (the JSON after the reasoning the prompt
    opened, a forced call) are compiled at admission (compiler.py: off the step loop, probed, a roll-out bound in
    masks), and a lockstep rank that compiles the announced request makes the same constraint: the same shortest
    answer (opening with </think>: the roll-out closes the reasoning first), the same bound, the same first mask."""
    import numpy as np

    from clusterctl.rank.grammar.compiler import Compiler, GrammarRefused, Refusal
    from clusterctl.rank.engine.generation import GenRequest
    from clusterctl.rank.grammar.mask import json_schema

    tok = toks["json"]
    rf = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
        "type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}}}
    chat = chat_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                  "tool_choice": "required"})
    grammars = {"reasoned json": {"lark": T.reasoned_json(tok, json_schema(rf), "reasoning"), "response_format": rf},
                "forced call": {"lark": T.call_constraint(tok, chat, "reasoning").lark()}}
    rank0, other = Compiler(tok), Compiler(tok)
    end = tok.encode("</think>", add_special_tokens=False)
    for name, grammar in grammars.items():
        req = GenRequest(id=name, tokens=[1], max_tokens=60, grammar=grammar)
        c = rank0.admit(req)
        assert c is not None and 16 <= req.rollout_steps <= 512 and c.rollout_steps == req.rollout_steps, name
        assert len(end) == 1 and c._way_out[0] == end[0], (name, c._way_out)
        other.announce(GenRequest(**req.__dict__))
        mine = other.take(req)
        assert (mine.min_tokens, mine.rollout_steps) == (c.min_tokens, c.rollout_steps), name
        assert np.array_equal(np.array(mine.mask()), np.array(c.mask())), name
        with pytest.raises(GrammarRefused) as e:  # its shortest answer cannot fit: refused, naming max_tokens
            rank0.admit(GenRequest(id=name, tokens=[1], max_tokens=c.min_tokens - 1, grammar=grammar))
        assert e.value.kind is Refusal.BUDGET and "max_tokens" in str(e.value), e.value
