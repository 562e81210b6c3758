"""The fault campaign (issue 13): one table, each row N trials of a fault and its pass criterion.

Run: .venv/bin/python bench/faults.py [--quick] [--trials N] [--rows a,b,...] [--seed S] [--out FILE]

Everything is real: the CLI (`clusterctl plan/launch/teardown/reap/status/replan`), MLX ranks of the 7M tiny
model on this machine ("local" nodes), network-namespace hosts with their own sshd for the link rows, a small
tmpfs for the full disk, a cgroup freezer for the unkillable rank. Needs root on Linux (namespaces, mount,
freezer); a row that cannot run here says why and counts as skipped, not passed.

The trials of a row draw their random moments from one seeded generator (`--seed`, printed), so a failing trial
can be rerun as it was. `--quick` runs 2 trials per row and 10 s of load with 16 clients; the full campaign runs
20 trials per row (the load row once: 64 clients for 60 s). `--out FILE` writes the table as markdown (what
docs/reliability.md keeps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "launch"))
sys.path.insert(0, str(REPO / "tests" / "gguf"))  # (test_fuzz_gguf's fuzzer; tests/ mirrors src/)
sys.path.insert(0, str(REPO / "tests" / "supervise"))  # (test_heal_races' bed)

from _common import machine_note, model, say, table  # noqa: E402
from launchutil import (IGNORE_TERM, cli, fill_disk, local_cluster, make_job, manifests,  # noqa: E402
                        processes_with_nonce, spawn, start_cli, wait_gone, wait_line)


class Skip(Exception):
    """This row cannot run on this machine (the message says why)."""


class Fail(Exception):
    """A trial broke its row's criterion (the message says how)."""


def need(cond, why: str) -> None:
    if not cond:
        raise Fail(why)


@dataclass
class Row:
    name: str
    criterion: str
    trial: object  # (Bed, random.Random, int) -> str (a note)
    trials: int | None = None  # fixed number of trials (the load row), else the campaign's N
    passed: int = 0
    failed: int = 0
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ---- the test bed: a tiny model, a plan for 2 local nodes, strangers that must never be signalled -----------

class Bed:
    def __init__(self, root: Path, quick: bool, load: tuple[int, float] | None = None):
        self.root = root
        self.quick = quick
        self.load = load
        self.model = model("7m")
        self.strangers = [subprocess.Popen(["sleep", "100000"], start_new_session=True) for _ in range(2)]
        self.stranger_ids = [(p.pid, psutil.Process(p.pid).create_time()) for p in self.strangers]
        self._n = 0
        self._netns = None

    def fresh(self, tag: str) -> tuple[Path, dict]:
        """A new folder with its own state dir."""
        self._n += 1
        d = self.root / f"{tag}{self._n}"
        d.mkdir()
        return d, {"CLUSTERCTL_STATE_DIR": str(d / "state")}

    def plan(self, d: Path, env: dict, mems=(2, 6)) -> str:
        out = d / "dep.json"
        p = cli("plan", "-c", str(local_cluster(d, mems)), "-m", str(self.model), "--allocation", "proportional",
                "--context", "512", "-o", str(out), "-q", env=env)
        if p.returncode:
            raise RuntimeError(f"plan exited {p.returncode}: {p.stderr.strip()}")
        return str(out)

    def strangers_alive(self) -> bool:
        for pid, t in self.stranger_ids:
            try:
                p = psutil.Process(pid)
                if p.create_time() != t or p.status() == psutil.STATUS_ZOMBIE:
                    return False
            except psutil.Error:
                return False
        return True

    def netns(self):
        if self._netns is None:
            from fixtures_ssh import NetnsBed

            why = NetnsBed.why_not()
            if why:
                raise Skip(why)
            self._netns_bed = NetnsBed(self.root / "netns")
            self._netns = self._netns_bed.build(2)
        return self._netns

    def close(self) -> None:
        for p in self.strangers:
            p.kill()
            p.wait()
        if self._netns is not None:
            self._netns_bed.close()


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (p.stderr or "").splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    need("Traceback" not in (p.stderr or ""), f"a traceback reached the user: {lines[-1:]}")
    need(len(errs) == 1, f"expected one error line, got {len(errs)}: {lines[-3:]}")
    return errs[0]


def _reap_leaves_nothing(bed: Bed, env: dict, d: Path, nonces: list[str]) -> None:
    r = cli("reap", "--grace", "2", "--json", env=env)
    need(r.returncode == 0, f"reap exited {r.returncode}: {r.stderr.strip()[-300:]}")
    for n in nonces:
        need(wait_gone(processes_with_nonce(n), 15) == [], "a rank process of the job is alive after reap")
    need(manifests(d / "state") == [], "a launch manifest is left after reap")
    need(bed.strangers_alive(), "an unrelated process was signalled")


def _teardown_clean(env: dict, d: Path, nonces: list[str], *, force: bool = True) -> None:
    td = cli("teardown", *(["--force"] if force else []), "--grace", "2", "--json", env=env)
    need(td.returncode == 0, f"teardown exited {td.returncode}: {td.stderr.strip()[-300:]}")
    for n in nonces:
        need(wait_gone(processes_with_nonce(n), 15) == [], "a rank process outlived a verified teardown")
    need(manifests(d / "state") == [], "a launch manifest is left after teardown")


# ---- rows -----------------------------------------------------------------------------------------------------

def coordinator_sigkill(bed: Bed, rng: random.Random, i: int) -> str:
    d, env = bed.fresh("ck")
    dep = bed.plan(d, env)
    phase = ("preflight", "mid-launch", "serving", "mid-teardown")[i % 4]
    proc = start_cli("launch", dep, "--timeout", "120", "--grace", "2", env=env)
    try:
        if phase == "preflight":
            time.sleep(rng.uniform(0.0, 0.8))
        elif phase == "mid-launch":
            time.sleep(rng.uniform(0.8, 3.0))
        else:
            wait_line(proc, 120)
            time.sleep(rng.uniform(0.0, 1.0))
            if phase == "mid-teardown":
                os.kill(proc.pid, signal.SIGINT)  # the coordinator starts its verified teardown...
                time.sleep(rng.uniform(0.0, 0.6))  # ...and dies somewhere inside it
        nonces = [m["nonce"] for m in manifests(d / "state")]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    nonces += [m["nonce"] for m in manifests(d / "state") if m["nonce"] not in nonces]
    _reap_leaves_nothing(bed, env, d, nonces)
    return phase


