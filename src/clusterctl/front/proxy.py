"""The front door: one stable address that forwards the OpenAI API to the cluster's current rank 0.

``python -m clusterctl.front.proxy --state-dir S --cluster C --host H --port P`` (what ``clusterctl front`` and
``launch --front`` run) listens on H:P for as long as it lives, independent of any job: front/follow.py
tells it which job is current (a replan, a heal or a new launch switches it without a restart). Every route but
its own ``/health`` and ``/metrics`` is forwarded to rank 0 (rank 0's are under ``/upstream/health`` and
``/upstream/metrics``), streams chunk by chunk as they arrive. The front enforces rank 0's API keys and CORS
origins itself (so it can refuse while nothing serves); while no rank 0 serves it answers 503 with
``Retry-After``; a rank 0 lost mid-answer ends the stream with an error event and ``data: [DONE]`` (503 before
any byte was sent). The clients' side is aiohttp's server (front/listener.py), rank 0 is reached through aiohttp's
client (front/upstream.py; docs/dependencies.md); the rules at the edge are protocol/httpedge.py's. docs/front.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time

from aiohttp import web
from multidict import CIMultiDict

from clusterctl.front.follow import Follower, Target
from clusterctl.front.records import FrontRecord, record_path, remove_record, url_of, write_record
from clusterctl.statedir.healfile import read_state as read_heal
from clusterctl.front.listener import Body, Listener
from clusterctl.statedir.manifest import now_iso, this_coordinator
from clusterctl.connect.nodes import Connector
from clusterctl.front.upstream import Lost, NotSent, Pool, Response
from clusterctl.statedir.state import StateDir
from clusterctl.protocol.httpedge import (CHALLENGE, MAX_BODY, UNAUTHORIZED_CODE, UNAUTHORIZED_MESSAGE, Access,
                                          ErrorType, FrontOutcome, error_document, front_outcome)

POLL_S = 0.25  # how often the launch manifests and the heal file are looked at
HEALTH_EVERY_S = 1.0  # how often rank 0's /health is asked
RETRY_AFTER = {"unavailable": 2, "healing": 5, "degraded": 30}
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length", "server", "expect"}  # rank 0's Date is kept
DONE = b"data: [DONE]\n\n"
SERVER = "clusterctl"  # the Server header, as rank 0 says it: not the library and its version


class Front:
    """The server's state: what it follows, its own health, its metrics."""

    def __init__(self, follower: Follower, *, linger: float = 0.0, metrics_open: bool = False):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.follower = follower
        self.linger = linger
        self.metrics_open = metrics_open
        self.pool = Pool()  # connections to rank 0
        self.server: Listener | None = None  # the clients' side (serve() sets it; the watcher sweeps it)
        self.healthy = False  # rank 0 of the target answered /health 200 last time
        self.state, self.reason, self.since = "unavailable", None, time.time()
        self.nothing_since = time.monotonic()
        self.stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._refreshing = asyncio.Lock()
        self._last_health = 0.0
        self._state_t = time.monotonic()
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("clusterctl_front_requests", "Requests the front answered, by outcome",
                                  ["outcome"], registry=r)
        self.m_state = Gauge("clusterctl_front_state", "1 for the front's current state", ["state"], registry=r)
        self.m_seconds = Counter("clusterctl_front_state_seconds", "Seconds spent in each state", ["state"],
                                 registry=r)
        self.m_switches = Counter("clusterctl_front_upstream_changes", "Times the front followed another job",
                                  registry=r)
        self.m_transitions = Counter("clusterctl_front_transitions", "Times the front entered a state", ["state"],
                                     registry=r)
        self.m_following = Gauge("clusterctl_front_following", "1 for the job whose rank 0 the front forwards to",
                                 ["job"], registry=r)
        for s in ("serving", "healing", "degraded", "unavailable"):
            self.m_state.labels(s).set(1 if s == self.state else 0)
        self._outcomes: dict = {}

    def count(self, outcome: FrontOutcome) -> None:
        """One answered request (the labelled child looked up once per outcome: this is on every request)."""
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self.m_requests.labels(outcome)
        child.inc()

    # ---- the view: what serves, and the state said on /health ---------------------------------------------------

    @property
    def target(self) -> Target | None:
        return self.follower.target

    @property
    def rules(self) -> Access | None:
        t = self.follower.target
        return t.rules if t is not None else self.follower.last_rules

    def _set_state(self, state: str, reason: str | None) -> None:
        now = time.monotonic()
        self.m_seconds.labels(self.state).inc(now - self._state_t)
        self._state_t = now
        if state != self.state:
            self.m_state.labels(self.state).set(0)
            self.m_state.labels(state).set(1)
            self.m_transitions.labels(state).inc()
            self.state, self.since = state, time.time()
        self.reason = reason

    async def refresh(self) -> None:
        async with self._refreshing:  # the watcher and a request that found rank 0 gone, one at a time
            await self._refresh()

    async def _refresh(self) -> None:
        before = self.target
        t = await self.follower.refresh()
        self._switched(before, t)
        if t is not None and (not self.healthy or time.monotonic() - self._last_health > HEALTH_EVERY_S):
            self.healthy = await self._probe(t)
            if not self.healthy:  # passed over while another job of the cluster serves (until it answers again)
                self.follower.down.add(t.job_id)
                t2 = await self.follower.refresh()
                if t2 is not None and t2.job_id != t.job_id:
                    self._switched(t, t2)
                    t = t2
                    self.healthy = await self._probe(t)
        heal = read_heal(self.follower.state, self.follower.cluster)
        if heal is not None and heal.state in ("healing", "degraded"):
            self._set_state(heal.state, heal.reason)
        elif t is not None and self.healthy:
            self._set_state("serving", None)
        else:
            self._set_state("unavailable", "no rank 0 serves" if t is None else f"rank 0 of job {t.job_id} "
                                                                                 "does not answer")
        busy = self.follower.has_jobs or (heal is not None and heal.state in ("healing", "degraded"))
        if busy:
            self.nothing_since = time.monotonic()

    def _switched(self, before: Target | None, t: Target | None) -> None:
        if (t and t.job_id) == (before and before.job_id):
            return
        if before is not None:
            self.m_following.remove(before.job_id)
        if t is not None:
            self.m_following.labels(t.job_id).set(1)
            self.m_switches.inc()
        self.healthy, self._last_health = False, 0.0

    async def _probe(self, t: Target) -> bool:
        self._last_health = time.monotonic()
        up = None
        try:
            async with asyncio.timeout(2):
                up = await self.pool.request(t.endpoint, "GET", "/health", [])
                await up.read()
        except (ConnectionError, asyncio.TimeoutError, OSError, ValueError):
            return False
        finally:
            if up is not None:
                up.release()
        if up.status == 200:
            self.follower.down.discard(t.job_id)
        return up.status == 200

    async def watch(self) -> None:
        """Refresh until stopped; a front with a linger exits once its cluster has had nothing for that long."""
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                await self.refresh()
            if self.server is not None:
                self.server.sweep()
            if self.linger and time.monotonic() - self.nothing_since > self.linger:
                self.follower.log(f"front: nothing of cluster {self.follower.cluster} for {self.linger:g} s; exiting")
                self.stop.set()
                return
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)

    async def refresh_now(self) -> Target | None:
        """Rank 0 did not answer: look again at once (a replan may have moved it) before saying 503."""
        self.healthy = False
        self.follower.rescan()
        with contextlib.suppress(Exception):
            await self.refresh()
        return self.target if self.healthy else None

    def retry_after(self) -> str:
        return str(RETRY_AFTER.get(self.state, 2))


