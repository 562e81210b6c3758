"""Operations that run ON a node. The coordinator reaches local and remote nodes the same way, through the
transport, so the code that signals processes is the same everywhere and always runs next to the processes (and
judges ages on the node's own clock).

Two ways in: ``python -m clusterctl.node.nodeops session`` (what the coordinator uses: one process per node for
a whole command, JSON lines ``{"id", "op", "req"}`` in and ``{"id", "answer"|"error"}`` out, each request parsed
into its op's request model and answered with its answer model (protocol/nodeops.py), each on its own thread,
so one SSH channel and one Python start-up serve every step of a launch or a teardown), or
``python -m clusterctl.node.nodeops OP`` with one JSON request on stdin and one answer on stdout.

OPs: probe (preflight facts), stop (identity-checked TERM/KILL of given processes), kill_group (SIGKILL a keeper's
group, its leader checked), sweep (stop what a job's markers recorded), spawn (start a detached rank), canary (a
short greedy request to rank 0), clean (remove a job's files), markers (read a job's markers), warm (import what the
next requests need), wait_markers (wait until markers reach a state), read / write (a small file; atomic write),
tail (a log's end), model_status (is the model copy here the planned one), model_prepare (create the folder a sync
writes into), fetch (download model files from an HTTP mirror); the marker ops live in markerops.py, the model ops
in modelops.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from clusterctl.atomic import atomic_write_bytes, private_dirs, read_capped, unsafe_folder
from clusterctl.errors import ClusterctlError, pydantic_line
from clusterctl.protocol.identity import Identity
from clusterctl.protocol.nodeops import (REQUESTS, AliveAnswer, AliveRequest, CanaryAnswer, CanaryRequest, CleanAnswer,
                                        CleanRequest, KillGroupAnswer, KillGroupRequest, ProbeAnswer, ProbeRequest,
                                        ReadAnswer, ReadRequest, RuntimeDirCheck, SpawnAnswer, SpawnRequest,
                                        StopAnswer, StopRequest, SweepRequest, TailAnswer, TailRequest, WarmAnswer,
                                        WarmRequest, WriteAnswer, WriteRequest)
from clusterctl.protocol.runtimefiles import belongs_to_job, is_cancel_or_ack, marker_rank
from clusterctl.protocol.versions import node_versions
from clusterctl.node.keeper import kill_group_if_same
from clusterctl.node.markerops import job_markers, op_markers, op_wait_markers, read_own_json
from clusterctl.node.modelops import copy_state, model_check, op_fetch, op_model_prepare, op_model_status
from clusterctl.node.procs import boot_id, status_of, stop

REQUEST_LIMIT = 64 << 20  # a model manifest of many files travels in the request


def default_runtime_dir() -> str:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return os.path.join(xdg, "clusterctl")
    return f"/tmp/clusterctl-{os.getuid()}"


def _port_free(host: str, port: int) -> bool:
    # A bind without SO_REUSEPORT (ring sockets would bind anyway, so this is what tells a live listener), but
    # with SO_REUSEADDR, as rank 0's HTTP server and the ring bind: connections of a job that just ended linger
    # in TIME_WAIT on its ports, and they do not keep a new listener out.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


def op_probe(req: ProbeRequest) -> ProbeAnswer:
    import psutil

    out = ProbeAnswer(hostname=socket.gethostname(), boot_id=boot_id(), time=time.time(), versions=node_versions(),
                      mem_available=psutil.virtual_memory().available, mem_total=psutil.virtual_memory().total,
                      default_runtime_dir=default_runtime_dir())
    if req.backend:
        try:
            import mlx.core as mx

            out.backend_available = bool(mx.distributed.is_available(req.backend))
        except Exception as e:  # mlx missing or broken: say why
            out.backend_available = False
            out.mlx_error = f"{type(e).__name__}: {e}"[:300]
    if req.model_path:
        out.model = model_check(req.model_path)
        if req.manifest:
            out.copy_check = copy_state(req.manifest, req.model_path, req.verify)
    if req.ports:
        out.ports_busy = [p for p in req.ports if not _port_free(req.bind_host, p)]
    out.runtime_dir = _runtime_dir_check(req.runtime_dir or default_runtime_dir())
    return out


def _runtime_dir_check(rd: str) -> RuntimeDirCheck:
    try:
        private_dirs(rd)
        test = Path(rd) / f".probe-{os.getpid()}"
        test.write_bytes(b"x")
        test.unlink()
        unsafe = unsafe_folder(rd)
        if unsafe:
            return RuntimeDirCheck(path=rd, ok=False, error=unsafe)
        return RuntimeDirCheck(path=rd, ok=True)
    except OSError as e:
        return RuntimeDirCheck(path=rd, ok=False, error=e.strerror or str(e))


def op_stop(req: StopRequest) -> StopAnswer:
    return StopAnswer(results=stop(req.targets, grace=req.grace))


def op_sweep(req: SweepRequest) -> StopAnswer:
    """Stop every process a job's markers recorded, after checking pid, start time AND the job's nonce.

    ``ranks`` (optional): only the markers of these rank numbers (``<job>-rank<r>.json``). Nodes that are one
    machine share a runtime dir, and each node's sweep must signal only its own ranks: a rank takes a second
    SIGTERM as "exit now", which cuts its clients' streams without a last event."""
    only = None if req.ranks is None else {str(r) for r in req.ranks}
    idents = []
    seen = set()
    for path, doc in job_markers(req.runtime_dir, req.job_id):
        if only is not None and marker_rank(path.name, req.job_id) not in only:
            continue  # another node's rank (compared as written: a rank's marker is <job>-rank<r>.json)
        if not doc or doc.get("job_id") != req.job_id or doc.get("nonce") != req.nonce:
            continue  # a marker of another job or deployment is never touched
        ident = Identity.from_marker(doc, req.nonce)
        if ident is None:
            continue  # a garbled marker names no process we could safely signal
        if ident.pid not in seen:
            seen.add(ident.pid)
            idents.append(ident)
    for ident in req.extra:
        if ident.pid not in seen:
            seen.add(ident.pid)
            idents.append(ident)
    return StopAnswer(results=stop(idents, grace=req.grace))