def _stream(endpoint: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    import http.client

    host, port = endpoint.split("//", 1)[1].rsplit(":", 1)
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "def main(argv):", "max_tokens": max_tokens, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        for line in r:
            if line.startswith(b"data: "):
                started.set()
                out.setdefault("events", []).append(line[6:].strip())
    except Exception as e:  # the rank died under it: that is the point
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        started.set()


def rank_sigkill(bed: Bed, rng: random.Random, i: int) -> str:
    from clusterctl.rank.peerprobe import DEFAULT_INTERVAL, DEFAULT_TOLERANCE
    from clusterctl.protocol.rankspec import DEFAULT_ABORT_GRACE as DEFAULT_GRACE

    d, env = bed.fresh("rk")
    dep = bed.plan(d, env)
    p = cli("launch", dep, "--detach", "--json", "--timeout", "120", "--grace", "2", env=env)
    need(p.returncode == 0, f"launch exited {p.returncode}: {p.stderr.strip()[-300:]}")
    doc = json.loads(p.stdout)
    [m] = manifests(d / "state")
    started, out = threading.Event(), {}
    t = threading.Thread(target=_stream, args=(doc["endpoint"], 300, started, out), daemon=True)
    t.start()
    started.wait(60)
    time.sleep(rng.uniform(0.0, 0.5))
    victim = next(r for r in m["ranks"] if r["rank"] != 0)
    others = [r["pid"] for r in m["ranks"] if r["rank"] != victim["rank"]]
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    bound = DEFAULT_INTERVAL * DEFAULT_TOLERANCE + DEFAULT_GRACE
    left = wait_gone(others, bound + 5)
    took = time.monotonic() - t0
    need(left == [], f"the other ranks still run {took:.1f} s after the kill (bound {bound:g} s + 5)")
    st = cli("status", "--json", env=env)
    ranks = json.loads(st.stdout)["jobs"][0]["ranks"] if st.stdout.strip() else []
    named = [r for r in ranks if f"rank {victim['rank']}" in (r.get("error") or "")]
    need(named, "status does not name the lost rank: "
         + "; ".join(f"rank {r['rank']} {r['state']}: {r.get('error')}" for r in ranks))
    t.join(30)
    _reap_leaves_nothing(bed, env, d, [m["nonce"]])
    return f"others gone {took:.1f} s (bound {bound:g}); status: {named[0]['error']}"


def _ns_cluster_toml(d: Path, cluster, model_path: Path) -> Path:
    lines = ["[cluster]", 'name = "ns"']
    for i, n in enumerate(cluster.nodes):
        lines += ["[[node]]", f'name = "{n.name}"', f'host = "{n.ip}"', 'user = "root"',
                  f'identity_file = "{cluster.client_key}"', f'ips = ["{n.ip}"]', f"memory_gb = {2 + 4 * i}",
                  f'python = "{sys.executable}"', f'model_path = "{model_path}"', f'runtime_dir = "{d}/run-{n.name}"']
    p = d / "cluster.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def _ns_launch(bed: Bed, env: dict, d: Path):
    from test_launch_netns import ns_cli

    cluster = bed.netns()
    env = {**env, "PYTHONPATH": ":".join(sys.path), "CLUSTERCTL_PEER_ABORT_GRACE": "6"}
    c = _ns_cluster_toml(d, cluster, bed.model)
    dep = d / "dep.json"
    r = ns_cli(cluster, env, "plan", "-c", str(c), "-m", str(bed.model), "--context", "512", "-o", str(dep), "-q")
    if r.returncode:
        raise RuntimeError(f"plan exited {r.returncode}: {r.stderr.strip()}")
    r = ns_cli(cluster, env, "launch", str(dep), "--detach", "--json", "--known-hosts", str(cluster.known_hosts),
               "--grace", "2")
    need(r.returncode == 0, f"launch exited {r.returncode}: {r.stderr.strip()[-300:]}")
    [m] = manifests(d / "state")
    return cluster, env, json.loads(r.stdout), m


def _ns_ask(cluster, endpoint: str) -> int:
    q = subprocess.run(["ip", "netns", "exec", cluster.nodes[0].netns, "curl", "-sf", endpoint + "/v1/completions",
                        "-H", "Content-Type: application/json",
                        "-d", json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0})],
                       capture_output=True, text=True, timeout=60)
    return json.loads(q.stdout)["usage"]["completion_tokens"] if q.returncode == 0 else -1


