"""Self-healing, the pure part: when to heal, when not to (flapping), when to go back. No I/O, no clock of its
own: every call takes ``now`` (seconds of one monotonic clock), so the tests drive it through hours in
microseconds. The supervisor that acts on these answers: supervise/loop.py and its verbs (docs/heal.md).

    grace      something (a rank, a node) must stay down this long before it is a loss; a blip is not.
    budget     at most ``max_heals`` plan changes (heals and rejoins) in any ``window_s``, and after each one
               a backoff that doubles with every change still in the window (``backoff_s``, 2x, 4x, ... up to
               ``backoff_max_s``). A link that flaps every 10 s therefore costs at most ``max_heals`` heals
               per window, whatever the other timings.
    rejoin     a lost node must answer (and pass the preflight probe) for ``rejoin_after_s`` without a miss;
               then the supervisor waits for no request in flight, at most ``drain_s``, and goes back to
               the original plan (a plan change like a heal: it counts in the budget).
    phase      serving | healing | degraded, since when and why; the time spent degraded adds up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("serving", "healing", "degraded")


@dataclass(frozen=True)
class HealPolicy:
    grace_s: float = 5.0
    max_heals: int = 3
    window_s: float = 600.0
    backoff_s: float = 10.0
    backoff_max_s: float = 300.0
    rejoin_after_s: float = 15.0
    drain_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_heals < 1 or min(self.grace_s, self.window_s, self.backoff_s, self.backoff_max_s,
                                     self.rejoin_after_s, self.drain_s) < 0:
            raise ValueError("heal policy: max_heals >= 1 and no negative duration")


@dataclass
class Book:
    """What the supervisor has seen and done, judged by ``policy``. Mutated only through its methods."""

    policy: HealPolicy
    down_since: dict[str, float] = field(default_factory=dict)  # what is down now -> first seen down
    changes: list[float] = field(default_factory=list)  # when each heal or rejoin was made
    heals: int = 0
    lost: list[str] = field(default_factory=list)  # nodes left out of the plan by heals, in loss order
    healthy_since: dict[str, float] = field(default_factory=dict)  # lost node -> answering well since
    drain_since: float | None = None
    phase: str = "serving"
    reason: str | None = None
    phase_since: float = 0.0
    degraded_total: float = 0.0

    # ---- losses ---------------------------------------------------------------------------------------------
    def seen_down(self, now: float, down: set[str], since: dict[str, float] | None = None) -> None:
        """What is down at ``now`` (rank or node keys); what is not in ``down`` is up again (grace restarts).
        ``since``: when a key went silent, when known to be earlier than ``now`` (a heartbeat's age: the grace
        counts the time without a sign of life, not the time since it was noticed)."""
        for k in list(self.down_since):
            if k not in down:
                del self.down_since[k]
        for k in down:
            t = min(now, (since or {}).get(k, now))
            self.down_since[k] = min(self.down_since.get(k, t), t)

    def due(self, now: float) -> list[str]:
        """What has been down for the grace or longer: a loss."""
        return sorted(k for k, t in self.down_since.items() if now - t >= self.policy.grace_s)

    # ---- the budget -----------------------------------------------------------------------------------------
    def _recent(self, now: float) -> list[float]:
        return [t for t in self.changes if now - t < self.policy.window_s]

    def wait(self, now: float) -> float:
        """Seconds before another plan change may be made (0: now)."""
        recent = self._recent(now)
        if not recent:
            return 0.0
        p = self.policy
        backoff = min(p.backoff_max_s, p.backoff_s * 2 ** (len(recent) - 1))
        wait = recent[-1] + backoff - now
        if len(recent) >= p.max_heals:
            wait = max(wait, recent[len(recent) - p.max_heals] + p.window_s - now)
        return max(0.0, wait)

    def why_waiting(self, now: float) -> str:
        """Why no change may be made now (the same words while that lasts: a state file's reason)."""
        n = len(self._recent(now))
        if n >= self.policy.max_heals:
            return f"{n} plan changes in the last {self.policy.window_s:g} s (at most {self.policy.max_heals})"
        return f"backoff after {n} plan change(s) in the last {self.policy.window_s:g} s"

    def healed(self, now: float, lost_nodes: list[str], *, plan_change: bool = True) -> None:
        """A heal was made (or attempted) at ``now``, leaving ``lost_nodes`` out of the plan. Not a
        ``plan_change`` (a relaunch of the same plan: the loss found no culprit): nothing spent from the
        budget."""
        if plan_change:
            self.changes.append(now)
        self.heals += 1
        for n in lost_nodes:
            if n not in self.lost:
                self.lost.append(n)
            self.healthy_since.pop(n, None)
        self.down_since.clear()
        self.drain_since = None

    # ---- rejoin ---------------------------------------------------------------------------------------------
    def probed(self, now: float, node: str, ok: bool) -> None:
        """A lost node's probe: answered and passed (``ok``) or not; one miss restarts its stability."""
        if node not in self.lost:
            return
        if ok:
            self.healthy_since.setdefault(node, now)
        else:
            self.healthy_since.pop(node, None)
            self.drain_since = None

    def stable(self, now: float) -> bool:
        """Every lost node has answered well for ``rejoin_after_s``."""
        return bool(self.lost) and all(now - self.healthy_since.get(n, now + 1) >= self.policy.rejoin_after_s
                                       for n in self.lost)

    def rejoin_now(self, now: float, idle: bool) -> bool:
        """The lost nodes are stable and the budget allows: go back when no request is in flight, or once
        ``drain_s`` has passed since that moment came (clients then see their requests end with an error)."""
        if not self.stable(now) or self.wait(now) > 0:
            self.drain_since = None
            return False
        if self.drain_since is None:
            self.drain_since = now
        return idle or now - self.drain_since >= self.policy.drain_s

    def rejoined(self, now: float) -> None:
        self.changes.append(now)
        self.lost.clear()
        self.healthy_since.clear()
        self.down_since.clear()
        self.drain_since = None

    # ---- phase ----------------------------------------------------------------------------------------------
    def set_phase(self, now: float, phase: str, reason: str | None = None) -> bool:
        """Enter ``phase`` (same phase: only the reason changes). Returns whether anything changed."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        if phase == self.phase and reason == self.reason:
            return False
        if phase != self.phase:
            if self.phase == "degraded":
                self.degraded_total += max(0.0, now - self.phase_since)
            self.phase_since = now
        self.phase, self.reason = phase, reason
        return True

    def degraded_seconds(self, now: float) -> float:
        return self.degraded_total + (max(0.0, now - self.phase_since) if self.phase == "degraded" else 0.0)


def culprits(ranks: list[dict], *, insist: bool = True) -> list[str]:
    """The nodes to blame for a job's loss, from each rank's record ``{"node", "state", "follower"}`` (state
    ``up`` or why not): a rank that only followed a lost peer (exited 69, or its marker says a peer was lost)
    blames no one while another rank is to blame. With only followers down and a rank still up, the one that
    left may not show yet (a frozen rank's heartbeat takes seconds to go stale): nobody is blamed unless
    ``insist``; then every node down is a suspect."""
    down = [r for r in ranks if r["state"] != "up"]
    blamed = [r for r in down if not r.get("follower")]
    if not blamed and not insist and len(down) < len(ranks):
        return []
    return sorted({r["node"] for r in (blamed or down)})


@dataclass(frozen=True)
class HealNodes:
    """Whom a heal asks and whom it leaves out, decided once from the loss: the log line and the state file
    (``leaving_out``) say this value and the relaunch plans on it (supervise/heal.py), so a node said to be left
    out is never planned."""

    ask: tuple[str, ...]  # probed; those that answer are the new plan's nodes, in this order
    leave_out: tuple[str, ...] = ()  # blamed: neither asked nor planned
    no_culprit: bool = False  # the loss blamed every node of the job: every one is asked, nothing spent

    def words(self) -> str:
        if self.leave_out:
            return f"leaving out {', '.join(self.leave_out)}"
        if self.no_culprit:
            return f"no node to blame: asking every one ({', '.join(self.ask)})"
        return f"asking {', '.join(self.ask) or 'no node'}"


def heal_nodes(order: list[str], lost: list[str], blame=()) -> HealNodes:
    """The nodes of the original deployment (``order``) not lost yet, less those ``blame``d; a loss that
    blames every one of them has no culprit (every one is asked, none left out). No ``blame``: a retry,
    every node of the job asked."""
    job = tuple(n for n in order if n not in lost)
    out = tuple(n for n in job if n in blame)
    if out and len(out) == len(job):
        return HealNodes(ask=job, no_culprit=True)
    return HealNodes(ask=tuple(n for n in job if n not in out), leave_out=out)
