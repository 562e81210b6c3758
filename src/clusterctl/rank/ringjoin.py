"""How a rank joins the ring: the ring's addresses (its hostfile), the join in order (the last rank enters MLX's
init only once the others announced theirs), under a SIGALRM deadline, then every peer checked."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from clusterctl.rank.engine.group import join_group, verify_group
from clusterctl.rank.peerprobe import Responder, announce_joining, job_token, parse_addr
from clusterctl.protocol.rankspec import RankSpec

JOIN_ORDER_WAIT_S = 10.0  # the last rank waits this long for the others' join announcements, then joins anyway
JOIN_SETTLE_S = 0.03


def ring_addresses(spec: RankSpec) -> list[tuple[str, int]] | None:
    """Every rank's (host, port) from the hostfile; None without peer probes or a readable hostfile."""
    if not spec.probes_on:
        return None
    try:
        entries = json.loads(Path(spec.hostfile).read_text())
        return [parse_addr(e[0]) for e in entries]
    except (OSError, ValueError, TypeError, IndexError, KeyError):
        return None


def join_ring(spec: RankSpec, watchdog, responder: Responder | None, stopping: threading.Event,
              say: Callable[[str], None]):
    """The ring group (None for a world of one), its peers checked."""
    if spec.world_size == 1:
        return None
    # mlx's init() blocks in connect/accept WITH the GIL held: no Python thread (watchdog, signals) runs until
    # it returns, and accept never times out. So the kernel enforces the limit: SIGALRM's default action ends
    # the process (exit by signal 14) if the ring is not joined in time.
    say(f"rank {spec.rank}: joining the ring (exit by SIGALRM if not joined within {spec.join_timeout_s:g} s)")
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, spec.join_timeout_s)
    try:
        join_in_order(spec, responder, stopping, say)
        group = join_group(spec)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    with watchdog.guard(spec.control_timeout_s, "checking the ring's peers"):
        verify_group(group, spec)
    return group


def join_in_order(spec: RankSpec, responder: Responder | None, stopping: threading.Event,
                  say: Callable[[str], None]) -> None:
    """Keep MLX's ring join off its 1 s retry: the last rank (the one that connects before it listens) enters
    init only when every other rank has announced it is entering init (peerprobe.announce_joining). Gates
    open on the nodes at different moments, and 4 local ranks hit the retry in 3 of 5 joins (gate to serving
    1.2 s instead of 0.25 s). Without peer probes (no responder) the ranks join as MLX orders them; a rank that
    does not hear back within JOIN_ORDER_WAIT_S joins anyway, and MLX's retry takes over as before."""

    addrs = ring_addresses(spec)
    if addrs is None or responder is None:
        return
    last = spec.world_size - 1
    if spec.rank != last:
        if not announce_joining(addrs[last], job_token(spec.job_id, spec.nonce), spec.rank,
                                min(JOIN_ORDER_WAIT_S, spec.join_timeout_s / 2), stopping):
            say(f"rank {spec.rank}: rank {last} did not see this rank's join announcement within "
                f"{JOIN_ORDER_WAIT_S:g} s; joining anyway")
        return
    missing = responder.wait_joining(set(range(last)), min(JOIN_ORDER_WAIT_S, spec.join_timeout_s / 2), stopping)
    if missing:
        say(f"rank {spec.rank}: rank(s) {', '.join(map(str, sorted(missing)))} did not announce their join "
            f"within {JOIN_ORDER_WAIT_S:g} s; joining anyway (MLX retries the connect)")
    else:
        time.sleep(JOIN_SETTLE_S)  # from their announcement to their listen(): a few Python lines and syscalls
