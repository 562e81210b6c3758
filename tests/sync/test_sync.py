"""`clusterctl sync` against a real sshd and real rsync: states, transfers, hostile paths, faults, download mode.

Node "a" is local; node "b" is reached over the session's loopback sshd (its own path, through ssh_policy).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clusterctl.connect.nodes import Connector
from clusterctl.statedir.state import StateDir
from clusterctl.sync.engine import SyncOptions, sync_deployment
from clusterctl.modelfiles.manifest import build_manifest
from fuzzutil import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-model-test"


@pytest.fixture(scope="session")
def tiny() -> Path:
    from clusterctl.modelfiles import tiny

    return tiny.build(TINY)


@pytest.fixture(scope="session")
def have_rsync():
    if not shutil.which("rsync"):
        pytest.skip("rsync is not installed")


def cli(*args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterctl", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout, stdin=subprocess.DEVNULL)


def events(p: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


class Bed:
    """A model source, a 2-node cluster (a local, b over ssh) with its own paths, a plan, a state dir."""

    def __init__(self, tmp: Path, sshd, source: Path, *, path_a: str | None = None, path_b: str | None = None,
                 port_b: int | None = None, extra_nodes: str = "", plan_args: tuple = ()):
        self.tmp, self.sshd, self.source = tmp, sshd, source
        self.path_a = path_a or str(tmp / "copy a")
        self.path_b = path_b or str(tmp / "copy b")
        self.env = {"CLUSTERCTL_STATE_DIR": str(tmp / "state")}
        text = f"""
