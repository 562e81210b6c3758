"""Benchmark (issue 42): a long prompt's first token pipelined across the stages, running streams while long prompts
join, and what idle ranks cost; side by side in one run, on the ~100M-parameter bench model.

Run: .venv/bin/python bench/prefill.py [--quick] [--rounds N] [--prompt-tokens N] [--parts chunks,ttft,gaps,idle]
     .venv/bin/python bench/prefill.py --stall [--quick]   (issue 49.12: the 100M model, 2 streams of 300 tokens,
     2 joining prompts of 512 tokens, arms one,base2,new2 with base2 = main before the time budget, 5b99778)

Parts:
  chunks  one process: the prompt's prefill time at each chunk size (mlx-lm's loop: a forward pass per chunk, the
          caches evaluated), and what that gives a pipeline of 2 and 3 stages: t(c) / S * (1 + (S - 1) / k) for k
          chunks (the pipeline fills for one chunk per stage). The chunk size (scheduler.PREFILL_CHUNK) is chosen
          from this table.
  ttft    a lone prompt of --prompt-tokens tokens, 1 new token (sent -> answer), distinct prompts per request:
            one     mlx_lm.server, one process
            base2   2 local ranks of commit 23e3c7f (before this issue: a prompt whole, one stage after the other)
            new2    2 local ranks of this tree (its chunks flow through the stages)
            new3    3 local ranks of this tree
            mlx2    the anchor: mlx-lm's own distributed server on 2 local ranks (`mlx.launch --backend ring -n 2 --
                    python -m mlx_lm.server --pipeline`; the tiny models are qwen2-class); not in the default arms,
                    skipped with a printed reason without mlx.launch
  gaps    2 streams decode (greedy, --stream-tokens each) while --joins long prompts join one after another: the
          gaps between the streams' tokens from the first join to the last answer, p50 / p99 / max, base2 vs new2;
          and each joining prompt's first token (sent -> answer, 1 new token), against one process's lone prompt
          of the same length (the ttft part's "one" arm).
  idle    every rank's CPU (utime + stime) over --idle-seconds (10) with no request in flight (3 s after the last
          answer), base2 vs new2.
The rank arms are started by the rank test harness (tests/launch/rankharness.py: unsigned specs, the overlapped
schedule, no launcher), the base arm with PYTHONPATH pointing at `git archive BASE src` (--base, 23e3c7f: the code
before this issue).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "launch"))
from _common import MLX_LAUNCH, PY, fmt, machine_note, med, model, say, table  # noqa: E402
from serve import Round, arm_mlx_launch, arm_single  # noqa: E402

BASE_COMMIT = "23e3c7f"
BEFORE_GAPS = 20  # the streams' gaps measured before the first join: their decode gap with no prompt joining
STALL_BASE = "5b99778"  # main before the time budget of a joining prompt's chunks (issue 49.12)


def split(path: Path, world: int) -> list[int]:
    """Layers per rank, as even as they go, the remainder to the last ranks (rank 0 also runs the head): the bench
    model's 8 blocks are [4, 4] and [2, 3, 3]; SmolLM2's 30 are [15, 15] and [10, 10, 10]."""
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    return [n // world + (1 if r >= world - n % world else 0) for r in range(world)]

_SWEEP = """
import json, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
path, n, chunks, reps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
model, tok = load(path)
vocab = model.args.vocab_size
def prefill(c, rep):
    tokens = mx.array([[(7 * i + 13 * rep) % (vocab - 300) + 259 for i in range(n)]])
    cache = make_prompt_cache(model)
    t = time.perf_counter()
    while tokens.shape[1]:
        model(tokens[:, :c], cache=cache)
        mx.eval([x.state for x in cache])
        tokens = tokens[:, c:]
    return time.perf_counter() - t
