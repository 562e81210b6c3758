"""Process identity on this machine: the boot id and process start times (standard library and psutil only).

A pid alone names a process only until it is reused; (pid, start time) within one boot names it for good. The
keeper, the node operations, the rank's marker and the coordinator's own record all read them here, so the two
sides of the wire compare values made the same way.
"""

from __future__ import annotations

import os


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
