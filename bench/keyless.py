"""Benchmark (issue 49, item 7): what unauthenticated clients can hold at the HTTP edge.

Run: .venv/bin/python bench/keyless.py [--target front|rank0] [--holders 150] [--mib 4] [--hold 30]
                                       [--mode body|head|idle]

The server runs in a child process of its own (so its RSS is its own): the front (front/proxy.py's server, given
a key as a job's contract would give it; nothing to forward to) or rank 0's HTTP API (rank/api/service.py, while
loading: its routes and key check are those of a serving rank 0). --holders clients connect to it on loopback at
once, none with a key, and each
  body   sends a POST head declaring a body of exactly --mib MiB, then all of it but one byte, then waits;
  head   sends a head that never ends: headers of 16 KiB each, as many as it may, then waits;
  idle   connects (one every 5 ms) and sends nothing.
Each holder waits up to --hold s for the server to answer or close. Printed: the server's RSS before, its peak
while the holders hold, and after they are gone; how many holders got an answer (by status) or a close, and how
long the server let the longest one hold its connection. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
KEY = "sk-bench-keyless-0123456789"

SERVE = {
    "front": """
import asyncio, sys, tempfile
from clusterctl.connect.nodes import Connector
from clusterctl.front.follow import Follower
from clusterctl.front.proxy import Front, make_server
from clusterctl.protocol.httpedge import Access, Cors, Keys
from clusterctl.statedir.state import StateDir
async def main():
    front = Front(Follower(StateDir(tempfile.mkdtemp()), "c", Connector(), log=lambda m: None))
    front.follower.last_rules = Access(Keys.of({"default": sys.argv[1]}), Cors(()))
    server = front.server = make_server(front)
    await server.listen("127.0.0.1", 0)
    asyncio.ensure_future(front.watch())  # the listener's sweep runs as in a serving front
    print(server.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
""",
    "rank0": """
import sys, tempfile, threading
from clusterctl.protocol.rankspec import parse_rank_spec
from clusterctl.rank.api.service import Api
from clusterctl.rank.engine.requestqueue import RequestQueue
d = tempfile.mkdtemp()
spec = parse_rank_spec(dict(deployment_id="d", job_id="j", nonce="n", node="a", rank=0, world_size=1, model_path="/m",
    start_layer=0, end_layer=8, layer_counts=[8], num_layers=8, hostfile=None, http_port=0, api_key=sys.argv[1],
    runtime_dir=d, marker_path=d + "/m.json", gate_path=d + "/gate"))
api = Api(spec, RequestQueue(), model_name="m")
api.start()
print(api.port, flush=True)
threading.Event().wait()
""",
}


def start(target: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(REPO / "src")}
    proc = subprocess.Popen([PY, "-c", SERVE[target], KEY], stdout=subprocess.PIPE, text=True, env=env)
    return proc, int(proc.stdout.readline())


async def hold(port: int, mode: str, size: int, hold_s: float, i: int) -> tuple[str, float]:
    """One keyless holder: (what the server did: an answer's status, "closed" or "held", seconds it let us hold)."""
    if mode == "idle":  # one after another: a burst past the listen backlog leaves connections the server never
        await asyncio.sleep(i * 0.005)  # accepted (the client thinks it connected), which would count as held
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        if mode == "body":
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % size)
            left = size - 1
            while left > 0:
                n = min(left, 64 << 10)
                writer.write(b"x" * n)
                await writer.drain()
                left -= n
        elif mode == "head":
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            for i in range(255):
                writer.write(b"X-H%d: %s\r\n" % (i, b"v" * ((16 << 10) - 16)))  # each just within a field's bound
                await writer.drain()
        await asyncio.Event().wait()  # then wait, sending nothing more

    async def watch() -> str:
        head = await reader.read(64)
        return head.split(b" ")[1].decode() if head.startswith(b"HTTP/") else "closed"

    sender, watcher = asyncio.ensure_future(send()), asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait([sender, watcher], timeout=hold_s, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            verdict = watcher.result()
            if verdict != "closed":  # answered: how long until the server closes on us
                try:
                    async with asyncio.timeout(max(0.1, hold_s - (time.monotonic() - t0))):
                        while await reader.read(65536):
                            pass
                except TimeoutError:
                    return verdict + " (held)", time.monotonic() - t0
                except (ConnectionError, OSError):  # closed with a reset: what the client still sent was unread
                    pass
            return verdict, time.monotonic() - t0
        if sender in done and sender.exception() is not None:  # the server cut us while we sent
            return "closed", time.monotonic() - t0
        return "held", time.monotonic() - t0
    except (ConnectionError, OSError):
        return "closed", time.monotonic() - t0
    finally:
        sender.cancel()
        watcher.cancel()
        writer.transport.abort()


async def run(port: int, pid: int, args) -> dict:
    proc = psutil.Process(pid)
    before = proc.memory_info().rss
    peak = [before]
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            await asyncio.sleep(0.1)

    sampler = asyncio.ensure_future(sample())
    t0 = time.monotonic()
    results = await asyncio.gather(*(hold(port, args.mode, args.mib << 20, args.hold, i) for i in range(args.holders)),
                                   return_exceptions=True)
    wall = time.monotonic() - t0
    await asyncio.sleep(1.0)
    stop.set()
    await sampler
    after = proc.memory_info().rss
    counts: dict[str, int] = {}
    times = []
    for r in results:
        verdict, held = r if isinstance(r, tuple) else (f"error {type(r).__name__}", 0.0)
        counts[verdict] = counts.get(verdict, 0) + 1
        times.append(held)
    return {"before": before, "peak": peak[0], "after": after, "counts": counts, "wall": wall,
            "held_median": statistics.median(times), "held_max": max(times), "fds": proc.num_fds()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/keyless.py")
    ap.add_argument("--target", choices=["front", "rank0"], default="front")
    ap.add_argument("--holders", type=int, default=150)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--hold", type=float, default=30.0)
    ap.add_argument("--mode", choices=["body", "head", "idle"], default="body")
    args = ap.parse_args(argv)
    if not 1 <= args.holders <= 1000 or not 0 < args.hold <= 600:
        ap.error("--holders 1..1000, --hold 0..600 s")
    server, port = start(args.target)
    try:
        r = asyncio.run(run(port, server.pid, args))
    finally:
        server.kill()
        server.wait()
    mib = 1 << 20
    print(f"{args.target}: {args.holders} keyless holders ({args.mode}, {args.mib} MiB), up to {args.hold:g} s each")
    print(f"  RSS {r['before'] / mib:.0f} MiB before, {r['peak'] / mib:.0f} MiB peak, {r['after'] / mib:.0f} MiB after"
          f" (+{(r['peak'] - r['before']) / mib:.0f} MiB at the peak)")
    print(f"  what the server did: {dict(sorted(r['counts'].items()))}")
    print(f"  a holder's connection lasted: median {r['held_median']:.2f} s, longest {r['held_max']:.2f} s "
          f"(all done in {r['wall']:.1f} s); server fds after: {r['fds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
