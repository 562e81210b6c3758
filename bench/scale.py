"""The coordinator at hundreds of nodes (issue 33): per-node cost of launch, status, teardown, reap and cancel, and
connections under a low open-file limit.

    .venv/bin/python bench/scale.py [--quick] [--json] [--nodes 16,256,1000] [--rtt 0,50]

Command rows run the real coordinator code (launch/start.py, status.py, teardown.py, reaper.py, cancel.py) against
nodes answered by the fake transport (launch/fakecluster.py: a healthy node, each answer ``rtt`` ms after its
request), so nothing but the coordinator is measured, at any node count. Per row:

  wall_s                       the command, start to end
  coordinator_cpu_ms_per_node  process CPU (every thread; the fake nodes' own answering included) / nodes
  bytes_sent_per_node          what the coordinator sent a node (op requests: files, contracts, argv), mean
  world_bytes_per_node         (launch) the part of it that lists every rank: the MLX hostfile, ~38 bytes per
                               rank (the only part that grows; contracts carry a rank's own layer range)
  round_trips                  node-op requests one node received (max over nodes); each costs one round trip
  max_loop_stall_ms            the most CPU the event-loop thread spent between two 5 ms ticks of a watcher: how
                               long the loop could not answer anything (CPU, not wall: the machine is shared, and
                               being descheduled is not a stall of ours); max_loop_lag_ms is the wall-clock lateness

Contract rows (``command: "contracts"``, 16, 100 and 1,000 nodes): every rank's contract planned and signed as
launch does it (``fakecluster.simulated_contracts``: jobplan, the deployment's proof, one signature each), alone:
``contract_bytes_per_node`` (the largest contract) and ``contract_cpu_ms_per_node`` (the best of 3 runs).

Connection rows (``command: "connect"``) open real asyncssh sessions (one node-op request each) to an asyncssh
server in this process, under a soft open-file limit of 256: ``failures`` is how many did not get their answer.
The server's end of each connection lives in this process too, so a connection costs one descriptor more here
(fdlimit.SLOTS is told so). Two arms side by side: connections in waves (what clusterctl does) and all at once.

Goals (checked and printed): launch CPU and bytes per node at 256 within 1.5x of 16, the same round trips, wall at
256 within 2x of 16 at 50 ms; 0 failures for the 300 sessions; contract bytes per node at 1,000 within 1.1x of 16 and
contract CPU per node within 1.5x; no launch loop stall over 100 ms at the largest node count run. ``--quick``: 16 and 256 nodes at 0 and 50 ms and 300
sessions; the default adds 1,000 nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clusterctl.connect import fdlimit  # noqa: E402
from clusterctl.launch.fakecluster import SimulatedNode, simulated_contracts, simulated_deployment  # noqa: E402
from clusterctl.connect.faketransport import fake_ssh  # noqa: E402
from clusterctl.launch.jobplan import LaunchOptions  # noqa: E402
from clusterctl.connect.nodes import Connector  # noqa: E402
from clusterctl.statedir.state import StateDir  # noqa: E402

TICK = 0.005


class LoopWatch:
    """The event loop's longest stall: CPU of the loop thread, and wall lateness, between two ticks."""

    def __init__(self):
        self.cpu = self.lag = 0.0
        self.task = None

    async def _run(self) -> None:
        last_wall, last_cpu = time.monotonic(), time.thread_time()
        while True:
            await asyncio.sleep(TICK)
            wall, cpu = time.monotonic(), time.thread_time()
            self.lag = max(self.lag, wall - last_wall - TICK)
            self.cpu = max(self.cpu, cpu - last_cpu)
            last_wall, last_cpu = wall, cpu

    def __enter__(self):
        self.task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc):
        self.task.cancel()


