"""Rank 0's HTTP server: its state, who may call it (API keys by tenant, CORS origins), which model names it
answers to, and admission (at most max_batch + max_queue requests, then 429). The HTTP plumbing is handler.py,
the routes routes.py, the answers respond.py; generation itself is the step loop's (``steploop``)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time

from clusterctl.errors import ConfigError
from clusterctl.rank.api.phase import Phase, ServingPhase
from clusterctl.rank.api.handler import RankHTTPServer, make_handler
from clusterctl.rank.engine.requestqueue import ActiveSet, ApiRequest, Done, Failed, RequestQueue
from clusterctl.rank.metrics import Metrics, metrics_open
from clusterctl.rank.api.openai import ApiError, RequestBuilder
from clusterctl.rank.engine.generation import GenResult
from clusterctl.protocol.httpedge import MAX_IDLE, Access
from clusterctl.protocol.rankspec import RankSpec
from clusterctl.rank.api.admission import Preparer
from clusterctl.rank.grammar.compiler import Compiler, GrammarRefused, Refusal

COSTLY = (Refusal.COMPILE_COST, Refusal.MASK_COST, Refusal.PARSER_LIMIT)  # refused for what they would cost the ranks

# the name clients written for mlx_lm.server send for "the model this server serves"
SERVED_MODEL_ALIASES = ("default_model",)
# The HTTP server's accept loop blocks without a timeout, so an idle rank 0 wakes for nothing (it looked for a
# shutdown every 20 ms: 0.2-0.3 % of a core, idle); a stop wakes it with a connection of its own (``_wake_accept``).
WAKE_ACCEPT_S = 0.02  # the stop's connection is made again this often until the loop has ended
RETRY_AFTER_S = 1  # the Retry-After of a 429 (the batch frees a slot whenever a request finishes)


class Api:
    """The HTTP side of rank 0. Listens from start-up (so /health can say 503) and serves once ``state`` is
    "serving"."""

    def __init__(self, spec: RankSpec, queue: RequestQueue, *, model_name: str, active: ActiveSet | None = None):
        self.spec = spec
        self.queue = queue
        self.active = active or ActiveSet()
        self.model_name = model_name
        self.model_names = {model_name, *SERVED_MODEL_ALIASES, *spec.model_aliases}
        self.access = Access.of(spec.tenant_keys(), spec.cors_origins)  # keys and CORS (protocol/httpedge.py)
        self.cors_origins = list(spec.cors_origins)
        # what the answers' system_fingerprint says: this deployment and its placement (a replan changes it)
        self.fingerprint = "fp_" + hashlib.sha256(json.dumps(
            [spec.deployment_id, spec.layer_counts, spec.parallel, spec.schedule]).encode()).hexdigest()[:12]
        self.state = ServingPhase()  # loading -> serving -> stopping | failed (phase.py)
        self.builder: RequestBuilder | None = None
        self.preparer = None  # admission.Preparer: templates and tokenizer, off the step loop
        self.compiler: Compiler | None = None  # grammars, off the step loop (compiler.py)
        self._inflight = 0  # requests accepted and not yet answered (in the batch, queued, or being written)
        self._requests: dict[str, ApiRequest] = {}  # those requests, for the batch occupancy a scrape reads
        self.capacity = spec.max_batch + spec.max_queue
        self._lock = threading.Lock()
        self.metrics = Metrics(rank=spec.rank, max_batch=spec.max_batch, max_queue=spec.max_queue,
                               queue_depth=queue.__len__, occupancy=self.occupancy,
                               serving=lambda: self.state.serving)
        self.metrics_open = metrics_open()  # read once, on rank 0: /metrics without the API key
        # The listen backlog holds connections not yet accepted. socketserver's default of 5 drops the SYNs of a
        # burst of clients (64 reconnecting at once): the kernel then retries after 1 s, so /health took 1 s.
        server_class = type("RankHTTPServer", (RankHTTPServer,), {"request_queue_size": max(128, 2 * self.capacity),
                                                                  "max_connections": self.capacity + MAX_IDLE})
        try:
            self.httpd = server_class((spec.http_host, spec.http_port), make_handler(self))
        except OSError as e:
            raise ConfigError(f"cannot listen on {spec.http_host}:{spec.http_port}: {e.strerror or e}") from None
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": None},
                                        name="http", daemon=True)

    @property
    def endpoint(self) -> str:
        host = self.spec.http_host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def serving(self, limits, tokenizer) -> None:
        """Take requests: ``limits`` (admission.Limits) bound them, ``tokenizer`` prepares them."""

        self.builder = RequestBuilder(self.spec, limits)
        self.preparer = Preparer(tokenizer, wait_s=self.spec.http_timeout_s)
        self.compiler = Compiler(tokenizer)
        self.compiler.warm()
        self.state.to(Phase.SERVING)  # (not after a stop: phase.py)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop taking requests; fail queued ones; give streams in flight a moment to see their last event."""
        self.state.to(Phase.STOPPING)
        for api_req in self.queue.drain():
            api_req.events.put(Failed(ApiError(503, "server is shutting down", type="server_error")))
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        self._wake_accept()
        self.httpd.server_close()

    def _wake_accept(self, timeout: float = 5.0) -> None:
        """Shut the accept loop down: it blocks until a connection comes, so connect to it (again, until it has
        seen the shutdown; the connection is closed unread: nothing is counted)."""
        down = threading.Thread(target=self.httpd.shutdown, name="http-shutdown", daemon=True)
        down.start()
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.spec.http_host, self.spec.http_host)
        deadline = time.monotonic() + timeout
        while down.is_alive() and time.monotonic() < deadline:
            try:
                socket.create_connection((host, self.port), timeout=WAKE_ACCEPT_S * 5).close()
            except OSError:
                pass
            down.join(WAKE_ACCEPT_S)

    def fail_everyone(self, err: ApiError, wait_s: float = 1.0) -> None:
        """The rank is about to end (a lost peer, a stale lease): every request accepted and not yet answered
        gets ``err`` as its last event (a stream: an error event, then ``[DONE]``; otherwise the error as the
        answer), and its HTTP thread up to ``wait_s`` to write it. A client never meets a cut connection while
        rank 0 can still speak."""
        self.state.to(Phase.FAILED)
        with self._lock:
            accepted = list(self._requests.values())
        for api_req in accepted:
            api_req.events.put(Failed(err))
        deadline = time.monotonic() + wait_s
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)

    def admit(self, api_req: ApiRequest, *, enqueue: bool = True) -> None:
        """Take a request if the batch and the queue behind it have room (else 429, raised as ApiError), prepare
        it here on its HTTP thread (template and tokenizer: never on the step loop), then queue it (``enqueue``
        False: its choices are queued instead, choices.py). On an error the request holds nothing."""
        with self._lock:
            if self._inflight >= self.capacity:
                raise ApiError(429, f"busy: {self.spec.max_batch} requests in the batch and {self.spec.max_queue} "
                                    "waiting", type="rate_limit_error", retry_after=RETRY_AFTER_S)
            self._inflight += 1
            self._requests[api_req.id] = api_req
        self.active.add(api_req.id)
        try:
            api_req.req = self.preparer.prepare(api_req)
            api_req.grammar = self._compile(api_req.req)
            if enqueue and not self.queue.put(api_req):
                raise ApiError(429, "too many queued requests", type="rate_limit_error", retry_after=RETRY_AFTER_S)
        except BaseException:
            self.active.remove(api_req.id)
            self.release(api_req)
            raise

    def _compile(self, req):
        """The request's grammar compiled here, on a worker of its own within a CPU budget (compiler.py), before
        it is queued: a grammar that cannot be served, or would cost the ranks too much, is a 400 now."""
        if req.grammar is None:
            return None
        try:
            return self.compiler.admit(req, wait_s=self.spec.http_timeout_s)
        except GrammarRefused as e:
            param = "response_format" if "response_format" in req.grammar else "tool_choice"
            raise ApiError(400, str(e), param="max_tokens" if e.kind is Refusal.BUDGET else param,
                           code="grammar_too_costly" if e.kind in COSTLY else None) from None
        except TimeoutError:
            raise ApiError(503, "busy compiling other requests' grammars", type="server_error", code="grammar_busy",
                           retry_after=RETRY_AFTER_S) from None

    def leave_queue(self, api_req: ApiRequest) -> bool:
        """Its client left before it joined the batch: out of the queue at once (its admission slot frees now,
        not when the batch has room). False if the step loop took it already."""
        if not self.queue.remove(api_req):
            return False
        api_req.events.put(Done(GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0)))
        return True

    def release(self, api_req: ApiRequest) -> None:
        """The request's HTTP side is over (answered, refused, or its client left)."""
        with self._lock:
            self._inflight -= 1
            self._requests.pop(api_req.id, None)

    def occupancy(self) -> int:
        """Requests in the batch now: joined it, not yet finished (read by a scrape, not per token)."""
        with self._lock:
            accepted = list(self._requests.values())
        return sum(1 for r in accepted if r.started_at is not None and r.finished_at is None)

    def tenant(self, header: str | None) -> str | None:
        """The caller's tenant by its key; "" for an open API; None for a missing or wrong key."""
        return self.access.keys.tenant(header)

    def authorized(self, header: str | None) -> bool:
        return self.tenant(header) is not None

    # -- the model's names

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "clusterctl"}

    def knows_model(self, name: str) -> bool:
        return name in self.model_names

    def check_model(self, name) -> None:
        """A request's ``model``: absent, the served model's id, or an alias (the operator's, or mlx_lm.server's
        ``default_model``); anything else is 404 model_not_found, as OpenAI answers."""
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", param="model")
        if name not in self.model_names:
            raise self.model_not_found(name)

    def model_not_found(self, name: str) -> ApiError:
        """OpenAI's answer for a model it does not serve: 404, code model_not_found, param model, its message."""
        shown = name if len(name) <= 80 else name[:77] + "..."
        return ApiError(404, f"The model '{shown}' does not exist", param="model", code="model_not_found")

    # -- browsers (CORS): the edge's rule (protocol/httpedge.py), the same as the front's

    def cors_headers(self, origin: str | None) -> dict:
        """On every answer when the operator allowed origins: who may read it from a browser."""
        return self.access.cors.headers(origin)

    def preflight_headers(self, origin: str | None) -> dict:
        return self.access.cors.preflight_headers(origin)
