"""Layer allocation: how many layers each rank runs. Pure, exact (fractions.Fraction), deterministic.

- balanced: floor(L/N) each; the remainder goes one each to the first ranks in inventory order.
- proportional / speed: largest remainder on exact quotas L * w_i / sum(w), at least one layer per node.
  Nodes whose exact quota is below one layer get exactly one and the rest is re-apportioned among the others.
  Ties are broken by larger remainder, then larger weight, then node name (so input order never matters).
"""

from __future__ import annotations

from fractions import Fraction
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
