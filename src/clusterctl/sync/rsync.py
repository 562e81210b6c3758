"""Run rsync on the coordinator for a sync: argv from ssh_policy, a file list, parsed progress, one-line errors.

The transfer always names the files to send (``--files-from``, from the manifest comparison), so rsync never
walks or deletes anything else on the node. ``--ignore-times`` makes it compare the content of every listed
file (a stale file may keep its size and time); its delta algorithm still sends only the blocks that differ.
``--partial-dir`` keeps an interrupted file in the node's hidden ``.rsync-partial/`` so the next run resumes
from it; no half-written file ever appears under its real name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Callable

from clusterctl.connect import ssh_policy
from clusterctl.connect.ssh_policy import SshTarget
from clusterctl.modelfiles.copycheck import local_rsync  # noqa: F401  (one probe for both sides of a sync)

PARTIAL_DIR = ".rsync-partial"

_GNU = re.compile(r"rsync\s+version\s+v?(\d+)\.(\d+)(?:\.(\d+))?")
_PROGRESS = re.compile(rb"^\s*([\d,.]+)\s+\d+%")


def gnu_version(version_line: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) of GNU rsync's ``--version`` first line; None for openrsync or unknown."""
    m = _GNU.search(version_line or "")
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


@dataclass
class Endpoint:
    """One side of a transfer: a folder here (target None) or on a node reached over SSH."""

    path: str
    target: SshTarget | None = None
    gnu: tuple[int, int, int] | None = None  # the rsync version on that side, when it is GNU rsync


@dataclass
class RsyncResult:
    returncode: int
    error: str | None
    bytes_done: int


def build_argv(rsync: str, local_gnu: tuple[int, int, int] | None, src: Endpoint, dest: Endpoint, list_file: str,
               *, protect_args: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The rsync argv and extra environment. ``protect_args`` None: use ``-s`` when both sides are GNU >= 3.0."""
    remote = src if src.target is not None else dest
    if src.target is not None and dest.target is not None:
        raise ValueError("rsync copies between this machine and one node, not between two nodes")
    argv = [rsync, "-Lt", f"--files-from={list_file}", f"--partial-dir={PARTIAL_DIR}", "--ignore-times",
            "--chmod=Du+rwx,Fu+rw"]
    if local_gnu and local_gnu >= (3, 1, 0):
        argv += ["--info=progress2", "--no-inc-recursive"]
    env: dict[str, str] = {}
    operands = []
    if remote.target is not None:
        if protect_args is None:
            protect_args = bool(local_gnu and local_gnu >= (3, 0, 0) and remote.gnu and remote.gnu >= (3, 0, 0))
        flags, operand, env = ssh_policy.rsync_remote_spec(remote.target, remote.path.rstrip("/") + "/",
                                                           protect_args=protect_args)
        argv += flags + ["-e", ssh_policy.rsync_rsh(remote.target)]
    for side in (src, dest):
        if side is remote and side.target is not None:
            operands.append(operand)
        else:
            operands.append(side.path.rstrip("/") + "/")
    return argv + ["--", *operands], env


def _error_line(stderr: str, returncode: int, dest: Endpoint) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    text = "\n".join(lines)
    if "No space left on device" in text or "ENOSPC" in text:
        return f"no space left on the device holding {dest.path}"
    if "command not found" in text or "rsync: not found" in text or returncode == 127:
        return "rsync is not installed on the node (install it there)"
    if returncode == 255 and lines:
        return f"ssh failed: {lines[-1][:300]}"
    useful = [ln for ln in lines if not ln.startswith("rsync error:")] or lines
    return (useful[-1][:300] if useful else f"rsync exited with code {returncode}") + f" (rsync exit {returncode})"


async def run_rsync(src: Endpoint, dest: Endpoint, files: list[str], *, progress: Callable[[int], None] | None = None,
                    protect_args: bool | None = None, rsync: str | None = None,
                    local_gnu: tuple[int, int, int] | None = None) -> RsyncResult:
    """Copy ``files`` (paths relative to both folders) from ``src`` to ``dest``. Cancelling kills rsync."""
    if rsync is None:
        rsync, line = local_rsync()
        local_gnu = gnu_version(line)
    if rsync is None:
        return RsyncResult(127, "rsync is not installed on this machine (install it: apt-get install rsync)", 0)
    fd, list_file = tempfile.mkstemp(prefix="clusterctl-sync-", suffix=".list")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(p.encode() + b"\n" for p in files))
        argv, extra_env = build_argv(rsync, local_gnu, src, dest, list_file, protect_args=protect_args)
        env = {k: v for k, v in os.environ.items() if k not in ("RSYNC_OLD_ARGS", "RSYNC_PROTECT_ARGS")}
        env.update(extra_env, LC_ALL="C")  # progress numbers with "," separators
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env=env, start_new_session=True)
        done = 0

        async def read_progress() -> None:
            nonlocal done
            buf = b""
            while chunk := await proc.stdout.read(4096):
                buf += chunk
                *parts, buf = re.split(rb"[\r\n]", buf)
                for part in parts:
                    m = _PROGRESS.match(part)
                    if m:
                        done = int(m[1].replace(b",", b"").replace(b".", b""))
                        if progress:
                            progress(done)

        try:
            _, stderr = await asyncio.gather(read_progress(), proc.stderr.read())
            rc = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                os.killpg(proc.pid, 15)
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                os.killpg(proc.pid, 9)
            raise
        if rc != 0:
            return RsyncResult(rc, _error_line(stderr.decode("utf-8", "replace"), rc, dest), done)
        return RsyncResult(0, None, done)
    finally:
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            os.unlink(list_file)

