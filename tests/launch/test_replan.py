"""replan against real running deployments (local ranks; one over SSH): preview, apply, busy refusal,
unchanged short-circuit, node removal and addition, a path or schedule change (a new deployment, the ranks
restart), a missing model folder refused before anything stops, a failed new launch, history and rollback.

Launches are what these tests cost (each rank imports mlx and loads its layers; a replan stops and relaunches), so
the refusals that change nothing share one launched deployment (``running``), and a test that launches anyway
carries the checks that fit its launch (busy and drain in the preview test, the adapter in the schedule test)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from launchutil import cli, fill_disk, local_cluster, manifests, processes_with_nonce

pytestmark = pytest.mark.slow


def _plan(tmp_path, tiny, env, mems=(2, 6), allocation="proportional", extra=None, context=512,
          adapter: Path | None = None) -> Path:
    c = local_cluster(tmp_path, mems, extra=extra)
    out = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny), "--allocation", allocation, "--context", str(context), "-o",
        str(out), "-q", *(("--adapter", str(adapter)) if adapter else ()), env=env, check=True)
    return out


def _launch(dep, env) -> dict:
    p = cli("launch", str(dep), "--detach", "--json", "--timeout", "180", env=env)
    assert p.returncode == 0, p.stderr
    [m] = manifests(Path(env["CLUSTERCTL_STATE_DIR"]))
    return m


def _job(env) -> dict:
    [m] = manifests(Path(env["CLUSTERCTL_STATE_DIR"]))
    return m


def _layers(m) -> list:
    return [(r["node"], r["start_layer"], r["end_layer"]) for r in m["ranks"]]


def _ask(endpoint: str) -> str:
    import urllib.request

    req = urllib.request.Request(endpoint + "/v1/completions", data=json.dumps(
        {"prompt": "def main(argv):", "max_tokens": 6, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _verify_id(path: Path, env: dict) -> str:
    p = cli("verify", str(path), "--json", env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["deployment_id"]


def _load(path: Path, env: dict):
    from clusterctl.statedir.state import StateDir

    return StateDir(env["CLUSTERCTL_STATE_DIR"]).load_deployment(str(path))[1].deployment


def teardown(env):
    td = cli("teardown", "--force", "--json", env=env)
    assert td.returncode == 0, td.stderr


def test_preview_then_apply_an_allocation_change_busy_refuses_drain_applies_then_go_back(tmp_path, tiny, env):
    """A preview (exit 3) touches nothing; while a request runs, `--yes` is refused (exit 75) with the active
    counts and nothing stops; once its client leaves, the same replan with --drain applies (the dropped request
    no longer counts); the new split serves the same greedy answer; --to goes back. (The busy and drain checks were
    test_busy_refuses_with_the_active_counts_and_drain_waits, on a launch of its own.)"""
    import http.client

    dep = _plan(tmp_path, tiny, env, context=4096)  # room for a long request (rank 0 refuses beyond the context)
    old = _launch(dep, env)
    old_bytes = dep.read_bytes()
    host, port = old["endpoint"].rsplit("/", 1)[-1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        answer = _ask(old["endpoint"])
        # not a terminal and no --yes: a preview, exit 3, nothing touched
        p = cli("replan", str(dep), "--allocation", "balanced", "--json", env=env)
        assert p.returncode == 3, p.stderr
        doc = json.loads(p.stdout)
        assert doc["action"] == "previewed" and doc["given"] == {"allocation": "balanced"}
        assert {"nodes", "backend", "path_map", "context", "batch", "model"} <= set(doc["derived"])
        rows = {r["node"]: r for r in doc["diff"]["nodes"]}
        assert rows["a"]["layers_before"] == [6, 8] and rows["a"]["layers_after"] == [4, 8]
        assert doc["diff"]["plan_hash_before"] != doc["diff"]["plan_hash_after"]
        assert dep.read_bytes() == old_bytes and _job(env)["job_id"] == old["job_id"]
        assert sorted(processes_with_nonce(old["nonce"])) == sorted(r["pid"] for r in old["ranks"])

        # busy: a request generating (its first token streamed) refuses the replan; nothing stops or changes
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "def main(argv):", "max_tokens": 3000, "temperature": 0, "stream": True}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.readline().startswith(b"data: ")
        p = cli("replan", str(dep), "--allocation", "balanced", "--yes", env=env)
        assert p.returncode == 75, p.stderr
        assert "busy" in p.stderr and "1 active request" in p.stderr
        assert dep.read_bytes() == old_bytes and _job(env)["job_id"] == old["job_id"]
        assert sorted(processes_with_nonce(old["nonce"])) == sorted(r["pid"] for r in old["ranks"])
        r.close()
        conn.close()  # the client leaves: its request is dropped; a drain now finds the ranks idle

        p = cli("replan", str(dep), "--allocation", "balanced", "--yes", "--drain", "20", "--json", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["action"] == "applied" and doc["job_id"] != old["job_id"]
        new = _job(env)
        assert _layers(new) == [("a", 4, 8), ("b", 0, 4)]
        assert new["endpoint"] == old["endpoint"]  # the same port: clients keep their URL
        assert processes_with_nonce(old["nonce"]) == []
        assert _verify_id(dep, env) == doc["new"] != doc["current"]  # the operator's file now holds the new plan
        assert _ask(new["endpoint"]) == answer  # the same greedy answer from the new split

        h = json.loads(cli("history", str(dep), "--json", env=env, check=True).stdout)["clusters"][0]
        assert h["current"] == doc["new"] and h["entries"][0]["from"] == doc["current"]
        assert any("[6,8)->[4,8)" in c for c in h["entries"][0]["changes"])

        back = cli("replan", str(dep), "--to", doc["current"], "--yes", "--json", env=env)
        assert back.returncode == 0, back.stderr
        assert _layers(_job(env)) == [("a", 6, 8), ("b", 0, 6)] and _verify_id(dep, env) == doc["current"]
        assert len(json.loads(cli("history", "--json", env=env, check=True).stdout)["clusters"][0]["entries"]) == 2
    finally:
        conn.close()
        teardown(env)


def _token_ids(endpoint: str, prompt: str, n: int) -> list[int]:
    import urllib.request

    req = urllib.request.Request(endpoint + "/v1/completions", data=json.dumps(
        {"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _contract(m: dict, node: str) -> dict:
    """What the rank on ``node`` was told to run (its signed contract's spec)."""
    return json.loads(next(Path(r["contract_path"]) for r in m["ranks"] if r["node"] == node).read_text())["spec"]


def test_a_path_map_change_is_a_new_deployment_the_ranks_restart_with_and_the_map_is_carried_after(tmp_path, tiny,
                                                                                                   env):
    """Issue 30: a --path-map change was "unchanged" (same id, the old record overwritten, nothing restarted, so
    the ranks ran the old path until some later launch). Now the ranks restart on the new folder under a new id."""
    dep = _plan(tmp_path, tiny, env)
    old = _launch(dep, env)
    old_id, old_bytes = _verify_id(dep, env), dep.read_bytes()
    copy = tmp_path / "copy-of-model"
    shutil.copytree(tiny, copy)
    try:
        p = cli("replan", str(dep), "--path-map", f"a={copy}", "--yes", "--json", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["action"] == "applied" and doc["diff"]["fields_changed"] == ["path_map"]
        assert doc["paths_checked"] == [f"a={copy}"] and doc["new"] != old_id
        new = _job(env)
        assert new["job_id"] != old["job_id"] and processes_with_nonce(old["nonce"]) == []
        assert _contract(new, "a")["model_path"] == str(copy)  # the ranks run from the new folder
        assert _load(dep, env).path_map["a"] == str(copy) and _ask(new["endpoint"])
        # the old deployment is kept as it was
        state = Path(env["CLUSTERCTL_STATE_DIR"])
        assert (state / "deployments" / f"{old_id}.json").read_bytes() == old_bytes
        # a later replan derives that path_map (and says so), and the new ranks use it
        p = cli("replan", str(dep), "--allocation", "balanced", "--yes", "--json", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert f"a={copy}" in doc["derived"]["path_map"] and doc["paths_checked"] == []
        assert _contract(_job(env), "a")["model_path"] == str(copy)
        # nothing to do at all: exit 0, "unchanged", no file written
        before = dep.read_bytes()
        p = cli("replan", str(dep), "--json", env=env)
        assert p.returncode == 0 and json.loads(p.stdout)["action"] == "unchanged", p.stderr
        assert dep.read_bytes() == before
    finally:
        teardown(env)


def test_a_schedule_change_restarts_the_ranks_under_a_new_id_carries_the_adapter_and_the_way_back_is_kept(
        tmp_path, tiny, env):
    """Issue 30: `replan --schedule lockstep --yes` exited 0, restarted nothing and overwrote the old record
    (the id did not cover the schedule), so `--to` the old id was a no-op.
    The deployment carries a LoRA adapter (plan --adapter): its 2 ranks answer as one
    ``mlx_lm.load(model, adapter_path=...)`` process before the replan, after it (the same adapter content on the
    new deployment's ranks) and after the way back. (The adapter checks were
    test_an_adapter_deployment_serves_the_adapter_and_a_replan_carries_it, on a launch of its own.)"""
    from adaptermodels import adapted_tokens, build_adapter

    adapter = build_adapter(tiny, tmp_path / "lora", num_layers=6)
    want = adapted_tokens(tiny, adapter, "def main(argv):", 8)
    dep = _plan(tmp_path, tiny, env, adapter=adapter)
    old = _launch(dep, env)
    old_id, old_bytes = _verify_id(dep, env), dep.read_bytes()
    assert _contract(old, "a")["schedule"] == "overlap"
    try:
        assert {_contract(old, n)["adapter_path"] for n in "ab"} == {str(adapter)}
        planned = _contract(old, "b")["adapter_hash"]
        assert _token_ids(old["endpoint"], "def main(argv):", 8) == want
        p = cli("replan", str(dep), "--schedule", "lockstep", "--yes", "--json", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["action"] == "applied" and doc["new"] != old_id and "schedule" in doc["diff"]["fields_changed"]
        new = _job(env)
        assert new["deployment_id"] == doc["new"] and processes_with_nonce(old["nonce"]) == []
        assert {_contract(new, n)["schedule"] for n in "ab"} == {"lockstep"}
        assert _contract(new, "b")["adapter_hash"] == planned
        assert _token_ids(new["endpoint"], "def main(argv):", 8) == want
        state = Path(env["CLUSTERCTL_STATE_DIR"])
        assert (state / "deployments" / f"{old_id}.json").read_bytes() == old_bytes
        h = json.loads(cli("history", str(dep), "--json", env=env, check=True).stdout)["clusters"][0]
        assert "schedule overlap->lockstep" in h["entries"][-1]["changes"]
        # the same again: nothing to do, nothing restarted
        p = cli("replan", str(dep), "--schedule", "lockstep", "--yes", env=env)
        assert p.returncode == 0 and f"unchanged: deployment {doc['new']} already has these options" in p.stderr, p.stderr
        assert "nothing to do" in p.stderr and _job(env)["job_id"] == new["job_id"]
        # the way back: exactly the old deployment, overlapped again, the same answer
        p = cli("replan", str(dep), "--to", old_id, "--yes", "--json", env=env)
        assert p.returncode == 0, p.stderr
        assert dep.read_bytes() == old_bytes
        back = _job(env)
        assert back["deployment_id"] == old_id and _contract(back, "b")["schedule"] == "overlap"
        assert _token_ids(back["endpoint"], "def main(argv):", 8) == want
    finally:
        teardown(env)


def test_three_to_two_nodes_and_back_with_speeds_carried(tmp_path, tiny, env):
    speeds = {"a": {"speed": 10.0}, "b": {"speed": 10.0}, "c": {"speed": 20.0}}
    dep = _plan(tmp_path, tiny, env, mems=(2, 2, 4), allocation="speed", extra=speeds)
    _launch(dep, env)
    try:
        assert _layers(_job(env)) == [("a", 6, 8), ("b", 4, 6), ("c", 0, 4)]
        p = cli("replan", str(dep), "--nodes", "a,c", "--yes", "--json", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert {r["node"]: r["change"] for r in doc["diff"]["nodes"]}["b"] == "leaves"
        assert _layers(_job(env)) == [("a", 5, 8), ("c", 0, 5)]  # 10:20 of 8 layers
        # back to three from a cluster file without speeds: the measured speeds are carried by name
        (tmp_path / "bare").mkdir()
        bare = local_cluster(tmp_path / "bare", (2, 2, 4))
        p = cli("replan", str(dep), "-c", str(bare), "--yes", "--json", env=env)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["derived"]["speeds"] == "a=10,b=10,c=20"
        assert {r["node"]: r["change"] for r in doc["diff"]["nodes"]}["b"] == "joins"
        assert [n for n, _, _ in _layers(_job(env))] == ["a", "b", "c"]
    finally:
        teardown(env)


def test_a_new_plan_that_cannot_launch_leaves_the_old_one_relaunchable(tmp_path, tiny, env):
    dep = _plan(tmp_path, tiny, env)
    old = _launch(dep, env)
    old_id = _verify_id(dep, env)
    # a runtime dir under a regular file: only the relaunch's own preflight finds it (the old job still runs)
    (tmp_path / "bad").mkdir()
    (tmp_path / "a-file").write_text("")
    bad = local_cluster(tmp_path / "bad", (2, 6))
    bad.write_text(bad.read_text().replace(f"{tmp_path}/bad/run-a", f"{tmp_path}/a-file/run"))
    try:
        p = cli("replan", str(dep), "-c", str(bad), "--allocation", "balanced", "--yes", env=env)
        assert p.returncode != 0
        assert "did not launch" in p.stderr and f"--to {old_id}" in p.stderr
        assert processes_with_nonce(old["nonce"]) == []  # the old job was stopped, verified
        assert manifests(Path(env["CLUSTERCTL_STATE_DIR"])) == []
        back = cli("launch", old_id, "--detach", "--json", "--timeout", "180", env=env)  # the one-command way back
        assert back.returncode == 0, back.stderr
        assert _layers(_job(env)) == [("a", 6, 8), ("b", 0, 6)]
    finally:
        teardown(env)


@pytest.fixture(scope="module")
def running(tmp_path_factory, tiny):
    """One launched deployment (2 local ranks) for the tests whose replan is refused before anything stops: each
    checks that the job, its ranks, the deployment file and the state dir's records are as they were, and leaves
    them so. Its deployment file is on a 256 KiB tmpfs when one can be mounted here (the full-disk test fills it,
    then empties it again); ``mount_error`` says why not otherwise."""
    root = tmp_path_factory.mktemp("running")
    env = {"CLUSTERCTL_STATE_DIR": str(root / "state")}
    small = root / "small"
    small.mkdir()
    mount_error = "mounting a small tmpfs needs root" if os.geteuid() != 0 else None
    if mount_error is None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True,
                           text=True)
        mount_error = f"cannot mount a tmpfs here: {r.stderr.strip()}" if r.returncode else None
    try:
        dep = small / "dep.json"
        shutil.move(str(_plan(root, tiny, env)), dep)
        yield SimpleNamespace(root=root, env=env, dep=dep, small=small, mount_error=mount_error, job=_launch(dep, env))
    finally:
        try:
            teardown(env)
        finally:
            if mount_error is None:
                subprocess.run(["umount", "-l", str(small)], capture_output=True)


def _as_launched(running) -> None:
    """The shared job still runs as launched: the same job, the same rank processes, and it answers."""
    m = running.job
    assert _job(running.env)["job_id"] == m["job_id"]
    assert [r["pid"] for r in _job(running.env)["ranks"]] == [r["pid"] for r in m["ranks"]]
    assert sorted(processes_with_nonce(m["nonce"])) == sorted(r["pid"] for r in m["ranks"])
    assert _ask(m["endpoint"])


def test_a_path_map_to_a_missing_folder_is_refused_before_anything_stops(tmp_path, running):
    dep, env = running.dep, running.env
    before = dep.read_bytes()
    state = Path(env["CLUSTERCTL_STATE_DIR"])
    files = sorted(p.name for p in (state / "deployments").iterdir())
    p = cli("replan", str(dep), "--allocation", "balanced", "--path-map", f"a={tmp_path}/no-model-here",
            "--yes", env=env)
    assert p.returncode == 69, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"{tmp_path}/no-model-here does not exist" in errors[0], p.stderr
    assert "nothing was changed" in errors[0] and "Traceback" not in p.stderr
    assert dep.read_bytes() == before and sorted(q.name for q in (state / "deployments").iterdir()) == files
    assert _job(env)["job_id"] == running.job["job_id"]
    assert sorted(processes_with_nonce(running.job["nonce"])) == sorted(r["pid"] for r in running.job["ranks"])
    p = cli("replan", str(dep), "--path-map", "a=models/m", "--yes", env=env)  # not even a path
    assert p.returncode == 2 and "not NODE=/absolute/path" in p.stderr, p.stderr
    assert dep.read_bytes() == before
    _as_launched(running)


def test_a_full_disk_under_the_deployment_file_stops_the_replan_before_the_old_job_does(running):
    """The new file is written (and fsynced) beside the old one before anything stops; on a full disk the replan
    ends there with one line, exit 73, the old file byte-identical and the old job still serving."""
    if running.mount_error:
        pytest.skip(running.mount_error)
    dep, small = running.dep, running.small
    before = dep.read_bytes()
    filler = fill_disk(small)
    try:
        p = cli("replan", str(dep), "--allocation", "balanced", "--yes", env=running.env)
        assert p.returncode == 73, p.stderr
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "No space left" in errors[0] and "Traceback" not in p.stderr, p.stderr
        assert dep.read_bytes() == before
        assert sorted(q.name for q in small.iterdir()) == ["dep.json", "filler"]  # no temp file left
        _as_launched(running)
    finally:
        filler.unlink()  # the shared deployment's folder as it was
