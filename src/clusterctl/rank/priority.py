"""The rank's compute yields the CPU to its control plane (Linux).

A serving rank's CPU goes to three kinds of threads: the step loop (the main thread), MLX's own threads (the CPU
stream that runs the model, and the ring backend's socket threads, which busy-poll a non-blocking socket while a
collective waits for a peer), and the control plane (the HTTP server and its request threads, the marker
heartbeat, the watchdog, the peer prober and responder). On a node whose cores are all busy, a woken control
thread waited behind the compute: under 64 streaming clients on 2 cores, rank 0's /health took p99 46 ms and up to
161 ms (bench/faults.py, load row, medians of 5 runs of 45 s). With the compute threads at nice +10 the control
plane runs first: p99 28 ms, worst 28-90 ms, and as many completed requests (docs/reliability.md).

The compute threads are reniced once, when the rank starts serving: the main thread and every thread that is not
a Python thread (MLX's). Threads that start later inherit their creator's nice value, so the HTTP server's request
threads stay at the control plane's priority. A nice value only matters when the cores are contended: on an idle
node the model runs as fast as before. Only Linux lets one thread be reniced alone (``/proc/self/task``); elsewhere
nothing changes.
"""

from __future__ import annotations

import os
import threading

TASKS = "/proc/self/task"


def compute_threads() -> list[int]:
    """Thread ids of the main thread and of every thread Python did not start (MLX's)."""
    try:
        tids = [int(t) for t in os.listdir(TASKS)]
    except OSError:
        return []
    main = threading.main_thread()
    control = {t.native_id for t in threading.enumerate() if t is not main}
    return sorted(t for t in tids if t not in control)


def lower_compute(nice: int) -> list[int]:
    """Renice the compute threads by ``nice`` (a no-op for 0 or off Linux); returns the thread ids changed."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return []
    changed = []
    for tid in compute_threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
            changed.append(tid)
        except OSError:  # the thread ended meanwhile
            pass
    return changed
