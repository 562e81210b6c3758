"""Test-only: start N real rank processes on this machine, each with its own hostfile on fresh loopback ports.

This stands in for the launcher in rank tests only (the real supervisor belongs to the launcher): it writes
UNSIGNED specs (``--spec`` behind CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS=1), starts each rank in its own session,
waits on the markers, creates the gate file, and tears everything down (TERM, then KILL of each process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from clusterctl.errors import IntegrityError
from clusterctl.protocol.runtimefiles import Marker, read_marker
from clusterctl.protocol.rankspec import layer_range

PY = sys.executable


if str(Path(__file__).resolve().parents[1]) not in sys.path:  # bench scripts put only tests/launch on the path
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from testports import free_ports  # noqa: E402,F401  (this worker's own ports: tests/testports.py)
from slowguard import require_slow  # noqa: E402  (a test that starts ranks is marked slow: tests/slowguard.py)


class RankCluster:
    def __init__(self, root: Path, model_path: Path, layer_counts: list[int], *, api_key: str | None = None,
                 lease_seconds: float | None = None, env: dict | None = None, spec_env: dict | None = None,
                 overrides: dict | None = None, per_rank: dict[int, dict] | None = None, tag: str = "t",
                 tensor: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model_path = Path(model_path)
        self.layer_counts = list(layer_counts)
        self.world = len(layer_counts)
        self.api_key = api_key
        self.env = env or {}
        self.spec_env = spec_env or {}
        self.overrides = overrides or {}
        self.per_rank = per_rank or {}
        self.tag = tag
        ring = free_ports(self.world + 1)
        self.http_port = ring.pop()
        self.ring_ports = ring
        self.gate = self.root / "gate"
        self.lease = self.root / "job.lease" if lease_seconds else None
        self.lease_seconds = lease_seconds or 30.0
        self.procs: list[subprocess.Popen] = []
        self.tensor = tensor  # tensor parallel: layer_counts is [L] * world, every rank runs every layer
        self.num_layers = layer_counts[0] if tensor else sum(layer_counts)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def marker_path(self, r: int) -> Path:
        return self.root / f"dep-rank{r}.json"

    def log_path(self, r: int) -> Path:
        return self.root / f"rank{r}.log"

    def spec(self, r: int) -> dict:
        start, end = (0, self.num_layers) if self.tensor else layer_range(self.layer_counts, r)
        hostfile = None
        if self.world > 1:
            hostfile = str(self.root / f"hostfile-rank{r}.json")
            Path(hostfile).write_text(json.dumps([[f"127.0.0.1:{p}"] for p in self.ring_ports]))
        spec = dict(
            deployment_id="dep", job_id=f"job-{self.tag}", nonce=f"nonce-{self.tag}", node=f"node{r}", rank=r,
            world_size=self.world, backend="ring", model_path=str(self.model_path), start_layer=start,
            end_layer=end, num_layers=self.num_layers, hostfile=hostfile,  # its own range, as launch writes it
            http_port=self.http_port if r == 0 else None, api_key=self.api_key if r == 0 else None, seed=7,
            runtime_dir=str(self.root), marker_path=str(self.marker_path(r)), gate_path=str(self.gate),
            lease_path=str(self.lease) if self.lease else None, lease_seconds=self.lease_seconds,
            max_tokens_default=16, env=dict(self.spec_env), parallel="tensor" if self.tensor else "pipeline",
        )
        spec.update(self.overrides)
        spec.update(self.per_rank.get(r, {}))
        return spec

    def start(self, *, ranks: list[int] | None = None) -> "RankCluster":
        require_slow(f"{self.world} real rank(s) (RankCluster)")
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("MLX_", "JACCL_")):
                del env[k]
        env.update(self.env)
        env["CLUSTERCTL_UNSIGNED_SPEC_FOR_TESTS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        for r in ranks if ranks is not None else range(self.world):
            for stale in (self.gate, self.marker_path(r)):
                stale.unlink(missing_ok=True)
            path = self.root / f"spec-rank{r}.json"
            path.write_text(json.dumps(self.spec(r)))
            log = open(self.log_path(r), "wb")
            self.procs.append(subprocess.Popen(
                [PY, "-m", "clusterctl.rank", "--spec", str(path)], env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        return self

    def marker(self, r: int) -> Marker | None:
        try:
            return read_marker(self.marker_path(r))
        except IntegrityError:
            return None

    def wait_state(self, state: str, timeout: float = 60.0, ranks: list[int] | None = None) -> list[Marker]:
        deadline = time.monotonic() + timeout
        ranks = list(range(self.world)) if ranks is None else ranks
        while True:
            ms = [self.marker(r) for r in ranks]
            if all(m is not None and m.state == state for m in ms):
                return ms
            for r in ranks:
                p = self.procs[r]
                if p.poll() is not None:
                    raise AssertionError(f"rank {r} exited {p.returncode} waiting for {state}:\n{self.logs(r)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timeout waiting for {state}: {[m and m.state for m in ms]}\n"
                                     + "\n".join(self.logs(r) for r in ranks))
            time.sleep(0.05)

    def open_gate(self) -> None:
        self.gate.write_text("go\n")

    def up(self, timeout: float = 90.0) -> "RankCluster":
        self.start()
        self.wait_state("ready", timeout)
        self.open_gate()
        self.wait_state("serving", timeout)
        return self

    def renew_lease(self, seq: int, duration: float | None = None) -> None:
        from clusterctl.protocol.runtimefiles import Lease, write_lease

        write_lease(self.lease, Lease(holder="harness", seq=seq, duration_s=duration or self.lease_seconds))

    def logs(self, r: int) -> str:
        try:
            return f"--- rank {r} log ---\n" + self.log_path(r).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_exit(self, r: int, timeout: float = 30.0) -> int:
        try:
            return self.procs[r].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {r} still running after {timeout} s\n{self.logs(r)}") from None

    def signal(self, r: int, sig: int) -> None:
        self.procs[r].send_signal(sig)

    def stop(self, timeout: float = 20.0) -> list[int | None]:
        """TERM every rank, wait, then KILL each process group that is left."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is not None:
                continue  # reaped: its pid and group id may belong to someone else now
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        return [p.returncode for p in self.procs]

    def __enter__(self) -> "RankCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- the shared tiny model (built once, reused across sessions from the repo's ignored .cache/)

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO / ".cache" / "tiny-model-test"


