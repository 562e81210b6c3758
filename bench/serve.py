"""Benchmark (issues 3, 11): tokens/s through the HTTP API, alone and with concurrent clients, time to first
token, cold start, and peak RSS per rank, clusterctl side by side with mlx-lm's own server and with mlx.launch,
in one run.

Run: .venv/bin/python bench/serve.py [--quick] [--rounds N] [--requests N] [--clients 1,4,8] [--models 7m,100m]
     .venv/bin/python bench/serve.py --models smollm2 [--quick]     (the real model, issue 23; arms below)

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

--models smollm2: the real SmolLM2-135M-Instruct (30 layers, 9 heads, Q4_1 GGUF imported once into
bench/out/models/smollm2). mlx-lm's llama class has no pipeline(), so `mlx_lm.server --pipeline` cannot serve it:
the arms are (reported as a, b, c, d)
  a       mlx_lm.server   1 process, as above
  pp2     clusterctl      `plan --parallel pipeline` on 2 local nodes (balanced: 15/15 layers), launch, teardown
  tp3     clusterctl      `plan --parallel tensor` on 3 local nodes (9 heads / 3; they do not divide by 2)
  mlxtp3  mlx.launch      3 local ranks of `mlx_lm.server` without --pipeline: mlx-lm's own tensor parallelism
                          (only with --arms ...,mlxtp3: the same floor as tp3 without clusterctl)
Per round: ready, cold start to first token (a 1-token request), idle CPU (first round), then C concurrent streaming
greedy chat clients for C in --clients (default 1,8), then peak RSS per rank next to the plan's `planned.total`.
Before the arms, an `all_sum` of 576 floats is timed on 2 and 3 bare local ring ranks (plain MLX, no clusterctl):
with 3 ranks on this 2-core machine it takes ~8-16 ms instead of ~0.1-0.5 ms, and tensor parallelism needs 2 per
layer per decode step, so tp3 is bound by that floor here, not by clusterctl.
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
from _common import (MLX_LAUNCH, PY, TAG_ENV, alive, check, clusterctl, fmt, idle_cores, kill_tagged, pipelineable,  # noqa: E402
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
    loads: dict = field(default_factory=dict)  # clients -> (aggregate tok/s, [first token], errors, [(k, Stream)])
    planned: dict = field(default_factory=dict)  # clusterctl: rank -> the deployment's planned bytes
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
def arm_mlx_launch(path: Path, r: Round, workdir: Path, n: int = 2, pipeline: bool = True,
                   layers: dict | None = None):
    """n local ranks of mlx_lm.server under mlx.launch: --pipeline (mlx-lm's even split), or without it mlx-lm's
    tensor parallelism (its shard())."""
    if pipeline:
        path = pipelineable(path)  # llama (SmolLM2) has no pipeline() in mlx-lm: its qwen2 twin does
    tag = new_tag("mlxl")
    ring = port_run(n)
    port = port_run(1)
    before = mktemp_names()
    t0 = time.monotonic()
    # stdin: a pipe kept open, as a terminal would be (at EOF its stdin loop spins a core)
    proc = subprocess.Popen([MLX_LAUNCH, "--hosts", ",".join(["127.0.0.1"] * n), "--backend", "ring",
                             "--starting-port", str(ring), "--env", f"{TAG_ENV}={tag}", "--python", PY, "--", "-m",
                             "mlx_lm.server", "--model", str(path), *(["--pipeline"] if pipeline else []),
                             "--port", str(port)],
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
        yield t0, base, ranks, layers or {0: "4 (last)", 1: "4 (first)"}, [proc.pid, *ranks.values()]
    finally:
        stop_popen(proc, signal.SIGKILL)
        kill_tagged(tag)
        remove_mlx_launch_leaks(before, {"[" + ", ".join(f'["127.0.0.1:{ring + i}"]' for i in range(n)) + "]"},
                                seen)


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
        doc = dep_doc(dep)
        if doc.get("parallel") == "tensor":  # every rank holds 1/N of every layer
            layers = {k: f"1/{len(pids)} of {v}" for k, v in layers.items()}
        r.planned = {x["rank"]: x.get("planned") or {} for x in doc.get("ranks", [])}
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


def dep_doc(dep: Path) -> dict:
    import json

    with contextlib.suppress(OSError, ValueError):
        return json.loads(dep.read_text())
    return {}


def marker_peak(path: str) -> int | None:
    import json

    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(path).read_text()).get("peak_rss_bytes")
    return None


def concurrent_load(base: str, clients: int, per_client: int, offset: int, max_tokens: int = MAX_TOKENS
                    ) -> tuple[float, list[float], int, list]:
    """``clients`` threads, each streaming ``per_client`` requests one after another: (aggregate tok/s, the time
    to first token of every request, failed requests, every (prompt index, Stream))."""
    import threading

    got: list = []
    errors = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(per_client):
            k = (offset + i * per_client + j) % len(PROMPTS)
            try:
                st = stream_chat(base, PROMPTS[k], max_tokens)
            except Exception:  # counted: a refused or broken request is a result too
                with lock:
                    errors[0] += 1
                continue
            with lock:
                got.append((k, st))

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.monotonic() - t0
    return (sum(s.tokens for _, s in got) / wall if wall > 0 else 0.0, [s.first for _, s in got], errors[0],
            sorted(got, key=lambda x: x[0]))


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_round(arm: str, kind: str, path: Path, ctx, n_requests: int, *, idle: bool, offset: int,
              clients: tuple[int, ...] = (), per_client: int = 2, max_tokens: int = MAX_TOKENS,
              cold_tokens: int = MAX_TOKENS) -> Round:
    r = Round(arm, kind)
    try:
        with ctx(r) as (t0, base, pids, layers, all_pids):
            s = stream_chat(base, COLD_PROMPT, cold_tokens)
            r.cold_first = (time.monotonic() - s.seconds + s.first) - t0
            for i in range(n_requests):
                k = (offset + i) % len(PROMPTS)
                r.streams.append((k, stream_chat(base, PROMPTS[k], max_tokens)))
            if idle:
                r.idle = idle_cores(all_pids, 2.0)
            for c in clients:
                r.loads[c] = concurrent_load(base, c, per_client, offset, max_tokens)
            time.sleep(1.2)  # let the marker heartbeat (<= 1 s) carry the peak after the last request
            markers = r.markers
            r.rss = [(rank, layers.get(rank, "?"), marker_peak(markers[rank]) if rank in markers else None,
                      vm_hwm(pid)) for rank, pid in sorted(pids.items())]
    except Exception as e:  # one arm failing must not hide the others: report it and go on
        r.error = f"{type(e).__name__}: {e}"
    return r


def plan(workdir: Path, env: dict, path: Path, mems, allocation: str, name: str, parallel: str | None = None
         ) -> Path:
    lines = ["[cluster]", f'name = "{name}"']
    for i, mem in enumerate(mems):
        node = "abcdefgh"[i]
        lines += ["[[node]]", f'name = "{node}"', "local = true", f"memory_gb = {mem}",
                  f'runtime_dir = "{workdir}/run-{name}-{node}"']
    c = workdir / f"{name}.toml"
    c.write_text("\n".join(lines) + "\n")
    out = workdir / f"{name}.json"
    extra = ["--parallel", parallel] if parallel else []
    check(clusterctl("plan", "-c", str(c), "-m", str(path), "--allocation", allocation, "--context", "512",
                     *extra, "-o", str(out), "-q", env=env), "clusterctl plan")
    return out


# ---- main -----------------------------------------------------------------------------------------------------

ARM_NAMES = {"a": "mlx_lm.server (1 proc)", "b": "mlx.launch + server --pipeline", "c": "clusterctl 4/4",
             "c62": "clusterctl 6/2"}
# --models smollm2: a, b, c of issue 23 (mlx_lm.server --pipeline cannot serve it: llama has no pipeline())
SMOL_ARMS = {"a": "a mlx_lm.server (1 proc)", "pp2": "b clusterctl pipeline, 2 ranks",
             "tp3": "c clusterctl tensor, 3 ranks", "mlxtp3": "d mlx.launch + server, tensor, 3 ranks"}
SMOL_DEFAULT = ("a", "pp2", "tp3")  # d only when asked for (--arms ...,mlxtp3): mlx-lm's own tensor parallelism
TINY_KINDS = ("7m", "100m")


def rotate(order: list, i: int) -> list:
    return order[i % len(order):] + order[:i % len(order)] if order else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="7M: 1 round of 5 requests per arm; 100M: only the peak RSS of 1 process vs 6/2 (~2 min); "
                         "smollm2: 1 round, 8 new tokens per request (~4 min here)")
    ap.add_argument("--rounds", type=int, help="rounds per arm (default 3, smollm2 2; --quick 1)")
    ap.add_argument("--requests", type=int, help="measured requests per round, 7m/100m (default 2; --quick 5)")
    ap.add_argument("--models", default="7m,100m", help="comma list of 7m, 100m, smollm2")
    ap.add_argument("--arms", help="comma list of arms to run: a,b,c,c62 for 7m/100m (default all); "
                                   "a,pp2,tp3 (default) and mlxtp3 for smollm2")
    ap.add_argument("--clients", help="concurrent streaming clients to measure (comma list; default 1,4,8, "
                                      "smollm2 1,8)")
    ap.add_argument("--per-client", type=int, help="requests each concurrent client sends in turn (default 2, "
                                                   "smollm2 1)")
    ap.add_argument("--tokens", type=int, help=f"new tokens per request (default {MAX_TOKENS}; smollm2 32, "
                                               "--quick 8)")
    ns = ap.parse_args()
    kinds = [k.strip() for k in ns.models.split(",") if k.strip()]
    bad = [k for k in kinds if k not in (*TINY_KINDS, "smollm2")]
    if bad:
        ap.error(f"unknown model(s) {', '.join(bad)}: choose from 7m, 100m, smollm2")
    wanted = {a.strip() for a in ns.arms.split(",") if a.strip()} if ns.arms else None
    if wanted and wanted - set(ARM_NAMES) - set(SMOL_ARMS):
        ap.error(f"unknown arm(s) {', '.join(sorted(wanted - set(ARM_NAMES) - set(SMOL_ARMS)))}: "
                 "a, b, c, c62 (7m, 100m); a, pp2, tp3, mlxtp3 (smollm2)")
    clients_arg = tuple(int(c) for c in ns.clients.split(",") if c.strip()) if ns.clients else None
    clients = clients_arg if clients_arg is not None else (1, 4, 8)
    per_client = ns.per_client or 2
    tokens = ns.tokens or MAX_TOKENS
    rounds = ns.rounds or (1 if ns.quick else 3)
    n_req = ns.requests or (5 if ns.quick else 2)
    started = time.monotonic()
    if any(k in TINY_KINDS for k in kinds):
        say(f"bench/serve.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds={rounds} "
            f"requests/round={n_req}  greedy, {tokens} new tokens, streamed")
    workdir = Path(tempfile.mkdtemp(prefix="cct-bench-serve-"))
    results: dict[str, list[Round]] = {}
    plans: dict[str, float] = {}
    smol = None
    try:
        for kind in kinds:
            if kind == "smollm2":
                smol = run_smollm2(ns, workdir, wanted, clients_arg)
                continue
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
            order = [a for a in (["a"] if rss_only else ["a", "b", "c"]) if wanted is None or a in wanted]
            rs: list[Round] = []
            for i in range(rounds):
                arms = rotate(order, i)
                if i == 0 and (wanted is None or "c62" in wanted):
                    arms.insert(1, "c62")
                for arm in arms:
                    k = 0 if (ns.quick and (arm == "c62" or rss_only)) else n_req  # quick: RSS only
                    r = run_round(arm, kind, path, ctxs[arm], k, idle=(i == 0), offset=i * n_req,
                                  clients=() if (arm == "c62" or rss_only) else clients, per_client=per_client,
                                  max_tokens=tokens, cold_tokens=tokens)
                    rs.append(r)
                    log(f"{kind} round {i + 1} {ARM_NAMES[arm]}: ready {fmt(r.ready, ' s')}, first token "
                        f"{fmt(r.cold_first, ' s')}, tok/s {fmt(med(s.tok_s for _, s in r.streams), digits=1)}"
                        f" (load {os.getloadavg()[0]:.1f})" + (f" ERROR {r.error}" if r.error else ""))
            results[kind] = rs
        if results:
            report(results, plans, time.monotonic() - started)
        if smol:
            report_smollm2(**smol)
            say(f"(total {time.monotonic() - started:.0f} s)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# ---- the real model: SmolLM2-135M-Instruct (issue 23) ------------------------------------------------------------

ALLSUM_PROBE = """\
import json, sys, time
import mlx.core as mx
g = mx.distributed.init(strict=True, backend="ring")
x = mx.ones((1, 576))  # one token's hidden state of SmolLM2
for _ in range(5):
    mx.eval(mx.distributed.all_sum(x, group=g))
ts = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    mx.eval(mx.distributed.all_sum(x, group=g))
    ts.append(time.perf_counter() - t)
ts.sort()
if g.rank() == 0:
    print(json.dumps({"size": g.size(), "p50_ms": ts[len(ts) // 2] * 1e3}), flush=True)
"""


def allsum_probe(workdir: Path, size: int, n: int) -> float | None:
    """Median ms of one 576-float `all_sum` over ``size`` bare local ring ranks (plain MLX, no clusterctl, no
    model): the floor every per-step collective pays on this machine."""
    import json

    script = workdir / "allsum_probe.py"
    script.write_text(ALLSUM_PROBE)
    tag = new_tag(f"allsum{size}")
    hostfile = workdir / f"allsum{size}.json"
    base = port_run(size)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + i}"] for i in range(size)]))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(size):
            procs.append(subprocess.Popen(
                [PY, str(script), str(n)], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                env={**clean, TAG_ENV: tag, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
                start_new_session=True))
        out, _ = procs[0].communicate(timeout=120)
        return float(json.loads(out.strip().splitlines()[-1])["p50_ms"])
    except Exception as e:  # a failed probe is reported as n/a, the arms still run
        log(f"all_sum probe on {size} ranks failed: {type(e).__name__}: {e}")
        return None
    finally:
        for p in procs:
            stop_popen(p, signal.SIGKILL)
        kill_tagged(tag)


def run_smollm2(ns, workdir: Path, wanted: set | None, clients_arg: tuple | None) -> dict:
    rounds = ns.rounds or (1 if ns.quick else 2)
    tokens = ns.tokens or (8 if ns.quick else 32)  # c decodes at ~0.5 tok/s here: 64 tokens x 8 clients is long
    per_client = ns.per_client or 1
    clients = clients_arg if clients_arg is not None else (1, 8)
    arms = [a for a in SMOL_ARMS if (a in wanted if wanted is not None else a in SMOL_DEFAULT)]
    if wanted is not None and wanted & {"b", "c", "c62"}:
        log("note: b, c, c62 are arms of the 7m/100m comparison; smollm2's are a, pp2, tp3, mlxtp3")
    say(f"bench/serve.py --models smollm2  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  rounds={rounds}  "
        f"clients={','.join(map(str, clients))} x {per_client} request(s) each  greedy chat, {tokens} new tokens, "
        f"streamed")
    path = model("smollm2")
    env = {"CLUSTERCTL_STATE_DIR": str(workdir / "state-smollm2")}
    deps: dict[str, Path] = {}
    plan_s: dict[str, float] = {}
    for arm, mems, parallel in (("pp2", (4, 4), "pipeline"), ("tp3", (4, 4, 4), "tensor")):
        if arm in arms:
            t = time.monotonic()
            deps[arm] = plan(workdir, env, path, mems, "balanced", f"smol{arm}", parallel)
            plan_s[arm] = time.monotonic() - t
    floor: dict[int, float | None] = {}
    if "tp3" in arms or "mlxtp3" in arms:  # before any arm, alone: the latency every collective starts from
        floor = {2: allsum_probe(workdir, 2, 200), 3: allsum_probe(workdir, 3, 60)}
        log(f"all_sum of 576 floats: 2 ranks {fmt(floor[2], ' ms')}, 3 ranks {fmt(floor[3], ' ms')}")
    ctxs = {"a": lambda r: arm_single(path, r),
            "pp2": lambda r: arm_clusterctl(deps["pp2"], env, r),
            "tp3": lambda r: arm_clusterctl(deps["tp3"], env, r),
            "mlxtp3": lambda r: arm_mlx_launch(path, r, workdir, 3, pipeline=False,
                                               layers={i: "1/3 of 30" for i in range(3)})}
    rs: list[Round] = []
    for i in range(rounds):
        for arm in rotate(arms, i):
            r = run_round(arm, "smollm2", path, ctxs[arm], 0, idle=(i == 0), offset=i * max(clients) * per_client,
                          clients=clients, per_client=per_client, max_tokens=tokens, cold_tokens=1)
            rs.append(r)
            log(f"smollm2 round {i + 1} {SMOL_ARMS[arm]}: ready {fmt(r.ready, ' s')}, first token "
                f"{fmt(r.cold_first, ' s')}, aggregate tok/s "
                + ", ".join(f"{c} client(s) {fmt(v[0], digits=1)}" for c, v in r.loads.items())
                + f" (load {os.getloadavg()[0]:.1f})" + (f" ERROR {r.error}" if r.error else ""))
    return {"rs": rs, "arms": arms, "deps": deps, "plan_s": plan_s, "floor": floor, "tokens": tokens,
            "rounds": rounds, "per_client": per_client, "clients": clients}


def report_smollm2(rs: list[Round], arms: list, deps: dict, plan_s: dict, floor: dict, tokens: int, rounds: int,
                   per_client: int, clients: tuple) -> None:
    by = {a: [r for r in rs if r.arm == a] for a in arms}
    say("")
    say("== smollm2: SmolLM2-135M-Instruct (real weights, Q4_1 GGUF import, 30 layers, hidden 576, 9 heads) ==")
    what = {"a": "a = one mlx_lm.server process", "pp2": "b = clusterctl --parallel pipeline on 2 local ranks",
            "tp3": "c = clusterctl --parallel tensor on 3 local ranks (1/3 of every layer)",
            "mlxtp3": "d = mlx.launch + mlx_lm.server on 3 local ranks (mlx-lm's tensor parallelism)"}
    say("; ".join(what[a] for a in arms) + f". {rounds} round(s), greedy chat, {tokens} new tokens per request.")
    rows = [[SMOL_ARMS[a], fmt(med(r.ready for r in by[a])), fmt(med(r.cold_first for r in by[a])),
             fmt(med(r.idle for r in by[a])), fmt(plan_s.get(a))] for a in arms]
    say(table(rows, ["arm", "ready s", "cold start -> first token s", "idle cores", "plan s (not in ready)"]))
    cs = sorted({c for r in rs for c in r.loads})
    agg = {(a, c): med(r.loads[c][0] for r in by[a] if c in r.loads) for a in arms for c in cs}
    p50, dec = {}, {}
    rows = []
    for a in arms:
        for c in cs:
            firsts = [x for r in by[a] if c in r.loads for x in r.loads[c][1]]
            errs = sum(r.loads[c][2] for r in by[a] if c in r.loads)
            p50[(a, c)] = pct(firsts, 0.5)
            dec[(a, c)] = med((s.tokens - 1) / (s.seconds - s.first) for r in by[a] if c in r.loads
                              for _, s in r.loads[c][3] if s.tokens > 1 and s.seconds > s.first)
            rows.append([SMOL_ARMS[a], str(c), fmt(agg[(a, c)]), fmt(p50[(a, c)]),
                         fmt(pct(firsts, 0.95)), fmt(dec[(a, c)]), str(len(firsts)), str(errs)])
    say(f"concurrent streaming clients (each sends {per_client} request(s) in a row; aggregate tok/s = all "
        f"completion tokens / wall time, median over rounds; first token per request, over all requests; decode "
        f"tok/s = per stream after its first token, median)")
    say(table(rows, ["arm", "clients", "aggregate tok/s", "first token p50 s", "p95 s", "decode tok/s/stream",
                     "requests", "failed"]))
    letter = {a: SMOL_ARMS[a].split()[0] for a in arms}
    pairs = [(x, "a") for x in arms if x != "a" and "a" in arms]
    if "tp3" in arms and "mlxtp3" in arms:
        pairs.append(("tp3", "mlxtp3"))  # clusterctl vs mlx-lm's own tensor parallelism on the same floor
    for c in cs:
        for what, d in (("aggregate tok/s", agg), ("first token p50", p50), ("decode tok/s", dec)):
            say(f"  {c} client(s), {what}: " + "   ".join(
                f"{letter[x]}/{letter[y]} = {ratio(d.get((x, c)), d.get((y, c)))}" for x, y in pairs))
    if "a" in arms:
        say(f"  note: every prompt starts with the chat template's system prompt (24 of its 36-37 tokens). "
            f"mlx_lm.server keeps a prompt cache and prefills only the rest; clusterctl has no prefix cache "
            f"and prefills all of it (a's readiness poll, a 1-token chat request, already put the system prompt in "
            f"that cache, so its cold start gains too). On this CPU a prompt token costs about as much as a decoded "
            f"one, so with {tokens} new tokens the prefill weighs on aggregate tok/s and first token; decode tok/s "
            f"does not include it.")
    for a in arms:
        if len(cs) > 1 and 1 in cs:
            say(f"  {SMOL_ARMS[a]}: {max(cs)} clients / 1 client = {ratio(agg[(a, max(cs))], agg[(a, 1)])}")
    # peak RSS per rank next to the plan's figure
    rows = []
    single = next((hwm for r in by.get("a", []) for _, _, _, hwm in r.rss if hwm), None)
    for a in arms:
        v = [r for r in by[a] if r.rss]
        if not v:
            continue
        for rank, layers, peak, hwm in v[0].rss:
            pl = v[0].planned.get(rank) or {}
            total = pl.get("total")
            parts = "+".join(fmt(pl.get(k) and pl[k] / 2**20, digits=0) for k in ("weights", "kv", "headroom")) \
                if pl else ""
            best = peak or hwm
            rows.append([SMOL_ARMS[a], str(rank), str(layers), fmt(peak and peak / 2**20, digits=0),
                         fmt(hwm and hwm / 2**20, digits=0),
                         f"{fmt(total / 2**20, digits=0)} ({parts})" if total else "-",
                         ratio(best, total) if total else "-", ratio(best, single)])
    say("peak RSS per rank (MiB; marker = the rank marker's peak_rss_bytes, VmHWM = /proc/PID/status; planned = "
        "the deployment's planned.total = weights + kv + headroom)")
    say(table(rows, ["arm", "rank", "holds", "marker peak", "VmHWM", "planned total (w+kv+headroom)",
                     "peak / planned", "vs 1 process"]))
    say(f"greedy outputs vs a, prompt by prompt at the same concurrency: {smol_identical(by, arms)}")
    if floor:
        f3 = floor.get(3)
        step = f3 and 2 * 30 * f3 / 1e3  # tensor parallel: an all_sum after o_proj and after down_proj, 30 layers
        say(f"note: 3 local ranks are slow on this {os.cpu_count()}-core machine for reasons outside clusterctl. "
            f"A bare MLX ring all_sum of 576 floats (no clusterctl, no model), timed in this run: "
            f"{fmt(floor.get(2), ' ms')} on 2 ranks, {fmt(f3, ' ms')} on 3. Tensor parallelism needs 2 per "
            f"layer per decode step: 60 x {fmt(f3, ' ms')} = {fmt(step, ' s')} of collectives per step with idle "
            f"ranks, i.e. at most {fmt(step and 1 / step, digits=1)} tok/s per stream before any compute (a batch "
            f"of 8 shares a step); with the ranks computing, 3 processes share 2 cores and every all_sum also waits "
            f"for whichever rank is off-core. So c is dominated "
            f"by that floor here; judge clusterctl's own cost on b"
            + (", and c against d (mlx-lm's own tensor parallelism on the same 3 local ranks)." if "mlxtp3" in arms
               else " (--arms a,pp2,tp3,mlxtp3 adds mlx-lm's own tensor parallelism on 3 ranks for comparison)."))
    for r in rs:
        if r.error:
            say(f"error: {SMOL_ARMS[r.arm]}: {r.error}")


def smol_identical(by: dict, arms: list) -> str:
    if "a" not in by or not by["a"]:
        return "n/a (arm a not run)"
    ref: dict[tuple, set] = {}
    for r in by["a"]:
        for c, v in r.loads.items():
            for k, s in v[3]:
                ref.setdefault((c, k), set()).add(s.text)
    out = []
    for a in arms:
        if a == "a":
            continue
        same = total = 0
        diff = []
        for r in by[a]:
            for c, v in r.loads.items():
                for k, s in v[3]:
                    if (c, k) in ref:
                        total += 1
                        if s.text in ref[(c, k)]:
                            same += 1
                        else:
                            diff.append(f"{c}c/p{k}")
        out.append(f"{SMOL_ARMS[a].split()[0]} {same}/{total} identical"
                   + (f" (differ: {', '.join(diff[:6])}{' ...' if len(diff) > 6 else ''})" if diff else ""))
    return "; ".join(out) or "n/a"


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
