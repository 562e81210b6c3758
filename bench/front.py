"""Benchmark (issue 34): the front door's cost, side by side with talking to rank 0 directly.

Run: .venv/bin/python bench/front.py [--rounds N] [--clients 1,8] [--requests N] [--tokens N] [--streams N]
                                     [--think MS] [--phase-check N]

One real 2-rank local deployment of the tiny model (`launch --detach --front 127.0.0.1:PORT`); every round
measures both arms back to back (the order alternates), and the medians over rounds are compared:
  latency    each of C clients holds a kept-alive connection to each arm and sends --requests requests to
             each, alternating request by request: GET /v1/models (rank 0's HTTP path, no model work) and a
             1-token chat completion, each chat after a random pause of 0..--think ms (20; untimed) so that
             neither arm's requests reach rank 0 at a fixed moment after its answers (--phase-check). Added
             latency, two ways:
             - side by side: the mean over all pairs (one client's two requests, one per arm, back to back)
               of front - direct, with its 95% confidence interval; rank 0's own jitter (a 1-token chat
               takes 20-50 ms there) makes this interval wide unless --requests is large;
             - without that jitter: each front request's time on the client's clock minus the time rank 0
               took as the front saw it (the front's Server-Timing header, upstream;dur=), i.e. the hops to
               the front and back plus the front's own work; the median over rounds of each round's median
  streamed   C clients each stream one greedy chat completion of --tokens tokens at once, --streams times per
             arm and round, the arms in turn (the order flipping each time): aggregate tokens/s of an arm in a
             round = all its completion tokens / the time its streams took (each: first request sent -> last
             stream ended); the ratio is the geometric mean over every pair (the two arms' streams back to
             back) of front / direct, with its 95% confidence interval; each arm's tokens/s is the median over
             rounds
  phase check (--phase-check N) C = the most clients, N 1-token chats each with no pause, every client on one
             arm at a time: direct, the front, and direct with each request held back by the front's own added
             time. Closed-loop clients with no pause send their next request just as rank 0 answers, and rank 0's
             time then depends on how soon after its answers that request arrives (whether it joins the batch
             being formed or waits for the next); the third arm tells that apart from the front's own cost
Targets: added latency <= 1 ms per request; streamed tokens/s >= 0.98x direct; at 1 and 8 clients.
Also printed: the front process's own CPU time per request and per streamed token (psutil), which a loaded
machine does not inflate the way it inflates wall-clock latency (every hop through one more process waits for a
core).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import check, clusterctl, fmt, log, machine_note, med, model, say, stream_chat, table  # noqa: E402

PROMPTS = ["Tell me about the sea.", "Count to ten.", "Why is the sky blue?", "Name three birds.",
           "Write a short poem.", "What is a cluster?", "Describe a cat.", "List some colours."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def latencies(direct: str, front: str, clients: int, requests: int, what: str, *, think: float = 0.0,
              only: str | None = None, delay: float = 0.0, seed: int = 0) -> dict[str, list[float]]:
    """Per-request seconds by arm: each of ``clients`` threads holds a kept-alive connection to each arm and
    alternates between them request by request (the order flips every time), so both arms see the same load.
    ``think``: each request first waits a random 0..think seconds (untimed), so that arrivals at rank 0 are not
    phase-locked to its answers (see ``phase_check``). ``only``: every request to that one arm instead (``requests``
    of them per client, ``delay`` seconds of untimed pause before each)."""
    out: dict[str, list[float]] = {"direct": [], "front": [], "own": [], "pair": []}
    lock = threading.Lock()
    ids = itertools.count()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0})

    def one(conn, name: str, mine: dict) -> None:
        t0 = time.perf_counter()
        if what == "models":
            conn.request("GET", "/v1/models")
        else:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        took = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"{what}: {r.status}")
        mine[name].append(took)
        if name == "front":  # what the client's clock says beyond rank 0's time as the front saw it
            mine["own"].append(took - upstream_ms(r.getheader("Server-Timing")) / 1e3)

    def client() -> None:
        conns = {name: http.client.HTTPConnection(*base.removeprefix("http://").rsplit(":", 1), timeout=60)
                 for name, base in (("direct", direct), ("front", front))}
        mine: dict[str, list[float]] = {"direct": [], "front": [], "own": [], "pair": []}
        rng = random.Random(seed * 1000 + next(ids))
        for i in range(requests):
            if only is not None:
                time.sleep(delay)
                one(conns[only], only, mine)
                continue
            for name in (("direct", "front") if i % 2 == 0 else ("front", "direct")):
                if think:
                    time.sleep(rng.uniform(0.0, think))
                one(conns[name], name, mine)
            mine["pair"].append(mine["front"][-1] - mine["direct"][-1])  # two requests back to back
        for c in conns.values():
            c.close()
        with lock:
            for k, v in mine.items():
                out[k].extend(v)

    ts = [threading.Thread(target=client) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def phase_check(direct: str, front: str, clients: int, requests: int, delay: float, reps: int = 2
                ) -> dict[str, list[float]]:
    """Closed-loop 1-token chats with no think time, every client on one arm at a time: rank 0 directly, the
    front, and rank 0 directly with each request sent ``delay`` seconds after the previous answer (untimed; the
    front's own added time). With no think time each client's next request reaches rank 0 just after rank 0's
    answers, so how long rank 0 takes depends on how soon after them it arrives: if the delayed direct arm is as
    slow as the front, what the front costs there is its own time as rank 0's schedule amplifies it, which any hop
    (a LAN, a plain byte relay) would cause too. Returns each arm's per-request seconds (the arms in turn)."""
    out: dict[str, list[float]] = {"direct": [], "front": [], "direct+delay": []}
    arms = [("direct", "direct", 0.0), ("front", "front", 0.0), ("direct+delay", "direct", delay)]
    for rep in range(reps):
        for label, only, wait in arms if rep % 2 == 0 else arms[::-1]:  # the order flips every repeat
            got = latencies(direct, front, clients, requests, "chat", only=only, delay=wait, seed=rep)
            out[label].extend(got[only])
    return out


def half_ci(xs: list[float]) -> float:
    """Half the width of the mean's 95% confidence interval (normal approximation); nan under two points."""
    return 1.96 * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else math.nan


def pin(state: Path, front_pid: int) -> str:
    """--pin: every thread of the ranks' process groups on every core but the last; the front's and this
    benchmark's (its clients') on the last one. A front on a real coordinator does not wait for a core the ranks
    hold; on a machine this small, unpinned, it does (each wake-up of the front queues behind a rank)."""
    import psutil

    n = os.cpu_count() or 1
    if n < 2:
        raise SystemExit("--pin needs 2 cores or more")
    ranks, ours = set(range(n - 1)), {n - 1}
    pgids = {r["pgid"] for man in (state / "launches").glob("*.json")
             for r in json.loads(man.read_text()).get("ranks", []) if r.get("pgid")}
    pinned = 0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in pgids:
                pinned += _pin_threads(proc.pid, ranks)
        except (OSError, psutil.Error):
            continue
    if not pinned:
        raise SystemExit("--pin: found no rank process to pin")
    _pin_threads(front_pid, ours)
    _pin_threads(os.getpid(), ours)
    return f"ranks ({pinned} threads) on cores {sorted(ranks)}, the front and the clients on core {n - 1}"


def _pin_threads(pid: int, cpus: set[int]) -> int:
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            n += 1
        except OSError:
            pass  # a thread that ended meanwhile
    return n


def upstream_ms(server_timing: str | None) -> float:
    """The ``upstream;dur=`` of the front's Server-Timing header."""
    for part in (server_timing or "").split(","):
        name, _, params = part.strip().partition(";")
        if name == "upstream" and params.startswith("dur="):
            return float(params[4:])
    raise RuntimeError(f"no upstream timing in {server_timing!r}")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of the front process so far: its cost, whatever the machine's load (Linux: the scheduler's
    nanosecond count of every thread; elsewhere psutil's user + system, in clock ticks)."""
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


def idle_rate(pid: int, seconds: float = 3.0) -> float:
    """The front's CPU seconds per second with no request: its watcher (manifests 4/s, rank 0's health 1/s)."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def streamed(base: str, clients: int, tokens: int, offset: int) -> tuple[int, float]:
    """C clients stream one answer each at once: (all their tokens, first request sent -> last stream ended)."""
    got: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        st = stream_chat(base, PROMPTS[(offset + i) % len(PROMPTS)], tokens)
        with lock:
            got.append(st.tokens)

    t0 = time.monotonic()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(got), time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--requests", type=int, default=40, help="latency requests per client and round")
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per streamed request")
    ap.add_argument("--streams", type=int, default=4, help="streamed requests per client, arm and round")
    ap.add_argument("--think", type=float, default=20.0,
                    help="ms: a 1-token chat waits a random 0..THINK ms before it (untimed); 0: none")
    ap.add_argument("--pin", action="store_true",
                    help="the ranks on every core but the last, the front and the clients on the last (pin)")
    ap.add_argument("--phase-check", type=int, default=0, metavar="N",
                    help="then N closed-loop 1-token chats per client on each arm alone (phase_check)")
    ns = ap.parse_args()
    clients = [int(x) for x in ns.clients.split(",")]
    tiny = model("7m")
    work = Path(tempfile.mkdtemp(prefix="bench-front-"))
    env = {"CLUSTERCTL_STATE_DIR": str(work / "state")}
    lines = ["[cluster]", 'name = "benchfront"']
    for name in "ab":
        lines += ["[[node]]", f'name = "{name}"', "local = true", "memory_gb = 4", f'runtime_dir = "{work}/run-{name}"']
    (work / "cluster.toml").write_text("\n".join(lines) + "\n")
    dep = work / "dep.json"
    check(clusterctl("plan", "-c", str(work / "cluster.toml"), "-m", str(tiny), "-o", str(dep), "-q", env=env), "plan")
    front = f"127.0.0.1:{free_port()}"
    p = check(clusterctl("launch", str(dep), "--detach", "--json", "--timeout", "300", "--front", front, env=env,
                         timeout=400), "launch")
    direct, via = json.loads(p.stdout)["endpoint"], f"http://{front}"
    [rec] = (work / "state" / "fronts").glob("*.json")
    fpid = json.loads(rec.read_text())["pid"]
    log(f"rank 0 at {direct}, front at {via}; {machine_note()}")
    if ns.pin:
        log(f"pinned: {pin(work / 'state', fpid)}")
    res: dict = {}
    try:
        streamed(direct, 1, 8, 0)  # warm-up: connections, the prompt path
        streamed(via, 1, 8, 0)
        latencies(direct, via, 1, 5, "chat")
        idle = idle_rate(fpid)
        log(f"the front idle: {idle * 1e3:.3f} ms of CPU per second (subtracted from the CPU figures below)")
        for rnd in range(ns.rounds):
            for c in clients:
                for what in ("models", "chat"):
                    cpu0, t0 = cpu_seconds(fpid), time.monotonic()
                    got = latencies(direct, via, c, ns.requests, what, seed=rnd,
                                    think=ns.think / 1e3 if what == "chat" else 0.0)
                    spent = cpu_seconds(fpid) - cpu0 - idle * (time.monotonic() - t0)
                    res.setdefault((c, what, "cpu"), []).append(spent / (c * ns.requests))
                    for name, xs in got.items():
                        res.setdefault((c, what, name), []).append(med(xs))
                    res.setdefault((c, what, "pairs"), []).extend(got["pair"])
                arms = [("direct", direct), ("front", via)]
                tot = {"direct": [0, 0.0], "front": [0, 0.0], "cpu": [0, 0.0]}  # tokens, seconds
                for k in range(ns.streams):  # the arms in turn, the order flipping each time
                    rate = {}
                    for name, base in (arms if (rnd + k) % 2 == 0 else arms[::-1]):
                        cpu0, t0 = cpu_seconds(fpid), time.monotonic()
                        toks, secs = streamed(base, c, ns.tokens, rnd * c + k)
                        rate[name] = toks / secs
                        tot[name][0] += toks
                        tot[name][1] += secs
                        if name == "front":
                            tot["cpu"][0] += toks
                            tot["cpu"][1] += cpu_seconds(fpid) - cpu0 - idle * (time.monotonic() - t0)
                    res.setdefault((c, "tok/s", "logs"), []).append(math.log(rate["front"] / rate["direct"]))
                for name, (toks, secs) in tot.items():
                    res.setdefault((c, "tok/s", name), []).append(toks / secs if name != "cpu" else secs / toks)
            log(f"round {rnd + 1}/{ns.rounds} done ({machine_note()})")
        if ns.phase_check:
            c = max(clients)
            delay = med(res[(c, "chat", "own")])
            log(f"phase check: {c} clients, {ns.phase_check} chats each per arm and turn, delay {delay * 1e3:.3f} ms")
            res["phase"] = (c, delay, phase_check(direct, via, c, ns.phase_check, delay))
    finally:
        clusterctl("teardown", env=env, timeout=120)
        clusterctl("front", "--stop", env=env, timeout=60)
    rows = []
    for c in clients:
        for what in ("models", "chat"):
            d, f, pairs = res[(c, what, "direct")], res[(c, what, "front")], res[(c, what, "pairs")]
            mean = statistics.fmean(pairs)  # every pair: the same client's two requests, back to back
            half = half_ci(pairs)
            rows.append([str(c), f"latency {what}", fmt(med(d) * 1e3, " ms", 3), fmt(med(f) * 1e3, " ms", 3),
                         f"{mean * 1e3:+.3f} ± {half * 1e3:.3f} ms", fmt(med(res[(c, what, "own")]) * 1e3, " ms", 3),
                         "<= 1 ms", fmt(med(res[(c, what, "cpu")]) * 1e3, " ms/req", 3)])
        d, f, logs = res[(c, "tok/s", "direct")], res[(c, "tok/s", "front")], res[(c, "tok/s", "logs")]
        mean, half = statistics.fmean(logs), half_ci(logs)
        rows.append([str(c), "streamed tok/s", fmt(med(d), "", 1), fmt(med(f), "", 1), f"{math.exp(mean):.3f}x ({math.exp(mean - half):.3f}-{math.exp(mean + half):.3f})", "", ">= 0.98x",
                     fmt(med(res[(c, "tok/s", "cpu")]) * 1e3, " ms/token", 3)])
    say(f"front vs direct, medians of {ns.rounds} rounds ({machine_note()}); front CPU: its own time per request "
        f"or streamed token, its idle watcher ({idle * 1e3:.2f} ms/s) subtracted")
    say(table(rows, ["clients", "what", "direct", "front", "front - direct, 95% CI (or front / direct)",
                     "front - its upstream", "target", "front CPU"]))
    if "phase" in res:
        c, delay, got = res["phase"]
        base = statistics.fmean(got["direct"])
        say(f"phase check: {c} clients, closed loop with no think time, every client on one arm at a time "
            f"(mean per request; direct+delay waits the front's own {delay * 1e3:.3f} ms before each request)")
        say(table([[label, str(len(xs)), fmt(statistics.fmean(xs) * 1e3, " ms", 2), fmt(med(xs) * 1e3, " ms", 2),
                    f"{(statistics.fmean(xs) - base) * 1e3:+.2f} ms"] for label, xs in got.items()],
                  ["arm", "requests", "mean", "median", "mean - direct"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
