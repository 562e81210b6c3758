"""The overlapped pipeline: one micro-batch per stage in flight, so every stage computes while the others do.

In the lockstep schedule (batch.py) every rank runs every step of the whole batch together and each step ends in
an all_sum of the last stage's hidden state, so while one stage computes the others wait: N ranks at best match
one process. Here the batch is split into as many micro-batches as there are stages (a request belongs to one
micro-batch from its first token to its last); while stage s computes micro-batch k, the stage before it computes
micro-batch k+1. Stages are in mlx-lm's order (stage.py): rank ``world - 1`` embeds and runs the first blocks,
hidden states flow down to rank 0, which runs the last blocks, samples, streams the text to its clients and sends
only the sampled token ids back to rank ``world - 1`` over the ring's wrap-around link.

Slots and controls. A run (between two meetings, steploop.py) is a sequence of slots: slot s of micro-batch k is
one step of its rows (its new rows' prompts first). Every rank walks the positions (s, k) in the same order,
slot-major: (0, 0), (0, 1), ..., (1, 0), ... Before each slot every rank applies that slot's control: which rows
leave (finished: their KV goes to the prompt cache; or cancelled), which requests join, and whether the
micro-batch's run ends here. The controls of slot 0 are the meeting's; rank 0 decides the control of slot s + 1
of micro-batch k just before it computes slot s of it (from what the tokens up to slot s - 1 said: a finished
row is computed once more, ignored, then leaves; a queued request joins at the next slot: no meeting, no drained
pipeline) and sends it to rank ``world - 1``; the slot's sampled tokens follow from inside the step, so no
Python runs between rank 0 sampling and the first stage computing on. Rank ``world - 1`` passes each control
down with the slot's hidden state: each link carries, per slot, a header (flags, the changes' length, the cancel
epoch, a check word, the micro-batch it revives, every rank's load words), the changes' bytes when there are any,
then the slot's hidden states when it computes. An empty micro-batch sits the rest of the run out (it parks); a
request that arrives while one is parked joins it there: the control of another micro-batch's next slot names the
parked one and carries its joins, and every rank, applying that control at the same position, walks the revived
micro-batch's slots again from the next round on, its first slot's control local on the first stage as at a
meeting. So a join never ends the run. Rank 0 ends the run (every micro-batch's next control says "end") only when
it wants a meeting: a stop (its own, or a flag another rank set in a header), an empty batch. Cancels and their
acks travel in the headers too.

Why every rank issues its sends and receives in the same order (MLX's ring matches messages by order alone):
- every rank walks the same positions in the same order and applies the same control at each, so which rows a
  slot has, whether it computes, and the shape of every message are the same everywhere; a control reaches a
  rank before the slot it governs (rank ``world - 1`` gets the control of (s + 1, k) just before the tokens of
  (s, k); every other rank gets it in the header of (s + 1, k) from the rank before it);
- the link from rank r + 1 to rank r: per position, rank r + 1 sends the header, the changes, then (when the slot
  computes) the hidden states, and rank r receives the same messages in the same order; the first stage
  receives none;
- the link from rank 0 to rank ``world - 1``: at each position rank 0 sends the next slot's control (and its
  changes' bytes), then, when the slot computes, its tokens; rank ``world - 1`` receives them in that order at its
  next position of that micro-batch (the control before it passes the header down, then the tokens, queued
  without waiting, which its step waits for), and both walk the positions in the same order; rank 0 sends
  nothing at a parked micro-batch's positions, and the first stage receives nothing at a revived one's first
  slot (rank 0 sent its joins ahead, in the reviving control);
- a meeting (an all_sum on every link) begins only after every rank has run every position of the run, so no
  meeting byte is read as part of a run or the other way round.
And why it cannot deadlock: each position waits only for the same position on the stage before it, or (rank
``world - 1``) for the previous slot of the same micro-batch on the last stage (its control was sent before
that slot computed), all earlier in the one order every rank follows; headers, controls and tokens are a few
bytes, so a send never waits for its receive. Two sends are never put into one ``mx.eval``: MLX may run
independent sends of one eval in either order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import mlx.core as mx

from clusterctl.rank.engine.generation import GenRequest, GenResult, Seq, StopMatcher
from clusterctl.rank.engine.sampling import RowSampler, sample_rows
from clusterctl.rank.engine import prefill as prompts
from clusterctl.rank.engine.slotcosts import SlotCosts
from clusterctl.rank.watchdog import PeerLost
from clusterctl.rank.engine.logprobs import Entries
from clusterctl.rank.engine.promptlogprobs import PromptScorer

END, MEET = 1, 2  # a control's flags: the micro-batch's run ends here; a rank asks rank 0 for a meeting
CONTROL_WORDS = 6  # flags, the changes' length in bytes, the cancel epoch, the check word, the revived micro-batch,
# and the prompt tokens the slot may process while rows decode (rank 0's SlotCosts.budget)


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
    scorer: PromptScorer | None = None  # rank 0: its prompt's log-probabilities, as its chunks go by (prefill.py)

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def left(self) -> int:
        return self.req.max_tokens - self.decoded


@dataclass
class Control:
    """What happens before one slot of one micro-batch (rank 0 decides it; every rank applies it)."""

    flags: int = 0
    changes: bytes = b""  # scheduler.BatchChanges, encoded (empty: none)
    epoch: int = 0  # the newest cancel epoch whose drops every rank has applied by now
    load: list[int] = field(default_factory=list)  # every rank's load words, summed on the way down
    revive: int = -1  # a parked micro-batch the changes' joins go to, back in the run from its next slot (-1: none)
    budget: int = 0  # prompt tokens the slot may process while rows decode (scheduler.prefill_plan)

    @property
    def end(self) -> bool:
        return bool(self.flags & END)


class Hooks(Protocol):
    """What a run asks of the step loop (steploop.py)."""

    def decide(self, k: int, live: list[int]) -> Control: ...  # rank 0: the control of k's next slot

    def apply(self, k: int, changes: bytes) -> None: ...  # every rank: the changes, into micro-batch k

    def revived(self, k: int) -> None: ...  # every rank: parked micro-batch k came back into the run

    def received(self, c: Control) -> None: ...  # every rank: a control arrived (its epoch, flags, load words)

    def wants_meeting(self) -> bool: ...  # this rank would like to stop

    def load_words(self) -> list[int]: ...

    def slot_done(self) -> None: ...


@dataclass
class MicroBatch:
    rows: list[Row] = field(default_factory=list)
    fresh: list[Row] = field(default_factory=list)  # joined, prompt not processed yet (or not all of it)
    prefill: list[prompts.Prefill] = field(default_factory=list)  # groups of ``fresh`` whose prompts are under way
    cache: list = field(default_factory=list)  # mlx-lm's per-layer batch caches of ``rows``
    inputs: mx.array | None = None  # first stage: each row's next input token (rows order)
    computed: int = 0  # rows in its last slot (the tokens rank 0 sends back for it)

    def __len__(self) -> int:
        return len(self.rows) + len(self.fresh)


class OverlapBatch:
    """The requests in flight on this rank, in micro-batches; the same rows on every rank."""

    overlapped = True

    def __init__(self, model, tokenizer, *, rank: int, world: int, group, max_batch: int, pcache=None,
                 shares=None, fine_chunks: bool = True):
        self.model, self.tokenizer, self.group = model, tokenizer, group
        self.max_batch = max_batch
        self.rank, self.world = rank, world
        self.first, self.last = rank == world - 1, rank == 0
        self.mbs = [MicroBatch() for _ in range(world)]
        self.eos = set(tokenizer.eos_token_ids)
        self.steps = 0
        self.pcache = pcache  # promptcache.PromptCache: finished requests' KV is kept there
        self.shares = shares  # choices.PromptShares: a prompt row's KV is kept there for its choices
        # a short prompt cut finer so that its chunks fill the stages (scheduler.prefill_chunk); not with a quantized
        # KV cache, which mlx-lm quantizes after the pass that reaches its start: the chunks' bounds decide its answers
        self.fine_chunks = fine_chunks
        self.costs = SlotCosts()  # rank 0: what a decode step and a prompt token cost, for each slot's budget
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
        """Rank 0: requests answered (EOS, a stop string, max_tokens) whose rows are still in the batch."""
        return [r.id for mb in self.mbs for r in mb.rows if r.done]

    def sizes(self) -> list[int]:
        """Rank 0: each micro-batch's rows not yet answered."""
        return [sum(not r.done for r in (*mb.rows, *mb.fresh)) for mb in self.mbs]

    def lengths(self) -> list[int]:
        """Each micro-batch's rows, answered or not (what ``scheduler.place`` places joins by)."""
        return [len(mb) for mb in self.mbs]

    def add(self, req: GenRequest, emit: Callable[[str], None] | None = None, prefix: list | None = None,
            *, into: int, emit_lp: Callable[[dict], None] | None = None, grammar=None) -> None:
        """A request joins micro-batch ``into`` (the scheduler's choice: ``join_count`` during a run, ``place`` at
        a meeting) at its next slot; ``grammar``: its compiled constraint (rank 0; compiler.py)."""
        if any(r.id == req.id for mb in self.mbs for r in (*mb.rows, *mb.fresh)):
            raise ValueError(f"request {req.id} is already in the batch")
        if not req.tokens or req.max_tokens < 1:
            raise ValueError(f"request {req.id} has an empty prompt or no tokens to make")
        row = Row(req=req, prefix=prefix)
        if self.last:
            row.seq = Seq(req=req, uid=0, detok=self.tokenizer.detokenizer, emit=emit, stops=StopMatcher(req.stop),
                          emit_lp=emit_lp)
            row.sampler = RowSampler(req, grammar)
            row.seq.procs = row.sampler.procs
            if emit_lp is not None and req.logprobs >= 0:
                row.seq.lp = Entries(self.tokenizer, req.logprobs)
            if emit_lp is not None and req.prompt_logprobs >= 0:  # the last stage alone: its chunks end in no
                row.scorer = PromptScorer(req.tokens, req.prompt_logprobs,  # collective (promptlogprobs.py)
                                          Entries(self.tokenizer, req.prompt_logprobs), emit_lp)
        self.mbs[into].fresh.append(row)

    def drop(self, rid: str, finish: str, *, save: bool = False) -> GenResult | None:
        """Take a request out (``save``: it ended normally, keep its KV in the prompt cache); None if it is not
        in the batch or was answered already."""
        for mb in self.mbs:
            for i, r in enumerate(mb.fresh):
                if r.id == rid:
                    del mb.fresh[i]
                    prompts.forget(mb, r)
                    return self._result(r, finish)
            for i, r in enumerate(mb.rows):
                if r.id == rid:
                    if save:
                        self._save(mb, i)
                    self._keep(mb, [j for j in range(len(mb.rows)) if j != i])
                    return self._result(r, finish)
        return None

    def _save(self, mb: MicroBatch, i: int) -> None:
        """Keep row ``i``'s KV in the prompt cache (a prompt row's: for its choices): its prompt and the tokens fed
        after it."""
        r = mb.rows[i]
        count = len(r.req.tokens) - 1 + r.decoded
        if r.req.keep_prompt and self.shares is not None:
            self.shares.keep(r.id, [c.extract(i) for c in mb.cache], count, r.req.keep_prompt)
            return
        if self.pcache is None or not self.pcache.on:
            return
        tokens = (list(r.req.tokens) + r.sampled)[:count] if self.last else None
        self.pcache.save([c.extract(i) for c in mb.cache], count, tokens, took=r.req.took, partition=r.req.partition)

    def _result(self, r: Row, finish: str) -> GenResult | None:
        s = r.seq
        if r.done:
            return None
        if s is None:
            return GenResult(tokens=[], text="", finish_reason=finish, prompt_tokens=len(r.req.tokens))
        return s.so_far(finish)

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

    def run(self, hooks: Hooks, run_id: int, on_done: Callable[[str, GenResult], None] | None = None) -> int:
        """Slots of every micro-batch, overlapped across the stages, until rank 0 ends the run; rank 0 calls
        ``on_done`` for each request the moment it finishes. Returns the number of slots that computed."""
        live = list(range(len(self.mbs)))
        restart = set(live)  # micro-batches whose next slot's control is local (the meeting's, or a revival's)
        computed, s = 0, 0
        while live:
            for k in list(live):
                mb = self.mbs[k]
                c = self._control(s, k, run_id, k in restart)
                restart.discard(k)
                if not self.last:
                    self._pass_down(c, hooks, self._check(run_id, s, k))
                if self.first and s > 0 and mb.computed:  # the previous slot's tokens: received in turn, waited
                    mb.inputs = mx.distributed.recv((mb.computed,), mx.int32, 0, group=self.group)  # for by the step
                    mx.async_eval(mb.inputs)
                if c.revive >= 0:
                    self._revive(c.revive, live, restart, s, k)
                    hooks.revived(c.revive)
                if c.changes:
                    hooks.apply(k if c.revive < 0 else c.revive, c.changes)
                hooks.received(c)
                if c.end:
                    live.remove(k)
                    mb.computed = 0  # parked: nothing of it in flight
                    continue
                if self.last:  # the next slot's control goes out before this slot computes
                    self._send_control(hooks.decide(k, live), self._check(run_id, s + 1, k))
                prompted = bool(mb.fresh)
                if prompted:
                    prompts.process(self, mb, c.budget)
                mb.computed = len(mb.rows)
                if mb.rows:
                    t = time.perf_counter()
                    self._step(mb, on_done)
                    if self.last and not prompted:
                        self.costs.stepped(time.perf_counter() - t)
                    computed += 1
                hooks.slot_done()
            s += 1
        self.steps += computed
        return computed

    def _revive(self, k: int, live: list[int], restart: set[int], s: int, by: int) -> None:
        """A parked micro-batch comes back into the run (a request joins it): every rank learns it from the same
        control, so all walk its slots again from the same next position (the next round: ``run`` walks a copy of
        ``live``), and its first slot's control is local there, as at a meeting (rank 0 sent none for it)."""
        if not 0 <= k < len(self.mbs) or k in live:
            raise PeerLost.ring(self.rank, f"slot {s} of micro-batch {by} revives micro-batch {k}, not a parked one")
        live.append(k)
        live.sort()
        restart.add(k)

    @staticmethod
    def _check(run_id: int, s: int, k: int) -> int:
        """The check word of the control of slot ``s`` of micro-batch ``k``: the same on every rank."""
        return (run_id * 1_000_003 + s * 64 + k) % 2**30

    def _control(self, s: int, k: int, run_id: int, local: bool) -> Control:
        """This slot's control: on the first stage, the meeting's for slot 0 and an empty one for a revived
        micro-batch's first slot (there is nothing to receive: its joins came with the control that revived it),
        else what the previous stage (or, on the first stage, rank 0) sent."""
        import numpy as np

        if self.first and local:  # (rank 0 decided no budget for it: a prompt token is taken to cost a step)
            return Control(budget=prompts.budget(self, None))
        if self.first:
            ctrl, load = self._recv((CONTROL_WORDS,), 0), []
        else:
            words = self._recv((CONTROL_WORDS + 3 * self.world,), self.rank + 1)
            ctrl, load = words[:CONTROL_WORDS], words[CONTROL_WORDS:]
        flags, length, epoch, check, revive, budget = ctrl
        if check != self._check(run_id, s, k) or length < 0 or flags & ~(END | MEET) or budget < 0 \
                or not -1 <= revive < len(self.mbs) or (revive >= 0 and not length):
            raise PeerLost.ring(self.rank, f"slot {s} of micro-batch {k}: check word {check}, flags {flags}, "
                                           f"{length} bytes of changes, revives {revive}, budget {budget}")
        changes = b""
        if length:
            padded = mx.distributed.recv(((length + 3) // 4,), mx.int32,
                                         0 if self.first else self.rank + 1, group=self.group)
            changes = np.array(padded, copy=True).view(np.uint8)[:length].tobytes()
        return Control(flags=flags, changes=changes, epoch=epoch, load=load, revive=revive, budget=budget)

    def _recv(self, shape: tuple[int, ...], src: int) -> list[int]:
        import numpy as np

        got = mx.distributed.recv(shape, mx.int32, src, group=self.group)
        return np.array(got, copy=True).tolist()

    def _send(self, words: list[int], changes: bytes, dst: int) -> None:
        import numpy as np

        # one eval each: MLX may run two independent sends of one eval in either order
        mx.eval(mx.distributed.send(mx.array(np.array(words, dtype=np.int32)), dst, group=self.group))
        if changes:
            buf = np.zeros((len(changes) + 3) // 4 * 4, dtype=np.uint8)
            buf[:len(changes)] = np.frombuffer(changes, dtype=np.uint8)
            mx.eval(mx.distributed.send(mx.array(buf.view(np.int32)), dst, group=self.group))

    def _pass_down(self, c: Control, hooks: Hooks, check: int) -> None:
        """The header of this slot (and its changes) to the next stage, with this rank's load words added and its
        wish for a meeting."""
        mine = hooks.load_words()
        load = [a + b for a, b in zip(mine, c.load)] if c.load else mine
        flags = c.flags | (MEET if hooks.wants_meeting() else 0)
        self._send([flags, len(c.changes), c.epoch, check, c.revive, c.budget, *load], c.changes, self.rank - 1)

    def _send_control(self, c: Control, check: int) -> None:
        """Rank 0: the control of a micro-batch's next slot, to the first stage (its tokens follow in the step)."""
        self._send([c.flags, len(c.changes), c.epoch, check, c.revive, c.budget], c.changes, self.world - 1)

    def _step(self, mb: MicroBatch, on_done) -> None:
        n = len(mb.rows)
        x = mb.inputs if self.first else mx.zeros((n,), dtype=mx.int32)  # others: shape only (they receive)
        out = self.model(x[:, None], cache=mb.cache)
        states = [c.state for c in mb.cache]
        for r in mb.rows:
            r.decoded += 1
        if not self.last:
            mx.eval(states)
            return
        tokens = sample_rows([r.sampler for r in mb.rows], out[:, -1, :]).astype(mx.int32)
        lps = {i: r.seq.lp.pending(r.sampler.logprobs) for i, r in enumerate(mb.rows)
               if r.seq.lp is not None and not r.done}
        wanted = [a for row, top in lps.values() for a in (row, *(top or ()))]
        mx.eval(mx.distributed.send(tokens, self.world - 1, group=self.group), states, wanted)
        for i, (r, t) in enumerate(zip(mb.rows, tokens.tolist())):
            r.sampler.took(t)
            r.sampled.append(t)
            if not r.done:
                if i in lps and (t not in self.eos or r.seq.lists_eos) and not r.sampler.failed:
                    r.seq.emit_lp(r.seq.lp.entry(t, lps[i]))
                self._feed(r, t, on_done)

    def _feed(self, r: Row, token: int, on_done) -> None:
        self.produced += 1
        s = r.seq
        if r.sampler.failed:  # its own values broke its sampling: it alone ends (its row leaves as answered)
            r.done = True
            if on_done is not None:
                on_done(r.id, s.so_far("error", r.sampler.failed))
            return
        finish = s.feed(token, eos=token in self.eos, otherwise="length" if r.left <= 0 else None)
        if finish is not None:
            r.done = True
            if on_done is not None:
                on_done(r.id, s.result(finish))

    def close(self) -> None:
        self.mbs = [MicroBatch() for _ in range(self.world)]