def _ns_teardown(cluster, env, d, m) -> None:
    from test_launch_netns import ns_cli

    r = ns_cli(cluster, env, "teardown", "--force", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
    need(r.returncode == 0, f"teardown exited {r.returncode}: {r.stderr.strip()[-300:]}")
    need(processes_with_nonce(m["nonce"]) == [] and manifests(d / "state") == [], "teardown left something")


def link_short(bed: Bed, rng: random.Random, i: int) -> str:
    d, env = bed.fresh("ls")
    cluster, env, doc, m = _ns_launch(bed, env, d)
    try:
        down = rng.uniform(2.5, 4.0)  # 2 probes of 1 s miss (the ladder starts), the 6 s grace is not used up
        cluster.cut(cluster.nodes[1])
        time.sleep(down)
        cluster.restore(cluster.nodes[1])
        log0 = Path(m["ranks"][0]["log_path"])
        deadline = time.monotonic() + 15
        while "answers again" not in (log0.read_text(errors="replace") if log0.exists() else ""):
            need(time.monotonic() < deadline, f"rank 0 never saw its peer again after {down:.1f} s down")
            time.sleep(0.1)
        need(len(processes_with_nonce(m["nonce"])) == 2, "a rank exited although the link came back in time")
        need(_ns_ask(cluster, doc["endpoint"]) == 4, "the ranks do not serve after the link came back")
    finally:
        cluster.restore(cluster.nodes[1])
        _ns_teardown(cluster, env, d, m)
    return f"down {down:.1f} s: both ranks serving"


def link_long(bed: Bed, rng: random.Random, i: int) -> str:
    from test_launch_netns import ns_cli

    d, env = bed.fresh("ll")
    cluster, env, doc, m = _ns_launch(bed, env, d)
    t0 = time.monotonic()
    cluster.cut(cluster.nodes[1])
    try:
        left = wait_gone(processes_with_nonce(m["nonce"]), 30)
        took = time.monotonic() - t0
        need(left == [], "ranks still run 30 s after the link went down for good")
    finally:
        cluster.restore(cluster.nodes[1])
    states = [json.loads(Path(r["marker_path"]).read_text()).get("state") for r in m["ranks"]]
    need(states == ["lost", "lost"], f"markers say {states}, not lost")
    r = ns_cli(cluster, env, "reap", "--grace", "2", "--json", "--known-hosts", str(cluster.known_hosts))
    need(r.returncode == 0, f"reap exited {r.returncode}: {r.stderr.strip()[-200:]}")
    r = ns_cli(cluster, env, "teardown", "--json", "--known-hosts", str(cluster.known_hosts), "--grace", "2")
    need(r.returncode in (0, 66), f"teardown exited {r.returncode}: {r.stderr.strip()[-200:]}")
    need(processes_with_nonce(m["nonce"]) == [] and manifests(d / "state") == [], "something was left behind")
    return f"every rank exited {took:.1f} s after the cut"


def term_ignored(bed: Bed, rng: random.Random, i: int) -> str:
    d, env = bed.fresh("ti")
    nonce = secrets.token_hex(8)
    procs = [spawn(nonce, IGNORE_TERM), spawn(nonce)]
    make_job(d / "state", procs, nonce)
    grace = rng.choice((0.5, 1.0, 2.0))
    t0 = time.monotonic()
    r = cli("teardown", "--grace", str(grace), "--json", env=env)
    took = time.monotonic() - t0
    need(r.returncode == 0, f"teardown exited {r.returncode}: {r.stderr.strip()[-200:]}")
    codes = [p.wait(5) for p in procs]
    need(codes == [-signal.SIGKILL, -signal.SIGTERM], f"exit statuses {codes}")
    need(took >= grace, "KILL came before the grace")
    need([x["status"] for x in json.loads(r.stdout)["jobs"][0]["ranks"]] == ["gone", "gone"], "not verified gone")
    need(manifests(d / "state") == [], "manifest left")
    return f"grace {grace:g} s: KILLed after {took:.1f} s, verified"


def unkillable(bed: Bed, rng: random.Random, i: int) -> str:
    root = Path("/sys/fs/cgroup/freezer")
    if not root.is_dir():
        raise Skip("no cgroup v1 freezer here")
    cg = root / f"clusterctl-faults-{secrets.token_hex(3)}"
    try:
        cg.mkdir()
    except OSError as e:
        raise Skip(f"cannot make a freezer cgroup: {e}") from None
    d, env = bed.fresh("uk")
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    try:
        (cg / "tasks").write_text(str(p.pid))
        (cg / "freezer.state").write_text("FROZEN")
        m = make_job(d / "state", [p, spawn(nonce)], nonce)
        r = cli("teardown", "--grace", "0.5", "--json", env=env)
        need(r.returncode == 1, f"teardown exited {r.returncode}, not 1")
        ranks = json.loads(r.stdout)["jobs"][0]["ranks"]
        need([x["status"] for x in ranks] == ["survived", "gone"], f"statuses {[x['status'] for x in ranks]}")
        need(f"pid {p.pid}" in r.stderr and "manifest kept" in r.stderr, "the survivor is not named")
        need((d / "state" / "launches" / f"{m.job_id}.json").exists(), "the manifest was not kept")
        (cg / "freezer.state").write_text("THAWED")
        r2 = cli("teardown", "--grace", "0.5", env=env)
        need(r2.returncode == 0 and manifests(d / "state") == [], "the retry after thawing did not finish the job")
    finally:
        (cg / "freezer.state").write_text("THAWED")
        p.kill()
        p.wait()
        time.sleep(0.1)
        with contextlib.suppress(OSError):
            cg.rmdir()
    return "exit 1, survivor named, manifest kept; retry after thaw: 0"


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the fillers and the (empty) lock files a command may create."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith("filler") and p.parent.name != "locks"}


def disk_full(bed: Bed, rng: random.Random, i: int) -> str:
    if os.geteuid() != 0:
        raise Skip("mounting a small tmpfs needs root")
    case = ("plan --out", "launch manifest", "deployment swap", "sync cache")[i % 4]
    d, env = bed.fresh("df")
    small = d / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], capture_output=True, text=True)
    if r.returncode:
        raise Skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        env = {"CLUSTERCTL_STATE_DIR": str(small / "state")}
        c = local_cluster(d)
        dep = small / "dep.json"
        p = cli("plan", "-c", str(c), "-m", str(bed.model), "--context", "512", "-o", str(dep), "-q", env=env)
        need(p.returncode == 0, f"plan before filling: {p.stderr.strip()}")
        job = None
        if case == "deployment swap":  # a running deployment: the replan must stop before its teardown
            p = cli("launch", str(dep), "--detach", "--json", "--timeout", "120", env=env)
            need(p.returncode == 0, f"launch before filling: {p.stderr.strip()[-300:]}")
            [job] = manifests(small / "state")
        if case == "sync cache":  # plan cached the model's manifest: sync must write it again
            for f in (small / "state" / "manifests").glob("*.json"):
                f.unlink()
        fill_disk(small)
        before = _snapshot(small)
        if case == "plan --out":
            p = cli("plan", "-c", str(c), "-m", str(bed.model), "--context", "512", "--allocation", "proportional",
                    "-o", str(dep), "-q", env=env)
        elif case == "launch manifest":
            p = cli("launch", str(dep), "--detach", "--timeout", "60", env=env)
        elif case == "deployment swap":
            p = cli("replan", str(dep), "--allocation", "proportional", "--yes", "-q", env=env)
        else:
            p = cli("sync", str(dep), "--json", env=env)
        line = _one_line(p)
        need(p.returncode == 73, f"exit {p.returncode}, not 73 (cannot write): {line}")
        after = _snapshot(small)
        need(after == before, f"files changed on the full disk: {sorted(set(after) ^ set(before)) or 'contents'}")
        need(not any(n.endswith(".tmp") for n in after), "a temp file was left")
        if job is None:
            leftovers = [q.pid for q in psutil.process_iter() if _is_rank_of(q, small)]
            need(leftovers == [], f"rank processes started: {leftovers}")
        else:
            pids = sorted(r["pid"] for r in job["ranks"])
            need(sorted(processes_with_nonce(job["nonce"])) == pids, "the old job did not survive the failed replan")
    finally:
        for f in small.glob("filler*"):
            f.unlink()
        if job is not None:
            cli("teardown", "--force", "-q", env=env)
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
    return f"{case}: exit 73, one line, files byte-identical" + (", the old job still serving" if job else "")


