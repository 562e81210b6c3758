"""The request side of tool calls and reasoning in rank 0's chat API, on top of what mlx-lm already knows about a
model: the prompt rendered, a forced call's grammar, the tokens "none" bans. The OpenAI fields (``messages`` with
assistant ``tool_calls`` and ``tool`` messages, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``chat_template_kwargs``) are checked by requests.py's ``ChatRequest``; ``ChatTools.of`` takes them as the
template, the grammar and the splitter need them; ``render_kwargs`` adds what the model's ``TokenizerWrapper``
says and gives the keyword arguments of ``apply_chat_template``. What only the tokenizer can tell (the template
refuses the messages, the model cannot call tools, its call format cannot be forced) is a ``ToolsError`` (a 400
naming ``e.param``). The response side (content, reasoning and tool-call events out of the detokenized text) is
splitter.py.

Use, on rank 0::

    chat = ChatTools.of(parse(ChatRequest, body))  # requests.py: a 400 naming the field
    text = render(tokenizer, chat, template_args)   # the operator's template arguments under the request's
    tokens = tokenizer.encode(text, add_special_tokens=False)
    chat.constraint(tokenizer, tokens)              # forced call: the grammar of CallConstraint.lark(), or None
    reasoned_json(tokenizer, schema, initial)       # response_format after the reasoning the prompt opened
    banned_token_ids(tokenizer, chat)               # tool_choice "none": logit bias -inf on these
    no_call_lark(tokenizer, chat)                   # ... and this grammar: no call markup, however spelled
    splitter = chat.splitter(tokenizer, tokens)     # splitter.py's OutputSplitter

Decisions where OpenAI and mlx-lm leave room:
- ``tool_choice`` "none": the tools are still rendered (OpenAI's model still sees its tools; the prompt, and its
  cached prefix, stay those of "auto"), no call is parsed, and no call markup can be written: ``no_call_lark`` is
  a grammar of any text without the markers' stems nor a start like the opener's, and ``banned_token_ids`` names
  an opener of one token for the sampler to forbid (a logit bias of -inf; it holds under a response_format too).
- A forced call or a ``response_format`` on a prompt that opened a reasoning block comes after that block (the
  grammar module closes the reasoning in time for it): else the answer would be the reasoning.
- "required" / a named function: ``call_constraint`` says what the grammar module must enforce (a JSON schema of
  the call, the markers as tokens, and all of it as an llguidance Lark grammar); refused for call formats that
  are not JSON between markers (only mlx-lm's ``json_tools``: Qwen2.5, Qwen3, Hermes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from clusterctl.rank.api.requests import ChatRequest
from clusterctl.rank.api.splitter import OutputSplitter

JSON_CALL_FORMATS = frozenset({"json_tools"})  # call formats whose body is one JSON object {"name", "arguments"}


class ToolsError(ValueError):
    """A bad request field; ``param`` is the OpenAI body field to name in the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatTools:
    """The tool and template fields of one chat request (requests.ChatRequest, checked) as the template, the
    grammar and the splitter take them; no tokenizer needed."""

    messages: list[dict]
    tools: Optional[list[dict]] = None
    choice: str = "none"  # "none" | "auto" | "required" | "function"
    function: Optional[str] = None  # the forced function's name when choice == "function"
    parallel: bool = True  # parallel_tool_calls
    template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, request: ChatRequest) -> "ChatTools":
        return cls(messages=request.template_messages(), tools=request.template_tools(), choice=request.tool_mode,
                   function=request.forced_function, parallel=request.parallel_tool_calls is not False,
                   template_kwargs=dict(request.chat_template_kwargs or {}))

    @property
    def parse_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def constraint(self, tokenizer, prompt_tokens: list[int]) -> Optional["CallConstraint"]:
        """The grammar of this request's forced call (None when no call is forced)."""
        return call_constraint(tokenizer, self, initial_state(tokenizer, prompt_tokens))

    def splitter(self, tokenizer, prompt_tokens: list[int]) -> "OutputSplitter":
        """The splitter of this request's output, started in the state its prompt leaves the model in."""
        return OutputSplitter(tokenizer, self.tools, parse_calls=self.parse_calls,
                              initial_state=initial_state(tokenizer, prompt_tokens),
                              parallel=self.parallel and self.choice != "function",
                              forced=self.choice in ("required", "function"))