def op_kill_group(req: KillGroupRequest) -> KillGroupAnswer:
    """SIGKILL a keeper's group now, only while its leader is still the process it reported (a keeper that
    outlived its grace: connect/sshnode.py)."""

    return KillGroupAnswer(killed=kill_group_if_same(req.pid, req.pgid, req.start_time, req.boot_id))


def op_alive(req: AliveRequest) -> AliveAnswer:
    """Which of these processes are still ours and running (no signal sent)."""

    return AliveAnswer(status=[status_of(t) for t in req.targets])


def op_clean(req: CleanRequest) -> CleanAnswer:
    """Remove a job's files from the runtime dir (only names that start with the job id)."""

    folder = Path(req.runtime_dir)
    job = req.job_id
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return CleanAnswer(removed=removed)
    for n in names:
        mine = belongs_to_job(n, job)
        if not mine and is_cancel_or_ack(n):  # named by deployment: check whose it is
            doc = read_own_json(folder / n)
            mine = doc is not None and doc.get("job_id") == job
        if mine:
            try:
                os.unlink(folder / n)
                removed.append(n)
            except OSError:
                pass
    return CleanAnswer(removed=removed)


def op_spawn(req: SpawnRequest) -> SpawnAnswer:
    """Start a rank detached from any channel: its own session, output to a log file, stdin from /dev/null."""
    import psutil

    env = {**os.environ, **req.env, "PYTHONUNBUFFERED": "1"}
    log = os.fdopen(os.open(req.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600), "ab",
                    buffering=0)
    try:
        proc = subprocess.Popen(req.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)
    finally:
        log.close()
    return SpawnAnswer(pid=proc.pid, pgid=proc.pid, start_time=psutil.Process(proc.pid).create_time(),
                       boot_id=boot_id())


