"""Rank 0's routes: one small function each, in one table (``ROUTES``), with and without the ``/v1`` prefix.

Who may call what: ``GET /health`` needs no key; a CORS preflight (``OPTIONS``) needs none when the operator
allowed origins (a browser sends no credentials with it); ``GET /metrics`` needs one unless the operator opened
it; everything else needs a key, and without one the answer is 401 whatever the path or method — an
unauthenticated caller learns nothing, not even which routes exist."""

from __future__ import annotations

from clusterctl.rank.api.wire import RETRY_503_S, UNAUTHORIZED, ApiError
from clusterctl.rank.choices import serve


def health(api, h) -> None:
    ok = api.state.serving
    h.json(200 if ok else 503, {"status": "ok" if ok else api.state.now.value},
           None if ok else {"Retry-After": str(RETRY_503_S)})  # every 503 says when to come back
    h.outcome = None


def metrics(api, h) -> None:
    """Prometheus text (or OpenMetrics, if the scraper asks)."""
    data, content_type = api.metrics.render(h.headers.get("Accept"))
    h.raw(200, data, content_type)
    h.outcome = None


def models(api, h) -> None:
    h.json(200, {"object": "list", "data": [api.model_card()]})


def model(api, h) -> None:
    h.json(200, api.model_card())


def no_model(api, h) -> None:
    """GET /v1/models/<a name this server does not serve>: OpenAI's 404 model_not_found (clients catch it by its
    code, e.g. to tell a missing model from a missing route)."""
    h.error(api.model_not_found(h.path.split("?", 1)[0].split("/models/", 1)[1]))


def completions(api, h) -> None:
    serve(api, h, "completion")


def chat_completions(api, h) -> None:
    serve(api, h, "chat")


# (method, path) -> (route, who may call it: "anyone" | "metrics" (the key unless opened) | "key")
ROUTES = {
    ("GET", "/health"): (health, "anyone"),
    ("GET", "/metrics"): (metrics, "metrics"),
    ("GET", "/v1/models"): (models, "key"),
    ("POST", "/v1/completions"): (completions, "key"),
    ("POST", "/v1/chat/completions"): (chat_completions, "key"),
}
PREFIX = "/v1"


def _find(api, method: str, path: str):
    """(route, access) for this method and path; (None, known path?) when there is none."""
    if not path.startswith(PREFIX + "/") and path not in ("/health", "/metrics"):
        path = PREFIX + path  # the same routes without /v1, as mlx_lm.server and OpenAI-compatible servers serve
    hit = ROUTES.get((method, path))
    if hit is not None:
        return hit, True
    if method == "GET" and path.startswith(PREFIX + "/models/"):
        return (model if api.knows_model(path[len(PREFIX) + 8:]) else no_model, "key"), True
    return None, any(p == path for _, p in ROUTES)


def dispatch(api, h, method: str, path: str) -> None:
    hit, known = _find(api, method, path)
    if method == "OPTIONS" and api.cors_origins:
        h.drain_body()
        h.no_content(api.preflight_headers(h.headers.get("Origin")))
        h.outcome = None
        return
    access = hit[1] if hit is not None else "key"
    if access == "key" or (access == "metrics" and not api.metrics_open):
        if h.tenant() is None:
            if method != "GET":
                h.drain_body()
            h.error(UNAUTHORIZED)
            if access == "metrics":
                h.outcome = None  # a scrape, refused or not, is not an API request
            return
    if hit is None:
        if method != "GET":
            h.drain_body()
        if known:
            h.error(ApiError(405, f"method {method} is not allowed", type="invalid_request_error"))
        else:
            h.error(ApiError(404, f"no route {path}", type="not_found_error"))
        return
    hit[0](api, h)