def render_kwargs(tokenizer, chat: ChatTools, defaults: Optional[dict] = None) -> dict:
    """Keyword arguments of ``tokenizer.apply_chat_template(chat.messages, add_generation_prompt=True,
    tokenize=False, **kwargs)``: ``tools`` and the template variables (the operator's ``defaults``, then the
    request's ``chat_template_kwargs`` over them, as mlx_lm.server merges ``--chat-template-args``)."""
    if chat.tools and not tokenizer.has_tool_calling:
        raise ToolsError("tools: this model cannot call tools (mlx-lm knows no tool-call format for its chat "
                         "template)", "tools")
    if chat.choice in ("required", "function"):
        call_constraint(tokenizer, chat)  # refuses a call format that cannot be forced
    kwargs = dict(defaults or {})
    kwargs.update(chat.template_kwargs)
    kwargs["tools"] = chat.tools
    return kwargs


def render(tokenizer, chat: ChatTools, defaults: Optional[dict] = None) -> str:
    """The prompt text of ``chat`` (tokenize it with ``add_special_tokens=False``). A template that refuses the
    messages (its ``raise_exception``, or a value of the wrong shape) is the request's fault: a ToolsError."""
    from jinja2 import TemplateError

    kwargs = render_kwargs(tokenizer, chat, defaults)
    try:
        return tokenizer.apply_chat_template(chat.messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except TemplateError as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise ToolsError(f"messages: the model's chat template refused them: {why}", "messages") from None


def initial_state(tokenizer, prompt_tokens: list[int]) -> str:
    """"reasoning" when the prompt opened a think block it did not close (the generation prompt of some
    thinking templates), else "normal"; a chat-template module's own initial state wins (as in mlx_lm.server)."""
    state = "normal"
    if tokenizer.has_thinking and prompt_tokens:
        if tokenizer.rfind_think_start(prompt_tokens) > tokenizer.rfind_think_end(prompt_tokens):
            state = "reasoning"
    return tokenizer.response_initial_state or state


def banned_token_ids(tokenizer, chat: ChatTools) -> list[int]:
    """Tokens the sampler must never pick for this request: the call's opening marker under tool_choice "none"
    with tools rendered, when that marker is one token (the grammar of ``no_call_lark`` bans it too; this ban
    also holds under a ``response_format``, whose grammar takes that grammar's place)."""
    if chat.tools and chat.choice == "none" and tokenizer.has_tool_calling:
        start = tokenizer.tool_call_start_tokens or ()
        if len(start) == 1:
            return [start[0]]
    return []


def no_call_lark(tokenizer, chat: ChatTools) -> Optional[str]:
    """tool_choice "none" with tools rendered: the Lark grammar of an answer without call markup, however it is
    tokenized (a logit bias bans tokens, and a marker has many spellings in tokens: "<tool_call>" as "<", "tool",
    "_call>", ...). Banned: each marker's stem (``_stem``: "<tool_call", "</tool_call", "[TOOL_CALLS") anywhere,
    so no near-marker either (a model set on calling wrote "<tool_call]", its call, "</tool_call>"); and a text
    that starts (after blanks) the way the opener starts, its first two characters ("<t", "[T"): where a call
    would begin. One character is allowed there ("<", "[": markup, maths, a JSON array). Reasoning markers of one
    token stay allowed between texts. None when the request needs none (not "none", no tools, no markers)."""
    if not (chat.tools and chat.choice == "none" and tokenizer.has_tool_calling) or not tokenizer.tool_call_start:
        return None
    stems = sorted({_stem(m) for m in (tokenizer.tool_call_start, tokenizer.tool_call_end) if m and _stem(m)})
    opener = tokenizer.tool_call_start.lstrip()
    banned = [f"~/(?s:.*({'|'.join(_regex(t) for t in stems)}).*)/"] if stems else []
    if len(opener) >= 2:
        banned.append(f"~/[ \\t\\r\\n]*{_regex(opener[:2])}(?s:.*)/")
    lines = ["start: TEXT" + (" (think TEXT)*" if _think_tokens(tokenizer) else ""),
             "TEXT: " + " & ".join(["/(?s:.*)/", *banned])]
    if _think_tokens(tokenizer):
        lines.append("think: " + " | ".join(f"<[{i}]>" for i in _think_tokens(tokenizer)))
    return "\n".join(lines) + "\n"


def _stem(marker: str) -> str:
    """A marker up to its closing punctuation ("<tool_call>" -> "<tool_call"): what starts it whatever follows;
    "" when too short to tell call markup from text."""
    stem = marker.strip().rstrip(">]|)}:=\n ")
    return stem if len(stem) >= 3 else ""


def _regex(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _think_tokens(tokenizer) -> list[int]:
    """The reasoning markers of one token each (free text cannot take a token the grammar engine reads as special)."""
    if not tokenizer.has_thinking:
        return []
    ids = [_one_token(tokenizer, m) for m in (tokenizer.think_start, tokenizer.think_end)]
    return [i for i in ids if i is not None]


def call_format(tokenizer) -> Optional[str]:
    """The name of the model's call format in ``mlx_lm.tool_parsers`` ("json_tools", "qwen3_coder", ...)."""
    parser = tokenizer.tool_parser
    if parser is None:
        return None
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


def _arguments_schema(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    # OpenAI: "Omitting parameters defines a function with an empty parameter list."
    return params if params is not None else {"type": "object", "properties": {}, "additionalProperties": False}


# JSON as the templates write it ({"name": "f", "arguments": {...}}), and no room to pad a call with blanks forever
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallConstraint:
    """What the grammar module must enforce for tool_choice "required" or a named function.

    The output must be, with at most a few blanks or newlines between the parts (the templates write newlines):
      [reasoning] (start  JSON(schema)  end){min_calls, max_calls}  EOS
    where [reasoning] is free text closed by ``think[1]``: mandatory when ``think_open`` (the prompt opened the
    block), else optional and opened by ``think[0]``; absent when ``think`` is None. JSON(schema) is one JSON
    value valid against ``schema`` (an object {"name": <const>, "arguments": <the tool's parameters>}, ``anyOf``
    over the tools for "required"; "name" first, as the templates write it). ``max_calls`` None: unbounded.
    ``token_ids`` maps each marker that is one token to that token: grammar engines see added tokens as special
    (llguidance: not as their text), so a marker must be matched as its token. ``lark()`` is all of it in
    llguidance's Lark syntax: ``llguidance.LLMatcher.grammar_from_lark(c.lark())``.
    """

    start: str
    end: str
    schema: dict
    min_calls: int = 1
    max_calls: Optional[int] = None
    think: Optional[tuple[str, str]] = None
    think_open: bool = False
    token_ids: dict = field(default_factory=dict)

    def _marker(self, text: str) -> str:
        i = self.token_ids.get(text)
        return f"<[{i}]>" if i is not None else json.dumps(text, ensure_ascii=False)

    def lark(self) -> str:
        schema = dict(self.schema)
        schema.setdefault("x-guidance", JSON_STYLE)
        end = f" WS {self._marker(self.end)}" if self.end else ""
        lines = [f"call: {self._marker(self.start)} WS %json {json.dumps(schema, ensure_ascii=False)}{end}",
                 # parallel calls may end in blanks: a model's newline before its end token commits it to no call
                 "calls: call" + ("" if self.max_calls == 1 else " (WS call)* WS"), *LAYOUT_RULES]
        if self.think is None:
            lines.insert(0, "start: calls")
        else:
            lines[:0] = ["start: reasoning calls", _reasoning_rule(self.think, self.think_open, self._marker)]
        return "\n".join(lines) + "\n"


# the rules a reasoning block and markers need: a few blanks or newlines (the templates' layout), free text
LAYOUT_RULES = ("WS: /[ \\t\\n]{0,4}/", "TEXT: /(?s:.*)/")


def _reasoning_rule(think: tuple[str, str], opened: bool, marker) -> str:
    """Lark rule ``reasoning``: free text closed by ``think[1]``, mandatory when the prompt opened the block, else
    optional and opened by ``think[0]``. The grammar module's roll-out closes it (its end marker first) when the
    budget needs the tokens for the answer after it."""
    closed = f"TEXT {marker(think[1])} WS"
    return "reasoning: " + (closed if opened else f"({marker(think[0])} {closed})?")


def reasoned_json(tokenizer, schema: dict, initial: str) -> Optional[str]:
    """The Lark grammar of a JSON answer (``schema`` with its llguidance options, grammar.json_schema) after the
    reasoning block the prompt opened (``initial`` "reasoning"): reasoning </think> JSON(schema) EOS. Without it
    the JSON was the reasoning, and ``content`` stayed empty. None (the JSON alone) when the prompt opened no block
    (a block it closed, e.g. enable_thinking false, asked for none) or the markers are not one token each."""
    if not tokenizer.has_thinking or initial != "reasoning":
        return None
    think = (tokenizer.think_start, tokenizer.think_end)
    ids = {m: i for m in think if (i := _one_token(tokenizer, m)) is not None}
    if len(ids) < 2:  # free text before a marker made of several tokens would never end (the lexer is greedy)
        return None

    def marker(text: str) -> str:
        return f"<[{ids[text]}]>"

    return "\n".join(["start: reasoning answer", _reasoning_rule(think, True, marker),
                      f"answer: %json {json.dumps(schema, ensure_ascii=False)}", *LAYOUT_RULES]) + "\n"


def _one_token(tokenizer, text: str) -> Optional[int]:
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    return ids[0] if len(ids) == 1 else None


def call_constraint(tokenizer, chat: ChatTools, initial: str = "normal") -> Optional[CallConstraint]:
    """The grammar a forced call needs, or None when the request forces none ("none", "auto"). ``initial`` is
    the reply's ``initial_state``."""
    if chat.choice not in ("required", "function") or not chat.tools:
        return None
    fmt = call_format(tokenizer)
    if not tokenizer.has_tool_calling or fmt not in JSON_CALL_FORMATS:
        raise ToolsError(f"tool_choice {chat.choice if chat.choice == 'required' else 'naming a function'} "
                         f"cannot be enforced for this model's tool-call format ({fmt}); use \"auto\"",
                         "tool_choice")
    chosen = [t for t in chat.tools if chat.choice == "required" or t["function"]["name"] == chat.function]
    alts = [{"type": "object",
             "properties": {"name": {"const": t["function"]["name"]}, "arguments": _arguments_schema(t)},
             "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    single = chat.choice == "function" or not chat.parallel
    think = (tokenizer.think_start, tokenizer.think_end) if tokenizer.has_thinking else None
    markers = [tokenizer.tool_call_start, tokenizer.tool_call_end or ""] + list(think or ())
    ids = {m: i for m in markers if (i := _one_token(tokenizer, m)) is not None}
    return CallConstraint(start=tokenizer.tool_call_start, end=tokenizer.tool_call_end or "", schema=schema,
                          max_calls=1 if single else None, think=think,
                          think_open=think is not None and initial == "reasoning", token_ids=ids)
