"""What a test can ask of a process it watches, without a race between asking and looking.

``psutil.pid_exists(p) and psutil.Process(p).status()`` reads twice: a process that exits in between raises
``NoSuchProcess`` in the second read, though a process that is gone is exactly what a waiting test waits for. Each
helper here reads once and takes "gone" as an answer (tests/test_procstate.py keeps the two-read form out of the tree).
"""

from __future__ import annotations

import psutil


def running(pid: int) -> bool:
    """Does ``pid`` name a process that has not ended (a zombie has ended: only its exit status is left)?"""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def start_time(pid: int) -> float | None:
    """``pid``'s start time, or None once it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
