"""The prompt cache: the KV of recent token sequences, so a prompt that starts like an earlier one (a chat client
sends the whole conversation again every turn) computes only its new suffix.

Every rank keeps the KV of its own layers (a pipeline stage) or of its own heads (tensor parallel) for the same
entries, under the same ids: the cache's state changes only by ``take`` and ``save``, which every rank calls in
the same order with the same arguments — ``take`` when a request joins the batch (rank 0 chose the entry and the
prefix length before the meeting and sent them with the request), ``save`` when a request that finished normally
leaves the batch. Evictions follow (least recently used first, until the entries hold at most ``budget`` tokens),
so they are the same everywhere without a word on the wire. Only rank 0 knows entries' tokens (it looks them up).

Partitions: an entry is reused only by a request of the same partition (a hash of the caller's tenant, i.e. its
API key, and its ``cache_salt``). Without them, whether a prompt was served faster, or the hit counter of
/metrics, told any caller token by token whether another caller's prompt began the same way (docs/security.md).
The budget and the eviction order stay shared.

A request reuses at most all but the last token of its prompt (the last is its first step's input), and only a
prefix of at least ``MIN_REUSE`` tokens. Caches are only reused for models whose every layer keeps a plain
``KVCache`` (a prefix of it is a prefix of the sequence); sliding-window or state caches turn the cache off.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from clusterctl.errors import IntegrityError
from clusterctl.modelfiles.archs import cache_kinds

MIN_REUSE = 8


@dataclass
class Entry:
    cache: list  # per layer: mlx-lm's single-sequence KVCache
    count: int  # tokens held
    tokens: list[int] | None  # rank 0: the tokens whose KV this is
    partition: str | None = None  # rank 0: whose prompt it was (only that partition reuses it)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_copy(cache, n: int):
    """A new cache of the same class holding the first ``n`` tokens of ``cache`` (the entry itself is never
    changed); a quantized entry (plan --kv-bits, rank/engine/kvquant.py) stays quantized."""
    from mlx_lm.models.cache import QuantizedKVCache

    if isinstance(cache, QuantizedKVCache):
        c = type(cache)(group_size=cache.group_size, bits=cache.bits)
        if cache.keys is not None:
            c.keys = [x[..., :n, :] for x in cache.keys]
            c.values = [x[..., :n, :] for x in cache.values]
            c.offset = n
        return c
    c = type(cache)()
    if cache.keys is not None:
        c.keys = cache.keys[..., :n, :]
        c.values = cache.values[..., :n, :]
        c.offset = n
    return c


def reusable(model) -> bool:
    """Does every layer of this model keep a plain KVCache (so that a prefix can be reused)?"""

    return all(k == "KVCache" for k in cache_kinds(model))


class PromptCache:
    def __init__(self, budget: int):
        self.budget = max(0, budget)  # tokens, summed over the entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.held = 0
        self.next_id = 1  # ids are given in save order: the same on every rank

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def on(self) -> bool:
        return self.budget > 0

    def lookup(self, tokens: list[int], partition: str | None = None) -> tuple[int, int] | None:
        """Rank 0: (entry id, tokens to reuse) for the entry of ``partition`` sharing the longest prefix with
        ``tokens``."""
        best: tuple[int, int] | None = None
        for eid, e in self.entries.items():
            if e.tokens is None or e.partition != partition:
                continue
            n = min(common_prefix(e.tokens, tokens), len(tokens) - 1)
            if n >= MIN_REUSE and (best is None or n > best[1]):
                best = (eid, n)
        return best

    def take(self, eid: int, n: int, *, missing_ok: bool = False) -> list | None:
        """The first ``n`` tokens of entry ``eid`` as a fresh cache; the entry becomes the most recently used.
        ``missing_ok``: None when the entry is gone (evicted since rank 0 chose it; gone on every rank alike)."""
        e = self.entries.get(eid)
        if e is None and missing_ok:
            return None
        if e is None or not 0 < n <= e.count:
            raise IntegrityError(f"prompt cache entry {eid} ({n} tokens) is not on this rank: the ranks disagree")
        self.entries.move_to_end(eid)
        return [prefix_copy(c, n) for c in e.cache]

    def save(self, cache: list, count: int, tokens: list[int] | None, *, took: tuple[int, int] | None = None,
             partition: str | None = None) -> int:
        """Keep a finished request's KV (``count`` tokens); returns its id. An entry it reused whole is replaced
        by it (the new one starts with the same tokens)."""
        import mlx.core as mx

        eid = self.next_id
        self.next_id += 1
        if not self.on or count <= 0 or count > self.budget:
            return eid
        if took is not None and took[0] in self.entries and took[1] == self.entries[took[0]].count:
            self._forget(took[0])
        if tokens is not None:
            tokens = tokens[:count]
        mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
        self.entries[eid] = Entry(cache=cache, count=count, tokens=tokens, partition=partition)
        self.held += count
        while self.held > self.budget:
            self._forget(next(iter(self.entries)))
        return eid

    def _forget(self, eid: int) -> None:
        e = self.entries.pop(eid)
        self.held -= e.count
