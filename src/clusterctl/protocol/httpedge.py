"""The rules of the HTTP edge, one copy for both servers that face clients: rank 0's API (rank/api/handler.py,
service.py) and the front door (front/proxy.py). Who may call (API keys by tenant, each compared in constant
time), what a browser is told (CORS), the error document (OpenAI's shape), the request body's bound, and the
labels requests are counted by. Pure: no I/O, typed in and out; each server applies them in its own HTTP stack.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping

MAX_BODY = 4 << 20  # bytes of a request body; a larger one is refused (413) before it is read whole
# What a peer can hold before it has shown a key. Both servers decide who may call from the head alone, before
# a byte of the body is read; the body is read only for a request that passed (and then within MAX_BODY and
# BODY_S). An unread body is read and dropped, a buffer at a time, for at most LINGER_S after the answer, so the
# client reads the answer rather than a reset; then the connection closes.
MAX_HEAD = 128 << 10  # a request's line and headers together, bytes (431 beyond)
BODY_S = 60.0  # a body must arrive whole within this long of its head (408 beyond): a dribbled body holds no more
LINGER_S = 2.0  # after an answer that left the body unread, what the client still sends is dropped this long
MAX_IDLE = 256  # connections that answer no request that passed the key check (idle kept-alive ones, heads still
# arriving, refusals lingering): past it the longest-open of them is closed (the front; rank 0 refuses new ones)


def body_too_large(limit: int = MAX_BODY) -> str:
    """The message of a 413: the same words from rank 0 and the front."""
    return f"request body over {limit} bytes"


def is_too_large(length: int, limit: int = MAX_BODY) -> bool:
    return length > limit


def body_too_slow(limit_s: float = BODY_S) -> str:
    """The message of a 408: the same words from rank 0 and the front."""
    return f"the request body did not arrive whole in {limit_s:g} s"


def head_too_large(limit: int = MAX_HEAD) -> str:
    """The message of a 431 for a head whose headers together are too long."""
    return f"the request's line and headers over {limit} bytes"


# ---- the error document -----------------------------------------------------------------------------------------

class ErrorType(StrEnum):
    """OpenAI's error ``type``s that clusterctl answers with."""

    INVALID_REQUEST = "invalid_request_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"


def error_type(status: int) -> ErrorType:
    """The type of an error that names none: the client's fault below 500, the server's from 500."""
    return ErrorType.INVALID_REQUEST if status < 500 else ErrorType.SERVER


def error_document(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``, every key present."""
    return {"error": {"message": message, "type": str(type), "param": param, "code": code}}


UNAUTHORIZED_MESSAGE = "invalid or missing API key"
UNAUTHORIZED_CODE = "invalid_api_key"
CHALLENGE = {"WWW-Authenticate": "Bearer"}  # on every 401


# ---- who may call -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Keys:
    """The API keys by tenant; none: an open API."""

    tenants: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def of(cls, tenant_keys: Mapping[str, str]) -> Keys:
        return cls(tuple((name, key.encode()) for name, key in tenant_keys.items()))

    @property
    def open(self) -> bool:
        return not self.tenants

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant by the key of its ``Authorization: Bearer`` header (every key compared, in constant
        time each); "" for an open API; None for a missing or wrong key."""
        if not self.tenants:
            return ""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[7:].strip().encode()
        found = None
        for name, key in self.tenants:
            if hmac.compare_digest(given, key) and found is None:
                found = name
        return found

    def authorized(self, authorization: str | None) -> bool:
        return self.tenant(authorization) is not None


# ---- browsers -----------------------------------------------------------------------------------------------------

PREFLIGHT = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
             "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600"}


@dataclass(frozen=True)
class Cors:
    """The browser origins the operator allowed (``*``: any); none: no CORS headers at all."""

    origins: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        """Preflights (OPTIONS) are answered, without a key."""
        return bool(self.origins)

    def allowed(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin to answer ``origin`` (the request's Origin header, maybe absent) with:
        ``*`` when any origin is allowed (with or without an Origin header, as browsers and OpenAI's clients
        expect), the origin itself when it is listed, else None."""
        if not self.origins:
            return None
        if "*" in self.origins:
            return "*"
        return origin if origin in self.origins else None

    def headers(self, origin: str | None) -> dict[str, str]:
        """On every answer: who may read it from a browser (``Vary: Origin`` when the answer depends on it)."""
        allowed = self.allowed(origin)
        if allowed is None:
            return {}
        return {"Access-Control-Allow-Origin": allowed, **({"Vary": "Origin"} if allowed != "*" else {})}

    def preflight_headers(self, origin: str | None) -> dict[str, str]:
        """What a preflight's answer adds to ``headers``: the methods and headers a browser may send."""
        return dict(PREFLIGHT) if self.allowed(origin) is not None else {}


@dataclass(frozen=True)
class Access:
    """Who may call, and from which browser origins: what rank 0's contract says, enforced by rank 0 and the front."""

    keys: Keys = Keys()
    cors: Cors = Cors()

    @classmethod
    def of(cls, tenant_keys: Mapping[str, str], cors_origins) -> Access:
        return cls(Keys.of(tenant_keys), Cors(tuple(cors_origins)))

    def authorized(self, authorization: str | None) -> bool:
        return self.keys.authorized(authorization)


# ---- outcomes -----------------------------------------------------------------------------------------------------

class RankOutcome(StrEnum):
    """How a request to rank 0 ended (``clusterctl_requests_total{outcome}``, docs/metrics.md)."""

    OK = "ok"
    CANCELLED = "cancelled"  # the client left, or the request was cancelled: the API's own verdict
    CLIENT_ERROR = "4xx"
    BUSY = "429"
    SERVER_ERROR = "5xx"


def rank_outcome(status: int) -> RankOutcome:
    """An HTTP status as rank 0's outcome: ok, 4xx, 429 or 5xx."""
    if status == 429:
        return RankOutcome.BUSY
    if status >= 500:
        return RankOutcome.SERVER_ERROR
    if status >= 400:
        return RankOutcome.CLIENT_ERROR
    return RankOutcome.OK


class FrontOutcome(StrEnum):
    """How a request to the front ended (``clusterctl_front_requests_total{outcome}``, docs/front.md)."""

    OK = "ok"
    CLIENT_ERROR = "client_error"
    SERVER_ERROR = "server_error"  # rank 0's 5xx, or the front's own failure
    UNAVAILABLE = "unavailable"  # the front's 503: no rank 0 serves
    UPSTREAM_LOST = "upstream_lost"  # rank 0 lost mid-answer
    CLIENT_GONE = "client_gone"


def front_outcome(status: int) -> FrontOutcome:
    """An HTTP status as the front's outcome: ok, client_error or server_error."""
    if status >= 500:
        return FrontOutcome.SERVER_ERROR
    if status >= 400:
        return FrontOutcome.CLIENT_ERROR
    return FrontOutcome.OK