prefill(256, 0)  # warm up
times = {c: [] for c in chunks}
for rep in range(reps):  # the sizes interleaved: the machine's load drifts alike for all
    for c in chunks:
        times[c].append(prefill(c, rep + 1))
print(json.dumps({c: sorted(t)[len(t) // 2] for c, t in times.items()}))
"""


def chunk_sweep(path: Path, n: int, chunks: list[int], reps: int) -> dict[int, float]:
    p = subprocess.run([PY, "-c", _SWEEP, str(path), str(n), json.dumps(chunks), str(reps)], capture_output=True,
                       text=True, check=True)
    return {int(k): v for k, v in json.loads(p.stdout).items()}


def pipeline_estimate(t: float, n: int, chunk: int, stages: int) -> float:
    k = -(-n // chunk)
    return t / stages * (1 + (stages - 1) / k)


# ---- prompts ------------------------------------------------------------------------------------------------------

def long_prompt(tok, n: int, seed: int) -> str:
    """Text of about ``n`` tokens (code-like lines, different for every seed, so no prompt cache helps)."""
    rng = random.Random(seed)
    lines, text = [], ""
    while len(tok.encode(text)) < n:
        lines.append(f"def f{rng.randrange(10**6)}(x, y):\n    return x * {rng.randrange(1000)} + y\n" * 4)
        text = "".join(lines)
    ids = tok.encode(text)[:n]
    return tok.decode(ids)


# ---- clients ------------------------------------------------------------------------------------------------------

def complete(base: str, prompt: str, max_tokens: int = 1, timeout: float = 900) -> float:
    """A non-streamed completion; returns its time (sent -> answer)."""
    host, port = base.removeprefix("http://").split(":")
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0, "model": "default_model"}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {body[:200]!r}")
    return time.monotonic() - t0


def stream_times(base: str, prompt: str, max_tokens: int, out: list[float], timeout: float = 900) -> None:
    """A streamed greedy completion; appends the time of every event that carries text."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0, "stream": True,
                                                            "model": "default_model"}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    for line in r:
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
            out.append(time.monotonic())
    conn.close()


# ---- arms ---------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def ranks(path: Path, world: int, work: Path, base_src: Path | None):
    """``world`` local ranks (overlapped schedule) of this tree, or of ``base_src``: (endpoint, pids)."""
    from rankharness import RankCluster

    env = {"PYTHONPATH": str(base_src)} if base_src is not None else {}
    counts = split(path, world)
    overrides = {"max_batch": 8, "context_tokens": 4096, "control_timeout_s": 120.0}
    if base_src is not None:  # the code before issue 42 reads every rank's layer count (the spec names its own range now)
        overrides["layer_counts"] = counts
    c = RankCluster(Path(tempfile.mkdtemp(dir=work)), path, counts, env=env, tag=f"pf{world}", overrides=overrides)
    try:
        c.up(timeout=300)
        yield c.url, [p.pid for p in c.procs]
    finally:
        c.stop()


@contextlib.contextmanager
def arm(name: str, path: Path, work: Path, base_src: Path):
    if name == "one":
        with arm_single(path, Round(arm="one", model="100m")) as (_, base, pids, _layers, _all):
            yield base, list(pids.values())
        return
    if name == "mlx2":
        with arm_mlx_launch(path, Round(arm="mlx2", model="100m"), work) as (_, base, pids, _layers, _all):
            yield base, list(pids.values())
        return
    world = int(name[-1])
    with ranks(path, world, work, base_src if name.startswith("base") else None) as got:
        yield got


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def gaps(base: str, tok, ns, seed: int, joined: list[float], before: list[float]) -> list[float]:
    """The streams' gaps between tokens while long prompts join one after another (each one's first token into
    ``joined``; the gaps of their first BEFORE_GAPS tokens, before any join, into ``before``)."""
    import threading

    times: list[list[float]] = [[], []]
    threads = [threading.Thread(target=stream_times, args=(base, f"# stream {i}\nimport os\n", ns.stream_tokens,
                                                           times[i])) for i in range(2)]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < BEFORE_GAPS + 2:
        time.sleep(0.05)
    t0 = time.monotonic()
    before.extend(b - a for ts in times for a, b in zip(ts[1:], ts[2:]) if b <= t0)  # (the first: the prompt's)
    for j in range(ns.joins):
        joined.append(complete(base, long_prompt(tok, ns.prompt_tokens, seed + j)))
    t1 = time.monotonic()
    for t in threads:
        t.join()
    if max(max(t) for t in times) < t1:
        say("  (a stream ended before the last join was answered: raise --stream-tokens)")
    return [b - a for ts in times for a, b in zip(ts, ts[1:]) if t0 <= a and b <= t1]


def idle_cpu(pids: list[int], seconds: float) -> float:
    from _common import cpu_seconds

    time.sleep(3.0)
    c0 = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - c0) / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 1 request per arm, 1,000-token prompts, 2 joins")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="long prompts per arm and round (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 2000 (--quick 1000)")
    ap.add_argument("--joins", type=int, default=None, help="long prompts joining the streams (default 3)")
    ap.add_argument("--stream-tokens", type=int, default=None)
    ap.add_argument("--parts", default="chunks,ttft,gaps,idle")
    ap.add_argument("--model", default="100m", help="100m (the bench preset), 7m (overhead-bound) or smollm2 (the real model: "
                    "use a few hundred tokens, --prompt-tokens 300)")
    ap.add_argument("--arms", default="one,base2,new2,new3")
    ap.add_argument("--base", default=BASE_COMMIT, help=f"the commit of the base arms (default {BASE_COMMIT})")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="how long the idle part measures")
    ap.add_argument("--stall", action="store_true", help="issue 49.12's case: --model 100m --prompt-tokens 512 "
                    "--joins 2 --stream-tokens 300 --parts ttft,gaps --arms one,base2,new2 --base 5b99778")
    ns = ap.parse_args()
    if ns.stall:
        ns.model, ns.parts, ns.arms, ns.base = "100m", "ttft,gaps", "one,base2,new2", STALL_BASE
        ns.prompt_tokens, ns.joins, ns.stream_tokens = ns.prompt_tokens or 512, ns.joins or 2, ns.stream_tokens or 300
    ns.rounds = ns.rounds or 1 if ns.quick else ns.rounds or 2
    ns.requests = ns.requests or (1 if ns.quick else 2)
    ns.prompt_tokens = ns.prompt_tokens or (1000 if ns.quick else 2000)
    ns.joins = ns.joins or (2 if ns.quick else 3)
    ns.stream_tokens = ns.stream_tokens or (250 if ns.quick else 1000)
    parts, arms = set(ns.parts.split(",")), ns.arms.split(",")
    if "mlx2" in arms and not Path(MLX_LAUNCH).exists():
        say(f"the anchor arm (mlx2) is skipped: {MLX_LAUNCH} is not installed")
        arms.remove("mlx2")
    from mlx_lm.utils import load_tokenizer

    path = model(ns.model)
    tok = load_tokenizer(path)
    say(f"bench/prefill.py {time.strftime('%Y-%m-%d %H:%M')}: {ns.model} model, {ns.prompt_tokens}-token prompts; {machine_note()}")
    work = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    base_src = work / "base"
    base_src.mkdir()
    subprocess.run(f"git -C {HERE.parent} archive {ns.base} src | tar -x -C {base_src}", shell=True, check=True)
    base_src = base_src / "src"

    if "chunks" in parts:
        chunks = [128, 256, 512, 2048] if ns.quick else [64, 128, 256, 512, 1024, 2048]
        t = chunk_sweep(path, ns.prompt_tokens, chunks, 1 if ns.quick else 3)
        rows = [[str(c), fmt(t[c], " s"), fmt(ns.prompt_tokens / t[c], " tok/s", 0),
                 fmt(pipeline_estimate(t[c], ns.prompt_tokens, c, 2) / t[2048], "x"),
                 fmt(pipeline_estimate(t[c], ns.prompt_tokens, c, 3) / t[2048], "x")] for c in chunks]
        say("\nprefill in one process by chunk size (and the pipeline it allows, against one pass of 2048):")
        say(table(rows, ["chunk", "prefill", "speed", "2 stages est.", "3 stages est."]))

    ttft: dict[str, list[float]] = {a: [] for a in arms}
    gap: dict[str, list[float]] = {}
    joined: dict[str, list[float]] = {}
    before: dict[str, list[float]] = {}
    idle: dict[str, float] = {}
    for rnd in range(ns.rounds):
        order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
        for a in order:
            with arm(a, path, work, base_src) as (base, pids):
                complete(base, "warm up", 1)
                if "ttft" in parts:
                    for i in range(ns.requests):
                        ttft[a].append(complete(base, long_prompt(tok, ns.prompt_tokens, 1000 * rnd + i)))
                    say(f"round {rnd + 1} {a}: first token {fmt(med(ttft[a]), ' s')}")
                if "gaps" in parts and a in ("base2", "new2"):
                    gap.setdefault(a, []).extend(gaps(base, tok, ns, 5000 + 100 * rnd, joined.setdefault(a, []),
                                                       before.setdefault(a, [])))
                    say(f"round {rnd + 1} {a}: gaps p50 {fmt(pct(gap[a], 50) * 1e3, ' ms', 0)}, "
                        f"p99 {fmt(pct(gap[a], 99) * 1e3, ' ms', 0)}; joining first token {fmt(med(joined[a]), ' s')}")
                if "idle" in parts and a in ("base2", "new2") and rnd == 0:
                    idle[a] = idle_cpu(pids, ns.idle_seconds)

    if "ttft" in parts:
        one = med(ttft.get("one") or [])
        rows = [[a, fmt(med(ttft[a]), " s"), fmt(med(ttft[a]) / one, "x") if one else "n/a", str(len(ttft[a]))]
                for a in arms if ttft[a]]
        say(f"\nfirst token of a lone {ns.prompt_tokens}-token prompt (median):")
        say(table(rows, ["arm", "first token", "vs one", "n"]))
    if gap:
        rows = [[a, fmt(pct(before[a], 50) * 1e3, " ms", 0), str(len(g)), fmt(pct(g, 50) * 1e3, " ms", 0),
                 fmt(pct(g, 99) * 1e3, " ms", 0), fmt(max(g) * 1e3, " ms", 0), fmt(pct(g, 99) / pct(g, 50), "x"),
                 fmt(pct(g, 99) / pct(before[a], 50), "x")] for a, g in gap.items() if g and before.get(a)]
        say(f"\n2 streams' gaps between tokens while {ns.joins} prompts of {ns.prompt_tokens} tokens join (p50 before: "
            f"their first {BEFORE_GAPS} gaps, before any join):")
        say(table(rows, ["arm", "p50 before", "gaps", "p50", "p99", "max", "p99/p50", "p99/p50 before"]))
        one = med(ttft.get("one") or [])
        rows = [[a, fmt(med(j), " s"), fmt(med(j) / one, "x") if one else "n/a", str(len(j))]
                for a, j in joined.items() if j]
        say(f"\nfirst token of a {ns.prompt_tokens}-token prompt joining the streams (median; vs one process's lone "
            "prompt):")
        say(table(rows, ["arm", "first token", "vs one", "n"]))
    if idle:
        say(f"\nidle CPU of all ranks together ({ns.idle_seconds:g} s, no request in flight; base2 = {ns.base}), "
            "% of one core:")
        say(table([[a, fmt(v * 100, " %")] for a, v in idle.items()], ["arm", "CPU"]))
    say(f"\n{machine_note()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
