"""Benchmark (issues 3, 11): tokens/s through the HTTP API, alone and with concurrent clients, time to first
token, cold start, and peak RSS per rank, clusterctl side by side with mlx-lm's own server and with mlx.launch,
in one run.

Run: .venv/bin/python bench/serve.py [--quick] [--rounds N] [--requests N] [--clients 1,4,8] [--models 7m,100m]

Arms (only one arm's processes are alive at a time; the order rotates every round; medians reported):
  a  mlx_lm.server     1 process: `python -m mlx_lm.server --model PATH --port P` (mlx-lm's own server)
  b  mlx.launch        `mlx.launch --hosts 127.0.0.1,127.0.0.1 --backend ring ... -- -m mlx_lm.server --pipeline`
                       (2 local ranks, mlx-lm's default even split): what users run today
  c  clusterctl        plan a 2-node local cluster, `clusterctl launch --detach`, requests, `clusterctl teardown`;
                       balanced allocation (4/4 layers, the same split as b) for the speed ratios;
     clusterctl 6/2    memory_gb 2 and 6 with --allocation proportional (rank 0: 2 layers, rank 1: 6), once per
                       model, for the peak RSS per rank (and its speed, for information)
Per arm and round: start -> ready (a, b: a 1-token request answers; c: `launch --detach` returned, which already
includes a canary) -> a fresh streamed request (its first token = cold start; it is also the warm-up) -> N
streamed greedy requests of 64 new tokens (distinct prompts, the same list for every arm) -> idle CPU over 2 s
(first round) -> for each concurrency C in --clients: C streaming clients at once, each sending --per-client
requests one after another (distinct prompts) -> peak RSS -> stop. tok/s = completion tokens / (request sent ->
end of stream); with C clients, aggregate tok/s = all completion tokens / (first request sent -> last stream
ended), and time to first token is per request (sent -> first content chunk), p50/p95 over all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (MLX_LAUNCH, PY, TAG_ENV, alive, check, clusterctl, fmt, idle_cores, kill_tagged,  # noqa: E402
                     launch_manifests, log, machine_note, med, mktemp_names, model, new_tag, port_run, ratio,
                     remove_mlx_launch_leaks, say, stop_popen, stream_chat, table, tagged, vm_hwm, wait_gone,
                     wait_http, with_env)

MAX_TOKENS = 64
PROMPTS = [
    "Write one line about distributed inference.",
    "Explain pipeline parallelism to a child.",
    "List three uses of a ring all-reduce.",
    "What is a process group?",
    "Describe a teardown that leaves nothing behind.",
    "Why do ranks share a random seed?",
    "Summarise the life of a rank.",
    "Name a reason to split layers unevenly.",
    "How does a canary request help?",
    "What does a heartbeat marker prove?",
]
COLD_PROMPT = "Say hello."


@dataclass
class Round:
    arm: str
    model: str
    ready: float | None = None  # spawn -> ready as defined above
    cold_first: float | None = None  # spawn -> first streamed token of a fresh request
    streams: list = field(default_factory=list)  # (prompt index, Stream)
    idle: float | None = None
    rss: list = field(default_factory=list)  # per rank: (rank, layers, marker peak, VmHWM)
    markers: dict = field(default_factory=dict)  # clusterctl: rank -> marker file
    loads: dict = field(default_factory=dict)  # clients -> (aggregate tok/s, [time to first token], errors)
    error: str | None = None


# ---- arms: each is a context manager yielding (endpoint, pids by rank, layers by rank) once ready ---------------

@contextlib.contextmanager
def arm_single(path: Path, r: Round):
    tag = new_tag("srv1")
    port = port_run(1)
    t0 = time.monotonic()
    proc = subprocess.Popen([PY, "-m", "mlx_lm.server", "--model", str(path), "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, TAG_ENV: tag}, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        r.ready = wait_http(base, 300, alive=lambda: proc.poll() is None) - t0
        yield t0, base, {0: proc.pid}, {0: "all"}, [proc.pid]
    finally:
        stop_popen(proc, signal.SIGTERM)
        stop_popen(proc, signal.SIGKILL)
        kill_tagged(tag)


@contextlib.contextmanager
def arm_mlx_launch(path: Path, r: Round, workdir: Path):
    tag = new_tag("mlxl")
    ring = port_run(2)
    port = port_run(1)
    before = mktemp_names()
    t0 = time.monotonic()
    # stdin: a pipe kept open, as a terminal would be (at EOF its stdin loop spins a core)
    proc = subprocess.Popen([MLX_LAUNCH, "--hosts", "127.0.0.1,127.0.0.1", "--backend", "ring", "--starting-port",
                             str(ring), "--env", f"{TAG_ENV}={tag}", "--python", PY, "--", "-m", "mlx_lm.server",
                             "--model", str(path), "--pipeline", "--port", str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, TAG_ENV: tag}, start_new_session=True, cwd=str(workdir))
    ranks: dict[int, int] = {}
    seen: set[int] = set()  # every tagged pid: mlx.launch's pid files name the ranks
    try:
        base = f"http://127.0.0.1:{port}"
        r.ready = wait_http(base, 300, alive=lambda: proc.poll() is None) - t0
        import psutil

        seen.update(tagged(tag))
        for pid in tagged(tag, name_has="mlx_lm.server"):
            with contextlib.suppress(psutil.Error, ValueError, KeyError):  # the launcher has no MLX_RANK
                ranks[int(psutil.Process(pid).environ()["MLX_RANK"])] = pid
        yield t0, base, ranks, {0: "4 (last)", 1: "4 (first)"}, [proc.pid, *ranks.values()]
    finally:
        stop_popen(proc, signal.SIGKILL)
        kill_tagged(tag)
        remove_mlx_launch_leaks(before, {f'[["127.0.0.1:{ring}"], ["127.0.0.1:{ring + 1}"]]'}, seen)


@contextlib.contextmanager
def arm_clusterctl(dep: Path, env: dict, r: Round):
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    t0 = time.monotonic()
    p = clusterctl("launch", str(dep), "--detach", "--timeout", "300", env=env, timeout=400)
    nonce = None
    try:
        check(p, "clusterctl launch --detach")
        r.ready = time.monotonic() - t0
        [m] = launch_manifests(state)
        nonce = m["nonce"]
        pids = {x["rank"]: x["pid"] for x in m["ranks"]}
        layers = {x["rank"]: f"{x['end_layer'] - x['start_layer']} [{x['start_layer']},{x['end_layer']})"
                  for x in m["ranks"]}
        r.markers = {x["rank"]: x["marker_path"] for x in m["ranks"]}
        yield t0, m["endpoint"], pids, layers, list(pids.values())
    finally:
        td = clusterctl("teardown", "--json", env=env, timeout=120)
        left = with_env("CLUSTERCTL_NONCE", nonce) if nonce else []
        if td.returncode != 0 or left:
            said = (td.stderr or "").strip().splitlines()[-1:] or [""]
            r.error = (r.error or "") + f" teardown exited {td.returncode}, {len(left)} rank(s) left: {said[0]}"
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def marker_peak(path: str) -> int | None:
    import json

    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(path).read_text()).get("peak_rss_bytes")
    return None


def concurrent_load(base: str, clients: int, per_client: int, offset: int) -> tuple[float, list[float], int]:
    """``clients`` threads, each streaming ``per_client`` requests one after another: (aggregate tok/s, the time
    to first token of every request, failed requests)."""
    import threading

    got: list = []
    errors = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(per_client):
            k = (offset + i * per_client + j) % len(PROMPTS)
            try:
                st = stream_chat(base, PROMPTS[k], MAX_TOKENS)
            except Exception:  # counted: a refused or broken request is a result too
                with lock:
                    errors[0] += 1
                continue
            with lock:
                got.append(st)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.monotonic() - t0
    return sum(s.tokens for s in got) / wall if wall > 0 else 0.0, [s.first for s in got], errors[0]


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_round(arm: str, kind: str, path: Path, ctx, n_requests: int, *, idle: bool, offset: int,
              clients: tuple[int, ...] = (), per_client: int = 2) -> Round:
    r = Round(arm, kind)
    try:
        with ctx(r) as (t0, base, pids, layers, all_pids):
            s = stream_chat(base, COLD_PROMPT, MAX_TOKENS)
            r.cold_first = (time.monotonic() - s.seconds + s.first) - t0
            for i in range(n_requests):
                k = (offset + i) % len(PROMPTS)
                r.streams.append((k, stream_chat(base, PROMPTS[k], MAX_TOKENS)))
            if idle:
                r.idle = idle_cores(all_pids, 2.0)
            for c in clients:
                r.loads[c] = concurrent_load(base, c, per_client, offset)
            time.sleep(1.2)  # let the marker heartbeat (<= 1 s) carry the peak after the last request
            markers = r.markers
            r.rss = [(rank, layers.get(rank, "?"), marker_peak(markers[rank]) if rank in markers else None,
                      vm_hwm(pid)) for rank, pid in sorted(pids.items())]
    except Exception as e:  # one arm failing must not hide the others: report it and go on
        r.error = f"{type(e).__name__}: {e}"
    return r


def plan(workdir: Path, env: dict, path: Path, mems, allocation: str, name: str) -> Path:
    lines = ["[cluster]", f'name = "{name}"']
    for i, mem in enumerate(mems):
        lines += ["[[node]]", f'name = "{"ab"[i]}"', "local = true", f"memory_gb = {mem}",
                  f'runtime_dir = "{workdir}/run-{name}-{"ab"[i]}"']
    c = workdir / f"{name}.toml"
    c.write_text("\n".join(lines) + "\n")
    out = workdir / f"{name}.json"
    check(clusterctl("plan", "-c", str(c), "-m", str(path), "--allocation", allocation, "--context", "512",
                     "-o", str(out), "-q", env=env), "clusterctl plan")
    return out


# ---- main -----------------------------------------------------------------------------------------------------

ARM_NAMES = {"a": "mlx_lm.server (1 proc)", "b": "mlx.launch + server --pipeline", "c": "clusterctl 4/4",
             "c62": "clusterctl 6/2"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="7M: 1 round of 5 requests per arm; 100M: only the peak RSS of 1 process vs 6/2 (~2 min)")
    ap.add_argument("--rounds", type=int, help="rounds per arm (default 3; --quick 1)")
    ap.add_argument("--requests", type=int, help="measured requests per round (default 2; --quick 5)")
    ap.add_argument("--models", default="7m,100m", help="comma list of 7m, 100m")
    ap.add_argument("--clients", default="1,4,8", help="concurrent streaming clients to measure (comma list)")
    ap.add_argument("--per-client", type=int, default=2, help="requests each concurrent client sends in turn")
    ns = ap.parse_args()
    clients = tuple(int(c) for c in ns.clients.split(",") if c.strip())
    rounds = ns.rounds or (1 if ns.quick else 3)
    n_req = ns.requests or (5 if ns.quick else 2)
    kinds = [k.strip() for k in ns.models.split(",") if k.strip()]
    started = time.monotonic()
    say(f"bench/serve.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds={rounds} requests/round={n_req}"
        f"  greedy, {MAX_TOKENS} new tokens, streamed")
    workdir = Path(tempfile.mkdtemp(prefix="cct-bench-serve-"))
    results: dict[str, list[Round]] = {}
    plans: dict[str, float] = {}
    try:
        for kind in kinds:
            path = model(kind)
            env = {"CLUSTERCTL_STATE_DIR": str(workdir / f"state-{kind}")}
            t = time.monotonic()
            dep44 = plan(workdir, env, path, (4, 4), "balanced", f"b{kind}")
            plans[kind] = time.monotonic() - t
            dep62 = plan(workdir, env, path, (2, 6), "proportional", f"p{kind}")
            ctxs = {"a": lambda r, p=path: arm_single(p, r),
                    "b": lambda r, p=path: arm_mlx_launch(p, r, workdir),
                    "c": lambda r, d=dep44, e=env: arm_clusterctl(d, e, r),
                    "c62": lambda r, d=dep62, e=env: arm_clusterctl(d, e, r)}
            # quick: the 100M model only for peak RSS (1 process vs 6/2), one warm-up request each
            rss_only = ns.quick and kind == "100m"
            order = ["a"] if rss_only else ["a", "b", "c"]
            rs: list[Round] = []
            for i in range(rounds):
                arms = order[i % len(order):] + order[:i % len(order)]
                if i == 0:
                    arms.insert(1, "c62")
                for arm in arms:
                    k = 0 if (ns.quick and (arm == "c62" or rss_only)) else n_req  # quick: RSS only
                    r = run_round(arm, kind, path, ctxs[arm], k, idle=(i == 0), offset=i * n_req,
                                  clients=() if (arm == "c62" or rss_only) else clients, per_client=ns.per_client)
                    rs.append(r)
                    log(f"{kind} round {i + 1} {ARM_NAMES[arm]}: ready {fmt(r.ready, ' s')}, first token "
                        f"{fmt(r.cold_first, ' s')}, tok/s {fmt(med(s.tok_s for _, s in r.streams), digits=1)}"
                        f" (load {os.getloadavg()[0]:.1f})" + (f" ERROR {r.error}" if r.error else ""))
            results[kind] = rs
        report(results, plans, time.monotonic() - started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def report(results: dict[str, list[Round]], plans: dict, elapsed: float) -> None:
    for kind, rs in results.items():
        by = {a: [r for r in rs if r.arm == a] for a in ARM_NAMES}
        tok = {a: med(s.tok_s for r in v for _, s in r.streams) for a, v in by.items()}
        dec = {a: med((s.tokens - 1) / (s.seconds - s.first) for r in v for _, s in r.streams
                      if s.seconds > s.first and s.tokens > 1) for a, v in by.items()}
        nreq = {a: sum(len(r.streams) for r in v) for a, v in by.items()}
        ready = {a: med(r.ready for r in v) for a, v in by.items()}
        cold = {a: med(r.cold_first for r in v) for a, v in by.items()}
        idle = {a: med(r.idle for r in v) for a, v in by.items()}
        say("")
        say(f"== {kind} model ({'≈100M' if kind == '100m' else '≈6M, the default tiny'} params, fp32) ==")
        spread = {a: [s.tok_s for r in v for _, s in r.streams] for a, v in by.items()}
        rows = [[ARM_NAMES[a], fmt(tok[a], digits=1),
                 f"{min(spread[a]):.1f}-{max(spread[a]):.1f}" if spread[a] else "n/a", fmt(dec[a], digits=1),
                 str(nreq[a]), fmt(ready[a]), fmt(cold[a]), fmt(idle[a])] for a in ARM_NAMES]
        say(table(rows, ["arm", "tok/s (median)", "range", "decode tok/s", "requests", "ready s",
                         "first token s", "idle cores"]))
        target_b = 1.8 if kind == "100m" else 2.0
        say(f"tok/s  c/a = {ratio(tok['c'], tok['a'])} (target >= 0.85x)   c/b = {ratio(tok['c'], tok['b'])} "
            f"(target >= {target_b:g}x)   [6/2: c62/a = {ratio(tok['c62'], tok['a'])}, c62/b = "
            f"{ratio(tok['c62'], tok['b'])}]")
        say(f"cold start to first token  c/b = {ratio(cold['c'], cold['b'])} (target <= 1.0x)   c/a = "
            f"{ratio(cold['c'], cold['a'])}   (clusterctl plan, done once beforehand: {fmt(plans.get(kind))} s)")
        rows = []
        single = None
        for a in ARM_NAMES:
            v = [r for r in by[a] if r.rss]
            if not v:
                continue
            for rank, layers, peak, hwm in v[0].rss:
                if a == "a":
                    single = hwm
                best = peak or hwm
                rows.append([ARM_NAMES[a], str(rank), str(layers), fmt(peak and peak / 2**20, digits=0),
                             fmt(hwm and hwm / 2**20, digits=0), ratio(best, single)])
        say("peak RSS per rank (MiB; marker = clusterctl's peak_rss_bytes, VmHWM = /proc/PID/status)")
        say(table(rows, ["arm", "rank", "layers", "marker peak", "VmHWM", "vs 1 process"]))
        concurrency_report(by, kind)
        same = identical_outputs(rs)
        say(f"greedy outputs identical across arms, prompt by prompt: {same}")
        for r in rs:
            if r.error:
                say(f"error: {ARM_NAMES[r.arm]}: {r.error}")
    say(f"(total {elapsed:.0f} s)")


def concurrency_report(by: dict, kind: str) -> None:
    cs = sorted({c for v in by.values() for r in v for c in r.loads})
    if not cs:
        return
    agg = {(a, c): med(r.loads[c][0] for r in v if c in r.loads) for a, v in by.items() for c in cs}
    rows = []
    for a in ("a", "b", "c"):
        for c in cs:
            firsts = [x for r in by[a] if c in r.loads for x in r.loads[c][1]]
            errs = sum(r.loads[c][2] for r in by[a] if c in r.loads)
            rows.append([ARM_NAMES[a], str(c), fmt(agg[(a, c)], digits=1), fmt(pct(firsts, 0.5)),
                         fmt(pct(firsts, 0.95)), str(len(firsts)), str(errs)])
    say(f"concurrent streaming clients ({kind}; aggregate tok/s = median over rounds; first token over all requests)")
    say(table(rows, ["arm", "clients", "aggregate tok/s", "first token p50 s", "p95 s", "requests", "failed"]))
    for c in cs:
        say(f"  {c} client(s): c/a = {ratio(agg[('c', c)], agg[('a', c)])} (goal >= 0.85x)   "
            f"c/b = {ratio(agg[('c', c)], agg[('b', c)])} (goal >= 1.8x)")
    if 1 in cs and max(cs) > 1:
        top = max(cs)
        say(f"  clusterctl {top} clients / 1 client = {ratio(agg[('c', top)], agg[('c', 1)])} (goal >= 3x at 8)")


def identical_outputs(rs: list[Round]) -> str:
    texts: dict[int, dict[str, set]] = {}
    for r in rs:
        for k, s in r.streams:
            texts.setdefault(k, {}).setdefault(r.arm, set()).add(s.text)
    diffs = []
    for k, arms in sorted(texts.items()):
        if len(arms) < 2:
            continue
        if len(set().union(*arms.values())) > 1:
            diffs.append(f"prompt {k}: " + ", ".join(f"{a}={len(t)} variant(s)" for a, t in sorted(arms.items())))
    compared = sum(1 for arms in texts.values() if len(arms) >= 2)
    if not compared:
        return "n/a (no prompt was sent to two arms)"
    return "yes" if not diffs else "NO - " + "; ".join(diffs)


if __name__ == "__main__":
    sys.exit(main())
