"""Benchmark (issue 24): the overlapped pipeline against lockstep and against one mlx_lm.server process, side by
side in one run, on the 7M tiny model and the real SmolLM2-135M-Instruct.

Run: .venv/bin/python bench/overlap.py [--quick] [--models 7m,smollm2] [--clients 1,4,8] [--rounds N]

Arms (one arm's processes alive at a time; the order rotates every round; medians over rounds):
  a     mlx_lm.server    one process (`python -m mlx_lm.server --model PATH`)
  lock  clusterctl       2 local ranks, `plan --schedule lockstep` (every step on every rank; auto = balanced split)
  over  clusterctl       the same 2 ranks, `plan --schedule overlap` (a micro-batch per stage in flight; the default
                         `--allocation auto` then splits by work: rank 0 also runs the head)
  b     mlx-lm           the anchor: mlx-lm's own distributed server, 2 local ranks (`mlx.launch --backend ring -n 2
                         -- python -m mlx_lm.server --pipeline`); the tiny models are qwen2-class, which has
                         mlx-lm's pipeline(). SmolLM2 (llama: no pipeline() in mlx-lm) runs as its qwen2 twin
                         (_common.pipelineable: zero q/k/v biases, the same answers). Skipped with a printed reason
                         without mlx.launch. Not in the default arms: ask for it with --arms.
Per arm and round: launch, a warm-up request, then for each C in --clients: C streaming greedy chat clients at
once, each sending --per-client requests one after another (distinct prompts, the same for every arm): aggregate
tok/s = all completion tokens / (first request sent -> last stream ended); time to first token per request, p50.
Then the peak RSS of every rank (its marker's peak) next to what the plan reserved for it.

--open-loop SHARE: after the closed loop, each arm also takes open-loop traffic (as vLLM's benchmark_serving):
requests arrive at random (Poisson, exponential gaps; the same seeded schedule for every arm) at SHARE (e.g. 0.8)
of the request rate that arm reaches with the largest --clients closed-loop clients sending the same mix of prompt
lengths (the short chat prompts, and every fourth one a ~300-token prompt), each streamed by its own client. Reported:
throughput (served: requests/s from the start to the last answer; answered: the answers' own rate, first
to last answer, against the rate at which this draw's requests arrived, first to last arrival: a short draw comes
faster or slower than its nominal rate, and the last answer's service time is a tail the arrivals have not, so only
these two are compared; a server that keeps up answers at the arrival rate, ~1.0x), time to first token p50/p99 (and the closed loop's
p99 beside it), time per output token p50/p99 (end of stream - first token, over the tokens after the first), and
for clusterctl the overlapped runs that ended meanwhile (each a drained pipeline and a meeting: a run ends when
nothing is left in flight, never for an arrival) and the parked micro-batches a join revived, from rank 0's /metrics.

This machine's limit: one process timing a loop of MLX matmuls alone, then two such processes at once; the limit
is how much more work two processes do together than one alone (2 x alone time / together time). A 2-rank
pipeline can gain at most that over lockstep here; the overlap efficiency is the gain measured (over / lock)
divided by the limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (MLX_LAUNCH, PY, check, clusterctl, fmt, log, machine_note, med, model, say, stream_chat,  # noqa: E402
                     table)
from serve import (PROMPTS, Round, arm_clusterctl, arm_mlx_launch, arm_single, concurrent_load, marker_peak,  # noqa: E402
                   pct, rotate)

LONG_PROMPT = ("Summarise the following notes on serving a model across machines in one paragraph. " +
               "A pipeline splits the layers; each stage computes while the others do; a prompt's chunks flow "
               "through the stages; a join takes the next slot. " * 12)


def mix_prompt(i: int) -> str:
    """The open loop's mix of prompt lengths: the short chat prompts, and every fourth one a ~300-token prompt."""
    return LONG_PROMPT + f" ({i})" if i % 4 == 3 else f"{PROMPTS[i % len(PROMPTS)]} ({i})"


def closed_mix(base: str, clients: int, per_client: int, tokens: int) -> tuple[float, list[float]]:
    """``clients`` closed-loop clients sending the open loop's prompt mix: (requests per second, every TTFT): the
    capacity the open loop's rate is a share of, measured with the same prompts."""
    import threading

    got, lock = [], threading.Lock()

    def client(c: int) -> None:
        for j in range(per_client):
            with contextlib.suppress(Exception):
                st = stream_chat(base, mix_prompt(1000 + c * per_client + j), tokens)
                with lock:
                    got.append(st)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.monotonic() - t0
    return (len(got) / wall if wall > 0 else 0.0), [st.first for st in got]