def _is_rank_of(p: psutil.Process, folder: Path) -> bool:
    try:
        return "clusterctl.rank" in " ".join(p.cmdline()) and str(folder) in " ".join(p.cmdline())
    except psutil.Error:
        return False


def concurrent_reaps(bed: Bed, rng: random.Random, i: int) -> str:
    d, env = bed.fresh("cr")
    dep = bed.plan(d, env)
    launch = subprocess.Popen([sys.executable, "-m", "clusterctl", "launch", dep, "--detach", "--json", "--timeout",
                               "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    codes: list[int] = []
    reaped: list = []
    time.sleep(rng.uniform(0.0, 1.5))
    while launch.poll() is None:
        reaps = [subprocess.Popen([sys.executable, "-m", "clusterctl", "reap", "--json", "--grace", "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
                                  stdin=subprocess.DEVNULL) for _ in range(3)]
        for rp in reaps:
            out, err = rp.communicate(timeout=120)
            codes.append(rp.returncode)
            need("Traceback" not in err, "a reap printed a traceback")
            if rp.returncode == 0 and out.strip():
                reaped += json.loads(out)["reaped"]
    out, err = launch.communicate()
    need(launch.returncode == 0, f"the launch failed under the reaps: {err.strip()[-300:]}")
    need(all(c in (0, 75) for c in codes), f"reap exit codes {sorted(set(codes))}")
    need(reaped == [], f"a reap reaped the live launch: {reaped}")
    [m] = manifests(d / "state")
    pids = [r["pid"] for r in m["ranks"]]
    need(all(psutil.pid_exists(x) for x in pids), "a rank of the live launch died")
    need(bed.strangers_alive(), "an unrelated process was signalled")
    _teardown_clean(env, d, [m["nonce"]])
    return f"{len(codes)} reaps during the launch ({codes.count(75)} told another reap runs): launch unaffected"


def _flip(path: Path, rng: random.Random) -> None:
    """Change one letter or digit somewhere in the signed part (the file stays valid JSON)."""
    data = bytearray(path.read_bytes())
    end = data.rfind(b'"signature"')
    spots = [j for j in range(end) if chr(data[j]).isalnum()]
    j = rng.choice(spots)
    data[j] = ord("7") if data[j] != ord("7") else ord("8")
    path.write_bytes(bytes(data))


def tampered(bed: Bed, rng: random.Random, i: int) -> str:
    case = ("deployment", "signing key swapped", "rank contract", "contract from another key")[i % 4]
    d, env = bed.fresh("tp")
    dep = Path(bed.plan(d, env))
    if case in ("deployment", "signing key swapped"):
        if case == "deployment":
            _flip(dep, rng)
        else:
            shutil.rmtree(d / "state" / "keys")
            p = cli("plan", "-c", str(d / "cluster.toml"), "-m", str(bed.model), "--context", "512",
                    "-o", str(d / "other.json"), "-q", env=env)  # a new key pair now signs
            need(p.returncode == 0, p.stderr)
        p = cli("launch", str(dep), "--detach", "--timeout", "60", env=env)
        line = _one_line(p)
        need(p.returncode == 65, f"exit {p.returncode}, not 65: {line}")
        need(manifests(d / "state") == [] and not [q for q in psutil.process_iter() if _is_rank_of(q, d)],
             "something started")
        return f"{case}: launch refused (65), nothing started"
    # rank contracts: copy the real ones of a real launch, stop it, then start the ranks by hand on the copies
    p = cli("launch", str(dep), "--detach", "--json", "--timeout", "120", env=env)
    need(p.returncode == 0, f"launch exited {p.returncode}: {p.stderr.strip()[-300:]}")
    [m] = manifests(d / "state")
    copies = []
    for r in m["ranks"]:
        c = d / f"copy-rank{r['rank']}.contract"
        shutil.copy(r["contract_path"], c)
        copies.append((r, c))
    _teardown_clean(env, d, [m["nonce"]], force=True)
    refusals = []
    for r, c in copies:
        if case == "rank contract":
            _flip(c, rng)
        else:
            _resign(c, r, d)
        q = subprocess.run([sys.executable, "-m", "clusterctl.rank", "--contract", str(c), "--node", r["node"]],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        need(q.returncode != 0, f"rank {r['rank']} accepted a {case}")
        need("Traceback" not in q.stderr, f"rank {r['rank']} printed a traceback")
        refusals.append(q.returncode)
    need(processes_with_nonce(m["nonce"]) == [], "a rank runs")
    return f"{case}: every rank refused (exit {sorted(set(refusals))})"


def _resign(contract: Path, rank: dict, d: Path) -> None:
    """The same contract signed by a key the node does not trust."""
    from clusterctl.protocol.contract import contract_kind
    from clusterctl.protocol.signing import Keyring, sign_payload

    data = contract.read_bytes()
    payload = data[: data.rfind(b',\n  "signature"')] + b"\n}\n"
    key = Keyring(d / f"stranger-keys-{secrets.token_hex(2)}").signing_key()
    contract.write_bytes(sign_payload(payload, contract_kind(rank["node"]), key))


def coordinator_reboot(bed: Bed, rng: random.Random, i: int) -> str:
    d, env = bed.fresh("rb")
    nonce_live, nonce_rebooted = secrets.token_hex(8), secrets.token_hex(8)
    holder = subprocess.Popen(["sleep", "100000"], start_new_session=True)  # a live coordinator pid, in both jobs
    live = [spawn(nonce_live)]
    rebooted = [spawn(nonce_rebooted), spawn(nonce_rebooted)]
    try:
        m_live = make_job(d / "state", live, nonce_live, coordinator_pid=holder.pid)
        m_reb = make_job(d / "state", rebooted, nonce_rebooted, coordinator_pid=holder.pid,
                         coordinator_boot_id=secrets.token_hex(16))  # the coordinator's host booted since
        r = cli("reap", "--grace", "1", "--json", env=env)
        need(r.returncode == 0, f"reap exited {r.returncode}: {r.stderr.strip()[-200:]}")
        got = [j["job_id"] for j in json.loads(r.stdout)["reaped"]]
        need(got == [m_reb.job_id], f"reaped {got}, not just the rebooted coordinator's job")
        need(wait_gone([p.pid for p in rebooted], 10) == [], "ranks of the rebooted coordinator's job live on")
        need(all(p.poll() is None for p in live) and holder.poll() is None, "the live job was touched")
        need([m["job_id"] for m in manifests(d / "state")] == [m_live.job_id], "manifests are wrong")
    finally:
        for p in (*live, *rebooted, holder):
            p.kill()
            p.wait()
    return "the rebooted coordinator's job reaped; the live one untouched"


# ---- load -----------------------------------------------------------------------------------------------------

def load(bed: Bed, rng: random.Random, i: int) -> str:
    clients, seconds = bed.load or ((16, 10.0) if bed.quick else (64, 60.0))
    d, env = bed.fresh("ld")
    dep = bed.plan(d, env)
    p = cli("launch", dep, "--detach", "--json", "--timeout", "120", env=env)
    need(p.returncode == 0, f"launch exited {p.returncode}: {p.stderr.strip()[-300:]}")
    endpoint = json.loads(p.stdout)["endpoint"]
    [m] = manifests(d / "state")
    pids = {r["rank"]: r["pid"] for r in m["ranks"]}
    rss0 = {r: psutil.Process(pid).memory_info().rss for r, pid in pids.items()}
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"complete": 0, "429": 0, "5xx": 0, "4xx": 0, "broken": 0}
    why_broken: list[str] = []
    host, port = endpoint.split("//", 1)[1].rsplit(":", 1)

    def client(k: int) -> None:
        import http.client

        n = 0
        while not stop.is_set():
            n += 1
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                conn.request("POST", "/v1/chat/completions", body=json.dumps(
                    {"messages": [{"role": "user", "content": f"client {k} request {n}"}], "max_tokens": 16 + k % 24,
                     "temperature": 0, "stream": True}), headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                if r.status == 200:
                    done = finished = False
                    for line in r:
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif line.startswith(b"data: ") and b'"finish_reason": "' in line:
                            finished = True
                    kind = "complete" if done and finished else "broken"
                    if kind == "broken":
                        why = f"stream ended without {'[DONE]' if not done else 'a finish_reason'}"
                else:
                    r.read()
                    kind = "429" if r.status == 429 else "5xx" if r.status >= 500 else "4xx"
                    if r.status == 429:
                        time.sleep(float(r.getheader("Retry-After") or 1) * rng.uniform(0.5, 1.0))
                conn.close()
            except Exception as e:
                kind, why = "broken", f"{type(e).__name__}: {e}"
            with lock:
                counts[kind] += 1
                if kind in ("broken", "5xx", "4xx") and len(why_broken) < 3:
                    why_broken.append(why if kind == "broken" else f"HTTP {kind}")

    # /health is timed from a process of its own: timed from a thread beside the 64 clients, it measured the
    # clients' own GIL as well (p99 71 ms, worst 153 ms in one run).
    prober = subprocess.Popen([sys.executable, "-c", _HEALTH_PROBER, endpoint + "/health", str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    peak = dict(rss0)
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for r, pid in pids.items():
            with contextlib.suppress(psutil.Error):
                peak[r] = max(peak[r], psutil.Process(pid).memory_info().rss)
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(150)
    health = json.loads(prober.communicate(timeout=60)[0] or "[]")
    reserve = _reserves(dep)
    growth = {r: peak[r] - rss0[r] for r in pids}
    alive = all(psutil.pid_exists(pid) for pid in pids.values())
    _teardown_clean(env, d, [m["nonce"]])
    worst = max(health) if health else float("inf")
    hs = sorted(health)
    p50, p99 = (hs[len(hs) // 2], hs[min(len(hs) - 1, int(len(hs) * 0.99))]) if hs else (worst, worst)
    note = (f"{clients} clients x {seconds:g} s: {counts['complete']} complete, {counts['429']} x 429, "
            f"{counts['5xx']} x 5xx, {counts['broken']} broken, {counts['4xx']} x 4xx; /health p50 {p50 * 1000:.0f} "
            f"p99 {p99 * 1000:.0f} worst {worst * 1000:.0f} ms ({len(health)} probes); RSS growth per rank "
            + ", ".join(f"r{r} {growth[r] / 2**20:.0f}/{reserve[r] / 2**20:.0f} MiB" for r in sorted(growth))
            + (f"; first failures: {'; '.join(why_broken)}" if why_broken else ""))
    need(alive, "a rank died under load: " + note)
    need(counts["5xx"] == 0 and counts["broken"] == 0 and counts["4xx"] == 0, note)
    need(counts["complete"] > 0, note)
    need(worst < 0.1, note)
    need(all(growth[r] <= reserve[r] for r in growth), note)
    return note


_HEALTH_PROBER = """
import json, sys, time, urllib.request
url, seconds, out = sys.argv[1], float(sys.argv[2]), []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            r.read()
        out.append(time.monotonic() - t0)
    except Exception:
        out.append(1e9)
    time.sleep(0.2)
print(json.dumps(out))
"""


def _reserves(dep: str) -> dict[int, int]:
    """Per rank, what the plan reserves beyond the weights (KV for its batch slots + headroom), bytes."""
    doc = json.loads(Path(dep).read_bytes())
    return {r["rank"]: r["planned"]["total"] - r["planned"]["weights"] for r in doc["ranks"]}


def replan_matrix(bed: Bed, rng: random.Random, i: int) -> str:
    """tests/replanfuzz.py's walk of the replan options (issue 30), 100 steps from this row's seeded generator."""
    from replanfuzz import model_folder, walk

    d, _ = bed.fresh("replan")
    try:
        notes = walk(d, model_folder(d / "m"), rng, steps=100)
    except AssertionError as e:
        raise Fail(" / ".join(str(e).splitlines()[:3])) from None
    kinds = sorted({n.split(" to ")[0].split()[0] + (" " + n.split()[1] if n.startswith("refused") else "")
                    for n in notes})
    return f"{len(notes)} steps: {', '.join(f'{k} x{sum(n.startswith(k) for n in notes)}' for k in kinds)}"


def gguf_fuzz(bed: Bed, rng: random.Random, i: int) -> str:
    """GGUF numeric metadata and counts through `model import` (tests/gguf/test_fuzz_gguf.py), with a random seed."""
    from test_fuzz_gguf import fuzz_gguf

    seed = rng.randrange(10**9)
    problems, n = fuzz_gguf(seed, 100 if bed.quick else 500, bed.root / f"gguf{i}")
    need(not problems, f"{len(problems)} of {n} cases: " + "; ".join(problems[:2]))
    return f"{n} cases, seed {seed}"


def request_fuzz(bed: Bed, rng: random.Random, i: int) -> str:
    """tests/admissionfuzz.py against 2 real ranks (either schedule, a planned context of 64) with a random seed:
    sampling values at and past the model's limits, sizes past the context and the byte cap (issue 30), response
    formats with costly compiles and logprobs with them (issue 41)."""
    import admissionfuzz
    from mlx_lm.utils import load_tokenizer
    from rankharness import RankCluster

    from clusterctl.rank.api.admission import limits_for

    seed, schedule = rng.randrange(10**9), rng.choice(["overlap", "lockstep"])
    d, _ = bed.fresh("requests")
    config = json.loads((Path(bed.model) / "config.json").read_text())
    limits = limits_for(config, load_tokenizer(bed.model), 64)
    with RankCluster(d, Path(bed.model), [1, config["num_hidden_layers"] - 1], tag=f"fz{i}",
                     overrides={"schedule": schedule, "context_tokens": 64, "control_timeout_s": 4.0}).up() as c:
        def alive() -> None:
            for r, p in enumerate(c.procs):
                need(p.poll() is None, f"rank {r} exited {p.returncode}: {c.logs(r)[-300:]}")

        t = admissionfuzz.Target(port=c.http_port, vocab=limits.vocab, context=64, token_bytes=limits.token_bytes)
        tally = admissionfuzz.run(t, seed, 64 if bed.quick else 300, alive=alive)
    need(not tally.failures, f"{len(tally.failures)} failures: " + "; ".join(tally.failures[:2]))
    return f"seed {seed}, {schedule}: {tally.ok} served, {tally.refused} refused ({tally.by_status})"


def constrained_fuzz(bed: Bed, rng: random.Random, i: int) -> str:
    """tests/admissionfuzz.py with tools, tool_choice, response_format and thinking on and off, against 2 real
    ranks (either schedule) serving a tiny model whose template calls tools and opens <think> (tests/toolmodels.py),
    with a random seed (issue 41: answers that landed in the reasoning, forced calls never made)."""
    import admissionfuzz
    from mlx_lm.utils import load_tokenizer
    from rankharness import RankCluster
    from toolmodels import tool_model

    from clusterctl.rank.api.admission import limits_for

    seed, schedule = rng.randrange(10**9), rng.choice(["overlap", "lockstep"])
    d, _ = bed.fresh("constrained")
    folder = tool_model(d / "model")
    config = json.loads((folder / "config.json").read_text())
    limits = limits_for(config, load_tokenizer(folder), 512)
    with RankCluster(d, folder, [1, config["num_hidden_layers"] - 1], tag=f"cz{i}",
                     overrides={"schedule": schedule, "context_tokens": 512, "control_timeout_s": 4.0}).up() as c:
        def alive() -> None:
            for r, p in enumerate(c.procs):
                need(p.poll() is None, f"rank {r} exited {p.returncode}: {c.logs(r)[-300:]}")

        t = admissionfuzz.Target(port=c.http_port, vocab=limits.vocab, context=512, token_bytes=limits.token_bytes,
                                 tools=admissionfuzz.TOOLS)
        tally = admissionfuzz.run(t, seed, 40 if bed.quick else 200, alive=alive)
    need(not tally.failures, f"{len(tally.failures)} failures: " + "; ".join(tally.failures[:2]))
    return f"seed {seed}, {schedule}: {tally.ok} served, {tally.refused} refused ({tally.by_status})"


def _heal_trial(case_name: str):
    """A heal row: bench/heal.py's case, held to its goals (heal time, rejoin time, 0 hung clients, same URL)."""
    def trial(bed: Bed, rng: random.Random, i: int) -> str:
        from heal import CASES, GOAL_HEAL, GOAL_REJOIN, run_case

        case = next(c for c in CASES if c.name == case_name)
        nbed = None
        if case.fault == "link":
            from fixtures_ssh import NetnsBed

            why = NetnsBed.why_not()
            if why:
                raise Skip(why)
            nbed = NetnsBed(bed.root / f"heal-netns{i}")
        try:
            r = run_case(bed.root, case, [], nbed)
        finally:
            if nbed is not None:
                nbed.close()
        c = r["clients"]
        need(r["heal_s"] <= GOAL_HEAL[case.kind], f"serving again {r['heal_s']:.1f} s after the fault "
             f"(goal {GOAL_HEAL[case.kind]:g} s)")
        need(r["rejoin_s"] <= GOAL_REJOIN, f"original plan {r['rejoin_s']:.1f} s after the node was healthy "
             f"(goal {GOAL_REJOIN:g} s)")
        need(c["hung"] == 0, f"{c['hung']} client request(s) hung")
        need(r["url_same"] and r["served_after_heal"] and r["served_after_rejoin"], f"the URL did not serve: {r}")
        need(r["kinds"] == ["heal", "rejoin"] and r["old_ranks_left"] == 0, f"history {r['kinds']}, "
             f"{r['old_ranks_left']} rank(s) of the lost job left")
        return (f"heal {r['heal_s']:.1f} s, rejoin {r['rejoin_s']:.1f} s, ranks {'->'.join(map(str, r['ranks']))}, "
                f"clients ok/error/hung {c['ok']}/{c['error']}/{c['hung']}")
    return trial


def heal_race_simulated(bed: Bed, rng: random.Random, i: int) -> str:
    """The supervisor's own loop over simulated nodes (tests/supervise/test_heal_races.py's bed: the real look,
    teardown, replan and relaunch code on a clock the trial turns): rank 0 SIGKILLed, rank 1 following it out at
    a random moment from 0 to 14 s (before, at, after the grace and the stale period) with one of the words a
    follower writes, or never; 25 moments per trial."""
    import asyncio

    import test_heal_races as races
    from clusterctl.launch.fakecluster import SimulatedNode

    moments = []
    for k in range(5 if bed.quick else 25):
        d, _ = bed.fresh("race")
        follow_at = None if rng.random() < 0.1 else round(rng.uniform(0.0, 14.0), 1)
        words = rng.choice(races.FOLLOWERS)
        nodes = {races.A: SimulatedNode(), races.B: SimulatedNode()}
        state, sup, clock = races._supervised(d, nodes, grace=rng.choice([1.0, 3.0, 5.0]))

        async def go():
            await sup.take_over()
            original = sup.current
            await races._kill_rank0_and_heal(sup, clock, nodes, follow_at, words)
            races._healed_onto_b(state, sup, original)

        try:
            asyncio.run(go())
        except AssertionError as e:
            raise Fail(f"rank 1 following at {follow_at} s ({words['state']}): {e}") from None
        moments.append(follow_at)
    return f"{len(moments)} moments, each healed onto rank 1's node with one plan change"


def heal_race_real(bed: Bed, rng: random.Random, i: int) -> str:
    """`supervise` over a detached 2-rank job; rank 0 SIGKILLed; rank 1 follows on its own (ring error, a stuck
    exchange or the probe ladder: whichever comes first), while the supervisor's grace (drawn from 0.5-3 s) puts
    its look before, during or after that exit."""
    d, env = bed.fresh("heal-race")
    dep = bed.plan(d, env, mems=(6, 6))
    state = d / "state"
    p = cli("launch", dep, "--detach", "--timeout", "120", "-q", env=env)
    need(p.returncode == 0, f"launch exited {p.returncode}: {p.stderr.strip()[-300:]}")
    grace = rng.choice(["0.5", "1", "2", "3"])
    sup = start_cli("supervise", dep, "--heal-grace", grace, "--rejoin-after", "600", "--grace", "3", env=env)
    try:
        endpoint = wait_line(sup)
        [m0] = manifests(state)
        os.kill(next(r["pid"] for r in m0["ranks"] if r["rank"] == 0), signal.SIGKILL)
        t0, doc = time.monotonic(), {}
        while time.monotonic() - t0 < 90:
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads((state / "heal" / "t.json").read_text())
            need("no node answers" not in (doc.get("reason") or ""), f"every node blamed: {doc.get('reason')}")
            if doc.get("state") == "serving" and doc.get("job") not in (None, m0["job_id"]):
                break
            time.sleep(0.1)
        healed = time.monotonic() - t0
        need(doc.get("lost_nodes") == ["a"], f"after {healed:.1f} s: {doc.get('state')}: {doc.get('reason')}, "
             f"lost {doc.get('lost_nodes')}")
        [m1] = manifests(state)
        need(m1["endpoint"] == endpoint, f"served on {m1['endpoint']}, not {endpoint}")
        return f"grace {grace} s: healed onto b in {healed:.1f} s"
    finally:
        sup.kill()
        sup.wait(timeout=30)
        cli("teardown", dep, "--force", "--grace", "1", env=env)


HEAL_CRITERION = ("launch --heal serves again on the nodes left within the goal (tiny 30 s, SmolLM2 60 s), back to "
                  "the original plan within 60 s of the node healthy, 0 hung clients, the same URL")

ROWS = [
    Row("coordinator SIGKILL (preflight, mid-launch, serving, mid-teardown)",
        "after one reap: 0 rank processes of the job, 0 strangers signalled, manifest gone", coordinator_sigkill),
    Row("rank SIGKILL while serving",
        "the others exit within probe x tolerance + grace (+5 s), status names the lost rank, teardown leaves 0",
        rank_sigkill),
    Row("link down shorter than the grace", "nothing exits, the ring serves again", link_short),
    Row("link down longer than the grace", "every rank exits (markers lost), reap + teardown leave 0", link_long),
    Row("rank ignoring SIGTERM", "KILL after the grace, verified gone, manifest gone", term_ignored),
    Row("unkillable rank (frozen)", "exit 1, survivor named, manifest kept; retry after thaw exits 0", unkillable),
    Row("disk full (plan --out, launch manifest, deployment swap, sync cache)",
        "exit 73, one line, every file byte-identical, nothing started", disk_full),
    Row("3 concurrent reaps during a launch", "launch ready, reaps exit 0 or 75, nothing reaped or signalled",
        concurrent_reaps),
    Row("tampered deployment / contract / key", "refused (launch 65, ranks non-zero), nothing starts", tampered),
    Row("coordinator host rebooted (boot id changed)", "reap reaps its job and only its job", coordinator_reboot),
    Row("load: 64 streaming clients x 60 s, 2 ranks",
        "0 5xx, each response complete or 429, /health < 100 ms, RSS growth within the plan's reserve", load,
        trials=1),
    Row("rank 0 requests fuzzed (sampling limits, sizes, planned context, response formats, costly schemas, logprobs)",
        "each a 200 within the context (strict JSON; a structured answer parses) or a clean 4xx; no rank ends",
        request_fuzz),
    Row("rank 0 constrained requests fuzzed (tools, response_format, a template that opens <think>)",
        "each a 200 whose JSON parses, forced call is made, 'none' has no call markup; or a clean 4xx",
        constrained_fuzz),
    Row("GGUF metadata and counts fuzzed (model import)",
        "each case a valid import or a one-line refusal 65/66/78, < 5 s and 512 MiB each", gguf_fuzz),
    Row("heal: tiny 2->1, rank SIGKILL", HEAL_CRITERION, _heal_trial("tiny 2->1, rank SIGKILL"), trials=2),
    Row("heal: tiny 2->1, rank frozen (SIGSTOP)", HEAL_CRITERION, _heal_trial("tiny 2->1, rank frozen (SIGSTOP)"),
        trials=2),
    Row("heal: tiny 2->1, link cut (netns)", HEAL_CRITERION, _heal_trial("tiny 2->1, link cut (netns)"), trials=2),
    Row("heal: SmolLM2 3->2, rank SIGKILL", HEAL_CRITERION, _heal_trial("SmolLM2 3->2, rank SIGKILL"), trials=1),
    Row("heal race (simulated): rank 0 lost, rank 1 follows at any moment 0-14 s or never",
        "healed onto rank 1's node every time, one plan change, never every node blamed", heal_race_simulated),
    Row("heal race (real ranks): supervise, rank 0 SIGKILL, rank 1 follows on its own",
        "healed onto rank 1's node (lost: a), the same URL, never 'no node answers'", heal_race_real),
    Row("replan option matrix (plan/replan random walk)", "new id + history entry for every change, --to gives "
        "the same bytes back, no-op says unchanged, a missing --path-map refused (69), nothing lost", replan_matrix),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 trials per row, a 10 s load with 16 clients")
    ap.add_argument("--trials", type=int, default=None, help="trials per row (default 20, --quick 2)")
    ap.add_argument("--rows", default="", help="comma-separated words; only rows whose name contains one run")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as markdown here")
    ap.add_argument("--load", default=None, metavar="CLIENTS,SECONDS", help="the load row's size (default 64,60)")
    ns = ap.parse_args()
    n = ns.trials or (2 if ns.quick else 20)
    seed = ns.seed if ns.seed is not None else random.SystemRandom().randrange(10**6)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    say(f"bench/faults.py  {time.strftime('%Y-%m-%d %H:%M')}  commit {commit}  {machine_note()}  trials={n}  "
        f"seed={seed}{'  (quick)' if ns.quick else ''}")
    words = [w.strip().lower() for w in ns.rows.split(",") if w.strip()]
    rows = [r for r in ROWS if not words or any(w in r.name.lower() for w in words)]
    root = Path(tempfile.mkdtemp(prefix="cct-faults-"))
    load_size = None
    if ns.load:
        c, sec = ns.load.split(",")
        load_size = (int(c), float(sec))
    bed = Bed(root, ns.quick, load_size)
    try:
        for row in rows:
            rng = random.Random(f"{seed}/{row.name}")
            t0 = time.monotonic()
            for i in range(row.trials or n):
                try:
                    note = row.trial(bed, rng, i)
                    row.passed += 1
                    say(f"  ok    {row.name} #{i + 1}: {note}")
                except Skip as e:
                    row.skipped = str(e)
                    say(f"  skip  {row.name}: {e}")
                    break
                except Fail as e:
                    row.failed += 1
                    row.notes.append(f"#{i + 1}: {e}")
                    say(f"  FAIL  {row.name} #{i + 1}: {e}")
                except Exception as e:  # the bed broke: count it against the row, say where
                    row.failed += 1
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    row.notes.append(f"#{i + 1}: {type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})")
                    say(f"  FAIL  {row.name} #{i + 1}: {row.notes[-1]}")
            row.seconds = time.monotonic() - t0
            if row.passed and not row.notes and row.trial is load:
                row.notes.append(note)
    finally:
        bed.close()
        shutil.rmtree(root, ignore_errors=True)
    header = ["row", "trials", "passed", "criterion", "s", "notes"]
    body = [[r.name, str(r.passed + r.failed), "skipped: " + r.skipped if r.skipped else str(r.passed), r.criterion,
             f"{r.seconds:.0f}", "; ".join(r.notes)[:400]] for r in rows]
    say("")
    say(table(body, header))
    all_ok = all(r.failed == 0 and not r.skipped and r.passed for r in rows)
    say(f"\n{'every row passed every trial' if all_ok else 'NOT every row passed'}; seed {seed}")
    if ns.out:
        md = [f"Run `{' '.join(['.venv/bin/python', 'bench/faults.py', *sys.argv[1:]])}` at commit {commit}, "
              f"{time.strftime('%Y-%m-%d %H:%M')} ({machine_note()}), seed {seed}.", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        md += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
        ns.out.write_text("\n".join(md) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
