"""The prompt cache's bookkeeping (rank/engine/promptcache.py): ids in save order, least recently used first out,
a token budget, the longest shared prefix, never the whole prompt, replacement of an entry reused whole."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from clusterctl.errors import IntegrityError
from clusterctl.rank.engine.promptcache import MIN_REUSE, PromptCache, common_prefix, prefix_copy


def kv(n: int, layers: int = 2) -> list[KVCache]:
    out = []
    for i in range(layers):
        c = KVCache()
        k = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1) + i
        c.update_and_fetch(k, k * 2)
        out.append(c)
    return out


def test_lookup_takes_the_longest_shared_prefix_and_leaves_the_last_prompt_token():
    pc = PromptCache(1000)
    a = pc.save(kv(20), 20, list(range(20)))
    b = pc.save(kv(30), 30, list(range(10)) + [99] * 20)
    assert (a, b) == (1, 2)
    assert pc.lookup(list(range(25))) == (a, 20)
    assert pc.lookup(list(range(20))) == (a, 19)  # the last token is the first step's input
    assert pc.lookup(list(range(10)) + [99] * 5 + [7]) == (b, 15)
    assert pc.lookup(list(range(MIN_REUSE - 1)) + [5000]) is None  # too short to be worth it
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_take_copies_a_prefix_and_never_changes_the_entry():
    pc = PromptCache(1000)
    eid = pc.save(kv(12), 12, list(range(12)))
    got = pc.take(eid, 9)
    assert [c.offset for c in got] == [9, 9] and got[1].keys.shape[2] == 9
    assert mx.array_equal(got[1].keys[0, 0, :, 0], mx.arange(9, dtype=mx.float32) + 1).item()
    got[0].update_and_fetch(mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)))  # the request goes on from there
    assert pc.entries[eid].cache[0].offset == 12
    with pytest.raises(IntegrityError):
        pc.take(eid, 13)
    with pytest.raises(IntegrityError):
        pc.take(77, 1)


def test_least_recently_used_entries_leave_first_within_the_token_budget():
    pc = PromptCache(100)
    a = pc.save(kv(40), 40, None)
    b = pc.save(kv(40), 40, None)
    pc.take(a, 10)  # a is now the most recent
    c = pc.save(kv(40), 40, None)
    assert list(pc.entries) == [a, c] and pc.held == 80
    d = pc.save(kv(101), 101, None)  # larger than the whole budget: never kept, but its id is used
    assert d == c + 1 and d not in pc.entries
    assert b not in pc.entries


def test_an_entry_reused_whole_is_replaced_by_the_longer_one():
    pc = PromptCache(1000)
    a = pc.save(kv(20), 20, list(range(20)))
    b = pc.save(kv(30), 30, list(range(30)), took=(a, 20))
    assert list(pc.entries) == [b]
    c = pc.save(kv(35), 35, list(range(35)), took=(b, 25))  # reused in part: both stay
    assert list(pc.entries) == [b, c]


def test_a_cache_of_no_budget_keeps_nothing_but_counts_ids_alike():
    pc = PromptCache(0)
    assert not pc.on and pc.save(kv(5), 5, None) == 1 and pc.save(kv(5), 5, None) == 2 and len(pc) == 0
    assert prefix_copy(KVCache(), 3).keys is None


def test_an_entry_is_reused_only_within_its_partition():
    pc = PromptCache(1000)
    a = pc.save(kv(20), 20, list(range(20)), partition="alice")
    assert pc.lookup(list(range(25)), "alice") == (a, 20)
    assert pc.lookup(list(range(25)), "bob") is None
    assert pc.lookup(list(range(25))) is None  # no partition is a partition of its own
    b = pc.save(kv(20), 20, list(range(20)), partition="bob")
    assert pc.lookup(list(range(25)), "bob") == (b, 20) and pc.lookup(list(range(25)), "alice") == (a, 20)
