"""Free TCP ports for the tests' own servers (sshd, ranks' ring and HTTP ports, mlx_lm.server).

The suite runs in several pytest-xdist workers at once (scripts/test). A port found free with ``bind(port 0)`` and
closed again is back in the kernel's ephemeral pool: another worker's ``bind(0)`` may be handed the same port
before the first worker's server binds it, and ring sockets bind with SO_REUSEPORT, so two clusters would then
share a port. So each worker takes its ports from a block of its own (``PYTEST_XDIST_WORKER`` gw0, gw1, ...),
below the kernel's ephemeral range (32768-60999 by default) and below the block launch picks its own ports from
(launch/hostfile.py, 20000-32767): no port one worker hands out can be handed out by another worker or by the
kernel. Within a worker the ports go round the block from a random start (so two sessions on one machine are
unlikely to walk in step), each checked with a plain bind (no SO_REUSEADDR) before it is handed out, none handed
out twice until the block wraps around.
"""

from __future__ import annotations

import os
import random
import socket

BASE, SPAN, WORKERS = 10000, 1250, 8  # worker i: [BASE + i*SPAN, BASE + (i+1)*SPAN); 8 workers end at 20000


def worker_index() -> int:
    """0 outside xdist; i for worker ``gw<i>`` (wrapping around past WORKERS)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) % WORKERS if name.startswith("gw") and name[2:].isdigit() else 0


def port_block() -> range:
    lo = BASE + worker_index() * SPAN
    return range(lo, lo + SPAN)


_next: list[int] = []  # the offset of the next port to try, in this worker's block


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port of this worker's block that nothing is bound to on ``host`` now (nor on every address)."""
    block = port_block()
    if not _next:
        _next.append(random.randrange(len(block)))
    for _ in range(len(block)):
        port = block[_next[0] % len(block)]
        _next[0] += 1
        if _bindable(host, port) and (host in ("", "0.0.0.0") or _bindable("0.0.0.0", port)):
            return port
    raise RuntimeError(f"no free port in {block.start}..{block.stop - 1} (this worker's block)")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports of this worker's block."""
    return [free_port(host) for _ in range(n)]
