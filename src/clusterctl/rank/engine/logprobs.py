"""Log probabilities of the generated tokens (OpenAI's ``logprobs``), made on the sampling rank (rank 0) from the
log-softmax of the step's logits after the request's logits processors — what one mlx-lm process reports — and
handed to the HTTP thread one entry per token.

An entry is OpenAI's chat shape: ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}...]}`` plus the token's ``id``; /v1/completions turns a list of them into its legacy shape
(``completion_shape``). ``token`` is the token's own text (a byte-level token that holds part of a character reads
as U+FFFD there; ``bytes`` are then those of that text, not the raw byte: a known approximation).

Every value is finite: JSON has no ``-Infinity`` (JavaScript's ``JSON.parse`` and Go's ``encoding/json`` refuse
the whole body), so a logprob is at least ``FLOOR`` (OpenAI's), and a token the request's grammar or bans forbid
(-inf after the processors) is never listed as an alternative."""

from __future__ import annotations

FLOOR = -9999.0  # OpenAI's smallest logprob


def finite(lp: float) -> float:
    """``lp`` clamped to FLOOR (-inf and NaN included)."""
    return lp if lp >= FLOOR else FLOOR


class Entries:
    """Makes the entries of one request: ``top`` alternatives per token (0: the chosen token only)."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self._text: dict[int, str] = {}

    def _token(self, tid: int) -> str:
        t = self._text.get(tid)
        if t is None:
            t = self._text[tid] = self.tokenizer.decode([tid])
        return t

    def one(self, tid: int, lp: float) -> dict:
        """The entry of token ``tid`` with log-probability ``lp`` (no alternatives)."""
        t = self._token(tid)
        return {"id": tid, "token": t, "logprob": finite(lp), "bytes": list(t.encode("utf-8", "replace"))}

    def pending(self, logprobs):
        """The lazy arrays an entry needs from a row's log-probabilities (shape (vocab,) or (1, vocab)): built
        into the step's graph, evaluated with its tokens."""
        import mlx.core as mx

        row = logprobs.reshape(-1)
        if self.top <= 0:
            return row, None
        idx = mx.argpartition(-row, kth=self.top - 1)[: self.top]
        return row, (idx, row[idx])

    def entry(self, token: int, pending) -> dict:
        row, top = pending
        e = self.one(token, row[token].item())
        alts = []
        if top is not None:
            idx, vals = top
            # a forbidden token (-inf: the grammar's mask; about -1e9: a ban, openai.BANNED) is no alternative
            alts = sorted(((i, v) for i, v in zip(idx.tolist(), vals.tolist()) if v >= FLOOR),
                          key=lambda p: -p[1])
        e["top_logprobs"] = [self.one(i, v) for i, v in alts]
        return e


def chat_shape(entries: list[dict]) -> dict:
    return {"content": entries}


def completion_shape(entries: list[dict], start: int = 0) -> dict:
    """The legacy /v1/completions shape; ``start``: the text offset of the first entry's token. An echoed prompt's
    first token has no logprob and no alternatives (null, promptlogprobs.py)."""
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None
                             else {a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
