"""Process identity: the ``Identity`` model and, on this machine, the boot id and process start times.

A pid alone names a process only until it is reused; (pid, start time) within one boot names it for good, and
the launch's nonce (env ``CLUSTERCTL_NONCE``) tells our process from an impostor that got the same pid within a
start-time tick. The keeper, the node operations, the rank's marker and the coordinator's own records all read
them here, so the two sides of the wire compare values made the same way; node/procs.py checks and signals an
``Identity`` on its node.
"""

from __future__ import annotations

import os
from typing import Optional

from pydantic import BaseModel, ConfigDict, ValidationError


class Identity(BaseModel):
    """One process, as the coordinator's records, a rank's marker or a node op name it. ``nonce`` None: not
    checked (the coordinator's own process, a supervisor); ``pgid``: the group it leads (stopped with it)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    pid: int
    start_time: Optional[float] = None
    nonce: Optional[str] = None
    pgid: Optional[int] = None
    boot_id: Optional[str] = None

    @classmethod
    def from_marker(cls, doc: dict, nonce: str) -> "Identity | None":
        """The process a rank's marker names (checked with ``nonce``), or None when its fields are not what a
        rank writes (a garbled marker names no process we could safely signal: no lax conversions here, and
        never pid or group 0 or 1, which would signal a group or init)."""
        fields = {k: doc.get(k) for k in ("pid", "start_time", "pgid", "boot_id")}
        try:
            ident = cls.model_validate({**fields, "nonce": nonce}, strict=True)
        except ValidationError:
            return None
        return ident if ident.pid > 1 and (ident.pgid is None or ident.pgid > 1) else None


class ChildInfo(BaseModel):
    """A process the keeper just started (its one JSON line: node/keeper.py, read by connect/transport.py):
    its identity but the nonce, which the coordinator put in its environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pid: int
    pgid: int
    start_time: Optional[float]
    boot_id: Optional[str]

    def identity(self, nonce: str | None) -> Identity:
        return Identity(pid=self.pid, start_time=self.start_time, nonce=nonce, pgid=self.pgid, boot_id=self.boot_id)


def boot_id() -> str | None:
    """This boot's id: Linux's random boot id, else (macOS) ``boot-<boot time>``; None when neither is known."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            value = f.read(128).decode("ascii").strip()
        if value:
            return value
    except (OSError, UnicodeDecodeError):
        pass
    try:
        import psutil

        return f"boot-{psutil.boot_time():.0f}"
    except Exception:
        return None


def start_time_of(pid: int | None = None) -> float | None:
    """The creation time psutil reports for ``pid`` (default: this process), or None when it is gone or hidden."""
    import psutil

    try:
        return psutil.Process(pid or os.getpid()).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