[cluster]
name = "s"
[[node]]
name = "a"
local = true
memory_gb = 4
ips = ["127.0.0.1"]
model_path = {json.dumps(self.path_a)}
runtime_dir = "{tmp}/run-a"
[[node]]
name = "b"
host = "127.0.0.1"
port = {port_b or sshd.port}
user = "root"
identity_file = "{sshd.client_key}"
ips = ["127.0.0.1"]
memory_gb = 4
python = "{sys.executable}"
model_path = {json.dumps(self.path_b)}
runtime_dir = "{tmp}/run-b"
{extra_nodes}"""
        (tmp / "cluster.toml").write_text(text)
        self.dep = str(tmp / "dep.json")
        # the plan is this bed's setup, not what a test here checks: the CLI in this process (fuzzutil.run_cli)
        # spares each test a Python that imports mlx-lm (1-2 s); sync and launch below run as processes
        p = run_cli(["plan", "-c", str(tmp / "cluster.toml"), "-m", str(source), "--context", "256", "-o", self.dep,
                     "-q", *plan_args], env=self.env)
        assert p.code == 0, p.stderr

    def sync(self, *args) -> subprocess.CompletedProcess:
        return cli("sync", self.dep, "--json", "--known-hosts", str(self.sshd.known_hosts), *args, env=self.env)

    def run_engine(self, **kw):
        opts = SyncOptions(ssh=Connector(known_hosts=self.sshd.known_hosts), **kw)
        return asyncio.run(sync_deployment(StateDir(self.tmp / "state"), self.dep, opts))

    @property
    def manifest_hash(self) -> str:
        return build_manifest(self.source, use_cache=False).manifest_hash


def same_tree(a: str | Path, b: str | Path) -> bool:
    return build_manifest(a, use_cache=False).manifest_hash == build_manifest(b, use_cache=False).manifest_hash


def node_states(p) -> dict[str, str]:
    return {e["node"]: e["state"] for e in events(p) if e["event"] == "status"}


def summary(p) -> dict:
    [s] = [e for e in events(p) if e["event"] == "summary"]
    return s


def test_sync_to_every_node_at_its_own_path_then_launch_preflight_passes(tmp_path, sshd, tiny, have_rsync):
    bed = Bed(tmp_path, sshd, tiny)
    dry = bed.sync("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert node_states(dry) == {"a": "missing", "b": "missing"}
    assert not Path(bed.path_a).exists() and not Path(bed.path_b).exists()  # a dry run sends nothing
    assert summary(dry)["mode"] == "rsync" and "coordinator's copy matches" in summary(dry)["reason"]

    p = bed.sync()
    assert p.returncode == 0, p.stderr
    kinds = [e["event"] for e in events(p)]
    assert kinds.count("start") == 2 and kinds.count("done") == 2 and "progress" in kinds and kinds[-1] == "summary"
    s = summary(p)
    assert s["ok"] and [n["result"] for n in s["nodes"]] == ["ok", "ok"]
    assert same_tree(bed.path_a, tiny) and same_tree(bed.path_b, tiny)
    assert s["manifest_hash"] == bed.manifest_hash

    again = bed.sync()
    assert again.returncode == 0 and node_states(again) == {"a": "ok", "b": "ok"}
    assert not [e for e in events(again) if e["event"] == "start"]  # nothing to send
    quiet = cli("sync", bed.dep, "--known-hosts", str(sshd.known_hosts), env=bed.env)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""  # cron: silent when all is well

    # preflight now compares each copy, quick and --verify; a changed byte on b is caught before any rank starts
    w = Path(bed.path_b) / "model.safetensors"
    with open(w, "r+b") as f:
        f.seek(w.stat().st_size - 100)
        f.write(b"\x01\x02")
    launch = cli("launch", bed.dep, "--detach", "--known-hosts", str(sshd.known_hosts), "--timeout", "60",
                 env=bed.env)
    assert launch.returncode == 69, launch.stderr
    assert f"b: model copy at {bed.path_b} is stale" in launch.stderr and f"clusterctl sync {bed.dep}" in launch.stderr
    assert not list((tmp_path / "state").glob("launches/*.json"))  # nothing was started

    fix = bed.sync()
    assert fix.returncode == 0, fix.stderr
    assert node_states(fix) == {"a": "ok", "b": "stale"}
    [start] = [e for e in events(fix) if e["event"] == "start"]
    assert start["node"] == "b" and start["files"] == 1  # only the file that differs
    assert same_tree(bed.path_b, tiny)


def test_sync_sends_the_adapter_and_launch_refuses_one_changed_after_plan(tmp_path, sshd, tiny, have_rsync):
    """Node b gets the adapter under its model folder (hidden: the model's manifest ignores it); node a, local,
    reads the coordinator's copy. An adapter changed after plan is caught by launch's copy check."""
    from adaptermodels import build_adapter

    adapter = build_adapter(tiny, tmp_path / "lora", num_layers=2)
    bed = Bed(tmp_path, sshd, tiny, plan_args=("--adapter", str(adapter)))
    ref = json.loads(Path(bed.dep).read_text())["adapter"]
    on_b = Path(ref["path_map"]["b"])
    assert on_b.parent == Path(bed.path_b) / ".clusterctl-adapters" and ref["path_map"]["a"] == str(adapter)
    p = bed.sync()
    assert p.returncode == 0, p.stderr
    s = summary(p)
    assert s["ok"] and s["adapter"]["ok"] and s["adapter"]["manifest_hash"] == ref["manifest_hash"]
    assert same_tree(on_b, adapter) and same_tree(bed.path_b, tiny)
    again = bed.sync()
    assert again.returncode == 0 and not [e for e in events(again) if e["event"] == "start"]

    build_adapter(tiny, adapter, num_layers=2, seed=5)  # the coordinator's (and node a's) copy, changed
    launch = cli("launch", bed.dep, "--detach", "--known-hosts", str(sshd.known_hosts), "--timeout", "60",
                 env=bed.env)
    assert launch.returncode != 0 and "Traceback" not in launch.stderr, launch.stderr
    assert f"a: adapter copy at {adapter} is stale" in launch.stderr, launch.stderr
    assert not list((tmp_path / "state").glob("launches/*.json"))  # nothing was started


def test_verify_finds_what_the_quick_check_trusts(tmp_path, sshd, tiny, have_rsync):
    bed = Bed(tmp_path, sshd, tiny)
    assert bed.sync().returncode == 0
    w = Path(bed.path_b) / "tokenizer.json"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[10] ^= 0x20
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, time and inode: only a re-hash can tell
    assert node_states(bed.sync("--dry-run"))["b"] == "ok"
    launch = cli("launch", bed.dep, "--detach", "--verify", "--known-hosts", str(sshd.known_hosts), "--timeout", "60",
                 env=bed.env)
    assert launch.returncode == 69, launch.stderr
    assert f"b: model copy at {bed.path_b} is stale (1 file(s) differ, e.g. tokenizer.json)" in launch.stderr
    p = bed.sync("--verify")
    assert p.returncode == 0 and node_states(p)["b"] == "stale"
    assert same_tree(bed.path_b, tiny)


@pytest.mark.parametrize("protect_args", [True, False], ids=["rsync-s", "quoted-operand"])
def test_hostile_remote_path(tmp_path, sshd, tiny, have_rsync, protect_args):
    canary = tmp_path / "PWNED"
    hostile = f"{tmp_path}/copy b; $(touch {canary}) `touch {canary}` 'q' \"dq\" tab\there & | > x"
    # (a newline never gets this far: cluster.toml refuses it in model_path)
    bed = Bed(tmp_path, sshd, tiny, path_b=hostile)
    rep = bed.run_engine(protect_args=protect_args)
    assert rep.ok, rep.to_json()
    assert same_tree(hostile, tiny) and not canary.exists()
    assert not (tmp_path / "x").exists()


def test_wildcards_in_a_remote_path_are_refused(tmp_path, sshd, tiny, have_rsync):
    bed = Bed(tmp_path, sshd, tiny, path_b=f"{tmp_path}/copy*b")
    p = bed.sync()
    assert p.returncode == 78, p.stderr
    s = summary(p)
    assert {n["node"]: n["result"] for n in s["nodes"]} == {"a": "ok", "b": "failed"}
    assert "wildcard" in [n for n in s["nodes"] if n["node"] == "b"][0]["error"]


def test_unreachable_node_is_reported_and_the_others_are_synced(tmp_path, sshd, tiny, have_rsync):
    from testports import free_port

    dead_port = free_port()  # free, and this worker's: no other worker's server can be listening there
    bed = Bed(tmp_path, sshd, tiny, port_b=dead_port)
    p = bed.sync()
    assert p.returncode == 69, p.stderr
    assert node_states(p) == {"a": "missing", "b": "unreachable"}
    assert same_tree(bed.path_a, tiny)
    [err] = [e for e in events(p) if e["event"] == "error"]
    assert err["node"] == "b" and "cannot reach" in err["error"]
    human = cli("sync", bed.dep, "--known-hosts", str(sshd.known_hosts), env=bed.env)
    assert human.returncode == 69 and human.stdout == ""
    assert human.stderr.startswith("error: b: cannot reach") and len(human.stderr.strip().splitlines()) == 1


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_no_space_on_the_node_keeps_what_is_complete(tmp_path, sshd, tiny, have_rsync, small_disk):
    dest = small_disk / "model"
    dest.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, dest / name)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    bed = Bed(tmp_path, sshd, tiny, path_b=str(dest))
    p = bed.sync()
    assert p.returncode == 73, p.stderr
    assert node_states(p)["b"] == "partial"
    [err] = [e for e in events(p) if e["event"] == "error"]
    assert err["node"] == "b" and "free there" in err["error"]
    assert {q.name: q.read_bytes() for q in dest.iterdir()} == before  # nothing complete was touched
    assert same_tree(bed.path_a, tiny)  # the other node was synced


def test_rsync_missing_on_the_node(tmp_path, sshd_factory, tiny, have_rsync):
    bare = sshd_factory(extra_config="SetEnv PATH=/nonexistent-bin")  # sessions find no rsync (nor anything)
    bed = Bed(tmp_path, bare, tiny)
    p = bed.sync()
    assert p.returncode == 1, p.stderr
    [err] = [e for e in events(p) if e["event"] == "error"]
    assert err["node"] == "b" and "rsync is not installed on node b" in err["error"]
    assert not Path(bed.path_b).exists() or not any(Path(bed.path_b).iterdir())


def test_interrupted_transfer_resumes(tmp_path, sshd, tiny, have_rsync):
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    with open(src / "extra-weights.bin", "wb") as f:  # big enough that the transfer is caught in the middle
        for _ in range(16):  # 128 MiB: caught past 16 MiB, 112 MiB still to go (~2 s at this VM's ~50 MB/s)
            f.write(os.urandom(8 << 20))
    bed = Bed(tmp_path, sshd, src)
    dest = Path(bed.path_b)
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl", "sync", bed.dep, "--json", "--known-hosts",
                             str(sshd.known_hosts)], env={**os.environ, **bed.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    caught = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        temps = [p for p in dest.glob(".extra-weights.bin.*")] if dest.exists() else []
        if temps and temps[0].stat().st_size > (16 << 20):
            proc.send_signal(signal.SIGTERM)
            caught = True
            break
        time.sleep(0.005)
    out, err = proc.communicate(timeout=60)
    if not caught:
        pytest.skip(f"the transfer finished before it could be interrupted (rc {proc.returncode})")
    assert proc.returncode == 130, err
    assert "sync interrupted" in err
    gone = time.monotonic() + 0.5  # rsync (the node's too) stopped within half a second of sync's exit
    while subprocess.run(["pgrep", "-f", f"rsync.*{dest}"], capture_output=True).stdout:
        assert time.monotonic() < gone, "rsync still runs after sync was interrupted"
        time.sleep(0.05)
    assert not (dest / "extra-weights.bin").exists()  # never a half file under its real name
    partial = dest / ".rsync-partial" / "extra-weights.bin"
    assert partial.is_file() and partial.stat().st_size > 0  # kept for the resume
    p = bed.sync()
    assert p.returncode == 0, p.stderr
    assert node_states(p)["b"] in ("partial", "missing")
    assert same_tree(dest, src)


# ---- download mode ------------------------------------------------------------------------------------------------

@pytest.fixture
def mirror(tmp_path):
    """A static HTTP server (no Range support, like many mirrors) over a folder."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/models/tiny"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_from_a_mirror_when_no_copy_is_verified(tmp_path, sshd, tiny, mirror):
    root, url = mirror
    shutil.copytree(tiny, root / "models" / "tiny")
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    bed = Bed(tmp_path, sshd, src)
    shutil.rmtree(src)  # the coordinator no longer holds a copy, and no node does
    no_url = bed.sync()
    assert no_url.returncode == 66 and "no verified copy" in no_url.stdout
    p = bed.sync("--url", url)
    assert p.returncode == 0, p.stderr
    s = summary(p)
    assert s["mode"] == "download" and "no copy" in s["reason"]
    assert same_tree(bed.path_a, tiny) and same_tree(bed.path_b, tiny)


def test_a_mirror_serving_other_bytes_changes_nothing(tmp_path, sshd, tiny, mirror):
    root, url = mirror
    shutil.copytree(tiny, root / "models" / "tiny")
    bed = Bed(tmp_path, sshd, tiny)
    with open(root / "models" / "tiny" / "tokenizer.json", "r+b") as f:
        f.write(b"[")
    p = bed.sync("--mode", "download", "--url", url)
    assert p.returncode == 1, p.stderr
    errors = {e["node"]: e["error"] for e in events(p) if e["event"] == "error"}
    assert set(errors) == {"a", "b"} and all("tokenizer.json" in e and "do not match" in e for e in errors.values())
    for path in (bed.path_a, bed.path_b):
        assert not (Path(path) / "tokenizer.json").exists()  # never a wrong file under a real name
        assert not (Path(path) / ".clusterctl-partial" / "tokenizer.json").exists()


def test_source_is_a_verified_node_when_the_coordinator_has_none(tmp_path, sshd, tiny, have_rsync):
    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    bed = Bed(tmp_path, sshd, src, path_b=str(tmp_path / "copy b"))
    shutil.copytree(tiny, tmp_path / "copy b")  # node b holds the model, the coordinator's copy goes away
    shutil.rmtree(src)
    p = bed.sync()
    assert p.returncode == 0, p.stderr
    s = summary(p)
    assert s["source"].startswith("b:") and "staged" in s["reason"]
    assert same_tree(bed.path_a, tiny)


def test_bad_flags(tmp_path, sshd, tiny, have_rsync):
    bed = Bed(tmp_path, sshd, tiny)
    assert bed.sync("--mode", "carrier-pigeon").returncode == 2
    assert bed.sync("--url", "ftp://x/y", "--mode", "download").returncode == 2
    assert bed.sync("--mode", "download").returncode == 2
    assert cli("sync", str(tmp_path / "missing.json"), env=bed.env).returncode == 66
