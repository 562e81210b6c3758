"""Benchmark (issue 44.4): what a LoRA adapter costs per decoded token, served as the ranks serve it (LoRA layers
beside the base linears, unfused) and fused into the base weights, side by side with the base model, in one run.

Run: .venv/bin/python bench/adapter.py [--models 7m,100m,smollm2] [--tokens 64] [--runs 6] [--rank 8]

One process per model, three copies of it loaded: base, lora (every linear of every block adapted, rank --rank,
non-zero B), fused (mlx-lm's ``fuse()`` of the same adapter: plain linears again). Rounds interleave the arms,
the order rotating (the machine is shared and noisy). Per arm: the median decode rate of --runs greedy
generations of --tokens tokens after a short prompt (batch 1), ms/token, and the rate over the base's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, machine_note, med, model, say, table  # noqa: E402

PROMPT = "def main(argv):"
ARMS = ["base", "lora", "fused"]


def _rate(m, tok, n: int) -> float:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    last = None
    for last in stream_generate(m, tok, PROMPT, max_tokens=n, sampler=make_sampler(0.0)):
        pass
    return last.generation_tps


def _loaded(kind: str, rank: int, arm: str):
    """The model as ``arm`` serves it: base, with LoRA layers (seeded: the same adapter for lora and fused), fused."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    m, tok = load(str(model(kind)))
    if arm != "base":
        m.freeze()
        linear_to_lora_layers(m, len(m.layers), {"rank": rank, "dropout": 0.0, "scale": 20.0})
        mx.random.seed(1)
        m.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.02) for k, v in
                                 tree_flatten(m.trainable_parameters())]))
    if arm == "fused":
        m.update_modules(tree_unflatten([(k, x.fuse()) for k, x in m.named_modules() if hasattr(x, "fuse")]))
    mx.eval(m.parameters())
    return m, tok


def measure(kind: str, n: int, runs: int, rank: int) -> list[list[str]]:
    loaded = {a: _loaded(kind, rank, a) for a in ARMS}
    for a in ARMS:  # warm up
        _rate(*loaded[a], 8)
    rates: dict[str, list[float]] = {a: [] for a in ARMS}
    for r in range(runs):
        for a in ARMS[r % 3:] + ARMS[:r % 3]:
            rates[a].append(_rate(*loaded[a], n))
    base = med(rates["base"])
    rows = []
    for a in ARMS:
        x = med(rates[a])
        rows.append([kind, a, fmt(x, digits=1), fmt(1000 / x if x else None),
                     fmt(x / base if x and base else None)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="7m,100m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    rows = [row for k in a.models.split(",") for row in measure(k, a.tokens, a.runs, a.rank)]
    say(table(rows, ["model", "arm", "tok/s", "ms/token", "rate / base"]))
    say(f"({machine_note()}; batch 1, {a.tokens} tokens, median of {a.runs} interleaved runs, LoRA rank {a.rank} "
        f"on every linear of every block)")


if __name__ == "__main__":
    main()