# ---- the server ---------------------------------------------------------------------------------------------------

Answer = tuple[web.StreamResponse, FrontOutcome | None]  # an answer and its outcome (None: not counted)


def make_server(front: Front) -> Listener:
    """One handler for every request (the front routes by itself); the listener's own refusals (a malformed
    request, a body too large) counted like the front's and given its CORS headers."""

    async def handle(req: web.BaseRequest, body: Body) -> web.StreamResponse:
        try:
            resp, outcome = await _route(front, req, body)
        except asyncio.CancelledError:
            # our client left (aiohttp cancels its handler): what was asked of rank 0 is closed, so it cancels there
            if req.transport is None or req.transport.is_closing():
                front.count(FrontOutcome.CLIENT_GONE)
            raise
        if outcome is not None:
            front.count(outcome)
        return resp

    def refusal_headers(headers) -> dict[str, str]:
        rules = front.rules
        return rules.cors.headers(headers.get("Origin")) if rules else {}

    return Listener(handle, name=SERVER, max_body=MAX_BODY, refused=lambda status: front.count(front_outcome(status)),
                    refusal_headers=refusal_headers)


def _json(front: Front, req: web.BaseRequest, status: int, doc: dict, extra: dict | None = None,
          outcome: FrontOutcome | None = None) -> Answer:
    rules = front.rules
    cors = rules.cors.headers(req.headers.get("Origin")) if rules else {}
    if status == 503:  # every 503 of the front says when to come back (docs/front.md), whoever builds it
        extra = {"Retry-After": front.retry_after(), **(extra or {})}
    resp = web.Response(status=status, body=json.dumps(doc).encode(),
                        headers={"Content-Type": "application/json", **cors, **(extra or {})})
    return resp, outcome or front_outcome(status)


