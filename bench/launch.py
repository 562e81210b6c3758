"""Benchmark (issue 4): command -> all ranks ready, and -> verified teardown, for 1, 2 and 4 ranks over SSH,
clusterctl side by side with mlx.launch, in one run.

Run: .venv/bin/python bench/launch.py [--quick] [--repeats N]   (needs root and /usr/sbin/sshd, like the ssh tests)

Every node is a real OpenSSH sshd on 127.0.0.1 (own port, host key and runtime dir); both tools reach the same
daemons. Arms (interleaved, rotated every repeat, medians reported):
  clusterctl   `clusterctl launch DEP --detach` (verify, reap, preflight, manifest, contracts, start ranks that LOAD
               the 7M tiny model, gate, join, canary request) -> returns = ready; `clusterctl teardown` (TERM,
               grace, KILL, identity-checked confirmation) -> returns = verified teardown.
  mlx.launch   ring hostfile over ssh, a script that inits the group, all_sums once, prints READY, sleeps:
               ready = every rank printed READY. Teardown: SIGTERM to the launcher ("term"), or SIGINT to its
               process group as Ctrl-C in a terminal does ("ctrl-c"); then we wait until no rank remains (capped)
               and count what was left.
  mlx.launch + mlx_lm.server --pipeline (2 and 4 ranks; not in --quick): the same model as clusterctl, ready =
               rank 0 answers a 1-token HTTP request; teardown by Ctrl-C. The like-for-like comparison.
mlx.launch runs a bare `ssh HOST`: a wrapper named ssh, first on PATH, adds `-F <our config>` (Host node0..3 ->
127.0.0.1:<port>, our key, our known_hosts); ~/.ssh is not touched.

Every SSH session runs the node user's login shell, and bash sources ~/.bashrc when sshd starts it. On this
machine root's ~/.bashrc runs `pyenv init` (about 0.1 s a session, and concurrent sessions queue on pyenv's
rehash lock: 4 at once 0.45 s vs 0.007 s without it). `--no-shell-init` gives the bench's sshd's
`SetEnv SHLVL=1`, so bash skips that file: nodes whose shell does no per-session work, for both tools alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (MLX_LAUNCH, PY, REPO, SshNodes, TAG_ENV, alive, check, clusterctl, fmt, kill_tagged,  # noqa: E402
                     launch_manifests, log, machine_busy_seconds, machine_note, med, mktemp_names, model, new_tag, port_run, ratio,
                     remove_mlx_launch_leaks, say, stop_popen, table, tagged, wait_gone, wait_http, with_env)

RANKS = (1, 2, 4)
LEFT_CAP = 5.0  # seconds we wait for mlx.launch ranks to go away before calling them "left behind"

READY_SCRIPT = """\
import os, sys, time
hf = os.environ.get("MLX_HOSTFILE")
if hf and os.path.isfile(hf) and not open(hf).read().strip():
    # 1 rank: mlx.launch writes an EMPTY hostfile, which mx.distributed.init() rejects; drop it (workaround)
    del os.environ["MLX_HOSTFILE"]
