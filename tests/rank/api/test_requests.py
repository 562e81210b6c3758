"""Rank 0's request models (rank/api/requests.py, messages.py): the shapes each union takes, the rules between
fields, and the 400 a wrong body gets (its ``param``: the body's field, however deep the error; its message one
line that says where). Pure pydantic: no tokenizer, no rank."""

import json

import pytest

from clusterctl.rank.api.requests import REQUESTS, ChatRequest, CompletionRequest, parse
from clusterctl.rank.api.wire import ApiError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
HI = [{"role": "user", "content": "hi"}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}], "role": "user"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "extra": 1},
    {"role": "ipython", "content": "a role only some templates know"},
]


def chat(**fields) -> ChatRequest:
    return parse(ChatRequest, {"messages": HI, **fields})


def refused(model, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error" and "\n" not in e.value.message
    return e.value


# -- the shapes each union accepts


@pytest.mark.parametrize("stop, stops", [(None, []), ("x", ["x"]), (["a", "", "b"], ["a", "b"]), ([""] * 4, [])])
def test_stop_is_a_string_or_up_to_four(stop, stops):
    assert parse(CompletionRequest, {"prompt": "p", "stop": stop}).stops() == stops


@pytest.mark.parametrize("prompt, taken", [("text", "text"), ([1, 2], [1, 2]), (["text"], "text"), ([[3, 4]], [3, 4]),
                                           ([5], [5]), ("", "")])
def test_prompt_is_a_string_token_ids_or_a_list_of_one(prompt, taken):
    assert parse(CompletionRequest, {"prompt": prompt}).prompt == taken


@pytest.mark.parametrize("prompt", [None, 3, [], ["a", "b"], [[1], [2]], [True], [1.0], [[]], [["a"]], {"a": 1}])
def test_other_prompts_are_refused_by_name(prompt):
    e = refused(CompletionRequest, {} if prompt is None else {"prompt": prompt})
    assert e.param == "prompt" and e.message == "prompt must be a string or a list of token ids"


def test_messages_of_every_role_become_what_templates_take():
    r = parse(ChatRequest, {"messages": HISTORY})
    assert [type(m).__name__ for m in r.messages] == ["SystemMessage", "UserMessage", "AssistantMessage",
                                                      "ToolMessage", "OtherMessage"]
    got = r.template_messages()
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"content": "Weather in Paris?", "role": "user"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "type": "function"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "extra": 1, "name": "get_weather"},
        {"role": "ipython", "content": "a role only some templates know"}]
    assert [list(m) for m in got][1] == ["content", "role"]  # the client's order (a template may dump a message)
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # the body is not changed
    assert parse(ChatRequest, {"messages": [{"role": "developer", "content": "x"}]}).messages[0].role == "developer"


@pytest.mark.parametrize("arguments, decoded", [({"a": 1}, {"a": 1}), ("", {}), (None, {}), ("[1]", [1])])
def test_call_arguments_are_decoded(arguments, decoded):
    call = {"function": {"name": "f", "arguments": arguments}}
    r = parse(ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [call]}]})
    assert r.template_messages()[0]["tool_calls"][0]["function"]["arguments"] == decoded


def test_tools_and_tool_choice():
    assert chat().tools is None and chat().tool_mode == "none"
    assert chat(tools=[]).tools is None  # no tools is none, as in mlx_lm.server
    auto = chat(tools=TOOLS)
    assert auto.tool_mode == "auto" and auto.template_tools() == TOOLS
    assert chat(tools=TOOLS, tool_choice="none").tool_mode == "none"
    assert chat(tool_choice="auto").tool_mode == "auto"  # "none" and "auto" need no tools (clients always send them)
    assert chat(tools=TOOLS, tool_choice="required").tool_mode == "required"
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.tool_mode, named.forced_function) == ("function", "get_time")
    kept = chat(tools=[{"function": {"name": "f", "x-vendor": 1}, "extra": True}]).template_tools()
    assert kept == [{"function": {"name": "f", "x-vendor": 1}, "extra": True, "type": "function"}]


def test_template_kwargs_and_unknown_fields_are_taken():
    r = chat(chat_template_kwargs={"enable_thinking": False}, metadata={"a": 1}, store=True, service_tier="auto")
    assert r.chat_template_kwargs == {"enable_thinking": False}
    assert parse(CompletionRequest, {"prompt": "p", "messages": 3, "vendor_extra": [1]}).prompt == "p"


# -- the rules between fields


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names function 'nope', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot both shape one answer"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "forced"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "tools[1].function.name: 'get_weather' is defined twice"),
])
def test_chat_rules_between_fields(fields, param, words):
    e = refused(ChatRequest, {"messages": HI, **fields})
    assert e.param == param and words in e.message, e.message


def test_rules_that_hold_let_the_request_through():
    assert chat(tools=TOOLS, tool_choice="required", response_format={"type": "text"}).grammar() is None
    assert chat(tools=TOOLS, tool_choice="auto", response_format={"type": "json_object"}).grammar() == \
        {"response_format": {"type": "json_object"}}
    assert chat(top_logprobs=0).alternatives() == -1 and chat(logprobs=True, top_logprobs=3).alternatives() == 3


