"""Benchmark: a 1000-node x 1000-layer proportional plan (allocation + fit + hash), side by side with balanced.

Run: .venv/bin/python bench/plan.py
"""

from __future__ import annotations

import random
import statistics
import time

from clusterctl.protocol.deployment import PlanOptions
from clusterctl.plan.inventory import parse_cluster
from clusterctl.plan.model import ModelFacts
from clusterctl.plan.planner import make_deployment


def facts(layers: int) -> ModelFacts:
    return ModelFacts(name="synthetic", model_type="qwen2", num_layers=layers, hidden_size=4096, num_heads=32,
                      num_kv_heads=8, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                      layer_bytes=[200 << 20] * layers, shared_bytes=1 << 30, kv_dtype_bytes=2,
                      facts_hash="0" * 64, files=["model.safetensors"])


def cluster(n: int):
    rng = random.Random(0)
    nodes = [{"name": f"n{i:04d}", "host": f"10.{i // 250}.{i % 250}.1", "memory_gb": rng.choice([16, 24, 32, 64, 96, 128, 192]),
              "model_path": "/models/m"} for i in range(n)]
    return parse_cluster({"cluster": {"name": "big"}, "node": nodes})


def timed(fn, repeat=5):
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    c, f = cluster(1000), facts(1000)
    prop = timed(lambda: make_deployment(c, f, "/models/m", PlanOptions(allocation="proportional", context=512)))
    bal = timed(lambda: make_deployment(c, f, "/models/m", PlanOptions(allocation="balanced", context=512)))
    print(f"1000 nodes x 1000 layers: proportional {prop * 1000:.1f} ms, balanced {bal * 1000:.1f} ms "
          f"(median of 5; proportional/balanced = {prop / bal:.2f}x; target: well under 1000 ms)")


if __name__ == "__main__":
    main()
