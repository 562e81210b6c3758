"""Ending a process that holds native threads (mlx, a ring group): flush stdio, then os._exit.

The interpreter's normal teardown can hang on a ring group's sockets and threads, or abort in mlx's native
worker threads ("terminate called without an active exception"); both after all the work was done.
"""

from __future__ import annotations

import os
import sys


def exit_now(code: int) -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
