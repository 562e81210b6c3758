"""Benchmark (issue 11): what batching can give on this machine at all, before any server or pipeline.

Run: .venv/bin/python bench/batchcost.py [--rounds N] [--steps N] [--models 7m,100m]

One process, mlx-lm's own BatchGenerator (what the ranks decode with), no HTTP, no ring: the time of one decode
step at batch 1, 4 and 8, interleaved round by round, medians. A step at batch b yields b tokens, so
b x step(1) / step(b) is the most any server of this model on this machine can gain from b concurrent streams
over one: the ceiling for "aggregate tok/s at 8 clients >= 3x one client". (On a GPU a batched matmul costs
nearly the same as one row; on a CPU it grows with the batch.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_note, model, say, table  # noqa: E402

BATCHES = (1, 4, 8)
PROMPT = [{"role": "user", "content": "Tell me about the sea and the ships that sail on it."}]


def step_seconds(gen_model, prompt: list[int], batch: int, steps: int) -> float:
    from mlx_lm.generate import BatchGenerator

    g = BatchGenerator(gen_model, stop_tokens=[], completion_batch_size=max(BATCHES),
                       prefill_batch_size=max(BATCHES))
    try:
        g.insert([prompt] * batch, max_tokens=[steps + 64] * batch)
        for _ in range(8):  # the prompts, then a few steps to warm up
            g.next_generated()
        t = time.perf_counter()
        for _ in range(steps):
            g.next_generated()
        return (time.perf_counter() - t) / steps
    finally:
        g.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=96, help="decode steps timed per batch size and round")
    ap.add_argument("--models", default="7m", help="comma list of 7m, 100m")
    ns = ap.parse_args()
    from mlx_lm import load

    say(f"bench/batchcost.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds={ns.rounds} "
        f"steps={ns.steps}")
    for kind in ns.models.split(","):
        gen_model, tok = load(str(model(kind)))
        prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
        got: dict[int, list[float]] = {b: [] for b in BATCHES}
        for r in range(ns.rounds):
            order = BATCHES[r % len(BATCHES):] + BATCHES[:r % len(BATCHES)]
            for b in order:
                got[b].append(step_seconds(gen_model, prompt, b, ns.steps))
        step = {b: statistics.median(v) for b, v in got.items()}
        rows = [[str(b), f"{step[b] * 1000:.2f}", f"{b / step[b]:.0f}", f"{step[b] / step[1]:.2f}x",
                 f"{b * step[1] / step[b]:.2f}x"] for b in BATCHES]
        say(f"{kind}: one decode step of mlx-lm's BatchGenerator, one process (median of {ns.rounds})")
        say(table(rows, ["batch", "ms/step", "tok/s", "step cost vs batch 1", "ceiling vs 1 stream"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
