"""What an operator's files and processes give away: private files and folders, an API key that lives only in rank
0's contract, state and runtime dirs that other users could write into refused."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from launchutil import cli, local_cluster, manifests

pytestmark = pytest.mark.slow

KEY = "sk-secret-4e1c9a7f0b"
TENANTS = {"alice": "sk-alice-7c1e9a0b4d", "bob": "sk-bob-0d3f6a2c9e1b"}


def _keys_file(tmp_path, mode: int = 0o600) -> str:
    path = tmp_path / f"tenants-{mode:o}.keys"
    path.write_text("".join(f"{name} {key}\n" for name, key in TENANTS.items()))
    path.chmod(mode)
    return str(path)


def _plan(tmp_path, tiny, env) -> str:
    c = local_cluster(tmp_path)
    out = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "512", "-o", str(out), "-q", env=env, check=True)
    return str(out)


def _walk(root: Path):
    for folder, dirs, files in os.walk(root):
        yield Path(folder), True
        for f in files:
            yield Path(folder) / f, False


def test_launch_files_are_private_and_the_api_key_is_only_in_rank_0s_contract(tmp_path, tiny, env):
    dep = _plan(tmp_path, tiny, env)
    p = cli("launch", dep, "--detach", "--json", "--timeout", "180", "--api-keys-file", _keys_file(tmp_path),
            env={**env, "CLUSTERCTL_API_KEY": KEY})
    assert p.returncode == 0, p.stderr
    try:
        [m] = manifests(tmp_path / "state")
        pids = [r["pid"] for r in m["ranks"]]
        # every file and folder clusterctl made: the state dir and both nodes' runtime dirs
        loose, holders = [], []
        for root in (tmp_path / "state", tmp_path / "run-a", tmp_path / "run-b"):
            for path, is_dir in _walk(root):
                mode = stat.S_IMODE(path.lstat().st_mode)
                if mode & 0o077:
                    loose.append(f"{path} {mode:04o}")
                if not is_dir and any(k.encode() in path.read_bytes() for k in (KEY, *TENANTS.values())):
                    holders.append(path)
        assert loose == []
        contract0 = next(r["contract_path"] for r in m["ranks"] if r["rank"] == 0)
        assert [str(h) for h in holders] == [contract0]  # not in logs, markers, manifests, the hostfile
        for pid in pids:
            proc = psutil.Process(pid)
            assert KEY not in " ".join(proc.cmdline())
            assert all(KEY not in v for v in proc.environ().values())
        for proc in psutil.process_iter(["cmdline"]):
            assert KEY not in " ".join(proc.info["cmdline"] or []), proc
        endpoint = json.loads(p.stdout)["endpoint"]
        assert endpoint.startswith("http://127.0.0.1:")
        port = int(endpoint.rsplit(":", 1)[1])
        listening = [c.laddr.ip for c in psutil.Process(pids[0] if m["ranks"][0]["rank"] == 0 else pids[1])
                     .net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening == ["127.0.0.1"]
        # each tenant's key is accepted, none is needed for /health, a missing key is refused
        import urllib.error
        import urllib.request

        def status(key):
            req = urllib.request.Request(endpoint + "/v1/models", headers={"Authorization": f"Bearer {key}"}
                                         if key else {})
            try:
                return urllib.request.urlopen(req, timeout=30).status
            except urllib.error.HTTPError as e:
                return e.code

        assert [status(k) for k in (KEY, *TENANTS.values(), None, "sk-wrong-000000000")] == [200, 200, 200, 401, 401]
    finally:
        td = cli("teardown", "--force", "--json", env=env)
    assert td.returncode == 0, td.stderr


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "another-owner", "symlinked-subfolder"])
def test_a_state_dir_other_users_could_write_into_is_refused(tmp_path, how):
    state = tmp_path / "state"
    (state / "deployments").mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    if how == "group-writable":
        state.chmod(0o770)
    elif how == "world-writable":
        (state / "deployments").chmod(0o777)
    elif how == "another-owner":
        if os.getuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        os.chown(state, 65534, 65534)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        (state / "launches").symlink_to(elsewhere)
    before = sorted(str(p) for p, _ in _walk(state))
    p = cli("status", "--json", env={"CLUSTERCTL_STATE_DIR": str(state)})
    assert p.returncode == 78, (p.returncode, p.stderr)
    [line] = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert str(state) in line and ("other users may write into it" in line or "belongs to uid" in line
                                   or "symlink" in line), line
    assert "Traceback" not in p.stderr
    assert sorted(str(p) for p, _ in _walk(state)) == before  # nothing written into it


@pytest.mark.parametrize("folder", ["heal", "fronts", "reports"])
def test_the_supervisors_and_front_doors_folders_are_checked_as_the_rest(tmp_path, folder):
    """A heal file status believes, a front record status reports, a report: the state dir's one owner
    (statedir/state.py) checks their folders as it checks the deployments' (issue 43: built ad hoc before)."""
    state = tmp_path / "state"
    (state / folder).mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    (state / folder).chmod(0o777)
    p = cli("status", "--json", env={"CLUSTERCTL_STATE_DIR": str(state)})
    assert p.returncode == 78, (p.returncode, p.stderr)
    [line] = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert str(state / folder) in line and "other users may write into it" in line, line