def tiny_model_path() -> Path:
    from clusterctl.modelfiles import tiny

    return tiny.build(TINY_MODEL_DIR)


def reference_tokens(model_path: Path, prompt: str, max_tokens: int, *, temperature: float = 0.0,
                     seed: int = 0, **generate) -> list[int]:
    """One process, plain mlx-lm: the tokens ``mlx_lm.stream_generate`` produces (EOS excluded); ``generate``:
    more of its arguments (kv_bits, kv_group_size, quantized_kv_start). Computed once per test process for the
    same model, prompt and sampling (a module's tests run once per cluster param and ask for the same answers):
    a run of n tokens answers any max_tokens <= n (tokens do not depend on max_tokens), and one that ended at EOS
    before its max_tokens answers any max_tokens."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    key = (str(model_path), prompt, temperature, seed, repr(sorted(generate.items())))
    done = _ANSWERS.get(key)
    if done is not None and (done[1] or len(done[0]) >= max_tokens):
        return done[0][:max_tokens]
    model, tok = _loaded(str(model_path))
    mx.random.seed(seed)
    out, eos = [], False
    for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(temperature),
                             **generate):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            eos = True
            break
        out.append(r.token)
    _ANSWERS[key] = (out, eos)
    return list(out)


_CACHE: dict = {}
_ANSWERS: dict = {}  # reference_tokens' answers: (model, prompt, sampling) -> (tokens, ended at EOS)


def _loaded(path: str):
    from mlx_lm import load

    if path not in _CACHE:
        _CACHE[path] = load(path)
    return _CACHE[path]


def complete(c: "RankCluster", prompt: str, max_tokens: int, *, timeout: float = 300) -> dict:
    """A greedy completion from rank 0 of ``c`` with its token ids: the choice (text, token_ids, ...)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=timeout)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}))
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 200, out
    return out["choices"][0]
