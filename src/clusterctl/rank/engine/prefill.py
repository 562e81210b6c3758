"""A group of prompts processed in chunks, over one or more slots of an overlapped micro-batch (overlap.py).

mlx-lm's ``PromptProcessingBatch.prompt`` processes a batch of prompts in one call: it right-pads them to the
longest, runs a forward pass per ``prefill_step_size`` columns (evaluating only the caches) and rolls the padding to
the left at the end. Here the same steps are split so that a slot can process part of a prompt and the next slot
the rest (``scheduler.prefill_plan`` says how much): the caches are mlx-lm's own batch caches of every family (KV,
rotating windows, linear-attention state), fed chunk after chunk as mlx-lm feeds them. Each chunk's hidden state
is sent on by the stage's last block as soon as it is evaluated (``stage.Send``), so the next stage works on chunk
c while this one computes chunk c + 1: a long prompt's chunks flow through the pipeline like micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from clusterctl.rank.engine.promptlogprobs import RowChunk, score
from clusterctl.rank.engine.scheduler import PREFILL_CHUNK, prefill_chunk


@dataclass
class Prefill:
    """A group of prompts under way; ``rows`` are overlap.py's rows (``req``, ``prefix``, ``id``, ``scorer``)."""

    rows: list
    cache: list  # mlx-lm's batch caches of the group (the prompt cache's prefixes merged in)
    tokens: mx.array | None  # the prompts' columns not processed yet, right-padded (None: none left)
    padded: bool  # the prompts differ in length: the caches roll the padding to the left when done
    gone: set[str] = field(default_factory=set)  # rows dropped meanwhile (cancelled): left out when done
    starts: list[int] = field(default_factory=list)  # each row's first position here (the cache gave the others)
    lengths: list[int] = field(default_factory=list)  # each row's columns here (the rest of its row is padding)
    done: int = 0  # columns processed
    chunk: int = PREFILL_CHUNK  # columns per forward pass (``scheduler.prefill_chunk``: smaller for a short prompt)

    @property
    def left(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    @classmethod
    def start(cls, model, rows: list, reused: Callable[[object], int], stages: int = 1) -> "Prefill":
        """The group's caches (each row's prompt-cache prefix, ``reused(row)`` tokens of it, or empty ones) merged
        into batch caches, and the prompts' remaining tokens (all but the last: the first step's input, as in
        mlx-lm) right-padded to the longest, to be processed in chunks that fill a pipeline of ``stages``."""
        from mlx_lm.generate import _merge_caches, _right_pad_prompts
        from mlx_lm.models.cache import make_prompt_cache

        skip = [reused(r) for r in rows]
        cache = _merge_caches([r.prefix if r.prefix is not None else make_prompt_cache(model) for r in rows])
        for r in rows:
            r.prefix = None
        prompts = [list(r.req.tokens[n:-1]) for r, n in zip(rows, skip)]
        lengths = [len(t) for t in prompts]
        padding = [max(lengths) - n for n in lengths]
        tokens = None
        if max(lengths) > 0:
            tokens = _right_pad_prompts(prompts, max_length=max(lengths))
            if max(padding) > 0:
                for c in cache:
                    c.prepare(lengths=lengths, right_padding=padding)
        return cls(rows=rows, cache=cache, tokens=tokens, padded=max(padding) > 0, starts=skip, lengths=lengths,
                   chunk=prefill_chunk(max(lengths), stages, PREFILL_CHUNK))

    def advance(self, model, cols: int) -> None:
        """Up to ``cols`` more columns, ``chunk`` per forward pass (only the caches are evaluated: a chunk's
        logits are not, unless a row asks for its prompt's log-probabilities: promptlogprobs.py)."""
        while cols > 0 and self.left:
            n = min(self.chunk, cols, self.left)
            logits = model(self.tokens[:, :n], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            if any(r.scorer is not None for r in self.rows):
                score(logits, [RowChunk(r.scorer, start + self.done, max(0, min(n, length - self.done)))
                               for r, start, length in zip(self.rows, self.starts, self.lengths)])
            self.done += n
            mx.clear_cache()
            self.tokens = self.tokens[:, n:] if n < self.left else None
            cols -= n

    def forget(self, rid: str) -> bool:
        """A row leaves while its prompt is under way (its padded columns are laid out already, so the group goes
        on and leaves it out when done); True when no row of the group is left."""
        self.gone.add(rid)
        return len(self.gone) == len(self.rows)

    def finish(self) -> list:
        """The prompts are processed: the padding rolled to the left, the dropped rows' caches filtered out; the
        rows that stay (in the caches' order)."""
        if self.padded:
            for c in self.cache:
                c.finalize()
            mx.eval([c.state for c in self.cache])
        keep = [i for i, r in enumerate(self.rows) if r.id not in self.gone]
        if keep and len(keep) < len(self.rows):
            for c in self.cache:
                c.filter(keep)
        return [self.rows[i] for i in keep]
