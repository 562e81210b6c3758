"""The peer-loss ladder: ranks probe each other over UDP and handle a lost peer in stages (docs/rank.md).

Every rank answers probes on UDP at its own ring address and port number (the ring itself is TCP). Rank 0
probes every peer, the other ranks their ring neighbours, every ``interval`` seconds. A peer that misses
``tolerance`` probes in a row starts the ladder:

1. ``suspect``: logged.
2. ``abort``: the rank cancels its in-flight and queued requests at the next step boundary (rank 0 also writes a
   cancel file, so `status` shows it), then keeps probing for ``grace`` seconds.
3. ``recovered`` if the peer answers within the grace: serving goes on. Otherwise ``lost``: the rank marks its
   marker ``lost``, releases memory and exits 69.

With grace 0 the ladder goes from ``suspect`` straight to ``lost``. A probe answer is the probe's own bytes
echoed with a flag, so a peer that is alive but frozen (SIGSTOP, a hung process) does not answer, and a probe
of another job (a stale rank on a reused port) is not answered either.

The same port carries two more small messages: the ring join order (``announce_joining``) and wake-up calls
(``Waker``): an idle rank that has work for the ranks (rank 0: a request came in; any rank: a stop) tells the
others to come to the next meeting now instead of at its scheduled time. A wake-up call carries the number of
the meeting it is for and nothing else; what the meeting decides still travels in the ring's own collective.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from clusterctl.protocol.rankspec import DEFAULT_ABORT_GRACE

MAGIC = b"CCPR"
PING, PONG = 1, 2
JOINING, JOIN_SEEN = 3, 4  # "I enter the ring's init now", sent to the rank that connects first; its answer
WAKE = 5  # "come to meeting <seq> now" (an idle rank's wake-up call; no answer)
_FMT = "!4s8sBHI"  # magic, job token, kind, from rank, sequence
SIZE = struct.calcsize(_FMT)
DEFAULT_INTERVAL = 1.0  # an answer may take this long: a loaded 2-core machine delayed threads by 0.5 s
DEFAULT_TOLERANCE = 2


def job_token(job_id: str, nonce: str) -> bytes:
    return hashlib.sha256(f"{job_id}\0{nonce}".encode()).digest()[:8]


def watched_peers(rank: int, world: int) -> list[int]:
    """Rank 0 watches everyone; the others their ring neighbours."""
    if world < 2:
        return []
    if rank == 0:
        return list(range(1, world))
    return sorted({(rank - 1) % world, (rank + 1) % world} - {rank})


def parse_addr(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    return host.strip("[]"), int(port)


# ---- the ladder (pure: time comes in, actions go out) --------------------------------------------------------

@dataclass
class Ladder:
    """Per watched peer: consecutive misses, and the abort deadline once the ladder runs."""

    tolerance: int = DEFAULT_TOLERANCE
    grace: float = DEFAULT_ABORT_GRACE
    misses: dict[int, int] = field(default_factory=dict)
    aborting: dict[int, float] = field(default_factory=dict)  # peer -> deadline

    def observe(self, peer: int, answered: bool, now: float) -> list[str]:
        """One probe round's result for ``peer``: the ladder's actions, in order ("suspect", "abort",
        "recovered", "lost")."""
        if answered:
            self.misses[peer] = 0
            if peer in self.aborting:
                del self.aborting[peer]
                return ["recovered"]
            return []
        self.misses[peer] = self.misses.get(peer, 0) + 1
        if peer in self.aborting:
            return ["lost"] if now >= self.aborting[peer] else []
        if self.misses[peer] >= self.tolerance:
            if self.grace <= 0:
                return ["suspect", "lost"]
            self.aborting[peer] = now + self.grace
            return ["suspect", "abort"]
        return []


# ---- sockets ----------------------------------------------------------------------------------------------------

class Responder:
    """Answers this job's probes on UDP ``(host, port)`` from a daemon thread."""

    def __init__(self, host: str, port: int, token: bytes, rank: int):
        self.token, self.rank = token, rank
        self.joining: set[int] = set()  # ranks that announced they enter the ring's init
        self.on_wake: Callable[[int], None] | None = None  # a peer's wake-up call for meeting <seq>
        self._joined = threading.Condition()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self._thread = threading.Thread(target=self._run, name="probe-responder", daemon=True)

    def start(self) -> "Responder":
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(64)
            except OSError:
                return
            if len(data) != SIZE:
                continue
            magic, token, kind, frm, seq = struct.unpack(_FMT, data)
            if magic != MAGIC or token != self.token:
                continue
            if kind == PING:
                try:
                    self.sock.sendto(struct.pack(_FMT, MAGIC, token, PONG, self.rank, seq), addr)
                except OSError:
                    pass
            elif kind == JOINING:
                with self._joined:
                    self.joining.add(frm)
                    self._joined.notify_all()
                try:
                    self.sock.sendto(struct.pack(_FMT, MAGIC, token, JOIN_SEEN, self.rank, seq), addr)
                except OSError:
                    pass
            elif kind == WAKE:
                on_wake = self.on_wake
                if on_wake is not None:
                    on_wake(seq)

    def wait_joining(self, ranks: set[int], timeout: float, stop: threading.Event | None = None) -> set[int]:
        """Wait until every rank in ``ranks`` announced it joins (or ``timeout``, or ``stop``); returns the
        ranks not heard from."""
        deadline = time.monotonic() + timeout
        with self._joined:
            while not ranks <= self.joining:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    break
                self._joined.wait(min(left, 0.05))
            return ranks - self.joining

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def announce_joining(addr: tuple[str, int], token: bytes, rank: int, timeout: float,
                     stop: threading.Event | None = None) -> bool:
    """Tell the rank that connects first (the last rank) that this rank enters the ring's init now; True once
    it saw the announcement, False after ``timeout`` (or ``stop``).

    MLX's ring joins in a fixed order: the last rank connects to rank 0, then rank 0 to rank 1, and so on; every
    other rank listens first. A connect that comes before its peer listens is refused, and MLX then sleeps 1 s
    (2, 4, 8 s on later tries) before the next attempt. So the last rank waits for every other rank's
    announcement before its own init, and the others repeat theirs (every 20 ms) until the last rank's
    responder answers: it may not be up yet (its gate may open later). Delaying a rank that listens first costs
    nothing: the join starts with the last rank's connect."""
    import select

    msg = struct.pack(_FMT, MAGIC, token, JOINING, rank, 0)
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)  # connected: a port nobody listens on yet comes back as ECONNREFUSED
        except OSError:
            return False
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                s.send(msg)
                ready, _, _ = select.select([s], [], [], 0.02)
                if ready and struct.unpack(_FMT, s.recv(64)[:SIZE].ljust(SIZE, b"\0"))[:3] == (MAGIC, token, JOIN_SEEN):
                    return True
            except OSError:  # refused: the last rank's responder is not up yet
                time.sleep(0.02)
    return False


