"""Rank 0's Prometheus metrics (``GET /metrics``, docs/metrics.md): one registry per server, every metric, and
the small named calls that move them (the API, the cancel acks, the peer-loss ladder, the step loop). What
describes the present (queue depth, batch occupancy, RSS) is read when scraped, never pushed per token."""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from clusterctl.protocol.httpedge import RankOutcome, rank_outcome

OPEN_ENV = "CLUSTERCTL_METRICS_OPEN"  # "1" on rank 0: /metrics answers without the API key
OUTCOMES = tuple(str(o) for o in RankOutcome)  # ok, cancelled, 4xx, 429, 5xx (protocol/httpedge.py)
LADDER_STAGES = ("suspect", "abort", "recovered", "lost")
RUN_ENDS = ("stop", "empty")  # why an overlapped run ended (scheduler.RunEnd)
# first tokens: tens of ms on a small model, seconds for a long prompt or a queue; per output token: ms to 1 s
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RECENT_S = 10.0  # the time constant of a rank's recent step time and idle share (steploop.py reports them)


def metrics_open(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(OPEN_ENV, "").strip() == "1"


def outcome_of(status: int) -> str:
    """An HTTP status as a request outcome: ok, 4xx, 429 or 5xx (cancelled is the API's own verdict); the edge's
    rule (protocol/httpedge.py)."""
    return rank_outcome(status)


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry in the format the scraper asked for (Prometheus text, or OpenMetrics): (body, content type)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


class Recent:
    """Exponentially weighted sums (time constant ``tau``): the recent mean step time and idle share."""

    def __init__(self, tau: float = RECENT_S, clock: Callable[[], float] = time.monotonic):
        self.tau, self.clock = tau, clock
        self.steps = self.busy = self.idle = 0.0
        self.at = clock()
        self.step_s: float | None = None  # kept through an idle spell: the last known step time
        self._lock = threading.Lock()

    def _decay(self) -> None:
        now = self.clock()
        f = math.exp(-max(0.0, now - self.at) / self.tau)
        self.steps, self.busy, self.idle, self.at = self.steps * f, self.busy * f, self.idle * f, now

    def add(self, *, steps: int = 0, busy: float = 0.0, idle: float = 0.0) -> None:
        with self._lock:
            self._decay()
            self.steps += steps
            self.busy += busy
            self.idle += idle
            if self.steps > 1e-9:
                self.step_s = self.busy / self.steps

    def read(self) -> tuple[float | None, float | None]:
        with self._lock:
            self._decay()
            total = self.busy + self.idle
            return self.step_s, (self.idle / total if total > 1e-12 else None)


class _RankStats:
    """Per rank: step time, idle share, RSS (labelled ``rank``), as every rank's meetings report them
    (``Metrics.set_rank_stats``, rank 0's own included); rank 0's RSS read from this process when not reported."""

    def __init__(self, rank: int):
        self.rank = rank
        self.others: dict[int, tuple[float | None, float | None, int | None]] = {}
        self._lock = threading.Lock()
        self._proc = None

    def _rss(self) -> int | None:
        try:
            import psutil

            if self._proc is None:
                self._proc = psutil.Process()
            return int(self._proc.memory_info().rss)
        except Exception:  # a scrape never fails for want of one number
            return None

    def _families(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily("clusterctl_rank_step_seconds", "Recent mean time of one batched step, per rank",
                                  labels=["rank"]),
                GaugeMetricFamily("clusterctl_rank_idle_share", "Recent share of time the rank's step loop had "
                                  "no batch to run (0 to 1), per rank", labels=["rank"]),
                GaugeMetricFamily("clusterctl_rank_rss_bytes", "Resident memory of the rank process, per rank",
                                  labels=["rank"])]

    def describe(self):
        return self._families()

    def collect(self):
        step, idle, rss = self._families()
        with self._lock:
            stats = dict(self.others)
        s0, i0, r0 = stats.get(self.rank, (None, None, None))
        stats[self.rank] = (s0, i0, self._rss() if r0 is None else r0)
        for r, (s, i, m) in sorted(stats.items()):
            for family, value in ((step, s), (idle, i), (rss, m)):
                if value is not None:
                    family.add_metric([str(r)], value)
        return [step, idle, rss]


class Metrics:
    """Every metric rank 0 exposes, in a registry of its own (never the process-wide default: tests run several
    servers in one process). ``queue_depth``, ``occupancy`` and ``serving`` are read at each scrape."""

    def __init__(self, *, rank: int = 0, max_batch: int = 1, max_queue: int = 0,
                 queue_depth: Callable[[], int] | None = None, occupancy: Callable[[], int] | None = None,
                 serving: Callable[[], bool] | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._requests = Counter("clusterctl_requests", "API requests by how they ended (every route but /health "
                                 "and /metrics)", ["outcome"], registry=r)
        for o in OUTCOMES:
            self._requests.labels(o)
        self._prompt = Counter("clusterctl_prompt_tokens", "Prompt tokens of the requests generated", registry=r)
        self._completion = Counter("clusterctl_completion_tokens", "Tokens generated", registry=r)
        self._ttft = Histogram("clusterctl_time_to_first_token_seconds", "From a request's arrival to its first "
                               "generated token, queue wait included", buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram("clusterctl_time_per_output_token_seconds", "Mean time per generated token after "
                               "the first, per finished request", buckets=TPOT_BUCKETS, registry=r)
        self._prefilled = Counter("clusterctl_prompt_tokens_processed", "Prompt tokens the ranks processed "
                                  "(neither from the prompt cache nor shared by the choices of one request)",
                                  registry=r)
        self._cache_hits = Counter("clusterctl_prompt_cache_hits", "Requests whose prompt prefix came from the "
                                   "prompt cache", registry=r)
        self._cache_tokens = Counter("clusterctl_prompt_cache_hit_tokens", "Prompt tokens taken from the prompt "
                                     "cache instead of computed", registry=r)
        self._acks = Counter("clusterctl_cancel_acks", "Cancel epochs rank 0 applied and acknowledged", registry=r)
        self._cancelled = Counter("clusterctl_cancel_requests", "Requests ended by those cancel epochs (in the "
                                  "batch or queued)", registry=r)
        self._ack_errors = Counter("clusterctl_cancel_ack_errors", "Cancel acks rank 0 could not write", registry=r)
        self._epoch = Gauge("clusterctl_cancel_epoch", "The newest cancel epoch rank 0 acknowledged", registry=r)
        self._ladder = Counter("clusterctl_peer_ladder", "Stages of the peer-loss ladder rank 0 went through, per "
                               "watched peer", ["stage", "peer"], registry=r)
        self._runs = Counter("clusterctl_overlap_runs_ended", "Overlapped runs that ended for a meeting (each drains "
                             "the pipeline), by why", ["reason"], registry=r)
        for why in RUN_ENDS:
            self._runs.labels(why)
        self._revivals = Counter("clusterctl_overlap_revivals", "Parked micro-batches a joining request brought "
                                 "back into a run (no meeting, no drain)", registry=r)
        Gauge("clusterctl_batch_slots", "Requests the batch holds at most (max_batch)", registry=r).set(max_batch)
        Gauge("clusterctl_queue_slots", "Requests that may wait for a batch slot (max_queue)",
              registry=r).set(max_queue)
        for name, doc, fn in (
                ("clusterctl_queue_depth", "Requests accepted and waiting for a batch slot", queue_depth),
                ("clusterctl_batch_occupancy", "Requests in the batch now", occupancy),
                ("clusterctl_serving", "1 while rank 0 serves requests, else 0 (loading, ready, stopping)", serving)):
            g = Gauge(name, doc, registry=r)
            if fn is not None:
                g.set_function(lambda fn=fn: float(fn()))
        self._ranks = _RankStats(rank)
        r.register(self._ranks)

    # -- requests (the API's HTTP threads)
    def request_done(self, outcome: str) -> None:
        self._requests.labels(outcome).inc()

    def tokens(self, prompt: int, completion: int) -> None:
        self._prompt.inc(max(0, prompt))
        self._completion.inc(max(0, completion))

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(max(0.0, seconds))

    def per_output_token(self, seconds: float) -> None:
        self._tpot.observe(max(0.0, seconds))

    def prefilled(self, tokens: int) -> None:
        """A row joined whose prompt takes ``tokens`` tokens of work (its prefix came from a cache or a share)."""
        self._prefilled.inc(max(0, tokens))

    def cache_hit(self, tokens: int) -> None:
        """A request whose first ``tokens`` prompt tokens came from the prompt cache."""
        self._cache_hits.inc()
        self._cache_tokens.inc(max(0, tokens))

    # -- cancels and the peer-loss ladder (runtime.py wires them)
    def cancel_acked(self, epoch: int, applied: int) -> None:
        self._acks.inc()
        self._cancelled.inc(max(0, applied))
        self._epoch.set(epoch)

    def ack_failed(self) -> None:
        self._ack_errors.inc()

    def watch_peers(self, peers) -> None:
        """The peers rank 0 probes: their ladder counters exist (at 0) before anything happens."""
        for p in peers:
            for stage in LADDER_STAGES:
                self._ladder.labels(stage, str(p))

    def ladder(self, stage: str, peer: int | str) -> None:
        self._ladder.labels(stage, str(peer)).inc()

    # -- the overlapped schedule (the step loop)
    def run_ended(self, why: str) -> None:
        self._runs.labels(why).inc()

    def revived(self) -> None:
        self._revivals.inc()

    # -- per rank
    def set_rank_stats(self, rank: int, step_s: float | None, idle_share: float | None,
                       rss_bytes: int | None) -> None:
        """Another rank's numbers (as its meetings report them); None leaves a number unreported."""
        with self._ranks._lock:
            self._ranks.others[rank] = (step_s, idle_share, rss_bytes)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        return render(self.registry, accept)