async def measured(name: str, nodes: dict[str, SimulatedNode], rtt_ms: float, coro_fn) -> dict:
    before = {k: (len(v.calls), v.bytes_in) for k, v in nodes.items()}
    cpu0, t0 = time.process_time(), time.monotonic()
    with LoopWatch() as watch:
        await asyncio.sleep(0)
        await coro_fn()
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    n = len(nodes)
    return {"command": name, "nodes": n, "rtt_ms": rtt_ms, "wall_s": round(wall, 3),
            "coordinator_cpu_ms_per_node": round(cpu * 1000 / n, 3),
            "bytes_sent_per_node": round(sum(v.bytes_in - before[k][1] for k, v in nodes.items()) / n),
            "round_trips": max(len(v.calls) - before[k][0] for k, v in nodes.items()),
            "max_loop_stall_ms": round(watch.cpu * 1000, 1), "max_loop_lag_ms": round(watch.lag * 1000, 1)}


def world_bytes(nodes: dict[str, SimulatedNode]) -> int:
    """Of what launch sent a node, the part that lists every rank, mean per node: its MLX hostfile (the ring reads
    every rank's address), as sent (base64 in a write request)."""
    total = sum(len(data) for node in nodes.values() for path, data in node.files.items()
                if path.endswith(".hostfile.json"))
    return round(total * 4 / 3 / len(nodes))


def contract_rows(counts: list[int], folder: Path) -> list[dict]:
    """Contracts alone: bytes of the largest and CPU per node of planning and signing all of them (best of 3)."""
    rows = []
    for i, n in enumerate([counts[0], *counts]):  # the first run warms up (imports, pydantic's schemas)
        state = StateDir(folder / f"contracts-{i}")
        path = simulated_deployment(state, n)
        best = None
        for _ in range(3):
            cpu0 = time.process_time()
            contracts = simulated_contracts(state, path)
            cpu = time.process_time() - cpu0
            best = cpu if best is None else min(best, cpu)
        if i:
            rows.append({"command": "contracts", "nodes": n, "rtt_ms": 0,
                         "contract_bytes_per_node": max(len(c) for c in contracts.values()),
                         "contract_cpu_ms_per_node": round(best * 1000 / n, 3)})
    return rows


async def commands(n: int, rtt_ms: float, folder: Path) -> list[dict]:
    """launch (detached), status, cancel, teardown; then a second launch whose ranks all exit, and reap."""
    from clusterctl.launch.cancel import cancel_command
    from clusterctl.launch.reaper import reap
    from clusterctl.launch.start import launch
    from clusterctl.launch.status import status
    from clusterctl.launch.teardown import teardown_command

    state = StateDir(folder / "state")
    dep = await asyncio.to_thread(simulated_deployment, state, n)
    nodes = {f"n{i:04d}": SimulatedNode(rtt=rtt_ms / 1000) for i in range(n)}
    ssh = fake_ssh(nodes)
    opts = LaunchOptions(check_model=False, detach=True, timeout=600, canary=True, ssh=ssh)
    rows = []
    rows.append(await measured("launch", nodes, rtt_ms, lambda: launch(dep, state, opts)))
    rows[-1]["world_bytes_per_node"] = world_bytes(nodes)
    rows.append(await measured("status", nodes, rtt_ms, lambda: status(state, ssh)))
    rows.append(await measured("cancel", nodes, rtt_ms, lambda: cancel_command(state, dep, ssh, requests=None)))
    rows.append(await measured("teardown", nodes, rtt_ms, lambda: teardown_command(state, None, ssh, grace=1)))
    await launch(dep, state, opts)
    for node in nodes.values():
        node.running.clear()  # every rank of the detached job exited: the reaper's to clean up
    rows.append(await measured("reap", nodes, rtt_ms, lambda: reap(state, ssh, grace=1)))
    assert rows[-1]["round_trips"] > 0
    return rows


# ---- real sessions under a low open-file limit ------------------------------------------------------------------

async def _session(process) -> None:
    """The node-op session protocol, answered in the server: every request gets ``{"status": []}``."""
    try:
        async for line in process.stdin:
            msg = json.loads(line)
            process.stdout.write(json.dumps({"id": msg["id"], "answer": {"status": []}}) + "\n")
    except Exception:
        pass
    process.exit(0)