class Waker:
    """Sends wake-up calls ("come to meeting <seq> now") to the other ranks' responders. Fire and forget: a
    call that is lost costs only latency, the rank it was for comes at its scheduled time."""

    def __init__(self, peers: dict[int, tuple[str, int]], token: bytes, rank: int):
        self.peers, self.token, self.rank = peers, token, rank
        self._socks = {}
        for p, (host, _) in peers.items():
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            if family not in self._socks:
                s = socket.socket(family, socket.SOCK_DGRAM)
                s.setblocking(False)
                self._socks[family] = s

    def send(self, seq: int) -> None:
        msg = struct.pack(_FMT, MAGIC, self.token, WAKE, self.rank, seq & 0xFFFFFFFF)
        for host, port in self.peers.values():
            try:
                self._socks[socket.AF_INET6 if ":" in host else socket.AF_INET].sendto(msg, (host, port))
            except OSError:
                pass  # a full buffer, no route: that rank comes at its scheduled time

    def close(self) -> None:
        for s in self._socks.values():
            s.close()


class Prober:
    """Probes the watched peers every ``interval`` s and feeds the ladder; ``on_action(action, peer)``."""

    def __init__(self, peers: dict[int, tuple[str, int]], token: bytes, rank: int, ladder: Ladder, *,
                 interval: float, on_action: Callable[[str, int], None], clock: Callable[[], float] = time.monotonic):
        self.peers, self.token, self.rank, self.ladder = peers, token, rank, ladder
        self.interval, self.on_action, self.clock = interval, on_action, clock
        self.socks: dict[int, socket.socket] = {}
        for p, (host, _) in peers.items():
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            self.socks[p] = s
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-prober", daemon=True)

    def start(self) -> "Prober":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def round(self) -> dict[int, bool]:
        """Send one probe to each peer, wait one interval for the answers; {peer: answered}."""
        import select

        self.seq = (self.seq + 1) & 0xFFFFFFFF
        ping = struct.pack(_FMT, MAGIC, self.token, PING, self.rank, self.seq)
        for p, s in self.socks.items():
            try:
                s.sendto(ping, self.peers[p])
            except OSError:
                pass  # no route, link down: a miss
        answered = {p: False for p in self.peers}
        deadline = self.clock() + self.interval
        while not all(answered.values()):
            left = deadline - self.clock()
            if left <= 0 or self._stop.is_set():
                break
            ready, _, _ = select.select(list(self.socks.values()), [], [], left)
            for s in ready:
                try:
                    data = s.recv(64)
                except OSError:
                    continue
                if len(data) != SIZE:
                    continue
                magic, token, kind, frm, seq = struct.unpack(_FMT, data)
                if magic == MAGIC and token == self.token and kind == PONG and seq == self.seq and frm in answered:
                    answered[frm] = True
        rest = deadline - self.clock()
        if rest > 0:
            self._stop.wait(rest)
        return answered

    def silent(self, timeout: float = 0.5) -> list[int]:
        """The watched peers that do not answer one probe within ``timeout`` (fresh sockets, so the probing
        thread's rounds are not disturbed): who is gone when the ring itself broke before any probe missed. A
        peer whose process died refuses at once (its port is closed), so this rarely waits the whole timeout."""
        import select

        socks: dict[socket.socket, int] = {}
        answered: set[int] = set()
        ping = struct.pack(_FMT, MAGIC, self.token, PING, self.rank, 0)
        for p, (host, port) in self.peers.items():
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            try:
                s.connect((host, port))  # connected: a closed port comes back as ECONNREFUSED
                s.send(ping)
                socks[s] = p
            except OSError:
                s.close()
        deadline = self.clock() + timeout
        try:
            while socks and len(answered) < len(socks):
                left = deadline - self.clock()
                if left <= 0:
                    break
                ready, _, _ = select.select(list(socks), [], [], left)
                for s in ready:
                    try:
                        data = s.recv(64)
                    except OSError:
                        del socks[s]  # refused: nobody listens there any more
                        s.close()
                        continue
                    if len(data) == SIZE and struct.unpack(_FMT, data)[:3] == (MAGIC, self.token, PONG):
                        answered.add(socks[s])
        finally:
            for s in socks:
                s.close()
        return sorted(set(self.peers) - answered)

    def _run(self) -> None:
        while not self._stop.is_set():
            for peer, ok in self.round().items():
                for action in self.ladder.observe(peer, ok, self.clock()):
                    self.on_action(action, peer)
                    if action == "lost":
                        return
