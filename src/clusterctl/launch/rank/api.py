"""Rank 0's HTTP server: routes, API key, admission (at most max_batch + max_queue requests, then 429), hostile
clients, the JSON / server-sent-event responses and what they tell the metrics (``metrics``, ``GET /metrics``);
generation itself is the step loop's (``steploop``)."""

from __future__ import annotations

import hmac
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from clusterctl.errors import ConfigError
from clusterctl.launch.rank.jobs import ActiveSet, Job, JobQueue
from clusterctl.launch.rank.metrics import Metrics, metrics_open, outcome_of
from clusterctl.launch.rank.openai import ApiError, RequestBuilder
from clusterctl.launch.rank.pipeline import GenResult
from clusterctl.launch.rankspec import RankSpec

MAX_BODY = 4 << 20
CLIENT_POLL_S = 0.25  # how often a waiting HTTP thread checks that its client is still there
# how often the HTTP server's accept loop looks for a shutdown request: a rank's stop waits for it (at 0.2 s,
# rank 0 took 0.25 s from TERM to exit against 0.1 s for the other ranks; a wake-up costs a few microseconds)
HTTP_SHUTDOWN_POLL_S = 0.02
RETRY_AFTER_S = 1  # the Retry-After of a 429 (the batch frees a slot whenever a request finishes)


class Api:
    """The HTTP side of rank 0. Listens from start-up (so /health can say 503) and serves once ``state`` is
    "serving"."""

    def __init__(self, spec: RankSpec, jobs: JobQueue, *, model_name: str, active: ActiveSet | None = None):
        self.spec = spec
        self.jobs = jobs
        self.active = active or ActiveSet()
        self.model_name = model_name
        self.state = "loading"
        self.builder: RequestBuilder | None = None
        self.preparer = None  # admission.Preparer: templates and tokenizer, off the step loop
        self._keys = [(name, key.encode()) for name, key in spec.tenant_keys().items()]
        self._inflight = 0  # requests accepted and not yet answered (in the batch, queued, or being written)
        self._jobs: dict[str, Job] = {}  # those requests, for the batch occupancy a scrape reads
        self.capacity = spec.max_batch + spec.max_queue
        self._lock = threading.Lock()
        self.metrics = Metrics(rank=spec.rank, max_batch=spec.max_batch, max_queue=spec.max_queue,
                               queue_depth=jobs.__len__, occupancy=self.occupancy,
                               serving=lambda: self.state == "serving")
        self.metrics_open = metrics_open()  # read once, on rank 0: /metrics without the API key
        # The listen backlog holds connections not yet accepted. socketserver's default of 5 drops the SYNs of a
        # burst of clients (64 reconnecting at once): the kernel then retries after 1 s, so /health took 1 s.
        server_class = type("RankHTTPServer", (ThreadingHTTPServer,),
                            {"request_queue_size": max(128, 2 * self.capacity)})
        try:
            self.httpd = server_class((spec.http_host, spec.http_port), _handler(self))
        except OSError as e:
            raise ConfigError(f"cannot listen on {spec.http_host}:{spec.http_port}: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": HTTP_SHUTDOWN_POLL_S},
                                        name="http", daemon=True)

    @property
    def endpoint(self) -> str:
        host = self.spec.http_host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def serving(self, limits, tokenizer) -> None:
        """Take requests: ``limits`` (admission.Limits) bound them, ``tokenizer`` prepares them."""
        from clusterctl.launch.rank.admission import Preparer

        self.builder = RequestBuilder(self.spec, limits)
        self.preparer = Preparer(tokenizer, wait_s=self.spec.http_timeout_s)
        self.state = "serving"

    def stop(self, timeout: float = 2.0) -> None:
        """Stop taking requests; fail queued ones; give streams in flight a moment to see their last event."""
        self.state = "stopping"
        for job in self.jobs.drain():
            job.events.put(("error", ApiError(503, "server is shutting down", type="server_error")))
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.02)
        self.httpd.shutdown()
        self.httpd.server_close()

    def admit(self, job: Job) -> None:
        """Take a request if the batch and the queue behind it have room (else 429, raised as ApiError), prepare
        it here on its HTTP thread (template and tokenizer: never on the step loop), then queue it. On an error
        the request holds nothing."""
        with self._lock:
            if self._inflight >= self.capacity:
                raise ApiError(429, f"busy: {self.spec.max_batch} requests in the batch and {self.spec.max_queue} "
                                    "waiting", type="rate_limit_error", retry_after=RETRY_AFTER_S)
            self._inflight += 1
            self._jobs[job.id] = job
        self.active.add(job.id)
        try:
            job.req = self.preparer.prepare(job)
            if not self.jobs.put(job):
                raise ApiError(429, "too many queued requests", type="rate_limit_error", retry_after=RETRY_AFTER_S)
        except BaseException:
            self.active.remove(job.id)
            self.release(job)
            raise

    def leave_queue(self, job: Job) -> bool:
        """Its client left before it joined the batch: out of the queue at once (its admission slot frees now,
        not when the batch has room). False if the step loop took it already."""
        if not self.jobs.remove(job):
            return False
        job.events.put(("done", GenResult(tokens=[], text="", finish_reason="cancelled", prompt_tokens=0)))
        return True

    def release(self, job: Job) -> None:
        """The request's HTTP side is over (answered, refused, or its client left)."""
        with self._lock:
            self._inflight -= 1
            self._jobs.pop(job.id, None)

    def occupancy(self) -> int:
        """Requests in the batch now: joined it, not yet finished (read by a scrape, not per token)."""
        with self._lock:
            jobs = list(self._jobs.values())
        return sum(1 for j in jobs if j.started_at is not None and j.finished_at is None)

    def tenant(self, header: str | None) -> str | None:
        """The caller's tenant by its key (every key compared, in constant time each); "" for an open API; None
        for a missing or wrong key."""
        if not self._keys:
            return ""
        if not header or not header.startswith("Bearer "):
            return None
        given = header[7:].strip().encode()
        found = None
        for name, key in self._keys:
            if hmac.compare_digest(given, key) and found is None:
                found = name
        return found

    def authorized(self, header: str | None) -> bool:
        return self.tenant(header) is not None


