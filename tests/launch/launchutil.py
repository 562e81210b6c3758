"""Test helpers for launches: local clusters of real ranks, and hand-made jobs of ordinary processes."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil

from clusterctl.statedir.manifest import LaunchManifest, ManifestStore, RankRecord, now_iso
from clusterctl.node.procs import boot_id
from clusterctl.plan.inventory import Node
from clusterctl.statedir.state import StateDir
from procstate import running, start_time
from diskutil import fill_disk  # noqa: F401  (the disk-full tests and bench/faults.py take it from here)

REPO = Path(__file__).resolve().parents[2]


def local_cluster(tmp: Path, mems=(2, 6), *, extra: dict | None = None, shared_runtime: bool = False) -> Path:
    """cluster.toml of local nodes a, b, ...; each with its own runtime dir ``run-<name>``, or all with one
    (``shared_runtime``: ``run-shared``, as nodes that are one machine)."""
    lines = ["[cluster]", 'name = "t"']
    for i, m in enumerate(mems):
        name = "abcdefgh"[i]
        lines += ["[[node]]", f'name = "{name}"', "local = true", f"memory_gb = {m}",
                  f'runtime_dir = "{tmp}/run-{"shared" if shared_runtime else name}"']
        for k, v in ((extra or {}).get(name) or {}).items():
            lines.append(f"{k} = {json.dumps(v)}")
    p = tmp / "cluster.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


# Commands that only read their inputs and write files, run in the test's own process (fuzzutil.run_cli: the same
# CLI main, stdout and stderr as a process would give them): a `plan` process costs ~1.3 CPU-s, most of it importing
# mlx-lm (and transformers) again, and the suite plans a few hundred times. Everything that starts, signals or
# watches processes (launch, teardown, reap, replan, supervise, front, ...) stays a process of its own.
IN_PROCESS = frozenset({"plan", "verify", "manifest"})


def cli(*args: str, env: dict | None = None, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    if args and args[0] in IN_PROCESS:
        from fuzzutil import run_cli

        r = run_cli(list(args), env=env)
        p = subprocess.CompletedProcess([sys.executable, "-m", "clusterctl", *args], r.code, r.stdout, r.stderr)
    else:
        p = subprocess.run([sys.executable, "-m", "clusterctl", *args], capture_output=True, text=True,
                           env={**os.environ, **(env or {})}, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise AssertionError(f"clusterctl {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "clusterctl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            stdin=subprocess.DEVNULL, start_new_session=True)


def wait_line(proc: subprocess.Popen, timeout: float = 240) -> str:
    """The first stdout line (the endpoint) of a foreground launch."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            raise AssertionError(f"launch exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError("launch did not become ready in time")


def processes_with_nonce(nonce: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("CLUSTERCTL_NONCE") == nonce and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def manifests(state: Path) -> list[dict]:
    folder = state / "launches"
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.glob("*.json")):
        text = p.read_text()
        out.append(json.loads(text))
    return out


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        time.sleep(0.1)
    return alive


