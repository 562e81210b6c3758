"""Sampling on the last stage of an overlapped pipeline: one random stream per request.

mlx-lm's samplers draw from MLX's global random state, so a request's tokens at temperature > 0 depend on who
else was sampled before it in the same batch. Here each request owns a key, made from its seed and split once
per token, so a request with a ``seed`` gives the same tokens whatever else is in the batch. The filters (top-p,
min-p, top-k, in mlx-lm's order) and the logits processors (repetition penalty) are mlx-lm's own.

A request's values are checked against the model at admission (openai.py), but no value may ever end a rank:
a filter or processor that raises while its row's graph is built makes that row fall back to the argmax and
marks the request failed (``failed``), and the batch ends that request alone with an error. The fallback is the
same on every rank (the same inputs raise the same way), so the ranks stay in step.
"""

from __future__ import annotations

import mlx.core as mx

from clusterctl.rank.engine.generation import GenRequest
from clusterctl.rank.grammar.mask import ROLLOUT_SECONDS


class GrammarMask:
    """A request's structured output (grammar/mask.py) as a logits processor: tokens the grammar does not allow now
    get -inf. Called once per sampled token (mlx-lm's batch and ``RowSampler`` alike): from the second call on,
    the newest token of ``tokens`` is the one sampled last, which the grammar consumes first (the last one:
    ``finish``). On the ranks of a lockstep pipeline every rank runs it and gets the same mask (the grammar is
    deterministic). Where the budget forces a token to close the answer, the model's own choice under the
    grammar's mask (an argmax, read once the step's logits are computed) tells the grammar whether the budget
    cut anything (Constraint.advance)."""

    def __init__(self, constraint):
        self.c = constraint
        self._started = False
        self._preferred: mx.array | None = None  # the model's own choice at a closing step, not read yet

    @property
    def closed_by_budget(self) -> bool:
        """The grammar forced its answer to an end to fit max_tokens (generation.Seq reads it: finish "length")."""
        return self.c.closed_by_budget

    def _consume(self, token: int) -> None:
        preferred, self._preferred = self._preferred, None
        self.c.advance(token, None if preferred is None else int(preferred.item()))

    def finish(self, last: int | None, finish: str) -> str:
        """The finish reason of the row the schedule ended with ``finish`` after sampling ``last`` (EOS included;
        None: nothing sampled): the grammar consumes it, then decides (Constraint.finish)."""
        if self._started and last is not None:
            self._started = False
            try:
                self._consume(last)
            except RuntimeError:  # a token the mask did not allow (a sampling failure's argmax): no say
                return finish
        return self.c.finish(finish)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            self._consume(int(tokens[-1].item()))
        self._started = True
        mask = self.c.mask()
        width = logits.shape[-1]
        if mask.shape[0] < width:  # ids past the tokenizer's own (a padded head) are never allowed
            mask = mx.concatenate([mask, mx.zeros((width - mask.shape[0],), dtype=mx.bool_)])
        if self.c.closing is not None:
            own = self.c.own_mask()
            if own.shape[0] < width:
                own = mx.concatenate([own, mx.zeros((width - own.shape[0],), dtype=mx.bool_)])
            self._preferred = mx.argmax(mx.where(own[:width], logits, mx.array(-mx.inf, dtype=logits.dtype)),
                                        axis=-1)
        return mx.where(mask[:width], logits, mx.array(-mx.inf, dtype=logits.dtype))


def processors(req: GenRequest, grammar=None) -> list:
    """mlx-lm's logits processors for a request's logit_bias and penalties, and its grammar last (none when it
    asks for none). ``grammar``: its constraint, compiled off the step loop (compiler.py), or the exception its
    compile raised; never compiled here."""
    procs = _bias_and_penalties(req)
    if req.grammar is not None:
        if grammar is None or isinstance(grammar, BaseException):
            def refuse(tokens, logits, why=failure(grammar or RuntimeError("the grammar was not compiled"))):
                raise ValueError(why)

            return [*procs, refuse]
        procs.append(GrammarMask(grammar))
    return procs


def _bias_and_penalties(req: GenRequest) -> list:
    from mlx_lm.sample_utils import make_logits_processors

    rep = req.repetition_penalty if req.repetition_penalty not in (None, 1.0) else None
    return make_logits_processors(
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        repetition_penalty=rep, repetition_context_size=req.repetition_context_size,
        presence_penalty=req.presence_penalty or None, presence_context_size=req.presence_context_size,
        frequency_penalty=req.frequency_penalty or None, frequency_context_size=req.frequency_context_size)


