"""Prompt log-probabilities (``echo: true`` with ``logprobs: k`` on /v1/completions, what lm-evaluation-harness's
loglikelihood requests read): each prompt token's log-probability under the tokens before it, and the ``k`` most
likely alternatives, from the logits of the prompt's own chunks.

Where they are computed: the prompt's chunks already run through the model on every schedule (prefill.py on the
overlapped one, mlx-lm's ``PromptProcessingBatch`` on the lockstep one), and their logits are built and dropped
(only the caches are evaluated). Rank 0 runs the model's last blocks and its head (pipeline), or all of them
(tensor), so the chunk's logits are rank 0's own: nothing new travels. Which ranks evaluate them: a graph the
caches do not need may hold collectives (tensor parallel: the last block's all_sum; a lockstep pipeline: the
Gather of a one-column chunk), so on the lockstep schedule every rank evaluates the same scoring graph at the same
point (every rank knows the request asks: ``GenRequest.prompt_logprobs``) wherever it holds one, and only rank 0
reports; on the overlapped one only rank 0 (the last stage; its chunks end in no collective).

The values: the log-softmax of a position's logits in float32 (logsumexp in float32, whatever the model's dtype),
before any logits processor (bias, penalties, grammar: those shape sampling, not the prompt's likelihood), as one
mlx-lm process scoring the same tokens gives. The first token has none (null), as OpenAI's legacy API and vLLM
answer. The prompt's last token is the input of the first generation step: its logits score the first generated
token, not a prompt token, so the prefill (every token but the last, as mlx-lm feeds it) covers them all.

Entries are logprobs.py's, handed to rank 0's HTTP thread one per prompt token before any generated token's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from clusterctl.rank.engine.logprobs import FLOOR, Entries

if TYPE_CHECKING:
    import mlx.core as mx


class PromptScorer:
    """One request's prompt scored as its chunks go by; ``emit`` None: this rank evaluates (for the collectives)
    but does not report."""

    def __init__(self, tokens: list[int], top: int, entries: Entries | None, emit: Callable[[dict], None] | None):
        self.tokens, self.top = tokens, top
        self.entries, self.emit = entries, emit
        if emit is not None:
            emit(self._first())

    def _first(self) -> dict:
        e = self.entries.one(self.tokens[0], 0.0)
        e["logprob"], e["top_logprobs"] = None, None
        return e

    def pending(self, logits: mx.array, start: int) -> tuple:
        """The lazy arrays of one row's chunk: ``logits`` (positions, vocab) of input positions ``start``...,
        scoring the tokens after each."""
        import mlx.core as mx  # (the rank loads mlx once its environment is final: runtime.py)
        n = logits.shape[0]
        x = logits.astype(mx.float32)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        targets = mx.array(self.tokens[start + 1:start + 1 + n])[:, None]
        chosen = mx.take_along_axis(lp, targets, axis=-1)[:, 0]
        if self.top <= 0:
            return start, chosen, None, None
        if self.top == 1:  # lm-eval's ask: the argmax alone (no partition of the vocabulary)
            idx = mx.argmax(lp, axis=-1, keepdims=True)
        else:
            idx = mx.argpartition(-lp, kth=self.top - 1, axis=-1)[:, : self.top]
        return start, chosen, idx, mx.take_along_axis(lp, idx, axis=-1)

    def report(self, start: int, chosen: mx.array, idx, vals) -> None:
        """The chunk's entries, evaluated, to rank 0's HTTP thread."""
        if self.emit is None:
            return
        chosen = chosen.tolist()
        idx, vals = (idx.tolist(), vals.tolist()) if idx is not None else (None, None)
        for j, v in enumerate(chosen):
            e = self.entries.one(self.tokens[start + 1 + j], v)
            alts = [] if idx is None else sorted(((i, a) for i, a in zip(idx[j], vals[j]) if a >= FLOOR),
                                                 key=lambda p: -p[1])
            e["top_logprobs"] = [self.entries.one(i, a) for i, a in alts]
            self.emit(e)


@dataclass(frozen=True)
class RowChunk:
    """One row of a prompt chunk: its scorer (None: the row does not ask), the input position of its first
    column, and its real columns (the rest is padding)."""

    scorer: PromptScorer | None
    start: int
    count: int


def score(logits: mx.array, rows: list[RowChunk]) -> None:
    """Every asking row's part of a chunk's logits (batch, columns, vocab): built, evaluated at once, reported."""
    import mlx.core as mx  # (the rank loads mlx once its environment is final: runtime.py)
    work = [(r.scorer, r.scorer.pending(logits[i, : r.count], r.start)) for i, r in enumerate(rows)
            if r.scorer is not None and r.count > 0]
    if not work:
        return
    mx.eval([a for _, p in work for a in p[1:] if a is not None])
    for scorer, p in work:
        scorer.report(*p)


def tap_prompt_batch(gen, scorers: dict[int, PromptScorer], *, pipeline: bool = False) -> None:
    """Score the lockstep schedule's prompt chunks: mlx-lm's ``BatchGenerator`` processes them in its one
    ``PromptProcessingBatch`` (``_prompt_batch``, made once and changed in place), whose ``prompt`` runs the model
    on each row's next columns and drops the logits. Its ``prompt`` is wrapped on that object (the copies it
    splits off for generation are made without it): before, each row's first position (the tokens its cache
    holds) and its columns; during, the model's outputs kept; after, the asking rows scored (``scorers``, by the
    generator's uid). No row asking: mlx-lm's own call, untouched. ``pipeline`` (a split model): a rank that
    reports nothing (not rank 0) evaluates only a one-column chunk, the one whose graph ends in the Gather's
    all_sum (stage.py); a wider chunk's head on a stage that is not the last would be work for nothing."""
    pb = gen._prompt_batch
    original = pb.prompt

    def prompt(tokens):
        import mlx.core as mx  # (the rank loads mlx once its environment is final: runtime.py)

        rows = [(scorers.get(uid), len(pb.tokens[i]), len(t)) for i, (uid, t) in enumerate(zip(pb.uids, tokens))]
        asking = [s for s, _, _ in rows if s is not None]
        if not asking or (pipeline and max(map(len, tokens)) > 1 and all(s.emit is None for s in asking)):
            return original(tokens)
        model, outs = pb.model, []

        def kept(*args, **kwargs):
            outs.append(model(*args, **kwargs))
            return outs[-1]

        pb.model = kept
        try:
            original(tokens)
        finally:
            pb.model = model
        logits = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        score(logits, [RowChunk(s, start, n) for s, start, n in rows])

    pb.prompt = prompt
