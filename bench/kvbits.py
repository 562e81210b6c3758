"""Benchmark: what plan --kv-bits buys and costs.

1. The context that fits a fixed node with and without --kv-bits 4 / 8 (pure plan computation, ``kv_fit``):
   a 7B-class model (28 layers, 4 KV heads of 128, bfloat16 cache, 4-bit weights) on two 16 GB nodes.
2. Decode tokens/s with the cache in full precision, 8-bit and 4-bit, through the code the ranks run (mlx-lm's
   BatchGenerator on the caches rank/engine/kvquant.py makes), one process, the 7M model, arms in rotating rounds.
3. What quantizing does to the answers: SmolLM2-135M-Instruct's mean log-likelihood of a text (the repository's
   docs) and the share of positions whose greedy token stays the same, the cache quantized after the first
   256 tokens (quantized_kv_start 0 with a first chunk of 256), against full precision.

Run: .venv/bin/python bench/kvbits.py [--quick]     (--quick: shorter prompts and text, fewer tokens and rounds)
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import REPO, model, say

ARMS = [("full", None), ("8-bit", 8), ("4-bit", 4)]


def fit_rows() -> None:
    from clusterctl.plan.inventory import parse_cluster
    from clusterctl.plan.model import ModelFacts
    from clusterctl.plan.planner import make_deployment
    from clusterctl.protocol.deployment import KvLayer, PlanOptions

    layers = 28
    facts = ModelFacts(name="7b-class", model_type="qwen2", num_layers=layers, hidden_size=3584, num_heads=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False,
                       layer_bytes=[130 << 20] * layers, shared_bytes=600 << 20, kv_dtype_bytes=2,
                       facts_hash="0" * 64, files=["model.safetensors"],
                       kv_layers=[KvLayer(kind="full", bytes_per_token=2 * 4 * 128 * 2)] * layers)
    cluster = parse_cluster({"cluster": {"name": "bench"}, "node": [
        {"name": n, "host": f"10.0.0.{i + 1}", "memory_gb": 16, "model_path": "/models/m"}
        for i, n in enumerate("ab")]})
    say("1. the context that fits two 16 GB nodes (7B-class, 4-bit weights, bf16 cache), per sequence:")
    for batch in (1, 8):
        cells = []
        for name, bits in ARMS[1:]:
            dep = make_deployment(cluster, facts, "/models/m", PlanOptions(
                context=1024, batch=batch, kv_bits=bits, quantized_kv_start=0, parallel="pipeline"))
            fit = dep.kv_fit
            cells.append(f"{name} {fit.max_context:>7} ({fit.max_context / fit.max_context_full:.2f}x)")
        say(f"   batch {batch}: full {fit.max_context_full:>7} | " + " | ".join(cells))


def decode_rate(path, bits: int | None, prompt: int, rows: int, steps: int) -> float:
    """Decode tokens/s of ``rows`` sequences of ``prompt`` tokens on mlx-lm's BatchGenerator."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from clusterctl.rank.engine.kvquant import quantize_kv

    m, tok = load(str(path))
    quantize_kv(m, bits, 64, 0)
    gen = BatchGenerator(m, stop_tokens=[], completion_batch_size=rows, prefill_batch_size=rows)
    mx.random.seed(0)
    prompts = mx.random.randint(3, 200, (rows, prompt)).tolist()
    gen.insert(prompts, max_tokens=[steps] * rows)
    got, t0 = 0, None
    while True:
        out = gen.next_generated()
        if not out:
            break
        if t0 is None:  # the first tokens come out of the prefill: time the decoding after them
            t0 = time.perf_counter()
            continue
        got += len(out)
    return got / (time.perf_counter() - t0)


def speed_rows(quick: bool) -> None:
    path = model("7m")
    prompt, rows, steps, rounds = (256, 2, 16, 2) if quick else (1024, 4, 32, 3)
    say(f"2. decode tokens/s, {path.name}, {rows} rows of {prompt}-token prompts, {steps} steps "
        f"(median of {rounds} rotating rounds):")
    seen: dict[str, list[float]] = {name: [] for name, _ in ARMS}
    for r in range(rounds):
        for name, bits in ARMS[r % 3:] + ARMS[: r % 3]:
            seen[name].append(decode_rate(path, bits, prompt, rows, steps))
    full = statistics.median(seen["full"])
    say("   " + " | ".join(f"{n} {statistics.median(v):.1f} tok/s ({statistics.median(v) / full:.2f}x)"
                           for n, v in seen.items()))


def quality_rows(quick: bool) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    m, tok = load(str(model("smollm2")))
    text = (REPO / "docs" / "architecture.md").read_text() + (REPO / "docs" / "allocation.md").read_text()
    n = 512 if quick else 1024
    tokens = mx.array(tok.encode(text)[: n + 1])[None]
    first = 256

    def scored(bits):
        cache = make_prompt_cache(m)
        m(tokens[:, :first], cache=cache)
        maybe_quantize_kv_cache(cache, 0, 64, bits)
        outs = []
        for s in range(first, n, 64):  # decoding-like: each chunk attends over the (quantized) cache
            outs.append(m(tokens[:, s: min(s + 64, n)], cache=cache))
            maybe_quantize_kv_cache(cache, 0, 64, bits)
        logits = mx.concatenate(outs, axis=1).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = tokens[:, first + 1: n + 1]
        nll = -mx.take_along_axis(lp, target[..., None], axis=-1).mean().item()
        return nll, mx.argmax(logits, axis=-1)

    base_nll, base_top = scored(None)
    say(f"3. SmolLM2-135M on {n - first} tokens of docs/ after a 256-token prefix (mean negative log-likelihood, "
        f"greedy token unchanged):")
    cells = [f"full {base_nll:.4f}"]
    for name, bits in ARMS[1:]:
        nll, top = scored(bits)
        same = (top == base_top).astype(mx.float32).mean().item()
        cells.append(f"{name} {nll:.4f} ({nll - base_nll:+.4f}, {same * 100:.1f}% same)")
    say("   " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    quick = ap.parse_args().quick
    fit_rows()
    speed_rows(quick)
    quality_rows(quick)


if __name__ == "__main__":
    main()