def op_canary(req: CanaryRequest) -> CanaryAnswer:
    """A short greedy completion against rank 0, from rank 0's own node (it may listen on loopback only)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": req.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if req.api_key:
        headers["Authorization"] = f"Bearer {req.api_key}"
    r = urllib.request.Request(req.url.rstrip("/") + "/v1/completions", data=body, headers=headers)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(r, timeout=req.timeout) as resp:
            doc = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        return CanaryAnswer(ok=False, error=f"canary request failed: {e}")
    tokens = (doc.get("usage") or {}).get("completion_tokens", 0)
    text = ((doc.get("choices") or [{}])[0]).get("text", "")
    return CanaryAnswer(ok=tokens > 0, tokens=tokens, text=text, seconds=time.monotonic() - t0)


def op_read(req: ReadRequest) -> ReadAnswer:
    """A small regular file (not through a symlink), base64 in the answer."""
    import base64

    data = read_capped(req.path, limit=req.limit, what="file")
    return ReadAnswer(data=base64.b64encode(data).decode())


def op_tail(req: TailRequest) -> TailAnswer:
    """The end of a log: its size and its last ``limit`` bytes (O_NOFOLLOW, O_NONBLOCK, regular files only)."""
    import base64

    try:
        fd = os.open(req.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ClusterctlError(f"cannot open {req.path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClusterctlError(f"{req.path} is not a regular file")
        os.lseek(fd, max(0, st.st_size - req.limit), os.SEEK_SET)
        chunks, left = [], req.limit
        while left > 0 and (b := os.read(fd, min(left, 1 << 20))):
            chunks.append(b)
            left -= len(b)
    finally:
        os.close(fd)
    return TailAnswer(size=st.st_size, data=base64.b64encode(b"".join(chunks)).decode())


def op_write(req: WriteRequest) -> WriteAnswer:
    """Replace a file atomically (temp file, fsync, rename), creating its folder."""
    import base64

    data = base64.b64decode(req.data, validate=True)
    atomic_write_bytes(req.path, data, mode=req.mode)
    return WriteAnswer(written=len(data))


WARM_MODULES = frozenset({"psutil", "mlx.core"})


def op_warm(req: WarmRequest) -> WarmAnswer:
    """Import modules the next requests will need (while the coordinator is busy with its own checks)."""
    import importlib

    done, failed = [], {}
    for name in req.modules:
        if name not in WARM_MODULES:
            failed[name[:100]] = "not a module this op imports"
            continue
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as e:  # preflight's probe reports it properly
            failed[name] = f"{type(e).__name__}: {e}"[:300]
    return WarmAnswer(imported=done, failed=failed)


OPS = {"probe": op_probe, "stop": op_stop, "kill_group": op_kill_group, "alive": op_alive, "sweep": op_sweep, "clean": op_clean, "spawn": op_spawn,
       "canary": op_canary, "markers": op_markers, "model_status": op_model_status, "model_prepare": op_model_prepare,
       "fetch": op_fetch, "read": op_read, "tail": op_tail, "write": op_write, "wait_markers": op_wait_markers,
       "warm": op_warm}
assert set(OPS) == set(REQUESTS), "every op has its request model (protocol/nodeops.py)"


class BadRequest(ValueError):
    """A request that is not its op's request model."""


def serve(op: str, req: dict) -> dict:
    """Run op ``op`` on the request object ``req`` (parsed into its model first); its answer object."""
    try:
        parsed = REQUESTS[op].model_validate(req)
    except ValidationError as e:
        raise BadRequest(f"bad request: {pydantic_line(e, op)}") from None
    return OPS[op](parsed).wire()

SESSION_DRAIN_S = 60.0  # after the coordinator went away: how long requests still running may take to finish


def session(stdin=None, stdout=None) -> int:
    """Serve requests, one JSON line each, until stdin ends; each on its own thread, answers in any order."""
    import threading

    stdin = stdin or sys.stdin.buffer
    if stdout is None:
        # answers go to a private copy of fd 1; fd 1 itself becomes stderr, so nothing an op (or a library it
        # imports) prints can corrupt the answer stream
        stdout = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
    out_lock = threading.Lock()

    def answer(doc: dict) -> None:
        line = json.dumps(doc).encode() + b"\n"
        with out_lock:
            stdout.write(line)
            stdout.flush()

    def handle(rid, op: str, req: dict) -> None:
        try:
            answer({"id": rid, "answer": serve(op, req)})
        except BadRequest as e:
            answer({"id": rid, "error": str(e)[:500]})
        except ClusterctlError as e:
            answer({"id": rid, "error": e.message, "kind": type(e).__name__})
        except Exception as e:  # the answer is always a JSON line
            answer({"id": rid, "error": f"{type(e).__name__}: {e}"[:2000]})

    running: list[threading.Thread] = []
    while line := stdin.readline(REQUEST_LIMIT + 1):
        msg = None
        try:
            msg = json.loads(line)
            rid, op, req = msg["id"], msg["op"], msg.get("req", {})
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}")
            if not isinstance(req, dict):
                raise ValueError(f"the request of {op} is not a JSON object")
        except (ValueError, KeyError, TypeError) as e:
            answer({"id": msg.get("id") if isinstance(msg, dict) else None, "error": f"bad request: {e}"[:500]})
            continue
        t = threading.Thread(target=handle, args=(rid, op, req), daemon=True)
        t.start()
        running = [x for x in running if x.is_alive()] + [t]
    deadline = time.monotonic() + SESSION_DRAIN_S
    for t in running:
        t.join(max(0.0, deadline - time.monotonic()))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["session"]:
        return session()
    if len(argv) != 1 or argv[0] not in OPS:
        print(f"usage: python -m clusterctl.node.nodeops {{session,{','.join(OPS)}}} < request.json",
              file=sys.stderr)
        return 2
    try:
        req = json.loads(sys.stdin.buffer.read(REQUEST_LIMIT) or b"{}")
        result = serve(argv[0], req)
    except Exception as e:  # the answer is always one JSON document
        json.dump({"error": f"{type(e).__name__}: {e}"[:2000]}, sys.stdout)
        return 1
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
