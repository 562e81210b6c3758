"""Benchmark (issue 34): the front door's cost, side by side with talking to rank 0 directly.

Run: .venv/bin/python bench/front.py [--rounds N] [--clients 1,8] [--requests N] [--tokens N]

One real 2-rank local deployment of the tiny model (`launch --detach --front 127.0.0.1:PORT`); every round
measures both arms back to back (the order alternates), and the medians over rounds are compared:
  latency    each of C clients sends --requests requests one after another over a kept-alive connection:
             GET /v1/models (rank 0's HTTP path, no model work) and a 1-token chat completion; the added latency
             is median(front) - median(direct) per request
  streamed   C clients each stream one greedy chat completion of --tokens tokens: aggregate tokens/s
             (all completion tokens / first request sent -> last stream ended); the ratio is front / direct
Targets: added latency <= 1 ms per request; streamed tokens/s >= 0.98x direct; at 1 and 8 clients.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
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


def latencies(base: str, clients: int, requests: int, what: str) -> list[float]:
    """Per-request seconds of ``clients`` threads, each on its own kept-alive connection."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    out: list[float] = []
    lock = threading.Lock()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0})

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        mine = []
        for _ in range(requests):
            t0 = time.perf_counter()
            if what == "models":
                conn.request("GET", "/v1/models")
            else:
                conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            mine.append(time.perf_counter() - t0)
            if r.status != 200:
                raise RuntimeError(f"{what}: {r.status}")
        conn.close()
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=client) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def streamed(base: str, clients: int, tokens: int, offset: int) -> float:
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
    return sum(got) / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--requests", type=int, default=40, help="latency requests per client and round")
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per streamed request")
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
    log(f"rank 0 at {direct}, front at {via}; {machine_note()}")
    res: dict = {}
    try:
        for arm in (direct, via):  # warm-up: connections, the prompt path
            streamed(arm, 1, 8, 0)
            latencies(arm, 1, 5, "chat")
        for rnd in range(ns.rounds):
            for c in clients:
                arms = [("direct", direct), ("front", via)]
                for name, base in (arms if rnd % 2 == 0 else arms[::-1]):
                    for what in ("models", "chat"):
                        res.setdefault((c, what, name), []).append(med(latencies(base, c, ns.requests, what)))
                    res.setdefault((c, "tok/s", name), []).append(streamed(base, c, ns.tokens, rnd * c))
            log(f"round {rnd + 1}/{ns.rounds} done")
    finally:
        clusterctl("teardown", env=env, timeout=120)
        clusterctl("front", "--stop", env=env, timeout=60)
    rows = []
    for c in clients:
        for what in ("models", "chat"):
            d, f = med(res[(c, what, "direct")]), med(res[(c, what, "front")])
            rows.append([str(c), f"latency {what}", fmt(d * 1e3, " ms", 3), fmt(f * 1e3, " ms", 3),
                         fmt((f - d) * 1e3, " ms", 3), "<= 1 ms"])
        d, f = med(res[(c, "tok/s", "direct")]), med(res[(c, "tok/s", "front")])
        rows.append([str(c), "streamed tok/s", fmt(d, "", 1), fmt(f, "", 1), f"{f / d:.3f}x", ">= 0.98x"])
    say(f"front vs direct, medians of {ns.rounds} rounds ({machine_note()})")
    say(table(rows, ["clients", "what", "direct", "front", "front - direct (or ratio)", "target"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