def test_a_runtime_dir_other_users_could_write_into_fails_preflight(tmp_path, tiny, env):
    dep = _plan(tmp_path, tiny, env)
    (tmp_path / "run-b").mkdir(mode=0o700)
    (tmp_path / "run-b").chmod(0o777)
    p = cli("launch", dep, "--detach", "--json", "--timeout", "60", env=env)
    assert p.returncode != 0
    assert "runtime dir" in p.stderr and "other users may write into it" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert manifests(tmp_path / "state") == []
    assert not any(f.name.endswith(".contract") or "contract" in f.name for f in (tmp_path / "run-b").iterdir())


def test_new_state_folders_are_0700_even_with_a_loose_umask(tmp_path, tiny):
    state = tmp_path / "deep" / "state"
    old = os.umask(0o002)
    try:
        p = cli("plan", "-c", str(local_cluster(tmp_path)), "-m", str(tiny), "--context", "512",
                "-o", str(tmp_path / "dep.json"), "-q", env={"CLUSTERCTL_STATE_DIR": str(state)})
    finally:
        os.umask(old)
    assert p.returncode == 0, p.stderr
    for path, is_dir in _walk(tmp_path / "deep"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} {mode:04o}"


@pytest.mark.parametrize("args,extra_env,code,message", [
    (["--api-key-env", "MY_KEY_TYPO"], {}, 78, "--api-key-env MY_KEY_TYPO: that variable is not set"),
    (["--api-key-env", "EMPTY_KEY"], {"EMPTY_KEY": ""}, 78, "that variable is empty"),
    (["--host", "0.0.0.0"], {}, 78, "rank 0 would listen on 0.0.0.0 without an API key"),
    (["--host", "0.0.0.0", "--api-key-env", "K", "--no-api-key"], {"K": "x"}, 2, "contradict"),
    (["--host", "not an ip;rm"], {}, 2, "is not an IP address or host name"),
    (["--port", "70000"], {}, 2, "--port"),
    (["--api-keys-file", "{loose}"], {}, 78, "is readable by others"),
    (["--api-keys-file", "{keys}", "--no-api-key"], {}, 2, "contradict"),
    (["--api-keys-file", "{missing}"], {}, 66, "not found"),
])
def test_launch_refuses_an_open_api_by_mistake_before_anything_starts(tmp_path, tiny, env, args, extra_env, code,
                                                                     message):
    dep = _plan(tmp_path, tiny, env)
    clean = {k: v for k, v in os.environ.items() if k != "CLUSTERCTL_API_KEY"}
    paths = {"loose": _keys_file(tmp_path, 0o644), "missing": str(tmp_path / "nope.keys")}
    paths["keys"] = _keys_file(tmp_path)
    args = [a.format(**paths) for a in args]
    p = subprocess.run([sys.executable, "-m", "clusterctl", "launch", dep, "--detach", "--timeout", "40", *args],
                       capture_output=True, text=True, env={**clean, **env, **extra_env}, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == code, p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "state" / "launches").exists() or not list((tmp_path / "state" / "launches").iterdir())
    assert not (tmp_path / "run-a").exists() and not (tmp_path / "run-b").exists()


def test_an_open_api_beyond_loopback_is_served_only_when_asked_for(tmp_path, tiny, env):
    import urllib.request

    dep = _plan(tmp_path, tiny, env)
    p = cli("launch", dep, "--detach", "--json", "--timeout", "180", "--host", "0.0.0.0", "--no-api-key", env=env)
    assert p.returncode == 0, p.stderr
    try:
        port = int(json.loads(p.stdout)["endpoint"].rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert r.status == 200
        # a replan that would relaunch it beyond loopback without a key stops before the old job does
        clean = {k: v for k, v in os.environ.items() if k != "CLUSTERCTL_API_KEY"}
        rp = subprocess.run([sys.executable, "-m", "clusterctl", "replan", dep, "--context", "256", "--yes"],
                            capture_output=True, text=True, env={**clean, **env}, timeout=120, stdin=subprocess.DEVNULL)
        assert rp.returncode == 78 and "without an API key" in rp.stderr, rp.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert r.status == 200  # the old job still serves
    finally:
        td = cli("teardown", "--force", "--json", env=env)
    assert td.returncode == 0, td.stderr
