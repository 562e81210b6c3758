"""OpenAI's request and response bodies for rank 0, as typed models: every field the API reads, with its type and
its bounds, in one place (docs/api.md lists them for clients).

Requests: ``CompletionBody`` and ``ChatBody`` validate strictly (no string for a number, no boolean for an
integer, finite numbers only) and allow fields they do not name, as OpenAI-compatible servers do (clients send
``user``, ``metadata``, ``store``...); fields that would change the answer but cannot be honoured are refused by
name in openai.py (``UNSUPPORTED``), never ignored. What depends on the model or the plan (the vocabulary, the
context) is checked by ``RequestBuilder``; tools and messages in depth by tools.py. ``parse`` turns a validation
error into one 400 naming the field.

Responses: ``Completion``, ``ChatCompletion`` and their stream chunks, dumped with ``body()``: the same keys a
client of OpenAI reads (``logprobs`` and ``finish_reason`` present as null; ``usage`` only where OpenAI puts it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


MAX_STOPS = 4
MAX_SALT = 1024  # characters of a cache_salt
MAX_BIAS = 300  # entries of a logit_bias, as OpenAI allows
MAX_TOP = 20  # top_logprobs, as OpenAI allows
MAX_TOKENS = 1 << 40
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # OpenAI's seed: a signed 64-bit integer

Body = TypeVar("Body", bound="_Common")


class ApiError(Exception):
    """A request that ends in an HTTP error, in OpenAI's shape (``body``); handler.py's ``error`` is the one place
    it becomes an answer (status, Retry-After, WWW-Authenticate, Connection)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


UNAUTHORIZED = ApiError(401, "invalid or missing API key", code="invalid_api_key")  # (the handler's and the routes')


class _Common(BaseModel):
    """What both routes take."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

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
    stop: Any = None  # a string or up to 4 (``stops``)
    n: Optional[int] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_SALT)  # vLLM's: a prompt-cache partition
    response_format: Optional[dict[str, Any]] = None
    return_token_ids: Optional[bool] = None  # an extension: the choice's token ids
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    user: Optional[str] = None

    def stops(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            return []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
            raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
        return [s for s in stop if s]


class CompletionBody(_Common):
    """/v1/completions. ``logprobs`` is the legacy integer: that many alternatives per token (with ``echo``, per
    prompt token too)."""

    prompt: Any = None  # a string or token ids (RequestBuilder.completion)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    echo: Optional[bool] = None  # the prompt's text (and, with logprobs, its tokens' log-probabilities) first
    max_tokens: Optional[int] = Field(None, ge=0, le=MAX_TOKENS)  # 0: with echo, score the prompt only


class ChatBody(_Common):
    """/v1/chat/completions. Messages, tools and the template's arguments in depth: tools.py."""

    messages: Any = None  # tools.py
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: Optional[bool] = None
    tools: Any = None  # tools.py
    tool_choice: Any = None  # tools.py
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Any = None  # tools.py


def parse(model: type[Body], body: dict) -> Body:
    """The body as ``model``, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = loc[0] if loc else None
        where = ".".join(loc) or "the body"
        raise ApiError(400, f"{where}: {err.get('msg', 'invalid value')}", param=param) from None


# -- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details={"cached_tokens": cached_tokens})


class _Choice(BaseModel):
    model_config = ConfigDict(extra="allow")  # token_ids (return_token_ids)

    index: int = 0
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatChoice(_Choice):
    message: dict[str, Any]


class ChatDelta(_Choice):
    delta: dict[str, Any]


class TextChoice(_Choice):
    text: str


class _Answer(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    usage: Optional[Usage] = None

    def body(self) -> dict:
        """The JSON document. ``usage`` is there when it was given, even as null (a stream's chunks carry
        ``"usage": null`` when the client asked for usage, and no key otherwise)."""
        return self.model_dump(exclude=None if "usage" in self.model_fields_set else {"usage"})


class ChatCompletion(_Answer):
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    choices: list[Union[ChatChoice, ChatDelta]]


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