def heal_file(state: Path, cluster: str = "t") -> dict:
    """The supervisor's state file of ``cluster`` (docs/heal.md), or {} while there is none (or it is mid-write)."""
    try:
        return json.loads((state / "heal" / f"{cluster}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(what: str, pred, timeout: float = 120.0, every: float = 0.1):
    """``pred()``'s first true value, polled every ``every`` s; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def ask(endpoint: str) -> str:
    """A 4-token greedy completion from ``endpoint`` (a rank 0 or a front), its text."""
    import urllib.request

    req = urllib.request.Request(endpoint + "/v1/completions", data=json.dumps(
        {"prompt": "def main(argv):", "max_tokens": 4, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def launch_for_long_requests(tmp_path: Path, tiny: Path, env: dict, *, shared_runtime: bool = False,
                             ) -> tuple[str, str, int]:
    """A detached 2-rank launch planned for a 4096-token context: (deployment file, host, port)."""
    c = local_cluster(tmp_path, (4, 4), shared_runtime=shared_runtime)
    dep = str(tmp_path / "dep.json")
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "4096", "-o", dep, "-q", env=env, check=True)
    p = cli("launch", dep, "--detach", "--json", "--timeout", "180", env=env)
    assert p.returncode == 0, p.stderr
    host, port = json.loads(p.stdout)["endpoint"].removeprefix("http://").rsplit(":", 1)
    return dep, host, int(port)


def open_stream(host: str, port: int | str, body: dict, timeout: float = 120):
    """Start a streaming completion: (connection, response), the response's status checked."""
    import http.client

    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def read_events(r) -> list:
    """A stream's `data:` events up to and including `[DONE]` (or until the server closes it)."""
    out = []
    for line in r:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            out.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]":
                break
    return out


def next_event(r):
    """The next `data:` event of a stream (None at its end)."""
    for line in r:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            return data if data == "[DONE]" else json.loads(data)
    return None


class StreamReader:
    """Reads the rest of a stream's events on its own thread, so a test can give up on a stream that runs on:
    ``events(timeout)`` is None if the stream has not ended by then."""

    def __init__(self, r):
        import threading

        self.got: list = []
        self._t = threading.Thread(target=self._run, args=(r,), daemon=True)
        self._t.start()

    def _run(self, r) -> None:
        try:
            self.got.extend(read_events(r))
        except OSError:
            pass

    def events(self, timeout: float) -> list | None:
        self._t.join(timeout)
        return None if self._t.is_alive() else self.got


# ---- hand-made jobs: ordinary processes carrying a nonce, under a real signed manifest -------------------------

IGNORE_TERM = "trap '' TERM; while :; do sleep 0.05; done"


def spawn(nonce: str | None, script: str = "while :; do sleep 0.05; done") -> subprocess.Popen:
    env = dict(os.environ)
    if nonce:
        env["CLUSTERCTL_NONCE"] = nonce
    p = subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)
    time.sleep(0.05)
    return p


def ident(p: subprocess.Popen, nonce: str | None) -> dict:
    return {"pid": p.pid, "pgid": p.pid, "start_time": psutil.Process(p.pid).create_time(), "nonce": nonce,
            "boot_id": boot_id()}


def make_job(state: Path, procs: list[subprocess.Popen | None], nonce: str, *, nodes: list[Node] | None = None,
             coordinator_pid: int | None = None, runtime: Path | None = None,
             coordinator_boot_id: str | None = None) -> LaunchManifest:
    st = StateDir(state)
    key = st.keyring.signing_key()
    store = ManifestStore(st.launches, key, st.keyring.public_keys())
    runtime = runtime or state / "run"
    runtime.mkdir(parents=True, exist_ok=True)
    nodes = nodes or [Node(name="a", local=True, runtime_dir=str(runtime))]
    job = f"hand-{secrets.token_hex(3)}"
    ranks = []
    for i, p in enumerate(procs):
        rec = RankRecord(rank=i, node=nodes[i % len(nodes)].name, host="localhost", local=True,
                         runtime_dir=str(runtime), marker_path=str(runtime / f"{job}-rank{i}.json"),
                         contract_path=str(runtime / f"{job}-rank{i}.contract"), state="started")
        if p is not None:
            d = ident(p, nonce)
            rec.pid, rec.pgid, rec.start_time, rec.boot_id = d["pid"], d["pgid"], d["start_time"], d["boot_id"]
        ranks.append(rec)
    if coordinator_pid is None:
        dead = subprocess.Popen(["true"])
        dead.wait()
        coordinator_pid = dead.pid
    m = LaunchManifest(job_id=job, deployment_id="dep-x", plan_hash="0" * 64, deployment_file="/nonexistent",
                       created_at=now_iso(), nonce=nonce,
                       coordinator={"host": os.uname().nodename, "pid": coordinator_pid,
                                    "start_time": start_time(coordinator_pid) or 1.0, "boot_id": coordinator_boot_id or boot_id()},
                       nodes=nodes, ranks=ranks)
    store.save(m)
    return m