def run_counts(base: str) -> tuple[float, float] | None:
    """clusterctl's overlapped runs ended so far (each one a drained pipeline and a meeting) and parked micro-batches
    revived by a join, from rank 0's /metrics; None where there is no such metric (mlx_lm.server, older code)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except Exception:  # a server without /metrics
        return None
    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            got[s.name] = got.get(s.name, 0.0) + s.value
    if "clusterctl_overlap_runs_ended_total" not in got:
        return None
    return got["clusterctl_overlap_runs_ended_total"], got.get("clusterctl_overlap_revivals_total", 0.0)


def open_loop(base: str, rate: float, n: int, tokens: int, seed: int = 42) -> dict:
    """``n`` streamed requests arriving at random (Poisson at ``rate`` per second), each from its own client; a
    mix of prompt lengths. Returns throughput, TTFT and TPOT samples, and (clusterctl) the runs ended and the
    micro-batches revived meanwhile."""
    import random
    import threading

    rng = random.Random(seed)
    got, errors, lock = [], [0], threading.Lock()

    def one(prompt: str) -> None:
        try:
            st = stream_chat(base, prompt, tokens)
        except Exception:  # counted: a refused or broken request is a result too
            with lock:
                errors[0] += 1
            return
        with lock:
            got.append((st, time.monotonic()))

    counts0 = run_counts(base)
    threads, t0, at, arrivals = [], time.monotonic(), 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        arrivals.append(at)
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        threads.append(threading.Thread(target=one, args=(mix_prompt(i),), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(900)
    wall = max((end for _, end in got), default=time.monotonic()) - t0
    # Arrivals and answers as rates over the same kind of span (first to last: n - 1 gaps each), so that a short
    # draw's own pace (seed 42's 24 arrivals come 1.48x faster than the nominal rate) and the last request's own
    # service time (a tail the arrivals have not) both cancel: a server that keeps up answers at the arrival rate.
    arrived = (n - 1) / (arrivals[-1] - arrivals[0]) if n > 1 and arrivals[-1] > arrivals[0] else rate
    ends = sorted(end for _, end in got)
    answered = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0
    time.sleep(0.5)  # the last run ends a slot after the last answer
    counts1 = run_counts(base)
    runs = [b - a for a, b in zip(counts0, counts1)] if counts0 and counts1 else None
    return {"offered": rate, "arrived": arrived, "answered": answered, "done": len(got), "errors": errors[0],
            "req_s": len(got) / wall if wall > 0 else 0.0, "runs": runs,
            "tok_s": sum(st.tokens for st, _ in got) / wall if wall > 0 else 0.0,
            "ttft": [st.first for st, _ in got],
            "tpot": [(st.seconds - st.first) / (st.tokens - 1) for st, _ in got if st.tokens > 1]}

ARMS = {"a": "mlx_lm.server (1 process)", "lock": "clusterctl 2 ranks, lockstep", "over": "clusterctl 2 ranks, overlap",
        "scrape": "overlap, /metrics scraped every 0.5 s", "b": "mlx-lm's distributed server, 2 ranks (--pipeline)"}
DEFAULT_ARMS = ("a", "lock", "over", "scrape")
GREEDY_CHECK = (PROMPTS[0], 24)  # every arm's greedy answer to this, compared with one process's

_MATMUL = """
import sys, time
import mlx.core as mx
a = mx.random.normal((512, 512)); mx.eval(a)
n = int(sys.argv[1])
t = time.perf_counter()
for _ in range(n):
    b = a
    for _ in range(8):
        b = b @ a
    mx.eval(b)
