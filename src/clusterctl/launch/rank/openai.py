"""OpenAI request bodies (/v1/completions, /v1/chat/completions) checked and turned into Jobs whose tokenization
runs later in the step loop, and OpenAI's error shape (``ApiError``): what a client may ask, refused with a 4xx
before it reaches the ranks."""

from __future__ import annotations

import math
import secrets
import threading

from clusterctl.launch.rank.jobs import Job
from clusterctl.launch.rank.pipeline import GenRequest
from clusterctl.launch.rankspec import RankSpec

MAX_STOPS = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _num(body: dict, name: str, default, lo=None, hi=None, kind=float):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
            or (isinstance(v, float) and not math.isfinite(v)):
        raise ApiError(400, f"{name} must be a{'n integer' if kind is int else ' finite number'}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"{name} must be between {lo} and {hi}", param=name)
    return kind(v)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    return [s for s in stop if s]


class RequestBuilder:
    """Turns an OpenAI request body into a Job whose ``prepare`` builds the GenRequest."""

    def __init__(self, spec: RankSpec, context: int):
        self.spec = spec
        self.context = context
        self._count = 0
        self._lock = threading.Lock()

    def _seed(self, body: dict) -> int:
        if body.get("seed") is not None:
            return _num(body, "seed", 0, kind=int) & 0x7FFFFFFF
        with self._lock:
            self._count += 1
            return (self.spec.seed * 1_000_003 + self._count) & 0x7FFFFFFF

    def _common(self, body: dict, max_key: str) -> dict:
        if body.get("n", 1) not in (1, None):
            raise ApiError(400, "only n=1 is supported", param="n")
        if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        max_tokens = body.get(max_key, body.get("max_tokens"))
        return dict(
            max_tokens=_num({"max_tokens": max_tokens}, "max_tokens", self.spec.max_tokens_default, 1,
                            self.context, kind=int),
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0),
            top_k=_num(body, "top_k", 0, 0, 1 << 20, kind=int),
            min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
            repetition_penalty=(_num(body, "repetition_penalty", 1.0, 0.0, 10.0)
                                if body.get("repetition_penalty") is not None else None),
            seed=self._seed(body),
            stop=_stops(body),
        )

    def _check_len(self, tokens: list[int], max_tokens: int) -> None:
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        if len(tokens) + max_tokens > self.context:
            raise ApiError(400, f"prompt ({len(tokens)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context of {self.context} tokens", code="context_length_exceeded")

    def completion(self, body: dict) -> Job:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        elif not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        params = self._common(body, "max_tokens")
        job_id = "cmpl-" + secrets.token_hex(12)

        def prepare(tokenizer) -> GenRequest:
            if isinstance(prompt, str):
                add = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
                tokens = tokenizer.encode(prompt, add_special_tokens=add)
            else:
                vocab = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else None
                if vocab and any(t < 0 or t >= max(vocab, 1) for t in prompt):
                    raise ApiError(400, "prompt has a token id outside the vocabulary", param="prompt")
                tokens = list(prompt)
            self._check_len(tokens, params["max_tokens"])
            return GenRequest(id=job_id, tokens=list(map(int, tokens)), **params)

        return Job(id=job_id, kind="completion", prepare=prepare, stream=bool(body.get("stream")))

    def chat(self, body: dict) -> Job:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a role", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(texts)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, "message content must be a string", param="messages")
            clean.append({"role": m["role"], "content": content})
        params = self._common(body, "max_completion_tokens")
        job_id = "chatcmpl-" + secrets.token_hex(12)

        def prepare(tokenizer) -> GenRequest:
            if not getattr(tokenizer, "has_chat_template", True):
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            tokens = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
            self._check_len(tokens, params["max_tokens"])
            return GenRequest(id=job_id, tokens=list(map(int, tokens)), **params)

        return Job(id=job_id, kind="chat", prepare=prepare, stream=bool(body.get("stream")))


def context_length(config: dict) -> int:
    v = config.get("max_position_embeddings")
    return int(v) if isinstance(v, int) and v > 0 else 4096
