"""OpenAI's request bodies for rank 0, one model per route: ``CompletionRequest`` (/v1/completions) and
``ChatRequest`` (/v1/chat/completions; its messages and tools: messages.py). Every field the API reads has its type
and its bounds here, the shapes a field may take as unions and literals (``stop``, ``prompt``; ``messages``,
``tools``, ``tool_choice``), and the rules between fields as validators; ``parse`` turns a body into its model, or
into one 400 naming the field (OpenAI's ``param``: the body's field, however deep the error).

They validate strictly (no string for a number, no boolean for an integer, finite numbers only) and allow fields
they do not name, as OpenAI-compatible servers do (clients send ``user``, ``metadata``, ``store``...); fields that
would change the answer but cannot be honoured are refused by name (``_only``), never ignored. What depends on the
served model and the plan (the vocabulary, the context, the operator's limit on ``n``, the prompt's byte cap) is
checked by openai.py's ``RequestBuilder``; what needs the tokenizer (the chat template, a forced call's format) by
tools.py when the request is prepared.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, TypeVar, Union

from pydantic import AfterValidator, BaseModel, Field, ValidationError, model_validator

from clusterctl.rank.api.messages import TAGS, Messages, NamedChoice, Plain, ToolChoice, Tools, for_template
from clusterctl.rank.api.wire import SAID, ApiError, refuse, said, sentence

MAX_STOPS = 4
MAX_SALT = 1024  # characters of a cache_salt
MAX_BIAS = 300  # entries of a logit_bias, as OpenAI allows
MAX_TOP = 20  # top_logprobs, as OpenAI allows
MAX_TOKENS = 1 << 40
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # OpenAI's seed: a signed 64-bit integer
# apply_chat_template's own parameters: a request's chat_template_kwargs must not reach them (a per-request
# template, tokenize=True, ...), nor the arguments clusterctl sets
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})

Request = TypeVar("Request", bound="_Refused")  # a route's model


def _only(*fine: Any) -> AfterValidator:
    """A field OpenAI (or mlx_lm.server) defines that rank 0 cannot honour: only a value that asks for nothing
    (of the same type: ``false`` is not ``0``)."""
    def check(value):
        if not any(value == f and type(value) is type(f) for f in fine):
            raise sentence("{where} is not supported by this server")
        return value
    return AfterValidator(check)


Unsupported = Annotated[Any, _only(None)]

# -- the fields both routes take

Stop = Annotated[Union[str, Annotated[list[str], Field(max_length=MAX_STOPS)]],
                 said(f"{{where}} must be a string or a list of at most {MAX_STOPS} strings", whole=True)]


def _check_format(rf: Optional[dict]) -> None:
    """response_format: text, json_object or json_schema (its schema is checked when its grammar compiles)."""
    if rf is not None and rf != {"type": "text"} and rf.get("type") not in ("json_object", "json_schema"):
        raise refuse(("response_format",), "{where}.type must be text, json_object or json_schema")


def _modalities(value: Any) -> Any:
    if value is not None and value != ["text"]:
        raise sentence("only the text modality is supported")
    return value


class _Common(BaseModel):
    """What both routes take."""

    model_config = Plain

    model: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[dict[str, Any]] = None
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0, le=1 << 20)  # mlx-lm's extension (0: off)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)  # mlx-lm's extension
    repetition_penalty: Optional[float] = Field(None, ge=0.0, le=10.0)  # mlx-lm's extension
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_context_size: Optional[int] = Field(None, ge=1)  # mlx-lm's: the last N tokens each one looks at
    presence_context_size: Optional[int] = Field(None, ge=1)
    frequency_context_size: Optional[int] = Field(None, ge=1)
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = Field(None, max_length=MAX_BIAS)
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: Optional[int] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_SALT)  # vLLM's: a prompt-cache partition
    response_format: Optional[dict[str, Any]] = None  # its type: the routes' rules (_check_format)
    return_token_ids: Optional[bool] = None  # an extension: the choice's token ids
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    user: Optional[str] = None
    def grammar(self) -> Optional[dict]:
        """The request's grammar as it travels to the ranks (its response_format), or None."""
        rf = self.response_format
        return None if rf is None or rf == {"type": "text"} else {"response_format": rf}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class _Refused(BaseModel):
    """What both routes check after the fields each takes (the order rank 0 has always checked them in: a body
    wrong twice names the same field): the fields rank 0 cannot honour (each with the values that ask for
    nothing: refused rather than ignored), then the stop strings. A route is ``Route(_Refused, _RouteFields)``."""

    model_config = Plain

    best_of: Annotated[Any, _only(None, 1)] = None
    suffix: Annotated[Any, _only(None, "")] = None
    functions: Unsupported = None
    function_call: Annotated[Any, _only(None, "none")] = None
    audio: Unsupported = None
    modalities: Annotated[Any, AfterValidator(_modalities)] = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    xtc_probability: Annotated[Any, _only(None, 0, 0.0)] = None
    xtc_threshold: Unsupported = None
    num_draft_tokens: Annotated[Any, _only(None, 0)] = None
    adapters: Unsupported = None
    stop: Optional[Stop] = None

    def stops(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]


# -- the routes