class RowSampler:
    """How one request's next token is chosen from its logits."""

    failed: str | None = None  # why this request's sampling failed (the row then took the argmax)
    logprobs: mx.array | None = None  # the last step's log-softmax after the processors (wants_logprobs)

    def __init__(self, req: GenRequest, grammar=None):
        """``grammar``: the request's constraint as ``processors`` takes it."""
        self.temp = float(req.temperature)
        self.filters = _filters(req)
        if grammar is not None and not isinstance(grammar, BaseException):
            grammar.seconds = ROLLOUT_SECONDS  # rank 0 alone samples: its roll-outs may be bounded in time too
        self.procs = processors(req, grammar)
        self.history = list(req.tokens) if self.procs else None  # what the processors look back on
        self.key = mx.random.key(req.seed) if self.temp > 0 else None
        self.wants_logprobs = req.logprobs >= 0

    @property
    def plain_greedy(self) -> bool:
        return self.temp == 0 and not self.procs and not self.wants_logprobs

    def __call__(self, logits: mx.array) -> mx.array:
        """``logits`` of shape (1, vocab) -> the token, shape (1,)."""
        try:
            return self._sample(logits)
        except Exception as e:  # the request's values, not the rank's state: this row alone fails
            self.failed = failure(e)
            self.logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return mx.argmax(logits, axis=-1)

    def _sample(self, logits: mx.array) -> mx.array:
        if self.procs:
            context = mx.array(self.history)
            for proc in self.procs:
                logits = proc(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.wants_logprobs:
            self.logprobs = logprobs
        if self.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        for f in self.filters:
            logprobs = f(logprobs)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=sub)

    def took(self, token: int) -> None:
        if self.history is not None:
            self.history.append(token)


def _filters(req: GenRequest) -> list:
    """mlx-lm's filters of a request's logprobs (top-p, min-p, top-k), in mlx-lm's order."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    out = []
    if 0 < req.top_p < 1.0:
        out.append(lambda x, p=req.top_p: apply_top_p(x, p))
    if req.min_p != 0.0:
        out.append(lambda x, p=req.min_p: apply_min_p(x, p, 1))
    if req.top_k > 0:
        out.append(lambda x, k=req.top_k: apply_top_k(x, k))
    return out


class KeyedSampler:
    """A sampled (temperature > 0) row of the lockstep batch drawn as ``RowSampler`` draws: from its own key, made
    from its seed and split once per token, so its tokens do not depend on the other rows (mlx-lm's samplers share
    one global random state). Every lockstep rank makes the same draws from the same keys."""

    def __init__(self, req: GenRequest):
        self.scale = 1.0 / float(req.temperature)
        self.filters = _filters(req)
        self.key = mx.random.key(req.seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        for f in self.filters:
            logprobs = f(logprobs)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * self.scale, key=sub)


def failure(e: Exception) -> str:
    """One line saying why a request's sampling failed."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"sampling failed for this request: {type(e).__name__}{': ' + text if text else ''}"[:300]


def _reseed_from(state: list) -> None:
    """The global random state, usable again after a compiled sampler raised: seeded from ``state``'s key (taken
    before the call), or from 0 when even that cannot be read."""
    try:
        mx.eval(mx.random.state)
        return  # still usable
    except RuntimeError:
        pass
    try:
        words = [int(w) for w in state[0].tolist()]
        mx.random.seed((words[0] << 32 | words[-1]) & ((1 << 64) - 1))
    except (RuntimeError, IndexError, TypeError, ValueError):
        mx.random.seed(0)


class Guard:
    """mlx-lm's sampler and logits processors of one request in the lockstep batch (batch.py), guarded like
    ``RowSampler``: what raises falls back (the argmax; the logits unchanged) and ``failed`` says why."""

    def __init__(self, sampler, procs: list):
        self.failed: str | None = None
        self._sampler = sampler
        self.sampler = self._sample
        self.procs = [self._proc(p) for p in procs]

    def _sample(self, logprobs: mx.array) -> mx.array:
        state = list(mx.random.state)
        try:
            return self._sampler(logprobs)
        except Exception as e:
            # mlx-lm's samplers are compiled with the global random state as input and output: one that raises
            # while traced leaves that state an array without a primitive, and every later random draw of this
            # rank would fail (every sampled request after it). Reseed from the state it started from (the same
            # on every lockstep rank, so their draws stay in step).
            _reseed_from(state)
            self.failed = self.failed or failure(e)
            return mx.argmax(logprobs, axis=-1)

    def _proc(self, proc):
        def run(tokens, logits):
            try:
                return proc(tokens, logits)
            except Exception as e:
                self.failed = self.failed or failure(e)
                return logits

        return run


def sample_rows(samplers: list[RowSampler], logits: mx.array) -> mx.array:
    """The next token of every row of ``logits`` (rows, vocab): one argmax when every row is plain greedy."""
    if all(s.plain_greedy for s in samplers):
        return mx.argmax(logits, axis=-1)
    return mx.concatenate([s(logits[i:i + 1]) for i, s in enumerate(samplers)], axis=0)