def _unavailable(front: Front, req: web.BaseRequest, message: str | None = None) -> Answer:
    msg = message or {"healing": "the deployment is healing; retry shortly",
                      "degraded": f"the deployment is degraded: {front.reason or 'no plan fits'}"}.get(
        front.state, "no rank 0 serves this deployment right now; retry shortly")
    return _json(front, req, 503, error_document(msg, type=ErrorType.SERVER, code="service_unavailable"),
                 outcome=FrontOutcome.UNAVAILABLE)


async def _route(front: Front, req: web.BaseRequest, body: Body) -> Answer:
    """Answer one request: from its head alone, but for what is forwarded (its body is read after the key check,
    so a caller without a key never has one read)."""
    method, path = req.method, req.path
    rules = front.rules
    if path == "/health" and method in ("GET", "HEAD"):
        ok = front.state == "serving"
        return _json(front, req, 200 if ok else 503, {"status": "ok" if ok else front.state})[0], None
    if method == "OPTIONS" and rules is not None and rules.cors.enabled:
        origin = req.headers.get("Origin")
        return web.Response(status=204, headers={**rules.cors.headers(origin),
                                                 **rules.cors.preflight_headers(origin)}), None
    open_metrics = path in ("/metrics", "/upstream/metrics") and front.metrics_open
    upstream_health = path == "/upstream/health" and method in ("GET", "HEAD")
    if rules is None and not (open_metrics or upstream_health):
        await front.refresh_now()  # a job may have become ready since the watcher last looked
        rules = front.rules
        if rules is None:
            return _unavailable(front, req)  # no job seen yet: nobody can be told apart
    if not (open_metrics or upstream_health) and not rules.authorized(req.headers.get("Authorization")):
        return _json(front, req, 401, error_document(UNAUTHORIZED_MESSAGE, type=ErrorType.INVALID_REQUEST,
                                                     code=UNAUTHORIZED_CODE), CHALLENGE)
    if path == "/metrics":
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(front.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}), None
    raw = req.raw_path  # as sent (still percent-encoded), query included; an absolute-form target: its path
    target = raw if raw.startswith("/") else req.rel_url.raw_path_qs
    if path in ("/upstream/health", "/upstream/metrics"):  # /upstream/... on the front is /... on rank 0
        target = path[len("/upstream"):] + (f"?{req.query_string}" if req.query_string else "")
    return await _forward(front, req, target, await body())


async def _forward(front: Front, req: web.BaseRequest, target: str, body: bytes) -> Answer:
    t = front.target if front.healthy else await front.refresh_now()
    if t is None:
        return _unavailable(front, req)
    headers = [(k, v) for k, v in req.headers.items() if k.lower() not in HOP]
    for attempt in (0, 1):
        t0 = time.perf_counter()
        try:
            up = await front.pool.request(t.endpoint, req.method, target, headers, body)
            break
        except NotSent:  # never reached rank 0: safe to send again
            t2 = await front.refresh_now()
            if attempt == 1 or t2 is None:
                return _unavailable(front, req)
            t = t2  # rank 0 moved (a replan, a heal): the same request once more, to the new one
        except (Lost, ValueError):  # sent, then lost: never sent twice
            await front.refresh_now()  # what /health says next is already true
            return _unavailable(front, req, f"rank 0 (job {t.job_id}) was lost before it answered; retry shortly")
    try:
        if up.content_type == "text/event-stream":
            return await _stream(front, req, up, t, _timing(t0))
        try:
            data = await up.read()
        except Lost:
            await front.refresh_now()
            return _unavailable(front, req, f"rank 0 (job {t.job_id}) was lost before it answered; retry shortly")
        headers = _relayed_headers(front, up, _timing(t0))
        if req.method == "HEAD":  # rank 0 declared the length of the body it did not send
            resp = web.StreamResponse(status=up.status, headers=headers)
            declared = up.header("Content-Length")
            resp.content_length = int(declared) if declared and declared.isdigit() else 0
            return resp, front_outcome(up.status)
        return web.Response(status=up.status, body=data, headers=headers), front_outcome(up.status)
    finally:
        up.release()


def _copy_headers(up: Response) -> list[tuple[str, str]]:
    return [(k, v) for k, v in up.headers if k.lower() not in HOP]


def _relayed_headers(front: Front, up: Response, timing: tuple[str, str]) -> CIMultiDict:
    """Rank 0's headers as the front passes them on; a 503 of rank 0 that names no Retry-After (an older rank)
    gets the front's: no 503 leaves the front without one."""
    headers = CIMultiDict([*_copy_headers(up), timing])
    if up.status == 503 and "Retry-After" not in headers:
        headers["Retry-After"] = front.retry_after()
    return headers