print(time.perf_counter() - t)
"""


def machine_limit(n: int = 25) -> tuple[float, float, float]:
    """(seconds alone, seconds each of two at once, the limit = 2 * alone / together)."""
    def run(k: int) -> list[float]:
        ps = [subprocess.Popen([PY, "-c", _MATMUL, str(n)], stdout=subprocess.PIPE, text=True) for _ in range(k)]
        return [float(p.communicate()[0]) for p in ps]

    run(1)  # warm the page cache and MLX's kernels
    alone = med([run(1)[0] for _ in range(3)])
    together = med([max(run(2)) for _ in range(3)])
    return alone, together, 2 * alone / together


def plan(workdir: Path, env: dict, path: Path, name: str, *flags: str, context: int = 1024) -> Path:
    """A signed deployment of ``path`` on two local nodes (4 GB each), pipeline, with ``flags`` for `plan`."""
    lines = ["[cluster]", f'name = "{name}"']
    for node in "ab":
        lines += ["[[node]]", f'name = "{node}"', "local = true", "memory_gb = 4",
                  f'runtime_dir = "{workdir}/run-{name}-{node}"']
    c = workdir / f"{name}.toml"
    c.write_text("\n".join(lines) + "\n")
    out = workdir / f"{name}.json"
    check(clusterctl("plan", "-c", str(c), "-m", str(path), "--parallel", "pipeline", *flags,
                     "--context", str(context), "-o", str(out), "-q", env=env), "clusterctl plan")
    return out


def scraper(base: str, stop) -> None:
    """A Prometheus that scrapes twice a second (ten times the usual rate)."""
    import urllib.request

    while not stop.wait(0.5):
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
                resp.read()


def metrics_update_cost(n: int = 2000) -> float:
    """Seconds of metrics work per request (what the API records for one request), measured in-process."""
    from clusterctl.rank.metrics import Metrics

    m = Metrics(queue_depth=lambda: 0, occupancy=lambda: 0)
    t = time.perf_counter()
    for _ in range(n):
        m.request_done("ok")
        m.tokens(30, 64)
        m.first_token(0.05)
        m.per_output_token(0.01)
    return (time.perf_counter() - t) / n


def run_arm(arm: str, ctx, clients: tuple[int, ...], per_client: int, tokens: int, offset: int, share: float = 0.0,
            n_open: int = 24, rate: float | None = None) -> Round:
    import threading

    r = Round(arm, "")
    stop = threading.Event()
    try:
        with ctx(r) as (_t0, base, pids, layers, _all):
            r.rss = [(rank, layers.get(rank), None) for rank in sorted(pids)]  # the split; peaks below
            stream_chat(base, PROMPTS[-1], 4)  # warm-up
            r.greedy = stream_chat(base, *GREEDY_CHECK).text
            if arm == "scrape":
                threading.Thread(target=scraper, args=(base, stop), daemon=True).start()
            for c in clients:
                r.loads[c] = concurrent_load(base, c, per_client, offset, tokens)
            if share:
                req_s, r.closed_ttft = closed_mix(base, max(clients), per_client, tokens)
                if req_s > 0:
                    r.open = open_loop(base, rate or share * req_s, n_open, tokens)
            stop.set()
            time.sleep(1.2)  # the marker heartbeat carries the peak
            r.rss = [(rank, layers.get(rank), marker_peak(r.markers[rank]) if rank in r.markers else None)
                     for rank in sorted(pids)]
    except Exception as e:  # one arm failing must not hide the others
        r.error = f"{type(e).__name__}: {e}"
    stop.set()
    return r


def bench_model(kind: str, workdir: Path, ns, limit: float | None) -> None:
    path = model(kind)
    env = {"CLUSTERCTL_STATE_DIR": str(workdir / f"state-{kind}")}
    deps = {s: plan(workdir, env, path, f"{kind}-{s}", "--schedule", s) for s in ("lockstep", "overlap")}
    ctxs = {"a": lambda r: arm_single(path, r), "lock": lambda r: arm_clusterctl(deps["lockstep"], env, r),
            "over": lambda r: arm_clusterctl(deps["overlap"], env, r),
            "scrape": lambda r: arm_clusterctl(deps["overlap"], env, r),
            "b": lambda r: arm_mlx_launch(path, r, workdir)}
    tokens = ns.tokens or (32 if kind == "smollm2" else 64)
    wanted = [a for a in ARMS if (a in ns.arms.split(",") if ns.arms else a in DEFAULT_ARMS)]
    if "b" in wanted and (why := anchor_unavailable(kind)):
        say(f"{kind}: the anchor arm (b) is skipped: {why}")
        wanted.remove("b")
    rs: list[Round] = []
    for i in range(ns.rounds):
        for arm in rotate(wanted, i):
            r = run_arm(arm, ctxs[arm], ns.clients, ns.per_client, tokens, i * 7, ns.open_loop, ns.open_requests,
                        ns.open_rate)
            rs.append(r)
            log(f"{kind} round {i + 1} {ARMS[arm]}: " + ", ".join(
                f"{c} client(s) {fmt(v[0], ' tok/s', 1)}" for c, v in r.loads.items())
                + (f" ERROR {r.error}" if r.error else ""))
    by = {a: [r for r in rs if r.arm == a and not r.error] for a in ARMS}

    def agg(a: str, c: int):
        return med([r.loads[c][0] for r in by[a] if c in r.loads])

    def ttft(a: str, c: int):
        return med([pct(r.loads[c][1], 0.5) for r in by[a] if c in r.loads])

    rows = []
    for c in ns.clients:
        a, lock, over = agg("a", c), agg("lock", c), agg("over", c)
        gain = over / lock if over and lock else None
        scr = agg("scrape", c)
        rows.append([str(c), fmt(a, "", 1), fmt(lock, "", 1), fmt(over, "", 1), fmt(gain, "x"),
                     fmt(over / a if over and a else None, "x"),
                     fmt(gain / limit if gain and limit else None, "", 2),
                     "/".join(fmt(ttft(x, c), "", 3) for x in ("a", "lock", "over")),
                     fmt(scr / over if scr and over else None, "x"),
                     str(sum(r.loads[c][2] for x in ARMS for r in by[x] if c in r.loads))])
    say("")
    say(f"== {kind}: {tokens} new tokens per request, {ns.per_client} request(s) per client, "
        f"{ns.rounds} round(s), medians ==")
    say(table(rows, ["clients", "a tok/s", "lock tok/s", "over tok/s", "over/lock", "over/a", "efficiency",
                     "TTFT p50 s a/lock/over", "scraped/over", "errors"]))
    planned = {arm: {x["rank"]: (x.get("planned") or {}).get("total") for x in json.loads(deps[s].read_text())["ranks"]}
               for arm, s in (("lock", "lockstep"), ("over", "overlap"))}
    for arm in ("lock", "over"):
        peaks, split = {}, {}
        for r in by[arm]:
            for rank, layers, peak in r.rss:
                split[rank] = layers
                if peak:
                    peaks[rank] = max(peaks.get(rank, 0), peak)
        say(f"{arm}: layers " + ", ".join(f"rank {k} {v}" for k, v in sorted(split.items())) + "; peak RSS " + ", ".join(
            f"rank {k} {fmt(v / 2**20, ' MiB', 0)} (plan reserves {fmt((planned[arm].get(k) or 0) / 2**20, ' MiB', 0)})"
            for k, v in sorted(peaks.items())))
    if by.get("b"):
        anchor_report(by, ns)
    if ns.open_loop:
        open_loop_report(by, ns)
    for a in ARMS:
        for r in rs:
            if r.arm == a and r.error:
                say(f"error in {a}: {r.error}")


def anchor_unavailable(kind: str) -> str | None:
    """Why mlx-lm's own distributed server cannot be the anchor here (None: it can)."""
    if not Path(MLX_LAUNCH).exists():
        return f"{MLX_LAUNCH} is not installed"
    return None


