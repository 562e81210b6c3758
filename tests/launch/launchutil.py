"""Test helpers for launches: local clusters of real ranks, and hand-made jobs of ordinary processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def local_cluster(tmp: Path, mems=(2, 6), *, extra: dict | None = None) -> Path:
    lines = ["[cluster]", 'name = "t"']
    for i, m in enumerate(mems):
        name = "abcdefgh"[i]
        lines += ["[[node]]", f'name = "{name}"', "local = true", f"memory_gb = {m}",
                  f'runtime_dir = "{tmp}/run-{name}"']
        for k, v in ((extra or {}).get(name) or {}).items():
            lines.append(f"{k} = {json.dumps(v)}")
    p = tmp / "cluster.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def cli(*args: str, env: dict | None = None, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
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
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive
