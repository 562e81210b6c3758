"""The overlapped pipeline: one micro-batch per stage in flight, so every stage computes while the others do.

In the lockstep schedule (batch.py) every rank runs every step of the whole batch together and each step ends in
an all_sum of the last stage's hidden state, so while one stage computes the others wait: N ranks at best match
one process. Here the batch is split into as many micro-batches as there are stages (a request belongs to one
micro-batch from its first token to its last); while stage s computes micro-batch k, the stage before it computes
micro-batch k+1. Stages are in mlx-lm's order (stage.py): rank ``world - 1`` embeds and runs the first blocks,
hidden states flow down to rank 0, which runs the last blocks, samples, streams the text to its clients and sends
only the sampled token ids back to rank ``world - 1`` over the ring's wrap-around link.

Runs and meetings. Between two meetings (steploop.py) every rank runs the same ``run(rounds)``: in each round
every non-empty micro-batch, in index order, takes one step (its requests that joined at the meeting first
process their prompts, in that micro-batch's first step). Rank 0 chooses ``rounds`` at the meeting, never more
than any request's remaining ``max_tokens``, so a request that ends by length ends with the run. A request that
ends early (EOS, a stop string) is answered at once by rank 0 and keeps its row, computed and ignored, until the
next meeting drops it; cancels, joins and stops happen at meetings only. So which rows every micro-batch has, and
the shape of every message, is a function of what the meetings said, identical on every rank.

Why every rank issues its sends and receives in the same order (MLX's ring matches messages by order alone):
- every rank walks the same list of work items in the same order: (round, micro-batch, prompt chunk or step),
  derived from the same meeting decisions; an item's messages on a link depend only on the item;
- the hidden-state link from rank r+1 to rank r: rank r+1 sends exactly one message per chunk or step of every
  item, in item order, and rank r receives one per item in the same order (the first stage receives none);
- the token link from rank 0 to rank world-1: rank 0 sends the tokens of every step of every item in item order;
  rank world-1 receives the tokens of step (j, k) just before its step (j+1, k), which comes later in item
  order, and the last round's after its last item; so both ends see the tokens of (0,0), (0,1), ..., in order;
- a meeting (an all_sum on every link) begins only after a rank has issued every message of the run, and the
  peer it exchanges with has too, so no meeting byte is read as part of a run and no run byte as a meeting's.
And why it cannot deadlock: each item waits only for the same item on the stage before it, or for the previous
round of the same micro-batch on the last stage, both earlier in the one order every rank follows; token
messages are a few bytes, so rank 0's sends never wait for the first stage's receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from clusterctl.launch.rank.batch import Seq
from clusterctl.launch.rank.pipeline import GenRequest, GenResult, StopMatcher
from clusterctl.launch.rank.sampling import RowSampler, sample_rows


@dataclass
class Row:
    """One request in a micro-batch (on every rank); rank 0 also keeps its text and its sampler."""

    req: GenRequest
    decoded: int = 0  # steps run for it (= tokens sampled for it)
    seq: Seq | None = None
    sampler: RowSampler | None = None
    done: bool = False  # rank 0: answered; its row is computed and ignored until the next meeting
    prefix: list | None = None  # the prompt cache's KV of the prompt's first req.cache_len tokens
    sampled: list[int] = field(default_factory=list)  # rank 0: every token sampled for it (its KV's tail)

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def left(self) -> int:
        return self.req.max_tokens - self.decoded


@dataclass
class MicroBatch:
    rows: list[Row] = field(default_factory=list)
    fresh: list[Row] = field(default_factory=list)  # joined at the last meeting: prompt first
    cache: list = field(default_factory=list)  # mlx-lm's per-layer batch caches of ``rows``
    inputs: mx.array | None = None  # first stage: each row's next input token (rows order)

    def __len__(self) -> int:
        return len(self.rows) + len(self.fresh)


class OverlapBatch:
    """The requests in flight on this rank, in micro-batches; the same rows on every rank."""

    def __init__(self, model, tokenizer, *, rank: int, world: int, group, max_batch: int,
                 prefill_step: int = 2048, pcache=None):
        self.model, self.tokenizer, self.group = model, tokenizer, group
        self.max_batch, self.prefill_step = max_batch, prefill_step
        self.rank, self.world = rank, world
        self.first, self.last = rank == world - 1, rank == 0
        self.mbs = [MicroBatch() for _ in range(world)]
        self.eos = set(tokenizer.eos_token_ids)
        self.steps = 0
        self.pcache = pcache  # promptcache.PromptCache: finished requests' KV is kept there
        self.produced = 0  # rank 0: tokens generated for requests not yet answered (EOS included)

    # -- the batch's membership (the same calls, in the same order, on every rank)

    def __len__(self) -> int:
        return sum(len(mb) for mb in self.mbs)

    def __bool__(self) -> bool:
        return len(self) > 0

    @property
    def room(self) -> int:
        return self.max_batch - len(self)

    def ids(self) -> list[str]:
        """The requests in the batch not yet answered."""
        return [r.id for mb in self.mbs for r in (*mb.rows, *mb.fresh) if not r.done]

    def ended(self) -> list[str]:
        """Rank 0: requests answered early (EOS, stop string) whose rows the next meeting should drop."""
        return [r.id for mb in self.mbs for r in mb.rows if r.done and r.left > 0]

    def rounds_limit(self, leaving: list[str], joining: list[GenRequest]) -> int | None:
        """Rank 0 at a meeting: the most rounds the next run may have, so that no request runs past its
        max_tokens (None: no requests would be left)."""
        gone = set(leaving)
        lefts = [r.left for mb in self.mbs for r in (*mb.rows, *mb.fresh) if not r.done and r.id not in gone]
        lefts += [q.max_tokens for q in joining]
        return min(lefts) if lefts else None

    def add(self, req: GenRequest, emit: Callable[[str], None] | None = None, prefix: list | None = None) -> None:
        if any(r.id == req.id for mb in self.mbs for r in (*mb.rows, *mb.fresh)):
            raise ValueError(f"request {req.id} is already in the batch")
        if not req.tokens or req.max_tokens < 1:
            raise ValueError(f"request {req.id} has an empty prompt or no tokens to make")
        row = Row(req=req, prefix=prefix)
        if self.last:
            row.seq = Seq(req=req, uid=0, detok=self.tokenizer.detokenizer, emit=emit, stops=StopMatcher(req.stop))
            row.sampler = RowSampler(req)
        min(self.mbs, key=len).fresh.append(row)  # the emptiest micro-batch, the lowest index on a tie

    def drop(self, rid: str, finish: str, *, save: bool = False) -> GenResult | None:
        """Take a request out at a meeting (``save``: it ended normally, keep its KV in the prompt cache); None if
        it is not in the batch or was answered already."""
        for mb in self.mbs:
            for i, r in enumerate(mb.fresh):
                if r.id == rid:
                    del mb.fresh[i]
                    return self._result(r, finish)
            for i, r in enumerate(mb.rows):
                if r.id == rid:
                    if save:
                        self._save(mb, i)
                    self._keep(mb, [j for j in range(len(mb.rows)) if j != i])
                    return self._result(r, finish)
        return None

    def _save(self, mb: MicroBatch, i: int) -> None:
        """Keep row ``i``'s KV in the prompt cache: its prompt and the tokens fed after it."""
        if self.pcache is None or not self.pcache.on:
            return
        r = mb.rows[i]
        count = len(r.req.tokens) - 1 + r.decoded
        tokens = (list(r.req.tokens) + r.sampled)[:count] if self.last else None
        self.pcache.save([c.extract(i) for c in mb.cache], count, tokens, took=r.req.took)

    def _result(self, r: Row, finish: str) -> GenResult | None:
        s = r.seq
        if r.done:
            return None
        if s is None:
            return GenResult(tokens=[], text="", finish_reason=finish, prompt_tokens=len(r.req.tokens))
        return GenResult(tokens=s.tokens, text="".join(s.parts), finish_reason=finish,
                         prompt_tokens=len(r.req.tokens))

    def _keep(self, mb: MicroBatch, keep: list[int]) -> None:
        mb.rows = [mb.rows[i] for i in keep]
        if not keep:
            mb.cache, mb.inputs = [], None
            return
        for c in mb.cache:
            c.filter(keep)
        if mb.inputs is not None:
            mb.inputs = mb.inputs[mx.array(keep)]

    # -- a run

    def run(self, rounds: int, on_done: Callable[[str, GenResult], None] | None = None,
            on_step: Callable[[], None] | None = None) -> list[str]:
        """``rounds`` steps of every micro-batch, overlapped across the stages. Rank 0 calls ``on_done`` for each
        request the moment it finishes (its row stays until the next meeting). Returns the requests that left
        at the end of the run (their max_tokens reached)."""
        for j in range(rounds):
            for mb in self.mbs:
                if j == 0 and mb.fresh:
                    self._prompt(mb)
                if mb.rows:
                    self._step(mb, j, on_done)
            if on_step is not None:
                on_step()
        if self.first:  # the last round's tokens: the next run's inputs
            for mb in self.mbs:
                if mb.rows:
                    mb.inputs = self._recv_tokens(len(mb.rows))
                    mx.eval(mb.inputs)
        gone = []
        for mb in self.mbs:  # requests at their max_tokens leave on every rank alike
            if any(r.left <= 0 for r in mb.rows):
                for i, r in enumerate(mb.rows):
                    if r.left <= 0:
                        self._save(mb, i)
                        gone.append(r.id)
                self._keep(mb, [i for i, r in enumerate(mb.rows) if r.left > 0])
        self.steps += rounds
        return gone

    def _prompt(self, mb: MicroBatch) -> None:
        """Process the prompts of the micro-batch's new requests (all but their last token, which is their first
        step's input, as in mlx-lm) and merge their caches into the micro-batch's."""
        from mlx_lm.generate import PromptProcessingBatch, _extend_cache
        from mlx_lm.models.cache import make_prompt_cache

        fresh, mb.fresh = mb.fresh, []
        reused = [r.req.cache_len if r.prefix is not None else 0 for r in fresh]
        batch = PromptProcessingBatch(self.model, list(range(len(fresh))),
                                      [r.prefix if r.prefix is not None else make_prompt_cache(self.model)
                                       for r in fresh],
                                      tokens=[list(r.req.tokens[:n]) for r, n in zip(fresh, reused)],
                                      prefill_step_size=self.prefill_step)
        for r in fresh:
            r.prefix = None
        prompts = [list(r.req.tokens[n:-1]) for r, n in zip(fresh, reused)]
        if any(prompts):
            batch.prompt(prompts)
        mb.cache = _extend_cache(mb.cache, batch.prompt_cache)
        mb.rows.extend(fresh)
        if self.first:
            last = mx.array([r.req.tokens[-1] for r in fresh], dtype=mx.int32)
            mb.inputs = last if mb.inputs is None else mx.concatenate([mb.inputs, last])

    def _recv_tokens(self, n: int) -> mx.array:
        return mx.distributed.recv((n,), mx.int32, 0, group=self.group)

    def _step(self, mb: MicroBatch, j: int, on_done) -> None:
        n = len(mb.rows)
        if self.first:
            x = mb.inputs if j == 0 else self._recv_tokens(n)
        else:
            x = mx.zeros((n,), dtype=mx.int32)  # shape only: this stage receives hidden states
        out = self.model(x[:, None], cache=mb.cache)
        states = [c.state for c in mb.cache]
        for r in mb.rows:
            r.decoded += 1
        if not self.last:
            mx.eval(states)
            return
        tokens = sample_rows([r.sampler for r in mb.rows], out[:, -1, :]).astype(mx.int32)
        sent = mx.distributed.send(tokens, self.world - 1, group=self.group)
        mx.eval(sent, states)
        for r, t in zip(mb.rows, tokens.tolist()):
            r.sampler.took(t)
            r.sampled.append(t)
            if not r.done:
                self._feed(r, t, on_done)

    def _feed(self, r: Row, token: int, on_done) -> None:
        self.produced += 1
        s = r.seq
        finish = None
        if token in self.eos:
            finish = "stop"  # the EOS token ends the text, it is not part of it
        else:
            s.tokens.append(token)
            s.detok.add_token(token)
            text, hit = s.stops.feed(s.detok.last_segment)
            s.out(text)
            if hit:
                s.stopped_by_text = True
                finish = "stop"
            elif r.left <= 0:
                finish = "length"
        if finish is not None:
            r.done = True
            if on_done is not None:
                on_done(r.id, s.result(finish))

    def close(self) -> None:
        self.mbs = [MicroBatch() for _ in range(self.world)]
