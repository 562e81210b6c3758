"""The batch of requests a rank decodes together (continuous batching on mlx-lm's ``BatchGenerator``).

Every rank holds the same batch: rank 0 decides at each meeting which requests join (their shared
``GenRequest``) and which leave early (cancelled), every rank applies that decision before the next step, and
every other change is a pure function of the tokens (EOS, max_tokens, stop strings), which all ranks share
through the model's own pipeline collectives. So the batch's shape is the same on every rank at every step —
which mlx-lm's pipeline needs, because each step's forward pass is a chain of sends and receives.

A request joins at a step boundary: its prompt is processed in the next step, alongside the decoding of the
others; a finished request leaves at once without stalling the rest.

Sampling randomness: each sampled row draws from a key of its own, made from its request's seed and split once per
token (sampling.KeyedSampler, the overlapped schedule's draw): a seeded request's tokens do not depend on who else
is in the batch, and a request served alone draws what one mlx-lm process seeded with its seed draws.
"""

from __future__ import annotations

from typing import Callable

from clusterctl.rank.engine.generation import GenRequest, GenResult, Seq, StopMatcher
from clusterctl.rank.engine.logprobs import Entries
from clusterctl.rank.engine.promptlogprobs import PromptScorer, tap_prompt_batch
from clusterctl.rank.engine.scheduler import PREFILL_CHUNK


class Batch:
    """The requests in flight on this rank, decoded together; identical on every rank."""

    overlapped = False  # the lockstep schedule (overlap.py: the overlapped one)

    def __init__(self, model, tokenizer, *, max_batch: int, prefill_step: int = PREFILL_CHUNK, pcache=None,
                 shares=None):
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self._mx = mx
        eos = sorted(set(tokenizer.eos_token_ids))
        self.gen = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=max_batch,
                                  prefill_batch_size=min(8, max_batch), prefill_step_size=prefill_step)
        self.eos = set(eos)
        self.seqs: dict[int, Seq] = {}  # by generator uid
        self.by_id: dict[str, Seq] = {}
        self.steps = 0
        self.pcache = pcache  # promptcache.PromptCache: finished requests' KV is kept there
        self.shares = shares  # choices.PromptShares: a prompt row's KV is kept there for its choices
        self.produced = 0  # tokens generated (EOS included)
        self.scorers: dict[int, PromptScorer] = {}  # by generator uid: requests whose prompt is scored
        from clusterctl.rank.engine.stage import is_split

        tap_prompt_batch(self.gen, self.scorers, pipeline=is_split(model))

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def room(self) -> int:
        return self.max_batch - len(self.seqs)

    def ids(self) -> list[str]:
        return list(self.by_id)

    def ended(self) -> list[str]:
        """Requests answered whose rows are still in the batch: none (a lockstep row leaves when it finishes)."""
        return []

    def add(self, req: GenRequest, emit: Callable[[str], None] | None = None, prefix: list | None = None,
            emit_lp: Callable[[dict], None] | None = None, grammar=None) -> None:
        """``grammar``: the request's compiled constraint (compiler.py; sampling.processors)."""
        from mlx_lm.sample_utils import greedy_sampler

        from clusterctl.rank.engine.sampling import Guard, KeyedSampler, processors

        if req.id in self.by_id:
            raise ValueError(f"request {req.id} is already in the batch")
        if not self.seqs:
            self._mx.random.seed(req.seed)
        # sampled rows draw from keys of their own (the overlapped schedule's RowSampler): their tokens do not depend
        # on the batch, so choice i of a seeded request is the same whatever n (choices.py)
        sampler = KeyedSampler(req) if req.temperature > 0 else greedy_sampler
        procs = own = processors(req, grammar)
        # plain greedy rows share mlx-lm's one sampler object (the batch then takes one argmax for all of them)
        guard = None if sampler is greedy_sampler and not procs else Guard(sampler, procs)
        if guard is not None:
            sampler, procs = guard.sampler, guard.procs
        n = req.cache_len if prefix is not None else 0  # tokens whose KV the prompt cache gave
        (uid,) = self.gen.insert([list(req.tokens[n:])], max_tokens=[req.max_tokens], samplers=[sampler],
                                 logits_processors=[procs], caches=[prefix] if prefix is not None else None,
                                 all_tokens=[list(req.tokens[:n])])
        s = Seq(req=req, uid=uid, detok=self.tokenizer.detokenizer, emit=emit, stops=StopMatcher(req.stop),
                guard=guard, emit_lp=emit_lp, procs=own)
        if emit_lp is not None and req.logprobs >= 0:
            s.lp = Entries(self.tokenizer, req.logprobs)
        if req.prompt_logprobs >= 0:  # every rank evaluates (promptlogprobs.py); rank 0 reports
            entries = Entries(self.tokenizer, req.prompt_logprobs) if emit_lp is not None else None
            self.scorers[uid] = PromptScorer(req.tokens, req.prompt_logprobs, entries, emit_lp)
        self.seqs[uid] = s
        self.by_id[req.id] = s

    def drop(self, rid: str, finish: str, *, save: bool = False) -> GenResult | None:
        """Take a request out before it finished (cancelled, shutdown); None if it is not in the batch."""
        s = self.by_id.get(rid)
        if s is None:
            return None
        self._forget(s)
        return s.so_far(finish)

    def _forget(self, s: Seq) -> None:
        self.gen.remove([s.uid])
        self.scorers.pop(s.uid, None)
        del self.seqs[s.uid]
        del self.by_id[s.req.id]

    def step(self) -> list[tuple[str, GenResult]]:
        """One step of every request in the batch (a new request's prompt is processed in it); returns the
        requests that finished in it, in the batch's order (the same on every rank)."""
        done: list[tuple[str, GenResult]] = []
        if not self.seqs:
            return done
        self.steps += 1
        for r in self.gen.next_generated():
            s = self.seqs.get(r.uid)
            if s is None:
                continue
            self.produced += 1
            finish = r.finish_reason
            if s.guard is not None and s.guard.failed:  # its own values broke its sampling: it alone ends
                self._forget(s)
                done.append((s.req.id, s.so_far("error", s.guard.failed)))
                continue
            eos = finish == "stop" and r.token in self.eos  # the generator stopped on an EOS token
            if s.lp is not None and (not eos or s.lists_eos):
                s.emit_lp(s.lp.entry(int(r.token), s.lp.pending(r.logprobs)))
            finish = s.feed(int(r.token), eos=eos, otherwise=finish)
            if finish is None:
                continue
            if r.finish_reason is None:  # a stop string: the generator does not know, take it out here
                kept = self.gen.remove([s.uid], return_prompt_caches=self.pcache is not None)
                cache, tokens = kept.get(s.uid, (None, None))
            else:
                cache, tokens = r.prompt_cache, r.all_tokens
            if s.req.keep_prompt and self.shares is not None and cache is not None:
                self.shares.keep(s.req.id, cache, len(tokens), s.req.keep_prompt)
            elif self.pcache is not None and cache is not None:
                self.pcache.save(cache, len(tokens), list(tokens), took=s.req.took, partition=s.req.partition)
            del self.seqs[s.uid]
            del self.by_id[s.req.id]
            self.scorers.pop(s.uid, None)
            done.append((s.req.id, s.result(finish)))
        return done

    def close(self) -> None:
        self.gen.close()
