import random
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from clusterctl.errors import ConfigError
from clusterctl.plan.allocate import balanced, by_work, exact_quotas, largest_remainder, layer_ranges


def test_proportional_64_128_192_by_hand():
    # quotas 32*64/384 = 5.33, 32*128/384 = 10.67, 32*192/384 = 16: floors 5+10+16 = 31,
    # the one layer left goes to the largest remainder (b, 0.67) -> 5/11/16
    assert largest_remainder(32, [64, 128, 192], ["a", "b", "c"]) == [5, 11, 16]


def test_balanced_remainder_goes_to_first_ranks():
    assert balanced(10, 3) == [4, 3, 3]
    assert balanced(32, 3) == [11, 11, 10]
    assert balanced(3, 3) == [1, 1, 1]


def test_too_few_layers():
    with pytest.raises(ConfigError, match="every rank needs at least one layer"):
        balanced(2, 3)


def test_min_one_layer_reapportions():
    # node c's exact share is 0.03 layers: it gets one and the rest is split between a and b
    assert largest_remainder(8, [100, 100, 1], ["a", "b", "c"]) == [4, 3, 1] or \
        largest_remainder(8, [100, 100, 1], ["a", "b", "c"]) == [3, 4, 1]
    assert sorted(largest_remainder(8, [100, 100, 1], ["a", "b", "c"])) == [1, 3, 4]


def test_ties_broken_by_weight_then_name():
    assert largest_remainder(3, [1, 1], ["b", "a"]) == [1, 2]  # equal remainder, equal weight: name a wins
    assert largest_remainder(3, [1, 1], ["a", "b"]) == [2, 1]


def test_exact_fractions_not_floats():
    # 0.1 + 0.2 != 0.3 in floats; exact quotas make the three equal
    w = [Fraction("0.1") + Fraction("0.2"), Fraction("0.3"), Fraction("0.3")]
    assert largest_remainder(4, w, ["a", "b", "c"]) == [2, 1, 1]


def test_layer_ranges_rank0_runs_last_layers():
    assert layer_ranges([5, 11, 16]) == [(27, 32), (16, 27), (0, 16)]


weights_st = st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(weights=weights_st, extra=st.integers(min_value=0, max_value=200))
def test_properties(weights, extra):
    n = len(weights)
    layers = n + extra
    names = [f"n{i:02d}" for i in range(n)]
    counts = largest_remainder(layers, weights, names)
    assert sum(counts) == layers
    assert all(c >= 1 for c in counts)
    quotas = exact_quotas(layers, weights)
    if all(q >= 1 for q in quotas):
        assert all(abs(c - q) < 1 for c, q in zip(counts, quotas))
    # monotone: more weight never means fewer layers
    for i in range(n):
        for j in range(n):
            if weights[i] > weights[j]:
                assert counts[i] >= counts[j]
    # permuted input order gives each node the same count (ties are broken by name)
    perm = list(range(n))
    random.Random(layers).shuffle(perm)
    pc = largest_remainder(layers, [weights[i] for i in perm], [names[i] for i in perm])
    assert {names[i]: c for i, c in zip(perm, pc)} == dict(zip(names, counts))


@settings(max_examples=200, deadline=None)
@given(weights=weights_st, extra=st.integers(min_value=0, max_value=100), which=st.integers(min_value=0),
       bump=st.integers(min_value=1, max_value=5000))
def test_more_memory_never_loses_layers(weights, extra, which, bump):
    n = len(weights)
    names = [f"n{i:02d}" for i in range(n)]
    i = which % n
    before = largest_remainder(n + extra, weights, names)[i]
    bigger = list(weights)
    bigger[i] += bump
    assert largest_remainder(n + extra, bigger, names)[i] >= before


def test_balanced_properties():
    for n in range(1, 20):
        for layers in range(n, 80):
            c = balanced(layers, n)
            assert sum(c) == layers and max(c) - min(c) <= 1


# ---- by work ------------------------------------------------------------------------------------------------------

SMOLLM2_BLOCK, SMOLLM2_HEAD = 3_540_096, 28_311_552  # logical parameters of SmolLM2-135M's block and tied head


def test_a_heavy_head_gives_rank_0_fewer_layers():
    # measured: [19, 30) + head on rank 0 and [0, 19) on rank 1 decode at 15.0 tok/s, 15/15 at 12.7
    assert by_work([SMOLLM2_BLOCK] * 30, SMOLLM2_HEAD, 2) == [11, 19]
    # the 7M test model: a head lighter than a block changes nothing
    assert by_work([590_848] * 8, 524_288, 2) == [4, 4]


def test_three_ranks_and_ties():
    # head = 8 layers: 5 + 8 = 13 on rank 0, then 12 / 13 (a tie between 12 and 13 goes to the fewer layers)
    assert by_work([1] * 30, 8, 3) == [5, 12, 13]
    # equal layers, no head: within one layer of each other, the extra ones on the last ranks
    assert by_work([1] * 9, 0, 4) == [2, 2, 2, 3]
    assert by_work([1] * 10, 0, 3) == [3, 3, 4]
    # a heavy layer in the middle gets a stage of its own
    assert by_work([1, 1, 1, 10, 1, 1, 1], 0, 3) == [3, 1, 3]


def test_every_rank_keeps_one_layer():
    assert by_work([1] * 5, 100, 2) == [1, 4]
    assert by_work([1, 1, 1], 10**12, 3) == [1, 1, 1]
    with pytest.raises(ConfigError, match="every rank needs at least one layer"):
        by_work([1, 1], 0, 3)


def _best_bottleneck(work, head, n):
    """By brute force: every contiguous split of the layers into n stages of at least one layer."""
    from itertools import combinations

    best = None
    for cuts in combinations(range(1, len(work)), n - 1):
        bounds = [len(work), *reversed(cuts), 0]  # rank 0 first: the last layers
        stages = [sum(work[bounds[i + 1]:bounds[i]]) + (head if i == 0 else 0) for i in range(n)]
        best = max(stages) if best is None else min(best, max(stages))
    return best


@settings(max_examples=300, deadline=None)
@given(work=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=10),
       head=st.integers(min_value=0, max_value=200), n=st.integers(min_value=1, max_value=4))
def test_by_work_finds_the_smallest_bottleneck(work, head, n):
    if n > len(work):
        return
    counts = by_work(work, head, n)
    assert sum(counts) == len(work) and all(c >= 1 for c in counts)
    stages = [sum(work[s:e]) + (head if i == 0 else 0) for i, (s, e) in enumerate(layer_ranges(counts))]
    assert max(stages) == _best_bottleneck(work, head, n)