def _handler(api: Api):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "clusterctl"
        sys_version = ""
        # a client that sends (or reads) nothing for this long loses its connection: a slow or stalled client
        # can hold a thread, never the server
        timeout = api.spec.http_timeout_s
        # TCP_NODELAY: a response is several small writes (headers, body; a stream's chunks). With Nagle, a write
        # waits for the ACK of the one before, which the client delays (up to 40 ms, more under load).
        disable_nagle_algorithm = True

        def log_message(self, fmt, *args):  # quiet: no request logs on stderr (prompts are private)
            pass

        # -- one outcome per request, counted once it is over: the status sent, unless the handler says better
        # (a stream that ended in an error or a cancel, a client that left); None: not counted (/health, /metrics)
        _outcome: str | None = None

        def handle_one_request(self):
            self._outcome = None
            try:
                super().handle_one_request()
            finally:
                if self._outcome is not None:
                    api.metrics.request_done(self._outcome)

        def send_response(self, code, message=None):
            self._outcome = outcome_of(code)
            super().send_response(code, message)

        # -- helpers
        def send_error(self, code, message=None, explain=None):
            """http.server's own refusals (a request line or header too long, too many headers, a malformed
            request line, an unknown method) as OpenAI-style JSON errors, never its HTML page."""
            from http import HTTPStatus

            self.close_connection = True
            if not str(getattr(self, "request_version", "")).startswith("HTTP/1."):
                self.request_version = "HTTP/1.1"  # unparsed request: still answer with a status line
            headers = getattr(self, "headers", None)
            key = headers.get("Authorization") if headers is not None else None
            if code == HTTPStatus.NOT_IMPLEMENTED and not api.authorized(key):
                # an unknown method (http.server says 501 only for a parsed request) is one more route: without
                # the key the caller learns nothing, not even which methods exist
                err = ApiError(401, "invalid or missing API key", code="invalid_api_key")
                self._json(401, err.body(), {"WWW-Authenticate": "Bearer", "Connection": "close"})
                return
            try:
                phrase = HTTPStatus(code).phrase
            except ValueError:
                phrase = "error"
            err = ApiError(code, message or phrase, type="invalid_request_error" if code < 500 else "server_error")
            data = json.dumps(err.body()).encode()
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(data)

        def _json(self, status: int, obj: dict, extra: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: ApiError) -> None:
            extra = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            if e.status >= 500 or e.status == 429:
                extra = {**(extra or {}), "Connection": "close"}
                self.close_connection = True
            if e.retry_after is not None:
                extra = {**(extra or {}), "Retry-After": str(e.retry_after)}
            self._json(e.status, e.body(), extra)

        def _sse(self, obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _auth(self) -> bool:
            if api.authorized(self.headers.get("Authorization")):
                return True
            self._error(ApiError(401, "invalid or missing API key", type="invalid_request_error",
                                 code="invalid_api_key"))
            return False

        # -- routes
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/health":
                ok = api.state == "serving"
                self._json(200 if ok else 503, {"status": "ok" if ok else api.state})
                self._outcome = None
            elif path == "/metrics":
                self._metrics()
                self._outcome = None
            elif not self._auth():  # every route but /health: no key, no answer (not even which routes exist)
                return
            elif path in ("/v1/models", "/v1/models/" + api.model_name):
                card = {"id": api.model_name, "object": "model", "created": 0, "owned_by": "clusterctl"}
                self._json(200, card if path != "/v1/models" else {"object": "list", "data": [card]})
            else:
                self._error(ApiError(404, f"no route {path}", type="not_found_error"))

        def _metrics(self) -> None:
            """Prometheus text (or OpenMetrics, if the scraper asks); the API key unless the operator opened it."""
            if not api.metrics_open and not self._auth():
                return
            data, content_type = api.metrics.render(self.headers.get("Accept"))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if not self._auth():
                self._drain_body()
                return
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._drain_body()
                self._error(ApiError(404, f"no route {path}", type="not_found_error"))
                return
            try:
                body = self._body()
                if api.state != "serving" or api.builder is None:
                    raise ApiError(503, f"not serving ({api.state})", type="server_error")
                tenant = api.tenant(self.headers.get("Authorization"))
                job = api.builder.chat(body, tenant) if path == "/v1/chat/completions" \
                    else api.builder.completion(body, tenant)
                include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
                    if isinstance(body.get("stream_options") or {}, dict) else False
                want_ids = bool(body.get("return_token_ids"))
                api.admit(job)
            except ApiError as e:
                self._error(e)
                return
            try:
                self._respond(job, include_usage, want_ids)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                job.gone.set()
                job.cancelled.set()
                self.close_connection = True
                self._outcome = "cancelled"
            finally:
                api.release(job)
                api.active.remove(job.id)

        def _not_allowed(self):
            self._drain_body()
            if self._auth():
                self._error(ApiError(405, f"method {self.command} is not allowed", type="invalid_request_error"))

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        _poll_at = 0.0

        def _client_gone(self) -> bool:
            """The client closed its side (EOF or reset) while we wait: it will never read the answer."""
            import select
            import socket

            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                if not readable:
                    return False
                return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True

        def _next(self, job: Job):
            """The job's next event; a client that went away meanwhile cancels it (at the next step boundary,
            on every rank) and the wait goes on until the step loop lets go of the job."""
            while True:
                now = time.monotonic()
                if now >= self._poll_at:  # tokens may arrive non-stop: check on a clock, not on silence
                    self._poll_at = now + CLIENT_POLL_S
                    if not job.gone.is_set() and self._client_gone():
                        job.gone.set()
                        job.cancelled.set()
                        self.close_connection = True
                        api.leave_queue(job)
                try:
                    event = job.events.get(timeout=CLIENT_POLL_S)
                except queue.Empty:
                    continue
                if event[0] == "text" and job.first_token_at is None:
                    job.first_token_at = time.monotonic()
                    api.metrics.first_token(job.first_token_at - job.arrived_at)
                elif event[0] == "done":
                    self._finished(job, event[1])
                return event

        def _finished(self, job: Job, result: GenResult) -> None:
            """A generation is over: its tokens, its time per output token, and a first token that came only
            with the end (all its text was held back, e.g. by a possible stop string)."""
            now, n = time.monotonic(), len(result.tokens)
            api.metrics.tokens(result.prompt_tokens, n)
            if n and job.first_token_at is None:
                job.first_token_at = now
                api.metrics.first_token(now - job.arrived_at)
            elif n >= 2 and result.finish_reason != "cancelled":
                api.metrics.per_output_token((now - job.first_token_at) / (n - 1))

        def _drain_body(self) -> None:
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = 0
            if 0 < n <= MAX_BODY:
                try:
                    self.rfile.read(n)
                except (TimeoutError, OSError):
                    self.close_connection = True
            else:
                self.close_connection = True

        def _body(self) -> dict:
            try:
                n = int(self.headers.get("Content-Length") or -1)
            except ValueError:
                n = -1
            if n < 0:
                self.close_connection = True
                raise ApiError(411, "Content-Length is required")
            if n > MAX_BODY:
                self.close_connection = True
                raise ApiError(413, f"request body over {MAX_BODY} bytes")
            try:
                raw = self.rfile.read(n)
            except (TimeoutError, OSError):
                self.close_connection = True
                raise ApiError(408, f"the request body did not arrive within {api.spec.http_timeout_s:g} s") from None
            if len(raw) < n:
                self.close_connection = True
                raise ApiError(400, f"the request body ended after {len(raw)} of {n} bytes")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise ApiError(400, "request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object")
            return body

        def _respond(self, job: Job, include_usage: bool, want_ids: bool) -> None:
            chat = job.kind == "chat"
            obj = "chat.completion" if chat else "text_completion"
            kind, value = self._next(job)
            if kind == "error":
                if job.gone.is_set():
                    self._outcome = "cancelled"
                else:
                    self._error(value)
                return
            if not job.stream:
                text = []
                while kind == "text":
                    text.append(value)
                    kind, value = self._next(job)
                if job.gone.is_set():
                    self._outcome = "cancelled"
                    return  # the client is gone: nobody to answer
                if kind == "error":
                    self._error(value)
                    return
                result: GenResult = value
                choice: dict = {"index": 0, "finish_reason": result.finish_reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": result.text}
                else:
                    choice.update(text=result.text, logprobs=None)
                if want_ids:
                    choice["token_ids"] = result.tokens
                self._json(200, {"id": job.id, "object": obj, "created": job.created, "model": api.model_name,
                                 "choices": [choice], "usage": _usage(result)})
                self._outcome = "cancelled" if result.finish_reason == "cancelled" else "ok"
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(delta: str | None, finish: str | None, role: bool = False, extra: dict | None = None):
                if chat:
                    d: dict = {}
                    if role:
                        d["role"] = "assistant"
                    if delta is not None:
                        d["content"] = delta
                    c = {"index": 0, "delta": d, "finish_reason": finish}
                else:
                    c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
                c.update(extra or {})
                out = {"id": job.id, "object": chunk_obj, "created": job.created, "model": api.model_name,
                       "choices": [c]}
                if include_usage:
                    out["usage"] = None
                self._sse(out)

            if chat:
                chunk("", None, role=True)
            while kind == "text":
                chunk(value, None)
                kind, value = self._next(job)
            if kind == "error":
                if job.gone.is_set():
                    self._outcome = "cancelled"
                    return  # an aborted request is never reported as a server error: nobody is there
                self._outcome = outcome_of(value.status)  # the status line said 200; the request failed
                self._sse({"error": value.body()["error"]})
                self._sse("[DONE]")
                return
            result = value
            if result.finish_reason == "cancelled" or job.gone.is_set():
                self._outcome = "cancelled"
            chunk(None if chat else "", result.finish_reason,
                  extra={"token_ids": result.tokens} if want_ids else None)
            if include_usage:
                self._sse({"id": job.id, "object": chunk_obj, "created": job.created, "model": api.model_name,
                           "choices": [], "usage": _usage(result)})
            self._sse("[DONE]")

    return Handler


def _usage(r: GenResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
            "total_tokens": r.prompt_tokens + len(r.tokens)}