import mlx.core as mx
g = mx.distributed.init()
x = mx.distributed.all_sum(mx.ones(1))
mx.eval(x)
print(f"READY {g.rank()} {g.size()} {int(x.item())}", flush=True)
time.sleep(3600)
"""


@dataclass
class Sample:
    arm: str
    n: int
    ready: float | None = None
    teardown: float | None = None  # None: never (ranks left behind)
    left_ranks: int = 0
    left_ssh: int = 0
    launcher_hung: bool = False
    leaked_files: int = 0
    split: dict = field(default_factory=dict)
    sessions: int | None = None  # ssh sessions opened on the nodes during the whole arm
    conns: tuple | None = None  # clusterctl: (launch connections, launch channels, teardown conns, teardown chans)
    cpu: float | None = None  # clusterctl: CPU-seconds the machine spent busy during the launch
    td_cpu: float | None = None  # ... and during the teardown
    error: str | None = None


# ---- clusterctl -----------------------------------------------------------------------------------------------

def write_cluster(root: Path, nodes: SshNodes, n: int, model_path: Path) -> Path:
    lines = ["[cluster]", f'name = "ssh{n}"']
    for i in range(n):
        d = nodes.daemons[i]
        lines += ["[[node]]", f'name = "n{i}"', 'host = "127.0.0.1"', f"port = {d.port}", 'user = "root"',
                  f'identity_file = "{nodes.client_key}"', 'ips = ["127.0.0.1"]', "memory_gb = 4",
                  f'python = "{PY}"', f'model_path = "{model_path}"', f'runtime_dir = "{root}/run{n}-n{i}"']
    p = root / f"cluster{n}.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


class Watcher(threading.Thread):
    """Polls the launch manifest and the rank markers (files on this machine: the nodes are loopback) to split
    a clusterctl launch into phases, without touching the launch itself."""

    def __init__(self, state: Path, t0: float):
        super().__init__(daemon=True)
        self.state, self.t0, self.stop = state, t0, threading.Event()
        self.t: dict[str, float] = {}

    def mark(self, k: str) -> None:
        self.t.setdefault(k, time.monotonic() - self.t0)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            ms = launch_manifests(self.state) if (self.state / "launches").is_dir() else []
            if not ms:
                continue
            self.mark("manifest")
            ranks = ms[0].get("ranks") or []
            docs = []
            for r in ranks:
                try:
                    docs.append(json.loads(Path(r["marker_path"]).read_text()))
                except (OSError, ValueError):
                    docs.append(None)
            if docs and all(d is not None for d in docs):
                self.mark("markers")
            if docs and all(d and d.get("state") in ("ready", "serving") for d in docs):
                self.mark("loaded")
            if docs and docs[0] and docs[0].get("state") == "serving":
                self.mark("serving")
                return


def sessions(nodes: SshNodes, n: int) -> int:
    return sum(d.log_text().count("Starting session:") for d in nodes.daemons[:n])


def connections(nodes: SshNodes, n: int) -> int:
    return sum(d.log_text().count("Accepted publickey") for d in nodes.daemons[:n])


def run_clusterctl(root: Path, nodes: SshNodes, n: int, dep: Path, env: dict) -> Sample:
    s = Sample("clusterctl", n)
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    s0, c0 = sessions(nodes, n), connections(nodes, n)
    t0, cpu0 = time.monotonic(), machine_busy_seconds()
    w = Watcher(state, t0)
    w.start()
    kh = str(nodes.known_hosts)
    p = clusterctl("launch", str(dep), "--detach", "--known-hosts", kh, "--timeout", "240", env=env, timeout=300)
    t_ready = time.monotonic() - t0
    s.cpu = machine_busy_seconds() - cpu0
    w.stop.set()
    w.join()
    if p.returncode != 0:
        s.error = f"launch exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
        clusterctl("teardown", "--known-hosts", kh, "--grace", "2", env=env)
        return s
    s.ready = t_ready
    ms = launch_manifests(state)
    nonce = ms[0]["nonce"] if ms else None
    sp, last = {}, 0.0
    for k, name in (("manifest", "verify+reap+preflight"), ("markers", "contracts+spawn"), ("loaded", "load"),
                    ("serving", "gate+join"), ("_end", "canary+return")):
        t = t_ready if k == "_end" else w.t.get(k)
        if t is not None:
            sp[name], last = t - last, t
    s.split = sp
    s1, c1 = sessions(nodes, n), connections(nodes, n)
    t1, cpu1 = time.monotonic(), machine_busy_seconds()
    td = clusterctl("teardown", "--known-hosts", kh, env=env, timeout=120)
    t_td = time.monotonic() - t1
    s.td_cpu = machine_busy_seconds() - cpu1
    s.conns = ((c1 - c0) / n, (s1 - s0) / n, (connections(nodes, n) - c1) / n, (sessions(nodes, n) - s1) / n)
    left = with_env("CLUSTERCTL_NONCE", nonce) if nonce else []
    s.sessions = sessions(nodes, n) - s0
    if td.returncode != 0 or left:
        s.error = f"teardown exited {td.returncode}, {len(left)} rank(s) still alive: {td.stderr.strip()[-300:]}"
        s.left_ranks = len(left)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    else:
        s.teardown = t_td
    return s


# ---- mlx.launch -----------------------------------------------------------------------------------------------

def _read_until(proc: subprocess.Popen, pred, timeout: float) -> tuple[bool, bytes]:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf, deadline = b"", time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        if sel.select(timeout=0.05):
            chunk = os.read(fd, 65536)
            if not chunk:
                return False, buf
            buf += chunk
            if pred(buf):
                return True, buf
    return False, buf


def run_mlx(root: Path, nodes: SshNodes, n: int, *, stop: str, serve_model: Path | None = None) -> Sample:
    arm = f"mlx.launch/{stop}" if serve_model is None else "mlx.launch+server"
    s = Sample(arm, n)
    tag = new_tag("mlxl")
    base = port_run(n)
    ring = [[f"127.0.0.1:{base + i}"] for i in range(n)]
    hostfile = root / f"hosts-{tag}.json"
    hostfile.write_text(json.dumps({"backend": "ring", "envs": ["PYTHONUNBUFFERED=1", f"{TAG_ENV}={tag}"],
                                    "hosts": [{"ssh": f"node{i}", "ips": ["127.0.0.1"]} for i in range(n)]}))
    if serve_model is None:
        script = root / "ready.py"
        command = [str(script)]
        http = None
    else:
        http_port = port_run(1)
        http = f"http://127.0.0.1:{http_port}"
        command = ["-m", "mlx_lm.server", "--model", str(serve_model), "--pipeline", "--port", str(http_port)]
    env = {**os.environ, "PATH": f"{nodes.ssh_wrapper_dir}:{os.environ['PATH']}"}
    before = mktemp_names()
    s0 = sessions(nodes, n)
    rank_pids: set[int] = set()
    t0 = time.monotonic()
    # stdin is a pipe we keep open, as a terminal would be (at EOF its stdin loop would spin)
    proc = subprocess.Popen([MLX_LAUNCH, "--hostfile", str(hostfile), "--starting-port", str(base),
                             "--python", PY, "--", *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True, cwd=str(root))
    try:
        if http is None:
            ok, out = _read_until(proc, lambda b: b.count(b"READY ") >= n, 120)
            if not ok:
                s.error = f"not ready: {out.decode(errors='replace')[-300:]!r}"
                return s
        else:
            try:
                wait_http(http, 180, alive=lambda: proc.poll() is None, poll=0.05)
            except RuntimeError as e:
                s.error = str(e)
                return s
        s.ready = time.monotonic() - t0
        ranks = tagged(tag)
        rank_pids = set(ranks)
        clients = [c.pid for c in _children(proc.pid) if c.pid not in rank_pids]
        t1 = time.monotonic()
        if stop == "term":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        t_gone, left = wait_gone(ranks, LEFT_CAP)
        s.left_ranks = len(left)
        s.left_ssh = len(alive(clients))
        s.teardown = (t_gone - t1) if t_gone is not None and not s.left_ssh else None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, LEFT_CAP - (time.monotonic() - t1)))
        s.launcher_hung = proc.poll() is None
        return s
    finally:
        stop_popen(proc, signal.SIGKILL)
        kill_tagged(tag)
        s.sessions = sessions(nodes, n) - s0
        s.leaked_files = remove_mlx_launch_leaks(before, {json.dumps(ring) if n > 1 else ""}, rank_pids)
        hostfile.unlink(missing_ok=True)


def _children(pid: int):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# ---- main -----------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats, no mlx.launch+server arm (~2 minutes)")
    ap.add_argument("--repeats", type=int, help="repeats per arm and rank count (default 5, --quick 2)")
    ap.add_argument("--no-shell-init", action="store_true",
                    help="the nodes' bash skips ~/.bashrc in ssh sessions (sshd SetEnv SHLVL=1)")
    ns = ap.parse_args()
    repeats = ns.repeats or (2 if ns.quick else 5)
    with_server = not ns.quick
    started = time.monotonic()
    say(f"bench/launch.py  {time.strftime('%Y-%m-%d %H:%M')}  {machine_note()}  repeats={repeats}  "
        f"node shell init: {'skipped (SetEnv SHLVL=1)' if ns.no_shell_init else 'as this machine has it'}")
    root = Path(tempfile.mkdtemp(prefix="cct-bench-launch-"))
    nodes = None
    samples: list[Sample] = []
    try:
        m = model("7m")
        (root / "ready.py").write_text(READY_SCRIPT)
        nodes = SshNodes.start(root / "ssh", max(RANKS), extra_config="SetEnv SHLVL=1" if ns.no_shell_init else "")
        env = {"CLUSTERCTL_STATE_DIR": str(root / "state")}
        deps, plan_s = {}, {}
        for n in RANKS:
            t = time.monotonic()
            deps[n] = root / f"dep{n}.json"
            check(clusterctl("plan", "-c", str(write_cluster(root, nodes, n, m)), "-m", str(m), "--allocation",
                             "balanced", "--context", "512", "-o", str(deps[n]), "-q", env=env), "plan")
            plan_s[n] = time.monotonic() - t
        arms = ["clusterctl", "mlx/term", "mlx/ctrl-c"] + (["mlx+server"] if with_server else [])
        for rep in range(repeats):
            for n in RANKS:
                order = arms[rep % len(arms):] + arms[:rep % len(arms)]
                for arm in order:
                    if arm == "mlx+server" and n == 1:
                        continue  # mlx_lm.server cannot init on mlx.launch's empty 1-rank hostfile
                    if arm == "clusterctl":
                        s = run_clusterctl(root, nodes, n, deps[n], env)
                    elif arm == "mlx+server":
                        s = run_mlx(root, nodes, n, stop="ctrl-c", serve_model=m)
                    else:
                        s = run_mlx(root, nodes, n, stop=arm.split("/")[1])
                    samples.append(s)
                    log(f"rep {rep + 1} n={n} {s.arm}: ready {fmt(s.ready, ' s')} teardown {fmt(s.teardown, ' s')}"
                        + (f" left {s.left_ranks} rank(s), {s.left_ssh} ssh" if s.left_ranks or s.left_ssh else "")
                        + (f" ERROR {s.error}" if s.error else ""))
        report(samples, plan_s, repeats, time.monotonic() - started)
    finally:
        if nodes is not None:
            nodes.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def report(samples: list[Sample], plan_s: dict, repeats: int, elapsed: float) -> None:
    def pick(arm, n):
        return [s for s in samples if s.arm == arm and s.n == n]

    names = ["clusterctl", "mlx.launch/term", "mlx.launch/ctrl-c", "mlx.launch+server"]
    say("")
    say(f"time to all ranks ready (median of {repeats}; seconds)")
    rows = []
    for n in RANKS:
        c = med(s.ready for s in pick("clusterctl", n))
        m_ = med(s.ready for s in pick("mlx.launch/term", n) + pick("mlx.launch/ctrl-c", n))
        srv = med(s.ready for s in pick("mlx.launch+server", n))
        rows.append([str(n), fmt(c), fmt(m_), fmt(srv), ratio(c, m_), ratio(c, srv), fmt(plan_s.get(n))])
    say(table(rows, ["ranks", "clusterctl", "mlx.launch(all_sum)", "mlx.launch+server", "cc/mlx", "cc/mlx+srv",
                     "(plan, once)"]))
    c1, c4 = med(s.ready for s in pick("clusterctl", 1)), med(s.ready for s in pick("clusterctl", 4))
    m1 = med(s.ready for s in pick("mlx.launch/term", 1) + pick("mlx.launch/ctrl-c", 1))
    m4 = med(s.ready for s in pick("mlx.launch/term", 4) + pick("mlx.launch/ctrl-c", 4))
    say(f"flatness (4 ranks / 1 rank): clusterctl {ratio(c4, c1)}, mlx.launch {ratio(m4, m1)}")
    cores = os.cpu_count() or 1
    rows = []
    for n in RANKS:
        ss = pick("clusterctl", n)
        cpu, td_cpu = med(s.cpu for s in ss), med(s.td_cpu for s in ss)
        rows.append([str(n), fmt(med(s.ready for s in ss)), fmt(cpu), fmt(cpu / cores if cpu else None),
                     fmt(med(s.teardown for s in ss)), fmt(td_cpu), fmt(td_cpu / cores if td_cpu else None)])
    say(f"what clusterctl cost this machine (CPU-seconds busy, all processes; / {cores} cores = the shortest wall "
        "time possible here, since every node shares these cores)")
    say(table(rows, ["ranks", "ready s", "launch CPU-s", "floor s", "teardown s", "teardown CPU-s", "floor s"]))
    c2 = med(s.ready for s in pick("clusterctl", 2))
    cpu4 = med(s.cpu for s in pick("clusterctl", 4))
    if c2 and c4 and cpu4:
        say(f"flatness (4 ranks / 2 ranks, goal <= 1.2x): {ratio(c4, c2)}; the 4-rank floor alone is "
            f"{ratio(cpu4 / cores, c2)} of the 2-rank ready time")
    say("note: clusterctl's ready includes preflight, loading the 7M model, gate, ring join and a canary request; "
        "mlx.launch's all_sum arm only imports mlx and all_sums once")
    say("")
    say("clusterctl launch split (median seconds per phase, from the manifest and marker files)")
    phases = ["verify+reap+preflight", "contracts+spawn", "load", "gate+join", "canary+return"]
    rows = []
    for n in RANKS:
        ss = [s for s in pick("clusterctl", n) if s.split]
        per = [s.conns for s in ss if s.conns]
        rows.append([str(n), *(fmt(med(s.split.get(p) for s in ss)) for p in phases),
                     fmt(med(s.sessions for s in ss), digits=0),
                     *(fmt(med(c[i] for c in per), digits=1) for i in range(4))])
    say(table(rows, ["ranks", *phases, "ssh sessions/job", "launch conns/node", "launch chans/node",
                     "teardown conns/node", "teardown chans/node"]))
    say("goal (issue 10): 1 connection per node and <= 3 channels per node per launch")
    say("")
    say(f"teardown: signal/command -> no rank left (median; 'never' = ranks still alive after {LEFT_CAP:g} s)")
    rows = []
    for n in RANKS:
        for arm in names:
            ss = pick(arm, n)
            if not ss:
                continue
            done = [s.teardown for s in ss if s.teardown is not None]
            never = sum(1 for s in ss if s.teardown is None and not s.error)
            errs = sum(1 for s in ss if s.error)
            rows.append([str(n), arm, fmt(med(done)) if done else "never",
                         f"{never}/{len(ss)}", str(sum(s.left_ranks for s in ss)), str(sum(s.left_ssh for s in ss)),
                         str(sum(s.launcher_hung for s in ss)), str(sum(s.leaked_files for s in ss)),
                         fmt(med(s.sessions for s in ss), digits=0), str(errs)])
    say(table(rows, ["ranks", "arm", "teardown s", "runs w/ leftovers", "ranks left", "ssh clients left",
                     "launcher hung", "tmp files leaked", "ssh sessions", "errors"]))
    for n in RANKS:
        c = med(s.teardown for s in pick("clusterctl", n))
        m_ = med(s.teardown for s in pick("mlx.launch/ctrl-c", n))
        say(f"  {n} rank(s): clusterctl verified teardown / mlx.launch Ctrl-C until ranks gone = {ratio(c, m_)}")
    errs = [s for s in samples if s.error]
    for s in errs:
        say(f"error: {s.arm} n={s.n}: {s.error}")
    say(f"(total {elapsed:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
