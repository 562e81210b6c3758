"""OpenAI requests (requests.py's models, one per route) turned into ApiRequests (requestqueue.py) whose
tokenization runs next, on the request's HTTP thread (admission.py ``Preparer``): what the served model and the plan
allow a request (its context, its vocabulary, the operator's limits and defaults), refused with a 4xx before it
reaches the ranks."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading

from clusterctl.rank.engine.requestqueue import ApiRequest, Echo, Prepared
from clusterctl.rank.choices import DEFAULT_MAX_N
from clusterctl.rank.engine.generation import GenRequest
from clusterctl.rank.api.requests import ChatRequest, CompletionRequest
from clusterctl.rank.api.wire import ApiError
from clusterctl.protocol.rankspec import RankSpec
from clusterctl.rank.api import tools as tl

BANNED = -1e9  # the logit bias of a token the request may never get (finite: it travels as JSON)


def _reasoned(tokenizer, response_format: dict, tokens: list[int]) -> dict:
    """The grammar of a response_format on this model: the JSON after a reasoning block when the model reasons in
    one (mandatory when the prompt opened it, so that the answer is the content, not the reasoning), else the JSON
    alone."""
    if not tokenizer.has_thinking:
        return {"response_format": response_format}
    from clusterctl.rank.grammar.mask import json_schema  # grammar.py loads MLX and numpy; this module neither

    try:
        lark = tl.reasoned_json(tokenizer, json_schema(response_format), tl.initial_state(tokenizer, tokens))
    except ValueError as e:
        raise ApiError(400, str(e), param="response_format") from None
    return {"response_format": response_format} if lark is None else {"lark": lark, "response_format": response_format}


# below this temperature a request is served greedy: 1/temperature overflows float32 near 1e-38 and the scaled
# logits become -inf or NaN (random tokens where a near-greedy answer was asked); the argmax is the limit anyway
GREEDY_BELOW = 1e-6


class RequestBuilder:
    """Turns a parsed request (requests.py) into an ApiRequest whose ``prepare`` builds the GenRequest."""

    def __init__(self, spec: RankSpec, limits):
        self.spec = spec
        self.limits = limits  # admission.Limits of the served model and the plan
        self.context = limits.context
        self._count = 0
        self._lock = threading.Lock()

    def build(self, request: CompletionRequest | ChatRequest, tenant: str | None = None) -> ApiRequest:
        return self.chat(request, tenant) if isinstance(request, ChatRequest) else self.completion(request, tenant)

    def _seed(self, r: CompletionRequest | ChatRequest) -> int:
        if r.seed is not None:
            return r.seed + (1 << 64) if r.seed < 0 else r.seed  # one-to-one onto MLX's unsigned 64-bit seeds
        with self._lock:
            self._count += 1
            return (self.spec.seed * 1_000_003 + self._count) & 0x7FFFFFFF

    @staticmethod
    def _partition(r: CompletionRequest | ChatRequest, tenant: str | None) -> str:
        """The prompt-cache partition of a request: its caller's tenant and its cache_salt (promptcache.py)."""
        ident = json.dumps([tenant or "", r.cache_salt]).encode("utf-8", "surrogatepass")
        return hashlib.sha256(ident).hexdigest()[:32]

    def _n(self, r: CompletionRequest | ChatRequest) -> int:
        """How many choices (OpenAI's ``n``): 1 to the operator's limit (plan --max-n, else DEFAULT_MAX_N)."""
        limit = self.spec.serving.max_n or DEFAULT_MAX_N
        if r.n is not None and not 1 <= r.n <= limit:
            raise ApiError(400, f"n must be between 1 and {limit} on this deployment", param="n")
        return r.n or 1

    def _max_tokens(self, r: CompletionRequest | ChatRequest) -> int | None:
        """The request's max_tokens, else the operator's default, else None: until the context is full (a default
        is cut to what the prompt leaves: ``_request``)."""
        asked = r.asked_max_tokens()
        default = self.spec.serving.max_tokens or self.spec.max_tokens_default
        max_tokens = asked if asked is not None else default
        if max_tokens is not None and max_tokens >= self.context:  # a prompt holds one token at least
            if asked is None:
                return None  # the operator's default is past this plan's context: until it is full
            raise ApiError(400, f"{_budget_field(r)} ({max_tokens}) leaves no room for a prompt in "
                                f"{self.limits.describe()}", param=_budget_field(r), code="context_length_exceeded")
        return max_tokens

    def _common(self, r: CompletionRequest | ChatRequest, tenant: str | None = None) -> dict:
        """The GenRequest's settings both routes share: the request's, else the operator's defaults, else OpenAI's."""
        d = self.spec.serving
        temperature = r.temperature if r.temperature is not None else (
            1.0 if d.temperature is None else d.temperature)
        top_k = r.top_k if r.top_k is not None else (d.top_k or 0)
        for k in ("repetition", "presence", "frequency"):
            size = getattr(r, f"{k}_context_size")
            if size is not None and size > self.context:
                raise ApiError(400, f"{k}_context_size must be between 1 and {self.context}",
                               param=f"{k}_context_size")
        return dict(
            max_tokens=self._max_tokens(r),
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=r.top_p if r.top_p is not None else (1.0 if d.top_p is None else d.top_p),
            top_k=0 if top_k >= self.limits.vocab else top_k,  # k at or past the vocabulary keeps every token
            min_p=r.min_p if r.min_p is not None else (d.min_p or 0.0),
            repetition_penalty=r.repetition_penalty,
            presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            **{f"{k}_context_size": getattr(r, f"{k}_context_size") or 20 for k in ("repetition", "presence",
                                                                                     "frequency")},
            logit_bias=self._logit_bias(r),
            seed=self._seed(r),
            stop=r.stops(),
            partition=self._partition(r, tenant),
            grammar=r.grammar(),
            logprobs=r.alternatives(),
        )

    def _logit_bias(self, r: CompletionRequest | ChatRequest) -> dict[str, float] | None:
        """OpenAI's logit_bias: token id (a string, as JSON keys are) -> a bias in [-100, 100], at most 300."""
        out = {}
        for k, v in (r.logit_bias or {}).items():
            if not (k.isascii() and k.isdigit() and int(k) < self.limits.vocab):
                raise ApiError(400, f"logit_bias: {k[:20]!r} is not a token id of this model (0 to "
                                    f"{self.limits.vocab - 1})", param="logit_bias")
            out[str(int(k))] = float(v)
        return out or None

    def _request(self, rid: str, tokens: list[int], params: dict, r: CompletionRequest | ChatRequest) -> GenRequest:
        """The request to generate: max_tokens resolved (none sent: the operator's default or until the context is
        full, at most what the prompt leaves) and checked against what ``r`` sent (its grammar is compiled next, off
        the preparer's lock: Api.admit, compiler.py)."""
        self._check_len(tokens, r)
        room = self.context - len(tokens)
        max_tokens = params["max_tokens"] if r.asked_max_tokens() is not None else min(params["max_tokens"] or room,
                                                                                        room)
        return GenRequest(id=rid, tokens=list(map(int, tokens)), **{**params, "max_tokens": max_tokens})

    def _check_len(self, tokens: list[int], r: CompletionRequest | ChatRequest) -> None:
        """The prompt against the context, in the terms the client sent: max_tokens 0 with echo scores the prompt
        (the one token made inside is dropped and never kept: it needs no room); no max_tokens needs room for one."""
        if not tokens:
            raise ApiError(400, "the prompt is empty")
        room, n = self.context - len(tokens), len(tokens)
        if getattr(r, "score_only", False):
            if room < 0:
                raise ApiError(400, f"prompt ({n} tokens) exceeds {self.limits.describe()}: max_tokens 0 scores a "
                                    f"prompt that fits it", code="context_length_exceeded")
        elif r.asked_max_tokens() is None:
            if room < 1:
                raise ApiError(400, f"prompt ({n} tokens) leaves no room for a completion in "
                                    f"{self.limits.describe()}", code="context_length_exceeded")
        elif r.asked_max_tokens() > room:
            raise ApiError(400, f"prompt ({n} tokens) plus {_budget_field(r)} ({r.asked_max_tokens()}) exceeds "
                                f"{self.limits.describe()}", code="context_length_exceeded")

    def _check_bytes(self, n: int) -> None:
        """Before any tokenizing: a prompt of more bytes than the context can hold tokens is refused unread."""
        if n > self.limits.prompt_bytes:
            raise ApiError(400, f"the prompt ({n} bytes) cannot fit {self.limits.describe()} (no token of this "
                                f"model stands for more than {self.limits.token_bytes} bytes)",
                           code="context_length_exceeded")

    def completion(self, request: CompletionRequest, tenant: str | None = None) -> ApiRequest:
        """A prompt as text (tokenized by ``prepare``) or token ids (inside the vocabulary and the context)."""
        prompt = request.prompt
        params = self._common(request, tenant)
        # echo with logprobs: the prompt's tokens are scored too (promptlogprobs.py), as many alternatives each
        params["prompt_logprobs"] = params["logprobs"] if request.echo else -1
        if isinstance(prompt, str):
            self._check_bytes(len(prompt.encode("utf-8", "surrogatepass")))
        else:
            self._check_len(prompt, request)
            if any(t < 0 or t >= self.limits.vocab for t in prompt):
                raise ApiError(400, "prompt has a token id outside the vocabulary", param="prompt")
        rid = "cmpl-" + secrets.token_hex(12)

        def prepare(tokenizer) -> Prepared:
            if isinstance(prompt, str):
                add = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
                tokens = tokenizer.encode(prompt, add_special_tokens=add)
            else:
                tokens = list(prompt)
            echo = None
            if request.echo:
                echo = Echo(text=prompt if isinstance(prompt, str) else tokenizer.decode(tokens),
                            score_only=request.score_only)
            return Prepared(self._request(rid, tokens, params, request), echo=echo)

        return ApiRequest(id=rid, kind="completion", prepare=prepare, stream=bool(request.stream),
                          n=self._n(request))

    def chat(self, request: ChatRequest, tenant: str | None = None) -> ApiRequest:
        """Messages (with tool calls and tool results), tools and tool_choice, the template's arguments: rendered
        and tokenized by ``prepare`` on the request's HTTP thread (tools.py)."""
        chat = tl.ChatTools.of(request)
        params = self._common(request, tenant)
        self._check_bytes(sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8", "surrogatepass"))
                              for m in chat.messages))
        defaults = self.spec.serving.chat_template_args
        rid = "chatcmpl-" + secrets.token_hex(12)

        def prepare(tokenizer) -> Prepared:
            if not getattr(tokenizer, "has_chat_template", True):
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            # rendered, then measured, then tokenized (what tokenize=True does in one call): a template can make
            # far more text than the messages hold, and tokenizing it is the slow part
            try:
                text = tl.render(tokenizer, chat, defaults)
            except tl.ToolsError as e:
                raise ApiError(400, str(e), param=e.param) from None
            self._check_bytes(len(text.encode("utf-8", "surrogatepass")))
            tokens = tokenizer.encode(text, add_special_tokens=False)
            shaped = {**params, "grammar": _chat_grammar(tokenizer, chat, tokens, params["grammar"])}
            banned = tl.banned_token_ids(tokenizer, chat)  # tool_choice "none": the call's opening token
            if banned:
                shaped["logit_bias"] = {**(params["logit_bias"] or {}), **{str(t): BANNED for t in banned}}
            gen = self._request(rid, tokens, shaped, request)
            return Prepared(gen, splitters=lambda: chat.splitter(tokenizer, gen.tokens))  # one per choice

        return ApiRequest(id=rid, kind="chat", prepare=prepare, stream=bool(request.stream), n=self._n(request))


def _budget_field(r: CompletionRequest | ChatRequest) -> str:
    """The name of the field that set the request's budget, as the client sent it (chat: either name)."""
    return "max_completion_tokens" if getattr(r, "max_completion_tokens", None) is not None else "max_tokens"


def _chat_grammar(tokenizer, chat: "tl.ChatTools", tokens: list[int], grammar: dict | None) -> dict | None:
    """A chat request's grammar on this model: a forced call's (tool_choice required or a function), else its
    response_format's (after the reasoning, when the model reasons), else, under tool_choice "none" with tools,
    any text without call markup (tools.no_call_lark); None: free text."""
    try:
        forced = chat.constraint(tokenizer, tokens)
    except tl.ToolsError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if forced is not None:
        return {"lark": forced.lark()}
    if grammar is not None:
        return _reasoned(tokenizer, grammar["response_format"], tokens)
    text = tl.no_call_lark(tokenizer, chat)
    return None if text is None else {"lark": text}
