"""Benchmark (issue 26): the prompt cache on a conversation's second turn, clusterctl side by side with one
mlx_lm.server process (which keeps its own prompt cache), on the real SmolLM2-135M-Instruct.

Run: .venv/bin/python bench/promptcache.py [--conversations N] [--words N] [--models smollm2]

Arms (one at a time):
  a     mlx_lm.server    one process
  pp2   clusterctl       2 local ranks, pipeline, overlap, `--prompt-cache-gb 0.25` (the default)
  off   clusterctl       the same 2 ranks with `--prompt-cache-gb 0`: every turn computed whole
Per arm, N conversations (distinct texts): turn 1 is a user message of about --words words (~1,500 tokens),
answered with 16 greedy tokens; turn 2 repeats turn 1 and its answer and adds a short question. Time to first
token (request sent -> first content chunk), medians over the conversations; for clusterctl the hit rate from
rank 0's /metrics (prompt tokens taken from the cache / prompt tokens).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, log, machine_note, med, model, say, table  # noqa: E402
from overlap import plan  # noqa: E402
from serve import Round, arm_clusterctl, arm_single  # noqa: E402

WORDS = ["river", "stone", "ledger", "orbit", "lantern", "cedar", "signal", "harbor", "quartz", "meadow", "copper",
         "violet", "engine", "saddle", "thunder", "marble", "willow", "canyon", "falcon", "pepper"]


def text(i: int, words: int) -> str:
    """A long, distinct user message: sentences of words in an order that depends on the conversation."""
    out = []
    for k in range(words // 8):
        out.append(" ".join(WORDS[(i * 7 + k * 3 + j * 5) % len(WORDS)] for j in range(8)) + ".")
    return f"Conversation {i}. Read these notes carefully: " + " ".join(out)


def chat(base: str, messages: list[dict], max_tokens: int = 16) -> tuple[float, str]:
    """(seconds to the first content chunk, the answer) of a streamed greedy chat completion."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first, parts = None, []
    for line in r:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        ch = json.loads(line[6:]).get("choices") or []
        piece = (ch[0].get("delta") or {}).get("content") if ch else None
        if piece:
            parts.append(piece)
            if first is None:
                first = time.monotonic() - t0
    conn.close()
    return (first if first is not None else time.monotonic() - t0), "".join(parts)


def cache_counts(base: str) -> tuple[float, float]:
    """(prompt tokens, prompt tokens from the cache) as rank 0's /metrics counts them."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        fams = list(text_string_to_metric_families(resp.read().decode()))
    got = {s.name: s.value for f in fams for s in f.samples}
    return got.get("clusterctl_prompt_tokens_total", 0.0), got.get("clusterctl_prompt_cache_hit_tokens_total", 0.0)


def run_arm(arm: str, ctx, ns) -> dict:
    r = Round(arm, "")
    res = {"t1": [], "t2": [], "hit": None, "error": None}
    try:
        with ctx(r) as (_t0, base, _pids, _layers, _all):
            chat(base, [{"role": "user", "content": "Say hello."}], 2)  # warm-up
            before = cache_counts(base) if arm != "a" else None
            for i in range(ns.conversations):
                turn1 = [{"role": "user", "content": text(i, ns.words)}]
                t1, answer = chat(base, turn1)
                turn2 = turn1 + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": "And which word came first?"}]
                t2, _ = chat(base, turn2)
                res["t1"].append(t1)
                res["t2"].append(t2)
                log(f"{arm} conversation {i + 1}: first turn {t1:.3f} s, second turn {t2:.3f} s")
            if before is not None:
                after = cache_counts(base)
                prompt, hit = after[0] - before[0], after[1] - before[1]
                res["hit"] = hit / prompt if prompt > 0 else None
    except Exception as e:  # one arm failing must not hide the others
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"{arm} failed: {res['error']}")
    if r.error:
        res["error"] = (res["error"] or "") + r.error
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--words", type=int, default=900, help="words in the first turn's message (~1,500 tokens)")
    ns = ap.parse_args()
    say(f"bench/promptcache.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  "
        f"conversations={ns.conversations}  words={ns.words}")
    path = model("smollm2")
    with tempfile.TemporaryDirectory(prefix="bench-pcache-") as tmp:
        work = Path(tmp)
        env = {"CLUSTERCTL_STATE_DIR": str(work / "state")}
        deps = {"pp2": plan(work, env, path, "pcon", "--prompt-cache-gb", "0.25", context=4096),
                "off": plan(work, env, path, "pcoff", "--prompt-cache-gb", "0", context=4096)}
        ctxs = {"a": lambda r: arm_single(path, r), "pp2": lambda r: arm_clusterctl(deps["pp2"], env, r),
                "off": lambda r: arm_clusterctl(deps["off"], env, r)}
        got = {arm: run_arm(arm, ctxs[arm], ns) for arm in ("a", "pp2", "off")}
    a2 = med(got["a"]["t2"])
    rows = []
    for arm, what in (("a", "mlx_lm.server, 1 process"), ("pp2", "clusterctl 2 ranks, prompt cache"),
                      ("off", "clusterctl 2 ranks, no prompt cache")):
        t1, t2 = med(got[arm]["t1"]), med(got[arm]["t2"])
        rows.append([what, fmt(t1, " s", 3), fmt(t2, " s", 3), fmt(t2 / t1 if t1 and t2 else None, "x"),
                     fmt(t2 / a2 if t2 and a2 else None, "x"),
                     fmt(got[arm]["hit"] * 100 if got[arm]["hit"] is not None else None, "%", 1),
                     got[arm]["error"] or ""])
    say("")
    say(f"== second turn of a conversation (first turn ~{ns.words} words), time to first token, medians of "
        f"{ns.conversations} ==")
    say(table(rows, ["arm", "turn 1", "turn 2", "turn 2 / turn 1", "turn 2 / a's turn 2", "prompt tokens cached",
                     "error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