def test_completion_rules():
    e = refused(CompletionRequest, {"prompt": "x", "max_tokens": 0})
    assert e.param == "max_tokens" and "echo" in e.message
    scored = parse(CompletionRequest, {"prompt": "x", "max_tokens": 0, "echo": True})
    assert scored.score_only and scored.asked_max_tokens() == 1  # one made inside and dropped
    assert "is for chat" in refused(CompletionRequest, {"prompt": "x", "top_logprobs": 2}).message
    assert "less than or equal to 20" in refused(CompletionRequest, {"prompt": "x", "top_logprobs": 21}).message
    for name in ("tools", "tool_choice", "chat_template_kwargs"):
        e = refused(CompletionRequest, {"prompt": "x", name: []})
        assert e.param == name and e.message == f"{name} is for /v1/chat/completions"


# -- a wrong shape's 400 names the body's field and says where


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": {"a": 1}}, "tools", "tools must be a list"),
    ({"tools": [3]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0].type: only function tools"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object with a name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages",
     "messages[0].tool_calls[0].function must be an object with a name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools[0].function.name is required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools",
     "tools[0].function.parameters must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "boolean"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set tokenize"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}", "not an identifier": 1}}, "chat_template_kwargs",
     "chat_template, not an identifier"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "messages", "messages[0].tool_calls[0].function.arguments must be a JSON string"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f"}}]}]},
     "messages", 'messages[0].tool_calls[0].type must be "function"'),
    ({"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]}, "messages",
     "messages[0].tool_calls must be a list"),
    ({"messages": [*HI, {"role": "user", "tool_calls": []}]}, "messages",
     "messages[1].tool_calls: only assistant messages make tool calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "messages[0].tool_call_id is required"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": ""}]}, "messages", "tool_call_id is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "messages[0].content: only text content parts are supported"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content must be a string"),
    ({"messages": [{"content": "no role"}]}, "messages", "messages[0] needs a role"),
    ({"messages": ["hi"]}, "messages", "messages[0] needs a role"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": None}, "messages", "messages must be a non-empty list"),
    ({"stop": [1]}, "stop", "stop must be a string or a list of at most 4 strings"),
    ({"stop": ["a"] * 5}, "stop", "at most 4"),
    ({"temperature": "0.5"}, "temperature", "temperature: Input should be a valid number"),
    ({"response_format": "json"}, "response_format", "response_format: Input should be a valid dictionary"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
    ({"logit_bias": {"3": 101}}, "logit_bias", "logit_bias.3:"),
    ({"echo": True}, "echo", "echo is not supported by this server"),
    ({"best_of": 2}, "best_of", "best_of is not supported"),
    ({"xtc_probability": False}, "xtc_probability", "not supported"),  # false is not 0
    ({"modalities": ["text", "audio"]}, "modalities", "only the text modality"),
])
def test_a_wrong_shape_names_its_field(body, param, words):
    e = refused(ChatRequest, {"messages": HI, **body})
    assert e.param == param and words in e.message, e.message


@pytest.mark.parametrize("model, body, param", [
    (ChatRequest, {"messages": [], "temperature": "hot"}, "temperature"),  # the scalars first
    (ChatRequest, {"messages": [], "parallel_tool_calls": 1, "tools": 3}, "parallel_tool_calls"),
    (ChatRequest, {"messages": [], "tools": 3, "tool_choice": 3}, "tools"),  # then the chat's parts
    (ChatRequest, {"messages": [], "stop": [1]}, "messages"),
    (ChatRequest, {"messages": HI, "echo": True, "stop": [1]}, "echo"),  # then what cannot be honoured, the stops
    (ChatRequest, {"messages": [], "response_format": {"type": "xml"}}, "messages"),  # then the rules
    (ChatRequest, {"messages": HI, "response_format": {"type": "xml"}, "top_logprobs": 2}, "response_format"),
    (CompletionRequest, {"prompt": 3, "logprobs": "x"}, "logprobs"),
    (CompletionRequest, {"prompt": 3, "best_of": 2}, "prompt"),
    (CompletionRequest, {"prompt": "p", "best_of": 2, "stop": [1], "tools": []}, "best_of"),
    (CompletionRequest, {"prompt": "p", "max_tokens": 0, "response_format": {"type": "xml"}}, "max_tokens"),
])
def test_a_body_wrong_twice_names_the_field_it_always_named(model, body, param):
    """Fields are checked in the order rank 0's hand-written checks had (compared before they went: 8,268 bodies
    with one or two fields changed got the same status, param and message from both)."""
    assert refused(model, body).param == param


def test_fields_that_ask_for_nothing_are_taken():
    r = parse(ChatRequest, {"messages": HI, "best_of": 1, "suffix": "", "function_call": "none", "echo": False,
                            "xtc_probability": 0.0, "num_draft_tokens": 0, "modalities": ["text"], "functions": None})
    assert r.echo is False
    assert parse(CompletionRequest, {"prompt": "p", "echo": True}).echo is True  # completions answer echo


def test_every_route_has_a_model():
    assert REQUESTS == {"completion": CompletionRequest, "chat": ChatRequest}
    assert json.dumps(parse(ChatRequest, {"messages": HI}).template_messages()) == json.dumps(HI)