def _template_kwargs(kwargs: Optional[dict]) -> Optional[dict]:
    """``chat_template_kwargs``: extra variables of the chat template (e.g. ``enable_thinking``); what a template
    does not use, it does not read (the model's template, as in mlx_lm.server). Not its own parameters."""
    bad = sorted(k for k in kwargs or () if not k.isidentifier() or k in RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise sentence(f"chat_template_kwargs may not set {', '.join(bad)}")
    return kwargs


def _one(prompt: Union[str, list]) -> Union[str, list[int]]:
    """A one-element list of a string or of token ids is that prompt."""
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) \
        else prompt


TokenIds = Annotated[list[int], Field(min_length=1)]
Prompt = Annotated[Union[str, TokenIds, Annotated[list[Union[str, TokenIds]], Field(min_length=1, max_length=1)]],
                   said("{where} must be a string or a list of token ids", whole=True), AfterValidator(_one)]
ForChat = Annotated[None, said("{where} is for /v1/chat/completions", whole=True)]


class _CompletionFields(_Common):
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    echo: Optional[bool] = None  # the prompt's text (and, with logprobs, its tokens' log-probabilities) first
    max_tokens: Optional[int] = Field(None, ge=0, le=MAX_TOKENS)  # 0: with echo, score the prompt only
    prompt: Prompt = Field(None, validate_default=True)  # a string or token ids (inside the vocabulary: openai.py)


class CompletionRequest(_Refused, _CompletionFields):
    """/v1/completions. ``logprobs`` is the legacy integer: that many alternatives per token (with ``echo``, per
    prompt token too)."""

    chat_template_kwargs: ForChat = None
    tools: ForChat = None
    tool_choice: ForChat = None

    @model_validator(mode="after")
    def _scoring(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise refuse(("max_tokens",), "max_tokens 0 makes nothing: it is for echo: true (score the prompt)")
        _check_format(self.response_format)
        if self.top_logprobs is not None:
            raise refuse(("top_logprobs",), "top_logprobs is for chat; /v1/completions takes an integer logprobs")
        return self

    @property
    def score_only(self) -> bool:
        return self.max_tokens == 0

    def asked_max_tokens(self) -> Optional[int]:
        """max_tokens as generated: scoring only (0), one token is made inside and dropped (respond.py: every
        request ends in a step of the batch)."""
        return 1 if self.score_only else self.max_tokens

    def alternatives(self) -> int:
        """Log-probability alternatives per token, -1: none (the integer logprobs of OpenAI's legacy API)."""
        return -1 if self.logprobs is None else self.logprobs


class _ChatFields(_Common):
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: Optional[bool] = None
    parallel_tool_calls: Optional[bool] = None
    tools: Tools = None
    tool_choice: Optional[ToolChoice] = None
    messages: Messages = Field(None, validate_default=True)
    chat_template_kwargs: Annotated[Optional[dict[str, Any]], said("{where} must be an object"),
                                    AfterValidator(_template_kwargs)] = None
    echo: Annotated[Any, _only(None, False)] = None  # completions' (the first field refused here)


class ChatRequest(_Refused, _ChatFields):
    """/v1/chat/completions."""

    @model_validator(mode="after")
    def _agree(self) -> "ChatRequest":
        """The rules between fields (in the order clients have been told about them): a forced call needs its
        tools, a response_format a known type, top_logprobs logprobs, and a forced call leaves no room for a
        response_format."""
        if self.tool_choice == "required" and not self.tools:
            raise refuse(("tool_choice",), 'tool_choice "required" needs tools')
        if isinstance(self.tool_choice, NamedChoice):
            name = self.tool_choice.function.name
            if not any(t.function.name == name for t in self.tools or ()):
                raise refuse(("tool_choice",), f"tool_choice names function {name!r}, which is not in tools")
        _check_format(self.response_format)
        if self.top_logprobs and not self.logprobs:
            raise refuse(("top_logprobs",), "top_logprobs needs logprobs: true")
        if self.tool_mode in ("required", "function") and self.grammar() is not None:
            raise refuse(("response_format",), "a forced tool call (tool_choice required or a function) and a "
                                               "response_format cannot both shape one answer")
        return self

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "function" (a named one). Absent: "auto" with tools, "none" without
        (OpenAI's defaults); "none" and "auto" need no tools (clients send them always)."""
        c = self.tool_choice
        if c is None:
            return "auto" if self.tools else "none"
        return "function" if isinstance(c, NamedChoice) else c

    @property
    def forced_function(self) -> Optional[str]:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedChoice) else None

    def asked_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def alternatives(self) -> int:
        """Log-probability alternatives per token, -1: none (logprobs true, and top_logprobs of them)."""
        return (self.top_logprobs or 0) if self.logprobs else -1

    def template_messages(self) -> list[dict]:
        return for_template(self.messages)

    def template_tools(self) -> Optional[list[dict]]:
        return None if self.tools is None else [t.as_template() for t in self.tools]


REQUESTS: dict[str, type[_Refused]] = {"completion": CompletionRequest, "chat": ChatRequest}  # by route kind


def _where(loc: list) -> str:
    """``messages[2].tool_calls[0].function.name`` of a pydantic path (the kind of message left out)."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else str(p)
    return out


def parse(model: type[Request], body: dict) -> Request:
    """The body as ``model``, or a 400 naming the field of the first thing wrong (``param``: the body's field)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [p for p in err.get("loc", ()) if p not in TAGS]
        where = _where(loc)
        if err["type"] == SAID:
            text = err["msg"].replace("{where}", where)
        elif err["type"] == "missing":
            text = f"{where} is required"
        else:
            text = f"{where or 'the body'}: {err.get('msg', 'invalid value')}"
        raise ApiError(400, text, param=str(loc[0]) if loc else None) from None