def _timing(t0: float) -> tuple[str, str]:
    """How long rank 0 took as the front saw it (its whole answer; a stream's head): what a client's own clock
    says beyond it is the front's cost (bench/front.py, docs/front.md)."""
    return "Server-Timing", f"upstream;dur={(time.perf_counter() - t0) * 1e3:.3f}"


async def _send(resp: web.StreamResponse, data: bytes) -> bool:
    """Part of a stream to the client; False if it left (one that reads nothing for STALL_S is cut off by the
    listener's sweep, which ends this write: no timer per event here)."""
    try:
        await resp.write(data)
        return True
    except ConnectionError:
        return False


async def _stream(front: Front, req: web.BaseRequest, up: Response, t: Target, timing: tuple[str, str]) -> Answer:
    """Forward the events as they arrive (only whole events: a partial one waits for its end); an upstream that
    ends without ``[DONE]`` gets an error event and ``[DONE]`` from here (a partial event at the cut is dropped,
    never sent half)."""
    resp = web.StreamResponse(status=up.status, headers=_relayed_headers(front, up, timing))
    writer = await resp.prepare(req)
    send_headers = getattr(writer, "send_headers", None)  # aiohttp otherwise holds the head until the first event
    if send_headers is not None:
        send_headers()  # the head at once, as rank 0 sent it (first-byte timeouts)
    pending, done = b"", False
    try:
        async for chunk in up.chunks():
            pending = pending + chunk if pending else chunk
            cut = pending.rfind(b"\n\n")
            if cut < 0:
                continue
            out, pending = pending[:cut + 2], pending[cut + 2:]
            if not await _send(resp, out):
                return resp, FrontOutcome.CLIENT_GONE  # our client left: closing upstream cancels it on rank 0
            done = out.endswith(DONE)
    except Lost:
        pass  # rank 0's side broke: said below
    finally:
        up.close()
    if not done:
        if req.transport is None or req.transport.is_closing():
            return resp, FrontOutcome.CLIENT_GONE
        front.healthy = False
        front._wake.set()
        err = error_document(f"rank 0 (job {t.job_id}) was lost mid-answer; retry the request",
                             type=ErrorType.SERVER, code="upstream_lost")
        if not await _send(resp, f"data: {json.dumps(err)}\n\n".encode() + DONE):
            return resp, FrontOutcome.CLIENT_GONE
        outcome = FrontOutcome.UPSTREAM_LOST
    else:
        outcome = front_outcome(up.status)
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp, outcome


# ---- the process --------------------------------------------------------------------------------------------------

async def serve(state: StateDir, cluster: str, host: str, port: int, *, ssh=None, linger: float = 0.0, auto: bool = False,
                ready=None) -> int:
    """Listen on host:port and serve until SIGTERM/SIGINT/SIGHUP (or the linger); returns the exit code."""
    def log(msg: str) -> None:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    front = Front(Follower(state, cluster, ssh or Connector(), log=log), linger=linger,
                  metrics_open=os.environ.get("CLUSTERCTL_METRICS_OPEN") == "1")
    server = front.server = make_server(front)
    try:
        await server.listen(host, port)
    except OSError as e:
        print(f"error: cannot listen on {url_of(host, port)}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 69
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, front.stop.set)
    me = this_coordinator()
    rec = FrontRecord(url=url_of(host, port), bind_host=host, port=port, cluster=cluster, host=me.host, pid=me.pid,
                      start_time=me.start_time, boot_id=me.boot_id, nonce=os.environ.get("CLUSTERCTL_NONCE") or None,
                      started_at=now_iso(), auto=auto, linger_s=linger)
    with contextlib.suppress(Exception):
        await front.refresh()
    write_record(state, rec)
    log(f"front: listening on {rec.url} for cluster {cluster}")
    if ready is not None:
        ready(rec)
    watcher = asyncio.ensure_future(front.watch())
    try:
        await front.stop.wait()
    finally:
        watcher.cancel()
        remove_record(record_path(state, host, port), rec)
        await server.close()
        await front.pool.close()
    log("front: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m clusterctl.front.proxy")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--linger", type=float, default=0.0)
    ap.add_argument("--auto", action="store_true")
    ap.add_argument("--known-hosts")
    ap.add_argument("--accept-new-host-keys", action="store_true")
    a = ap.parse_args(argv)
    ssh = Connector(known_hosts=Path(a.known_hosts) if a.known_hosts else None,
                    accept_new_host_keys=a.accept_new_host_keys)
    return asyncio.run(serve(StateDir(a.state_dir), a.cluster, a.host, a.port, ssh=ssh, linger=a.linger,
                             auto=a.auto))


if __name__ == "__main__":
    sys.exit(main())
