"""`clusterctl status DEPLOYMENT --watch` in a real terminal (tmux): the table is redrawn in place while requests
run, Ctrl-C ends it with exit 0; with --json one JSON line per refresh."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from launchutil import cli, local_cluster, manifests, start_cli

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux drives the terminal (apt-get install tmux)")]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def _screen(session: str) -> str:
    return _tmux("capture-pane", "-p", "-t", session)


def _wait_screen(session: str, ok, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _screen(session)
        if ok(text):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.2)


def _requests(endpoint: str, stop: threading.Event) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0)
    while not stop.is_set():
        for _ in client.completions.create(model="default_model", prompt="def main(argv):", max_tokens=48, temperature=0,
                                           stream=True):
            pass


def test_status_watch_in_a_terminal_and_as_json_lines(tmp_path, tiny, env):
    c = local_cluster(tmp_path, (2, 6))
    dep = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "512", "-o", str(dep), "-q", env=env, check=True)
    p = cli("launch", str(dep), "--detach", "--json", "--timeout", "180", env=env)
    assert p.returncode == 0, p.stderr
    endpoint = json.loads(p.stdout)["endpoint"]
    session = f"watch{os.getpid()}"
    stop = threading.Event()
    load = threading.Thread(target=_requests, args=(endpoint, stop), daemon=True)
    try:
        load.start()
        environ = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        cmd = (f"env -u COLUMNS -u LINES {environ} {shlex.quote(sys.executable)} -m clusterctl status {shlex.quote(str(dep))} --watch "
               f"--interval 0.5; echo EXIT=$?; sleep 600")
        _tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "40", cmd)
        _tmux("resize-window", "-t", session, "-x", "200", "-y", "40")
        # the table, redrawn: both ranks serving, rank 0 decoding (its batch, tokens per second)
        rank0 = re.compile(r"^\s*0\s+a\s+serving\s+\[\d+, \d+\)\s+(\d+)\s+(\d+)\s+([0-9.]+)\s", re.M)

        def decoding(text: str) -> bool:
            m = rank0.search(text)
            return text.count("serving") >= 2 and m is not None and float(m.group(3)) > 0

        screen = _wait_screen(session, decoding)
        assert "RANK" in screen and "LADDER" in screen and "CACHE" in screen
        rows = [ln for ln in screen.splitlines() if re.match(r"^\s*[01]\s+[ab]\s", ln)]
        assert len(rows) == 2, screen  # in place: one row per rank, not one table per refresh
        first = _screen(session)
        time.sleep(1.2)
        assert _screen(session) != first  # the clock in the title and the numbers move
        _tmux("send-keys", "-t", session, "C-c")
        screen = _wait_screen(session, lambda s: "EXIT=" in s)
        assert "EXIT=0" in screen and "Traceback" not in screen, screen
        # --json: one JSON line per refresh, for scripts; SIGINT ends it with exit 0
        w = start_cli("status", str(dep), "--watch", "--json", "--interval", "0.3", env=env)
        deadline = time.monotonic() + 60
        lines: list[str] = []

        def moved(line: str) -> bool:
            return bool(line.strip()) and any(r["tok_s"] for r in json.loads(line)["jobs"][0]["ranks"])

        # the refreshes as they come, one line each, until rank 0's token count moved between two of them (a
        # marker is rewritten between steps: under load two looks 0.3 s apart can both see the same count)
        while (len(lines) < 4 or not any(moved(ln) for ln in lines[1:])) and time.monotonic() < deadline:
            lines.append(w.stdout.readline())
        os.killpg(w.pid, signal.SIGINT)
        out, err = w.communicate(timeout=30)
        assert w.returncode == 0, err
        docs = [json.loads(line) for line in "".join(lines + [out]).splitlines()]
        assert len(docs) >= 4 and all(d["event"] == "status" for d in docs)
        ranks = docs[-1]["jobs"][0]["ranks"]
        assert [r["state"] for r in ranks] == ["serving", "serving"]
        assert all(r["rss_bytes"] and r["step_s"] for r in ranks) and ranks[0]["tokens_out"] > 0
        assert any(r["tok_s"] for d in docs[1:] for r in d["jobs"][0]["ranks"])
        assert ranks[0]["prompt_cache"] and ranks[0]["prompt_cache"][2] > 0
    finally:
        stop.set()
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        load.join(60)
        td = cli("teardown", str(dep), "--force", env=env)
        assert td.returncode == 0, td.stderr
    assert not [m for m in manifests(tmp_path / "state") if m.get("state") not in (None, "stopped")]


def _status(dep, env) -> dict:
    [job] = json.loads(cli("status", str(dep), "--json", env=env, check=True).stdout)["jobs"]
    return job


def _wait_status(dep, env, ok, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = _status(dep, env)
        if ok(job):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.3)


def test_a_narrow_watch_shows_rank_node_state_and_a_dead_rank_is_dead(tmp_path, tiny, env):
    """At 20 columns the live view keeps RANK, NODE and STATE (it once showed only "…"); a rank that stops
    answering is `lost` once its heartbeat is stale, and `dead` once its process is gone, while the job's
    manifest still says ready."""
    c = local_cluster(tmp_path, (2, 6))
    dep = tmp_path / "dep.json"
    cli("plan", "-c", str(c), "-m", str(tiny), "--context", "512", "-o", str(dep), "-q", env=env, check=True)
    p = cli("launch", str(dep), "--detach", "--json", "--timeout", "180", env=env)
    assert p.returncode == 0, p.stderr
    [m] = manifests(tmp_path / "state")
    pid1 = m["ranks"][1]["pid"]
    session = f"narrow{os.getpid()}"
    try:
        environ = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        cmd = (f"env -u COLUMNS -u LINES {environ} {shlex.quote(sys.executable)} -m clusterctl status "
               f"{shlex.quote(str(dep))} --watch --interval 0.5; echo EXIT=$?; sleep 600")
        _tmux("new-session", "-d", "-s", session, "-x", "20", "-y", "12", cmd)
        _tmux("resize-window", "-t", session, "-x", "20", "-y", "12")
        rows = {r: re.compile(rf"^{r}\s+{n}\s+(\S+)\s*$", re.M) for r, n in ((0, "a"), (1, "b"))}

        def both(state: str):
            return lambda s: all((x := rows[r].search(s)) and x.group(1) == state for r in (0, 1))

        screen = _wait_screen(session, both("serving"))
        assert re.search(r"^RANK\s+NODE\s+STATE\s*$", screen, re.M), screen
        assert screen.splitlines()[0].startswith("ready"), screen  # the title's short form: the job state first
        assert all(len(ln) <= 20 for ln in screen.splitlines()), screen
        # SIGSTOP: the process lives, its heartbeat stops: lost (the marker still says serving)
        os.kill(pid1, signal.SIGSTOP)
        job = _wait_status(dep, env, lambda j: j["ranks"][1]["state"] == "lost", timeout=20)
        r1 = job["ranks"][1]
        assert (r1["marker_state"], r1["process"], r1["stale"]) == ("serving", "alive", True), r1
        assert job["state"] == "ready" and job["ranks_down"] >= 1
        # SIGKILL: the process is gone: dead, at once (no heartbeat age to wait for)
        os.kill(pid1, signal.SIGKILL)
        job = _wait_status(dep, env, lambda j: j["ranks"][1]["state"] == "dead", timeout=10)
        assert job["ranks"][1]["process"] == "dead" and job["state"] == "ready"
        screen = _wait_screen(session, lambda s: (x := rows[1].search(s)) is not None and x.group(1) == "dead")
        assert "…" not in "\n".join(screen.splitlines()[1:4]), screen
        table = cli("status", str(dep), env={**env, "COLUMNS": "200"})
        assert table.returncode == 0 and re.search(r"^1\s+b\s+\S+\s+\d+\s+dead\s", table.stderr, re.M), table.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid1, signal.SIGCONT)
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        td = cli("teardown", str(dep), "--force", env=env)
        assert td.returncode == 0, td.stderr
    assert manifests(tmp_path / "state") == []