def anchor_report(by: dict, ns) -> None:
    """clusterctl's overlapped arm against mlx-lm's distributed server (the anchor), and each arm's greedy text
    against one process's."""
    def agg(a: str, c: int):
        return med([r.loads[c][0] for r in by.get(a, []) if c in r.loads])

    rows = [[str(c), fmt(agg("b", c), "", 1), fmt(agg("over", c), "", 1),
             fmt(agg("over", c) / agg("b", c) if agg("over", c) and agg("b", c) else None, "x")] for c in ns.clients]
    say("\nthe anchor: mlx-lm's distributed server (mlx.launch --backend ring -n 2, mlx_lm.server --pipeline):")
    say(table(rows, ["clients", "b tok/s", "over tok/s", "over/b"]))
    one = next((r.greedy for r in by.get("a", []) if getattr(r, "greedy", None) is not None), None)
    for a in ("b", "over"):
        texts = {r.greedy for r in by.get(a, []) if getattr(r, "greedy", None) is not None}
        same = "n/a (no one-process arm)" if one is None else ("yes" if texts == {one} else f"NO: {texts!r} vs {one!r}")
        say(f"{a}: greedy text of {GREEDY_CHECK[1]} tokens identical to one process: {same}")


def open_loop_report(by: dict, ns) -> None:
    c = max(ns.clients)
    rows = []
    for a, rounds in by.items():
        ol = [r.open for r in rounds if getattr(r, "open", None)]
        if not ol:
            continue
        ttft = [x for o in ol for x in o["ttft"]]
        tpot = [x for o in ol for x in o["tpot"]]
        closed_p99 = med([pct(r.closed_ttft, 0.99) for r in rounds if getattr(r, "closed_ttft", None)])
        offered, arrived = med([o["offered"] for o in ol]), med([o["arrived"] for o in ol])
        req_s, answered = med([o["req_s"] for o in ol]), med([o["answered"] for o in ol])
        rows.append([a, fmt(offered, "", 2), fmt(arrived, "", 2), fmt(req_s, "", 2), fmt(answered, "", 2),
                     fmt(answered / arrived if arrived else None, "x"),
                     fmt(pct(ttft, 0.5), "", 2), fmt(pct(ttft, 0.99), "", 2), fmt(closed_p99, "", 2),
                     fmt(pct(ttft, 0.99) / closed_p99 if closed_p99 else None, "x"),
                     fmt(1e3 * pct(tpot, 0.5), "", 0) if tpot else "n/a", fmt(1e3 * pct(tpot, 0.99), "", 0) if tpot
                     else "n/a", str(sum(o["errors"] for o in ol)),
                     "/".join(f"{sum(o['runs'][i] for o in ol):g}" for i in (0, 1))
                     if all(o.get("runs") for o in ol) else "n/a"])
    at = f"{ns.open_rate:g} req/s" if ns.open_rate else f"{ns.open_loop:.0%} of each arm's closed-loop rate"
    say(f"\nopen loop: Poisson arrivals at {at} at {c} clients, "
        f"{ns.open_requests} requests (every 4th a ~300-token prompt):")
    say(table(rows, ["arm", "offered req/s", "arrived req/s", "served req/s", "answered req/s", "answered/arrived",
                     "TTFT p50 s", "TTFT p99 s",
                     "closed p99 s", "p99 open/closed", "TPOT p50 ms", "TPOT p99 ms", "errors",
                     "runs ended/revivals"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--models", default="7m,smollm2", help="comma list of 7m, smollm2")
    ap.add_argument("--clients", default="1,4,8", help="concurrent streaming clients (comma list)")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends in turn")
    ap.add_argument("--rounds", type=int, help="rounds per arm (default 3; --quick 1)")
    ap.add_argument("--tokens", type=int, help="new tokens per request (default 64; smollm2 32)")
    ap.add_argument("--open-loop", type=float, default=0.0, metavar="SHARE",
                    help="also open-loop traffic at SHARE of the closed-loop rate (e.g. 0.8)")
    ap.add_argument("--open-rate", type=float, metavar="REQ_S",
                    help="with --open-loop: arrivals at this fixed rate instead (the same for every arm and run, "
                         "to compare code before and after at one load)")
    ap.add_argument("--open-requests", type=int, help="requests in the open-loop run (default 24; --quick 12)")
    ap.add_argument("--arms", help=f"comma list of arms (default {','.join(DEFAULT_ARMS)}; also b, the anchor)")
    ap.add_argument("--no-limit", action="store_true",
                    help="skip measuring the machine's limit (minutes on a loaded machine; efficiency then n/a)")
    ns = ap.parse_args()
    ns.clients = tuple(int(c) for c in ns.clients.split(","))
    ns.rounds = ns.rounds or (1 if ns.quick else 3)
    ns.open_requests = ns.open_requests or (12 if ns.quick else 24)
    say(f"bench/overlap.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  clients={ns.clients} x "
        f"{ns.per_client}  rounds={ns.rounds}")
    limit = None
    if not ns.no_limit:
        alone, together, limit = machine_limit()
        say(f"this machine's limit: matmul loop alone {alone:.2f} s, two at once {together:.2f} s each -> "
            f"two processes do {limit:.2f}x the work of one")
    say(f"metrics work per request (counters and histograms the API moves): "
        f"{metrics_update_cost() * 1e6:.1f} us")
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        for kind in ns.models.split(","):
            bench_model(kind.strip(), Path(tmp), ns, limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
