"""Layer allocation: how many layers each rank runs. Pure, exact (fractions.Fraction), deterministic.

- balanced: floor(L/N) each; the remainder goes one each to the first ranks in inventory order.
- proportional / speed: largest remainder on exact quotas L * w_i / sum(w), at least one layer per node.
  Nodes whose exact quota is below one layer get exactly one and the rest is re-apportioned among the others.
  Ties are broken by larger remainder, then larger weight, then node name (so input order never matters).
- work: the contiguous split with the smallest largest stage, rank 0's stage holding the head (see ``by_work``).
"""

from __future__ import annotations

from bisect import bisect_left
from fractions import Fraction
from itertools import accumulate, takewhile
from typing import Sequence

from clusterctl.errors import ConfigError


def balanced(num_layers: int, n: int) -> list[int]:
    _check(num_layers, n)
    base, extra = divmod(num_layers, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def largest_remainder(num_layers: int, weights: Sequence[Fraction | int], names: Sequence[str]) -> list[int]:
    """Seats per entry, in input order. Weights are exact (ints or Fractions); all must be > 0."""
    n = len(weights)
    _check(num_layers, n)
    if len(names) != n or len(set(names)) != n:
        raise ValueError("names must be unique, one per weight")
    w = [Fraction(x) for x in weights]
    if any(x <= 0 for x in w):
        raise ValueError("weights must be positive")
    counts = [0] * n
    active = list(range(n))
    seats = num_layers
    # Fix nodes whose quota is below one layer at exactly one, then re-apportion; repeat until stable.
    while True:
        total = sum(w[i] for i in active)
        low = [i for i in active if seats * w[i] / total < 1]
        if not low:
            break
        for i in low:
            counts[i] = 1
        seats -= len(low)
        active = [i for i in active if i not in low]
    total = sum(w[i] for i in active)
    quotas = {i: seats * w[i] / total for i in active}
    for i in active:
        counts[i] = int(quotas[i])  # floor: quotas are non-negative
    left = seats - sum(counts[i] for i in active)
    order = sorted(active, key=lambda i: (-(quotas[i] - counts[i]), -w[i], names[i]))
    for i in order[:left]:
        counts[i] += 1
    return counts


def by_work(layer_work: Sequence[int], head_work: int, n: int) -> list[int]:
    """Layers per rank for a pipeline whose stages compute at the same time (the slowest sets the pace): the
    contiguous split, in mlx-lm's order (rank 0 the last layers, plus ``head_work``), whose largest stage work is
    the smallest possible, every rank at least one layer. Works are non-negative integers; exact.

    Among the splits with that bottleneck, ranks are filled from rank 0: each takes the number of layers whose
    stage work comes closest to an equal share of the work still to place (the rank itself and those after it),
    the fewer layers on a tie. So equal layers without a head split within one layer of each other."""
    _check(len(layer_work), n)
    prefix = list(accumulate(layer_work, initial=0))  # prefix[j]: the work of layers [0, j)
    cap = _bottleneck(prefix, head_work, n)
    need = [0]  # need[j]: the fewest stages of at most ``cap`` that layers [0, j) fit in
    for j in range(1, len(prefix)):
        need.append(1 + need[_first_layer(prefix, j, cap)])
    counts, end, head = [], len(layer_work), head_work
    for left in range(n, 0, -1):  # ranks still to fill, this one included
        def stage(c: int) -> int:
            return prefix[end] - prefix[end - c] + head

        fits = [c for c in takewhile(lambda c: stage(c) <= cap, range(1, end - left + 2)) if need[end - c] < left]
        counts.append(min(fits, key=lambda c: (abs(left * stage(c) - prefix[end] - head), c)))
        end, head = end - counts[-1], 0
    return counts


def _first_layer(prefix: list[int], end: int, budget: int) -> int:
    """The lowest layer a stage ending at ``end`` can start at with at most ``budget`` of work (``end``: none)."""
    return bisect_left(prefix, prefix[end] - budget, 0, end)


def _bottleneck(prefix: list[int], head: int, n: int) -> int:
    """The smallest cap such that the layers fit in n stages of at most that work, rank 0's with the head."""
    def fits(cap: int) -> bool:
        end, budget = len(prefix) - 1, cap - head
        for _ in range(n):  # greedy from the top: each stage takes as many layers as fit
            start = _first_layer(prefix, end, budget)
            if start == end:
                return False
            end, budget = start, cap
            if end == 0:
                return True
        return False

    low, high = 0, prefix[-1] + head
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    return low


def exact_quotas(num_layers: int, weights: Sequence[Fraction | int]) -> list[Fraction]:
    w = [Fraction(x) for x in weights]
    total = sum(w)
    return [num_layers * x / total for x in w]


def _check(num_layers: int, n: int) -> None:
    if n < 1:
        raise ConfigError("no nodes to place layers on")
    if num_layers < n:
        raise ConfigError(f"the model has {num_layers} layers but the plan has {n} ranks: every rank needs at least one layer",
                          hint="use fewer nodes")


def layer_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Per rank [start, end) in model layer order. mlx-lm's pipeline gives rank 0 the LAST layers."""
    total = sum(counts)
    ranges = []
    end = total
    for c in counts:
        ranges.append((end - c, end))
        end -= c
    return ranges
