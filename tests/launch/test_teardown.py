"""Verified teardown and the reaper on hand-made jobs of ordinary processes (no MLX needed).

A "rank" here is any real process carrying the job's nonce in its environment; the manifest is a real signed
one in a real state dir, and teardown/reap run through the real CLI.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from clusterctl.statedir.manifest import LaunchManifest, ManifestStore, RankRecord, now_iso
from clusterctl.node.procs import Identity, boot_id, status_of, stop
from clusterctl.plan.inventory import Node
from clusterctl.statedir.state import StateDir
from launchutil import IGNORE_TERM, cli, ident, make_job, spawn  # noqa: F401

@pytest.fixture
def state(tmp_path):
    return tmp_path / "state"


def env_of(state):
    return {"CLUSTERCTL_STATE_DIR": str(state)}


@pytest.mark.slow
def test_rank_ignoring_sigterm_is_killed_after_the_grace(state):
    nonce = secrets.token_hex(8)
    p = spawn(nonce, IGNORE_TERM)
    make_job(state, [p], nonce)
    t0 = time.monotonic()
    r = cli("teardown", "--grace", "1", "--json", env=env_of(state))
    assert r.returncode == 0, r.stderr
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert time.monotonic() - t0 >= 1.0
    doc = json.loads(r.stdout)
    assert doc["jobs"][0]["ranks"][0]["status"] == "gone"
    assert not list((state / "launches").glob("*.json"))


@pytest.fixture
def freezer():
    root = Path("/sys/fs/cgroup/freezer")
    if not root.is_dir():
        pytest.skip("no cgroup v1 freezer on this machine")
    cg = root / f"clusterctl-test-{secrets.token_hex(3)}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a freezer cgroup: {e}")
    yield cg
    (cg / "freezer.state").write_text("THAWED")
    for pid in (cg / "tasks").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.2)
    try:
        cg.rmdir()
    except OSError:
        pass


@pytest.mark.slow
def test_unkillable_rank_is_reported_and_the_manifest_kept(state, freezer):
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    (freezer / "tasks").write_text(str(p.pid))
    (freezer / "freezer.state").write_text("FROZEN")
    m = make_job(state, [p], nonce)
    r = cli("teardown", "--grace", "0.5", "--json", env=env_of(state))
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    rank = doc["jobs"][0]["ranks"][0]
    assert rank["status"] == "survived" and rank["pid"] == p.pid and rank["host"] == "localhost"
    assert f"pid {p.pid}" in r.stderr and "manifest kept" in r.stderr
    assert (state / "launches" / f"{m.job_id}.json").exists()
    (freezer / "freezer.state").write_text("THAWED")
    r2 = cli("teardown", "--grace", "0.5", env=env_of(state))
    assert r2.returncode == 0, r2.stderr
    assert not (state / "launches" / f"{m.job_id}.json").exists()


def test_a_process_that_reused_the_pid_is_never_signalled(state):
    nonce = secrets.token_hex(8)
    impostor = spawn(None)  # same pid and start time as "recorded", but not carrying the job's nonce
    try:
        fake = Identity(pid=impostor.pid, start_time=psutil.Process(impostor.pid).create_time(), nonce=nonce,
                        pgid=impostor.pid)
        assert status_of(fake) == "foreign"
        results = stop([fake], grace=0.2)
        assert results[0].status == "not-ours"
        older = Identity(pid=impostor.pid, start_time=psutil.Process(impostor.pid).create_time() - 5, nonce=None)
        assert status_of(older) == "foreign"
        assert stop([older], grace=0.2)[0].status == "not-ours"
        assert impostor.poll() is None
    finally:
        impostor.kill()


def test_pid_reuse_inside_a_pid_namespace(tmp_path):
    """A real reuse: the rank dies, an impostor gets the very same pid, teardown leaves the impostor alone."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root")
    script = tmp_path / "reuse.py"
    script.write_text(f"""
import os, subprocess, sys, time
sys.path[:0] = {sys.path!r}
import psutil
from clusterctl.node.procs import Identity, stop
env = dict(os.environ, CLUSTERCTL_NONCE="n1")
rank = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
ident = Identity(pid=rank.pid, start_time=psutil.Process(rank.pid).create_time(), nonce="n1", pgid=rank.pid)
rank.kill(); rank.wait()
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(rank.pid - 1))
impostor = subprocess.Popen(["sleep", "300"], start_new_session=True)
assert impostor.pid == rank.pid, (impostor.pid, rank.pid)
res = stop([ident], grace=0.3)
print(res[0].status, impostor.poll() is None)
impostor.kill()
""")
    p = subprocess.run(["unshare", "-pf", "--mount-proc", sys.executable, str(script)], capture_output=True,
                       text=True, timeout=60)
    if p.returncode != 0 and ("Operation not permitted" in p.stderr or "unshare failed" in p.stderr):
        pytest.skip(f"unshare not permitted here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr
    status, impostor_alive = p.stdout.split()
    assert status in ("not-ours", "gone") and impostor_alive == "True"


def test_zombie_counts_as_dead():
    p = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status_of(Identity(pid=p.pid, start_time=psutil.Process(p.pid).create_time(), nonce=None)) == "dead"
    p.wait()


def test_a_process_we_may_not_signal_counts_as_alive(tmp_path):
    """Teardown run as an unprivileged user against a root-owned 'rank': EPERM, reported, never called gone."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a process of another user")
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    try:
        target = Identity.model_validate(ident(p, nonce))
        rfd, wfd = os.pipe()
        child = os.fork()
        if child == 0:  # drop to nobody without exec (the venv's interpreter may not be readable by nobody)
            try:
                os.close(rfd)
                os.setgid(65534)
                os.setuid(65534)
                os.write(wfd, json.dumps([r.wire() for r in stop([target], grace=0.2)]).encode())
            finally:
                os._exit(0)
        os.close(wfd)
        with os.fdopen(rfd) as f:
            out = f.read()
        os.waitpid(child, 0)
        assert json.loads(out)[0]["status"] == "permission-denied"
        assert p.poll() is None
    finally:
        p.kill()


@pytest.mark.slow
def test_unreachable_host_keeps_the_manifest(state):
    nonce = secrets.token_hex(8)
    # an SSH node on a closed loopback port: connection refused
    from testports import free_port

    port = free_port()  # this worker's: no other worker's server can be listening there
    node = Node(name="far", host="127.0.0.1", port=port, local=False, runtime_dir="/tmp/nowhere")
    m = make_job(state, [None], nonce, nodes=[node])
    m.ranks[0].pid, m.ranks[0].start_time = 12345, 1.0
    st = StateDir(state)
    ManifestStore(st.launches, st.keyring.signing_key(), st.keyring.public_keys()).save(m)
    r = cli("teardown", "--json", env=env_of(state))
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["jobs"][0]["ranks"][0]["status"] == "unreachable"
    assert (state / "launches" / f"{m.job_id}.json").exists()


@pytest.mark.slow
def test_markers_of_other_jobs_are_never_touched(state):
    nonce, other_nonce = secrets.token_hex(8), secrets.token_hex(8)
    mine = spawn(nonce)
    other = spawn(other_nonce)
    try:
        m = make_job(state, [mine], nonce)
        run = Path(m.ranks[0].runtime_dir)
        d = ident(other, other_nonce)
        (run / "otherjob-rank0.json").write_text(json.dumps({**d, "job_id": "otherjob", "rank": 0}))
        # a marker in OUR job's name but with a foreign nonce (a stale or forged file)
        (run / f"{m.job_id}-rank1.json").write_text(json.dumps({**d, "job_id": m.job_id, "rank": 1}))
        r = cli("teardown", "--grace", "0.5", env=env_of(state))
        assert r.returncode == 0, r.stderr
        assert mine.wait(timeout=5) is not None
        assert other.poll() is None
        assert (run / "otherjob-rank0.json").exists()
    finally:
        mine.kill()
        other.kill()


def test_a_nodes_sweep_signals_only_the_ranks_it_hosts_in_a_shared_runtime_dir(state):
    """Two nodes that are one machine share a runtime dir: node a's sweep must leave node b's rank to node b's
    own sweep, or that rank gets a second SIGTERM (a rank's "exit now", which cuts its clients' streams)."""
    from clusterctl.node.nodeops import op_sweep
    from clusterctl.protocol.nodeops import SweepRequest

    nonce = secrets.token_hex(8)
    ranks = [spawn(nonce), spawn(nonce)]
    try:
        m = make_job(state, ranks, nonce)
        run = Path(m.ranks[0].runtime_dir)
        for r, p in enumerate(ranks):
            (run / f"{m.job_id}-rank{r}.json").write_text(json.dumps({**ident(p, nonce), "job_id": m.job_id,
                                                                      "rank": r}))
        # (results may also name a `sleep` of a rank's group: group members are stopped with their leader)
        ans = op_sweep(SweepRequest(runtime_dir=str(run), job_id=m.job_id, nonce=nonce, grace=1.0, ranks=[1]))
        got = {x.pid: x.status for x in ans.results}
        assert got[ranks[1].pid] == "gone" and ranks[0].pid not in got, got
        assert ranks[1].wait(timeout=5) == -signal.SIGTERM
        assert ranks[0].poll() is None  # not this node's rank: never signalled
        ans = op_sweep(SweepRequest(runtime_dir=str(run), job_id=m.job_id, nonce=nonce, grace=1.0))
        got = {x.pid: x.status for x in ans.results}
        assert got[ranks[0].pid] == "gone" and ranks[1].pid in got, got  # without ranks: every marker
        assert ranks[0].wait(timeout=5) == -signal.SIGTERM
    finally:
        for p in ranks:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_reap_leaves_live_coordinators_alone_and_reports_malformed(state):
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    try:
        m = make_job(state, [p], nonce, coordinator_pid=os.getpid())  # this test process is a live coordinator
        bad = state / "launches" / "broken.json"
        bad.write_text('{"type": "launch-manifest", "truncat')
        r = cli("reap", "--json", env=env_of(state))
        assert r.returncode == 1
        doc = json.loads(r.stdout)
        assert doc["reaped"] == [] and doc["malformed"][0]["manifest"] == str(bad)
        assert bad.exists() and p.poll() is None
        assert (state / "launches" / f"{m.job_id}.json").exists()
        dry = cli("reap", "--dry-run", "--json", env=env_of(state))
        assert json.loads(dry.stdout)["reaped"] == []
    finally:
        p.kill()


@pytest.mark.slow
def test_reap_with_nothing_to_do_is_silent_and_imports_no_mlx(state):
    state.mkdir(parents=True)
    code = ("import sys\nfrom clusterctl.cli import main\n"
            "try:\n    main(['reap', '-q'])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, sorted(m for m in ('mlx', 'mlx_lm', 'numpy', 'asyncssh') if m in sys.modules))\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env_of(state)})
    assert r.stdout.strip() == "0 []" and r.stderr == ""
    assert time.monotonic() - t0 < 10  # generous: a shared 2-core machine; bench/ measures it properly


@pytest.mark.slow
def test_two_concurrent_reaps_never_fight(state):
    jobs = []
    for _ in range(3):
        nonce = secrets.token_hex(8)
        p = spawn(nonce, IGNORE_TERM)
        make_job(state, [p], nonce)
        jobs.append(p)
    a = subprocess.Popen([sys.executable, "-m", "clusterctl", "reap", "--grace", "0.5", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env_of(state)})
    b = subprocess.Popen([sys.executable, "-m", "clusterctl", "reap", "--grace", "0.5", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env_of(state)})
    outs = [x.communicate(timeout=120) for x in (a, b)]
    codes = sorted([a.returncode, b.returncode])
    assert all(c in (0, 75) for c in codes), outs
    assert 0 in codes
    assert not any("Traceback" in err for _, err in outs)
    reaped = [j["job_id"] for (out, _), c in zip(outs, (a.returncode, b.returncode)) if c == 0
              for j in json.loads(out)["reaped"]]
    assert len(reaped) == len(set(reaped)) == 3
    for p in jobs:
        assert p.wait(timeout=5) == -signal.SIGKILL
    assert not list((state / "launches").glob("*.json"))


@pytest.mark.slow
def test_verify_never_moves_a_launch_manifest_or_key(state):
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    try:
        m = make_job(state, [p], nonce)
        path = state / "launches" / f"{m.job_id}.json"
        r = cli("verify", str(path), env=env_of(state))
        assert r.returncode == 65 and path.exists()
        r = cli("verify", str(state / "keys" / "deploy.pub"), env=env_of(state))
        assert r.returncode != 0 and (state / "keys" / "deploy.pub").exists()
    finally:
        p.kill()


@pytest.mark.slow
def test_reap_quiet_is_silent_when_the_lock_is_held(state):
    (state / "launches").mkdir(parents=True)
    (state / "locks").mkdir(parents=True)
    holder = subprocess.Popen(["flock", str(state / "locks" / "reap.lock"), "sleep", "30"])
    try:
        time.sleep(0.3)
        r = cli("reap", "-q", env=env_of(state))
        assert r.returncode == 75 and r.stdout == "" and r.stderr == ""
        r = cli("reap", env=env_of(state))
        assert r.returncode == 75 and "locked" in r.stderr
    finally:
        holder.kill()


@pytest.mark.slow
def test_teardown_refuses_malformed_manifests(state):
    (state / "launches").mkdir(parents=True)
    (state / "launches" / "j1.json").write_text("{garbage")
    r = cli("teardown", env=env_of(state))
    assert r.returncode == 65 and "malformed" in r.stderr
    r = cli("teardown", "j1", env=env_of(state))
    assert r.returncode == 65
    assert cli("teardown", "state", env=env_of(state)).returncode == 66  # no substring matches on paths
    assert (state / "launches" / "j1.json").exists()


@pytest.mark.slow
def test_a_detached_job_whose_ranks_all_exited_is_reaped(state):
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    m = make_job(state, [p], nonce, coordinator_pid=os.getpid())
    st = StateDir(state)
    m.coordinator.detached = True
    ManifestStore(st.launches, st.keyring.signing_key(), st.keyring.public_keys()).save(m)
    r = cli("reap", "--json", env=env_of(state))
    assert r.returncode == 0 and json.loads(r.stdout)["reaped"] == []  # its rank still runs: left alone
    p.kill()
    p.wait()
    r = cli("reap", "--json", env=env_of(state))
    assert r.returncode == 0 and [j["job_id"] for j in json.loads(r.stdout)["reaped"]] == [m.job_id]
    assert not list((state / "launches").glob("*.json"))


@pytest.mark.slow
def test_one_malformed_manifest_does_not_keep_a_deployments_healthy_job_running(state):
    nonce = secrets.token_hex(8)
    p = spawn(nonce)
    try:
        m = make_job(state, [p], nonce)
        bad = state / "launches" / f"{m.deployment_id}-20260101000000-abcdef.json"
        bad.write_text('{"type": "launch-manifest", "truncat')
        r = cli("teardown", m.deployment_id, "--grace", "0.5", "--json", env=env_of(state))
        assert r.returncode == 1, r.stderr
        doc = json.loads(r.stdout)
        assert doc["ok"] is False and [j["job_id"] for j in doc["jobs"]] == [m.job_id] and doc["jobs"][0]["ok"]
        assert doc["malformed"][0]["manifest"] == str(bad) and "malformed manifest kept" in r.stderr
        assert p.wait(timeout=5) is not None  # the healthy job was stopped
        assert bad.exists() and not (state / "launches" / f"{m.job_id}.json").exists()
    finally:
        p.kill()