async def connect_rows(count: int, nofile: int, folder: Path) -> list[dict]:
    import asyncssh

    from clusterctl.connect.nodes import close_all, handles
    from clusterctl.plan.inventory import Node
    from clusterctl.protocol.nodeops import AliveRequest

    host_key, client_key = asyncssh.generate_private_key("ssh-ed25519"), asyncssh.generate_private_key("ssh-ed25519")
    (folder / "client").write_bytes(client_key.export_private_key())
    (folder / "client.pub").write_bytes(client_key.export_public_key())
    server = await asyncssh.listen("127.0.0.1", 0, server_host_keys=[host_key], process_factory=_session,
                                   authorized_client_keys=asyncssh.import_authorized_keys(
                                       client_key.export_public_key().decode()), encoding="utf-8")
    port = server.sockets[0].getsockname()[1]
    (folder / "known_hosts").write_bytes(f"[127.0.0.1]:{port} ".encode() + host_key.export_public_key())
    nodes = [Node(name=f"c{i:04d}", host="127.0.0.1", port=port, user="bench", identity_file=str(folder / "client"))
             for i in range(count)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    rows = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, _ctx: None)  # the server's own EMFILE on accept, when all at once
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
        for arm, slots in (("waves", fdlimit.ConnectionSlots(fds_per_connection=fdlimit.FDS_PER_CONNECTION + 1)),
                           ("all at once", fdlimit.ConnectionSlots(limit=1 << 20))):
            fdlimit.SLOTS = slots
            hs = handles(nodes, Connector(known_hosts=folder / "known_hosts", connect_timeout=20))
            cpu0, t0 = time.process_time(), time.monotonic()
            got = await asyncio.gather(*(h.ask(AliveRequest(targets=[]), timeout=120) for h in hs.values()),
                                       return_exceptions=True)
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            await close_all(hs)
            errors = [g for g in got if isinstance(g, BaseException)]
            first = next((getattr(e, "message", str(e)) for e in errors), None)
            rows.append({"command": "connect", "arm": arm, "nodes": count, "nofile": nofile,
                         "failures": len(errors), "wall_s": round(wall, 3),
                         "coordinator_cpu_ms_per_node": round(cpu * 1000 / count, 3),
                         **({"first_error": first[:160]} if first else {})})
    finally:
        fdlimit.SLOTS = fdlimit.ConnectionSlots()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        server.close()  # the handler stays: the server retries a failed accept after 100 ms, closed or not
    return rows


# ---- goals and output ---------------------------------------------------------------------------------------------

def goals(rows: list[dict]) -> list[tuple[str, float | None, float, bool]]:
    """(what, measured ratio or count, bound, met)."""
    def row(cmd, n, rtt):
        return next((r for r in rows if r["command"] == cmd and r["nodes"] == n and r["rtt_ms"] == rtt), None)

    out = []
    for rtt in sorted({r["rtt_ms"] for r in rows if r["command"] == "launch"}):
        a, b = row("launch", 16, rtt), row("launch", 256, rtt)
        if not (a and b):
            continue
        for key, bound in (("coordinator_cpu_ms_per_node", 1.5), ("bytes_sent_per_node", 1.5)):
            ratio = b[key] / a[key]
            out.append((f"launch {key} 256/16 at {rtt:g} ms", round(ratio, 2), bound, ratio <= bound))
        ratio = (b["bytes_sent_per_node"] - b["world_bytes_per_node"]) / \
            (a["bytes_sent_per_node"] - a["world_bytes_per_node"])
        out.append((f"launch bytes_sent_per_node without the rank list 256/16 at {rtt:g} ms", round(ratio, 2), 1.5,
                    ratio <= 1.5))
        out.append((f"launch round_trips 256 vs 16 at {rtt:g} ms", b["round_trips"] - a["round_trips"], 0,
                    b["round_trips"] == a["round_trips"]))
        if rtt == 50:
            ratio = b["wall_s"] / a["wall_s"]
            out.append(("launch wall_s 256/16 at 50 ms", round(ratio, 2), 2.0, ratio <= 2.0))
    c = {r["nodes"]: r for r in rows if r["command"] == "contracts"}
    if 16 in c and 1000 in c:
        for key, bound in (("contract_bytes_per_node", 1.1), ("contract_cpu_ms_per_node", 1.5)):
            ratio = c[1000][key] / c[16][key]
            out.append((f"{key} 1000/16", round(ratio, 2), bound, ratio <= bound))
    launches = [r for r in rows if r["command"] == "launch"]
    if launches:
        top = max(r["nodes"] for r in launches)
        stall = max(r["max_loop_stall_ms"] for r in launches if r["nodes"] == top)
        out.append((f"launch longest loop stall at {top} nodes (ms)", stall, 100, stall <= 100))
    for r in rows:
        if r["command"] == "connect" and r.get("arm") == "waves":
            out.append((f"connect {r['nodes']} sessions under nofile {r['nofile']}: failures", r["failures"], 0,
                        r["failures"] == 0))
    return out


