"""Benchmark (issue 44.2): one request with n=4 choices against four separate requests of the same prompt, on one
deployment of 2 local ranks (pipeline, overlapped), arms interleaved in rotating rounds.

Run: .venv/bin/python bench/choices.py [--quick] [--rounds N] [--words N] [--max-tokens N] [--model 7m|100m]

Arms (same prompt length, a distinct prompt each time so that no prompt cache entry helps either arm):
  n4    one completion, n=4, sampled (temperature 0.8)
  four  four completions of the same prompt sent at once, n=1 each, sampled
Per arm: the wall time until all four answers are in, completion tokens per second over it, and the prompt work
as rank 0's /metrics counts it (clusterctl_prompt_tokens_processed_total: prompt tokens the ranks processed), per
prompt token. `--quick`: the 7M model, 3 rounds, a ~300-token prompt (full: the 100M model, 8 rounds, ~900 tokens).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, log, machine_note, med, model, say, table  # noqa: E402
from overlap import plan  # noqa: E402
from serve import Round, arm_clusterctl  # noqa: E402

WORDS = ["river", "stone", "ledger", "orbit", "lantern", "cedar", "signal", "harbor", "quartz", "meadow"]
CHOICES = 4


def prompt(k: int, words: int) -> str:
    """A distinct prompt (its first words differ, so no prompt-cache prefix of an earlier one is reused)."""
    body = " ".join(WORDS[(k * 3 + j * 7) % len(WORDS)] for j in range(words))
    return f"Note {k}: {body}"


def complete(base: str, body: dict) -> dict:
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {str(out)[:200]}")
    return out


def processed(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        fams = list(text_string_to_metric_families(resp.read().decode()))
    return next((s.value for f in fams for s in f.samples if s.name == "clusterctl_prompt_tokens_processed_total"),
                0.0)


def one_arm(arm: str, base: str, text: str, max_tokens: int, seed: int) -> tuple[float, int, int, float]:
    """(seconds, completion tokens, prompt tokens, prompt tokens processed) of one go of ``arm``."""
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.8, "stop": "\x00never"}
    before = processed(base)
    t0 = time.monotonic()
    if arm == "n4":
        outs = [complete(base, {**body, "n": CHOICES, "seed": seed})]
    else:
        outs: list = [None] * CHOICES

        def one(i: int) -> None:
            outs[i] = complete(base, {**body, "seed": seed + i})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(CHOICES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    took = time.monotonic() - t0
    time.sleep(0.2)  # (the counter is rank 0's: the last join was counted before the answers, this is margin)
    work = processed(base) - before
    return took, sum(o["usage"]["completion_tokens"] for o in outs), outs[0]["usage"]["prompt_tokens"], work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 7M model, 3 rounds, a ~300-token prompt")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--words", type=int, default=None, help="words in the prompt (about 3 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", choices=("7m", "100m"), default=None)
    ns = ap.parse_args()
    rounds = ns.rounds or (3 if ns.quick else 8)
    words = ns.words or (100 if ns.quick else 300)
    kind = ns.model or ("7m" if ns.quick else "100m")
    say(f"bench/choices.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  model={kind}  rounds={rounds}  "
        f"words={words}  max_tokens={ns.max_tokens}")
    path = model(kind)
    got: dict[str, list] = {"n4": [], "four": []}
    with tempfile.TemporaryDirectory(prefix="bench-choices-") as tmp:
        work = Path(tmp)
        env = {"CLUSTERCTL_STATE_DIR": str(work / "state")}
        dep = plan(work, env, path, "choices", "--schedule", "overlap", context=2048)
        r = Round("pp2", kind)
        with arm_clusterctl(dep, env, r) as (_t0, base, _pids, _layers, _all):
            complete(base, {"prompt": prompt(10_000, 8), "max_tokens": 2, "n": 2})  # warm-up
            k = 0
            for i in range(rounds):
                for arm in (("n4", "four") if i % 2 == 0 else ("four", "n4")):
                    k += 1
                    got[arm].append(one_arm(arm, base, prompt(k, words), ns.max_tokens, seed=i))
                    took, toks, p, w = got[arm][-1]
                    log(f"round {i + 1} {arm}: {took:.3f} s, {toks} tokens, prompt {p} tokens, processed {w:.0f}")
        if r.error:
            say(f"teardown: {r.error}")
    rows = []
    for arm, what in (("n4", "one request, n=4"), ("four", "four requests, n=1")):
        took = med([t for t, *_ in got[arm]])
        rate = med([c / t for t, c, _, _ in got[arm]])
        work = med([w / p for _, _, p, w in got[arm]])
        rows.append([what, fmt(took, " s", 3), fmt(rate, " tok/s", 1), fmt(work, "x", 2)])
    ratio_t = med([a[0] / b[0] for a, b in zip(got["n4"], got["four"])])
    ratio_w = med([(a[3] / a[2]) / (b[3] / b[2]) for a, b in zip(got["n4"], got["four"])])
    say("")
    tokens = got["n4"][0][2] if got["n4"] else None
    say(f"== {CHOICES} answers of one {tokens}-token prompt, {ns.max_tokens} tokens each, medians of {rounds} rounds ==")
    say(table(rows, ["arm", "wall", "completion tokens/s", "prompt tokens processed / prompt tokens"]))
    say(f"n=4 / four requests: wall {fmt(ratio_t, 'x')}, prompt work {fmt(ratio_w, 'x')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
