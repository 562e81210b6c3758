"""Benchmark (issue 44.4): what a LoRA adapter costs per decoded token, served as the ranks serve it (LoRA layers
beside the base linears, unfused) and fused into the base weights, side by side with the base model, in one run.

Run: .venv/bin/python bench/adapter.py [--models 100m,smollm2] [--tokens 64] [--runs 5] [--rank 8]

One process per model; arms in turn on the same loaded weights: base, lora (every linear of every block adapted,
rank --rank, non-zero B), fused (mlx-lm's ``fuse()`` of the same adapter: plain linears again). Per arm: the
median decode rate of --runs greedy generations of --tokens tokens after a short prompt (batch 1), and ms/token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, machine_note, med, model, say, table  # noqa: E402


def _rate(m, tok, n: int, runs: int) -> float:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    rates = []
    for _ in range(runs + 1):  # the first run warms up
        last = None
        for last in stream_generate(m, tok, "def main(argv):", max_tokens=n, sampler=make_sampler(0.0)):
            pass
        rates.append(last.generation_tps)
    return med(rates[1:])


def measure(kind: str, n: int, runs: int, rank: int) -> list[list[str]]:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    m, tok = load(str(model(kind)))
    base = _rate(m, tok, n, runs)
    m.freeze()
    linear_to_lora_layers(m, len(m.layers), {"rank": rank, "dropout": 0.0, "scale": 20.0})
    m.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.02) for k, v in
                             tree_flatten(m.trainable_parameters())]))
    mx.eval(m.parameters())
    lora = _rate(m, tok, n, runs)
    m.update_modules(tree_unflatten([(k, x.fuse()) for k, x in m.named_modules() if hasattr(x, "fuse")]))
    mx.eval(m.parameters())
    fused = _rate(m, tok, n, runs)
    return [[kind, arm, fmt(r, digits=1), fmt(1000 / r if r else None), fmt(base / r if r else None)]
            for arm, r in (("base", base), ("lora", lora), ("fused", fused))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="100m,smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    rows = [row for k in a.models.split(",") for row in measure(k, a.tokens, a.runs, a.rank)]
    say(table(rows, ["model", "arm", "tok/s", "ms/token", "x base"]))
    say(f"({machine_note()}; batch 1, {a.tokens} tokens, median of {a.runs} runs, LoRA rank {a.rank} on every "
        f"linear of every block)")


if __name__ == "__main__":
    main()
