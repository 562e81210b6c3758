"""Benchmark (issue 9): cancel latency through cancel files, on a real 2-rank local deployment.

Run: .venv/bin/python bench/cancel.py [--runs N] [--rounds N] [--tokens N]   (defaults 20, 4, 400)

Per run: a streaming greedy completion of up to 3000 tokens starts; once its first token has arrived,
`clusterctl cancel DEP --request ID --wait 30 --json` runs. Measured from the moment the command is spawned:
  to acks      the command returned with every rank's ack (its own process start-up included)
  to final     the client received the chunk with finish_reason "cancelled"
  inside       the command's own figure: from its reads of the nodes' cancel files to the last ack (the ranks' part)
The command is a fresh Python process each time (typer, pydantic, asyncssh imports): most of the figure is that
start-up, which the "bare start-up" row (`clusterctl --version`) shows for comparison.

Then the cost of the checks: one long greedy request on 2 real ranks (the tests' rank harness) with the peer
probes and cancel-file checks on, vs a rank spec that turns both off; interleaved rounds, medians.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, fmt, machine_note, model, say, table  # noqa: E402

CLUSTERCTL = [PY, "-m", "clusterctl"]


def run(args, env, timeout=300) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLUSTERCTL, *args], capture_output=True, text=True, env={**os.environ, **env},
                       timeout=timeout, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise SystemExit(f"clusterctl {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    return p


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def throughput(rounds: int, tokens: int) -> list[list[str]]:
    """tok/s of one long greedy request on 2 real ranks, the checks on (probes every 0.5 s, cancel-file stats)
    vs off (RankSpec peer_probes/cancel_checks false), interleaved, the order swapped every round."""
    sys.path.insert(0, str(REPO / "tests" / "launch"))
    from rankharness import RankCluster  # the tests' harness: real ranks from an unsigned spec

    speeds: dict[str, list[float]] = {"on": [], "off": []}
    root = Path(tempfile.mkdtemp(prefix="bench-checks-"))
    try:
        for i in range(rounds):
            for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
                over = {} if arm == "on" else {"peer_probes": False, "cancel_checks": False}
                with RankCluster(root / f"{arm}{i}", model("7m"), [4, 4], overrides=over, tag=f"{arm}{i}") as c:
                    c.up()
                    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=600)
                    body = {"prompt": "def main(argv):", "max_tokens": tokens, "temperature": 0}
                    t0 = time.monotonic()
                    conn.request("POST", "/v1/completions", body=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
                    doc = json.loads(conn.getresponse().read())
                    dt = time.monotonic() - t0
                    conn.close()
                    speeds[arm].append(doc["usage"]["completion_tokens"] / dt)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    on, off = statistics.median(speeds["on"]), statistics.median(speeds["off"])
    return [["checks on", f"{on:.1f}", f"{on / off:.3f}x"], ["checks off", f"{off:.1f}", "1.000x"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4, help="throughput rounds (checks on vs off)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens of the throughput request")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-cancel-", dir=REPO / "bench" / "out" if (REPO / "bench" / "out").is_dir()
                                 else None))
    env = {"CLUSTERCTL_STATE_DIR": str(root / "state"), "CLUSTERCTL_CACHE_DIR": str(root / "cache")}
    try:
        cluster = root / "cluster.toml"
        nodes = "".join(f'[[node]]\nname = "{n}"\nlocal = true\nmemory_gb = 4\nruntime_dir = "{root}/run-{n}"\n'
                        for n in "ab")
        cluster.write_text('[cluster]\nname = "bench"\n' + nodes)
        dep = root / "dep.json"
        run(["plan", "-c", str(cluster), "-m", str(model("7m")), "--context", "4096", "-o", str(dep), "-q"], env)
        out = json.loads(run(["launch", str(dep), "--detach", "--json"], env).stdout)
        host, port = out["endpoint"].removeprefix("http://").rsplit(":", 1)
        acks, finals, bare, inside = [], [], [], []
        for i in range(a.runs):
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": "def main(argv):", "max_tokens": 3000, "temperature": 0, "stream": True}),
                headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            rid = json.loads(r.readline().decode()[6:])["id"]
            final_at: list[float] = []

            def read() -> None:
                for line in r:
                    if line.startswith(b"data: {") and b'"finish_reason": "cancelled"' in line:
                        final_at.append(time.monotonic())
                    if line.startswith(b"data: [DONE]"):
                        return

            t = threading.Thread(target=read)
            t.start()
            t0 = time.monotonic()
            res = json.loads(run(["cancel", str(dep), "--request", rid, "--wait", "30", "--json"], env).stdout)
            acks.append(time.monotonic() - t0)
            inside.append(res["jobs"][0]["seconds"])
            t.join(60)
            conn.close()
            if not final_at or not res["jobs"][0]["all_acked"]:
                raise SystemExit(f"run {i}: the request was not cancelled cleanly: {res}")
            finals.append(final_at[0] - t0)
            t1 = time.monotonic()
            run(["--version"], env)
            bare.append(time.monotonic() - t1)
        rows = [[name, fmt(statistics.median(xs), " s", 3), fmt(p95(xs), " s", 3), fmt(max(xs), " s", 3)]
                for name, xs in (("cancel -> every rank acked (command returned)", acks),
                                 ("cancel -> client got finish_reason cancelled", finals),
                                 ("inside the command: files written -> every ack read", inside),
                                 ("bare start-up: clusterctl --version", bare))]
        say(f"bench/cancel.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  runs {a.runs}")
        say(table(rows, ["from spawning `clusterctl cancel`", "median", "p95", "max"]))
        say("goal (issue 9): < 1 s p95")
        say("\nthroughput of one long greedy request, 2 ranks (median tok/s; goal: checks on >= 0.98x off)")
        say(table(throughput(a.rounds, a.tokens), ["arm", "tok/s", "vs off"]))
    finally:
        subprocess.run([*CLUSTERCTL, "teardown", "--force", "-q"], env={**os.environ, **env}, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
