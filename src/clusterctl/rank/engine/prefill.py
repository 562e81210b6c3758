"""A group of prompts processed in chunks, over one or more slots of an overlapped micro-batch (overlap.py), and
a micro-batch's prompts slot by slot (``process``: grouped, cut to the slot's budget, timed on rank 0).

mlx-lm's ``PromptProcessingBatch.prompt`` processes a batch of prompts in one call: it right-pads them to the
longest, runs a forward pass per ``prefill_step_size`` columns (evaluating only the caches) and rolls the padding to
the left at the end. Here the same steps are split so that a slot can process part of a prompt and the next slot
the rest (``scheduler.prefill_plan`` says how much): the caches are mlx-lm's own batch caches of every family (KV,
rotating windows, linear-attention state), fed chunk after chunk as mlx-lm feeds them. Each chunk's hidden state
is sent on by the stage's last block as soon as it is evaluated (``stage.Send``), so the next stage works on chunk
c while this one computes chunk c + 1: a long prompt's chunks flow through the pipeline like micro-batches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from clusterctl.rank.engine.promptlogprobs import RowChunk, score
from clusterctl.rank.engine.scheduler import DECODE_BUDGET, PREFILL_CHUNK, prefill_chunk, prefill_plan, prompt_groups
from clusterctl.rank.engine.slotcosts import STALL_STEPS, SlotCosts


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


# -- a micro-batch's prompts, slot by slot (``batch``: overlap.py's OverlapBatch, ``mb`` one of its micro-batches)

def process(batch, mb, budget: int) -> None:
    """Process the prompts of the micro-batch's new requests (all but their last token, which is their first
    step's input, as in mlx-lm), in groups of similar length (a batch pads every prompt to its longest, and on
    a CPU every padded token costs a real one), each in chunks of at most PREFILL_CHUNK columns (fewer for a
    short prompt, so that its chunks fill the stages: ``prefill_chunk``); a group that is done joins the
    micro-batch's rows and caches. How much of it this slot processes is ``prefill_plan``'s: all of it when no row
    decodes (its chunks flow through the stages like micro-batches), else the control's ``budget`` of tokens (rank
    0's, from what they cost: slotcosts.py), so the running rows keep their pace while a long prompt joins; rank 0
    times that work for the next budgets."""
    started = {id(r) for p in mb.prefill for r in p.rows}
    new = [r for r in mb.fresh if id(r) not in started]
    for group in prompt_groups([len(r.req.tokens) - 1 - reused(r) for r in new]):
        mb.prefill.append(Prefill.start(batch.model, [new[i] for i in group], reused,
                                        batch.world if batch.fine_chunks else 1))
    decoding = any(m.rows for m in batch.mbs)
    plan = prefill_plan([(len(p.rows), p.left) for p in mb.prefill], decoding, budget)
    t, tokens = time.perf_counter(), sum(len(p.rows) * cols for p, cols in zip(mb.prefill, plan))
    for p, cols in zip(list(mb.prefill), plan):
        p.advance(batch.model, cols)
        if not p.left:
            mb.prefill.remove(p)
            _finish(batch, mb, p)
    if batch.last and decoding:
        batch.costs.prompted(tokens, time.perf_counter() - t)


def budget(batch, costs: SlotCosts | None) -> int:
    """The prompt tokens a slot may process while rows decode: from ``costs`` (rank 0's), or as if a token cost a
    step (None: a slot rank 0 decided nothing for). A quantized KV cache keeps DECODE_BUDGET: mlx-lm quantizes it
    after the pass that reaches its start, so its chunks' bounds must not hang on timings."""
    if not batch.fine_chunks:
        return DECODE_BUDGET
    return costs.budget() if costs is not None else max(1, int(STALL_STEPS))


def reused(r) -> int:
    """The prompt tokens a row's prompt-cache prefix gives."""
    return r.req.cache_len if r.prefix is not None else 0


def forget(mb, r) -> None:
    """A row whose prompt is being processed leaves: its group goes on without it (its padded columns are already
    laid out), or stops when no row of it is left."""
    for p in mb.prefill:
        if any(x is r for x in p.rows):
            if p.forget(r.id):
                mb.prefill.remove(p)
            return


def _finish(batch, mb, p: Prefill) -> None:
    """A group's prompts are processed: its rows (those not dropped meanwhile) join the micro-batch's."""
    from mlx_lm.generate import _extend_cache

    rows = p.finish()
    if not rows:
        return
    mb.cache = _extend_cache(mb.cache, p.cache)
    mb.rows.extend(rows)
    mb.fresh = [r for r in mb.fresh if all(r is not x for x in rows)]
    if batch.first:
        last = mx.array([r.req.tokens[-1] for r in rows], dtype=mx.int32)
        mb.inputs = last if mb.inputs is None else mx.concatenate([mb.inputs, last])
