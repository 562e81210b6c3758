"""Benchmark (issue 44.1): prompt-logprob throughput, the work of an evaluation harness (lm-eval's loglikelihood
requests: echo, logprobs 1, the prompt as token ids), in prompt tokens scored per second; side by side in one run.

Run: .venv/bin/python bench/promptlogprobs.py [--quick] [--model 100m|7m] [--requests N] [--prompt-tokens N]
     [--concurrency C] [--rounds R]

Arms (each scores the same prompts; distinct prompts, so no prompt cache could help):
  one      one mlx-lm process: one forward pass per prompt, float32 log-softmax, each token's logprob and its top
           alternative evaluated (what an mlx-lm user scoring by hand runs)
  over2    2 local ranks, overlapped schedule: /v1/completions with echo, logprobs 1, max_tokens 0, C at a time
  lock2    the same on the lockstep schedule
  plain2   the overlapped ranks again, the same prompts without echo (max_tokens 1): what scoring adds to the
           prompt's prefill
Ratios are against "one". The rank arms are started by the rank test harness (tests/launch/rankharness.py).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "launch"))
from _common import PY, fmt, machine_note, med, model, ratio, say, table  # noqa: E402

_ONE = """
import json, sys, time
import mlx.core as mx
from mlx_lm import load
path, prompts = sys.argv[1], json.loads(sys.stdin.read())
model, tok = load(path)
def score(tokens):
    x = model(mx.array(tokens)[None]).astype(mx.float32)[0, :-1]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens[1:])[:, None], axis=-1)
    top = mx.argmax(lp, axis=-1)
    mx.eval(chosen, top)
    return chosen.tolist()
score(prompts[0])  # warm up
t = time.perf_counter()
for p in prompts:
    score(p)
print(json.dumps(time.perf_counter() - t))
"""


def prompts_of(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    return [[(7 * i + 131 * (seed * n + k)) % (vocab - 300) + 259 for i in range(length)] for k in range(n)]


def one_process(path: Path, prompts: list[list[int]]) -> float:
    p = subprocess.run([PY, "-c", _ONE, str(path)], input=json.dumps(prompts), capture_output=True, text=True,
                       check=True)
    return json.loads(p.stdout)


def post(base: str, body: dict, timeout: float = 900) -> dict:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "default_model", **body}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {out[:200]!r}")
    return json.loads(out)


def served(base: str, prompts: list[list[int]], concurrency: int, scored: bool) -> float:
    """Wall time of every prompt answered, ``concurrency`` in flight."""
    body = {"echo": True, "logprobs": 1, "max_tokens": 0} if scored else {"max_tokens": 1}
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: post(base, {"prompt": p, "temperature": 0, **body}), prompts))
    wall = time.perf_counter() - t
    if scored:
        assert all(len(o["choices"][0]["logprobs"]["token_logprobs"]) == len(p) for o, p in zip(outs, prompts))
    return wall


@contextlib.contextmanager
def ranks(path: Path, schedule: str, work: Path, context: int):
    from rankharness import RankCluster

    c = RankCluster(Path(tempfile.mkdtemp(dir=work)), path, [4, 4], tag=f"pl{schedule[:4]}",
                    overrides={"max_batch": 8, "context_tokens": context, "control_timeout_s": 120.0,
                               "schedule": schedule})
    try:
        c.up(timeout=300)
        yield c.url
    finally:
        c.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 8 prompts of 128 tokens, the 7m model")
    ap.add_argument("--model", default=None, help="100m (the bench preset; default) or 7m (--quick's)")
    ap.add_argument("--requests", type=int, default=None, help="prompts per arm and round (default 24)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 400 (--quick 200)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (lm-eval's num_concurrent)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--arms", default="one,over2,lock2,plain2")
    ns = ap.parse_args()
    ns.requests = ns.requests or (8 if ns.quick else 24)
    ns.prompt_tokens = ns.prompt_tokens or (128 if ns.quick else 400)
    ns.model = ns.model or ("7m" if ns.quick else "100m")
    ns.rounds = ns.rounds or (1 if ns.quick else 2)
    arms = ns.arms.split(",")
    path = model(ns.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    say(f"bench/promptlogprobs.py: {ns.model} model, {ns.requests} prompts of {ns.prompt_tokens} tokens, "
        f"{ns.concurrency} in flight; {machine_note()}")
    work = Path(tempfile.mkdtemp(prefix="bench-promptlp-"))
    scored = ns.requests * (ns.prompt_tokens - 1)  # the first token of each has no logprob
    speed: dict[str, list[float]] = {a: [] for a in arms}
    for rnd in range(ns.rounds):
        prompts = prompts_of(vocab, ns.requests, ns.prompt_tokens, rnd)
        order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]  # rotated: the machine's load drifts alike
        for a in order:
            if a == "one":
                speed[a].append(scored / one_process(path, prompts))
            elif a in ("over2", "plain2", "lock2"):
                with ranks(path, "lockstep" if a == "lock2" else "overlap", work, ns.prompt_tokens + 64) as base:
                    post(base, {"prompt": prompts[0][:8], "max_tokens": 1})  # warm up
                    speed[a].append(scored / served(base, prompts, ns.concurrency, a != "plain2"))
            say(f"round {rnd + 1} {a}: {fmt(speed[a][-1], ' tok/s', 0)}")
    one = med(speed.get("one") or [])
    rows = [[a, fmt(med(speed[a]), " tok/s", 0), ratio(med(speed[a]), one), str(len(speed[a]))]
            for a in arms if speed[a]]
    say("\nprompt tokens scored per second (median over rounds; plain2: the same prompts' prefill, unscored):")
    say(table(rows, ["arm", "scored", "vs one", "rounds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