def table(rows: list[dict]) -> None:
    cols = ["command", "nodes", "rtt_ms", "wall_s", "coordinator_cpu_ms_per_node", "bytes_sent_per_node",
            "world_bytes_per_node", "round_trips", "max_loop_stall_ms", "max_loop_lag_ms"]
    heads = ["COMMAND", "NODES", "RTT ms", "WALL s", "CPU ms/node", "BYTES/node", "RANK LIST", "TRIPS", "STALL ms",
             "LAG ms"]
    print(" ".join(f"{h:>11}" for h in heads))
    for r in rows:
        if r["command"] not in ("connect", "contracts"):
            print(" ".join(f"{r.get(c, '-')!s:>11}" for c in cols))
    for r in rows:
        if r["command"] == "contracts":
            print(f"contracts {r['nodes']} nodes: {r['contract_bytes_per_node']} bytes, "
                  f"{r['contract_cpu_ms_per_node']} ms of CPU per node")
    for r in rows:
        if r["command"] == "connect":
            print(f"connect {r['nodes']} real sessions, nofile {r['nofile']}, {r['arm']}: {r['failures']} failed, "
                  f"{r['wall_s']} s" + (f" (first: {r['first_error']})" if r.get("first_error") else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 and 256 nodes at 0 and 50 ms, 300 sessions")
    ap.add_argument("--json", action="store_true", help="one JSON object per row on stdout, then the goals")
    ap.add_argument("--nodes", default=None, help="node counts (default 16,256,1000; --quick 16,256)")
    ap.add_argument("--rtt", default="0,50", help="round trips in ms")
    ap.add_argument("--sessions", type=int, default=300)
    a = ap.parse_args(argv)
    counts = [int(x) for x in (a.nodes or ("16,256" if a.quick else "16,256,1000")).split(",")]
    rtts = [float(x) for x in a.rtt.split(",")]
    rows: list[dict] = []

    async def go() -> None:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            for rtt in rtts:
                for n in counts:
                    folder = Path(tmp) / f"{n}-{rtt:g}"
                    folder.mkdir()
                    got = await commands(n, rtt, folder)
                    rows.extend(got)
                    for r in got:
                        if a.json:
                            print(json.dumps(r), flush=True)
                        else:
                            print(f"  {r['command']} {n} nodes {rtt:g} ms: {r['wall_s']} s", file=sys.stderr)
            for r in contract_rows([16, 100, 1000], Path(tmp)):
                rows.append(r)
                if a.json:
                    print(json.dumps(r), flush=True)
            folder = Path(tmp) / "connect"
            folder.mkdir()
            for r in await connect_rows(a.sessions, 256, folder):
                rows.append(r)
                if a.json:
                    print(json.dumps(r), flush=True)

    os.environ.setdefault("USER", "bench")
    load = os.getloadavg()[0]
    asyncio.run(go())
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs "
          "(wall times include waiting for a CPU)", file=sys.stderr)
    met = goals(rows)
    if a.json:
        for what, value, bound, ok in met:
            print(json.dumps({"goal": what, "measured": value, "bound": bound, "met": ok}))
    else:
        table(rows)
        print("\ngoals:")
        for what, value, bound, ok in met:
            print(f"  {'met ' if ok else 'MISS'} {what}: {value} (bound {bound})")
    return 0 if all(ok for *_, ok in met) else 1


if __name__ == "__main__":
    sys.exit(main())
