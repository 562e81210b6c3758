"""flock-based locks in ``<state>/locks``: where cron and a person may race.

Lock files are opened close-on-exec, so a rank (or anything else started while the lock is held) never inherits
the lock and keeps it alive after the holder died. The kernel drops a flock when its holder dies: a SIGKILLed
coordinator never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from clusterctl.atomic import private_dirs
from clusterctl.errors import Busy, CannotWrite


class Lock:
    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self, *, blocking: bool = False, what: str | None = None) -> "Lock":
        try:
            private_dirs(self.path.parent)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise CannotWrite(f"cannot open lock {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise Busy(f"{what or self.path.stem} is locked by another clusterctl (lock {self.path})",
                       hint="try again when it has finished") from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def locked(path: Path, *, what: str | None = None, blocking: bool = False) -> Iterator[Lock]:
    lock = Lock(path).acquire(blocking=blocking, what=what)
    try:
        yield lock
    finally:
        lock.release()

