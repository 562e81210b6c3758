"""The front's client to rank 0: aiohttp's client over a pool of kept-alive connections (its connector), each
answer handed over as its bytes arrive.

Two failures are told apart, because only one of them makes resending safe (front/proxy.py):

- ``NotSent``: rank 0 was never reached (the connection refused, or not made in ``CONNECT_S``);
- ``Lost``: the connection broke (or rank 0's answer did not parse) after the request was written: it may have
  run, so it is never sent again (aiohttp itself resends only an idempotent request, GET or HEAD, whose kept-alive
  connection rank 0 had closed).

An idle connection is kept ``IDLE_S`` at most (well under rank 0's own 30 s) so that a request is not written
into a connection rank 0 is closing. The request goes as the client sent it: its target still percent-encoded,
its headers (hop-by-hop ones excepted, front/proxy.py) and no others (no User-Agent, Accept or Content-Type of
aiohttp's own).
"""

from __future__ import annotations

import functools
from typing import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from yarl import URL

CONNECT_S = 5.0
IDLE_S = 5.0
READ_BUFSIZE = 1 << 16  # bytes read ahead of the front; reading from rank 0 pauses past twice this (a slow client)
_NOT_ADDED = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class NotSent(ConnectionError):
    """Rank 0 was never reached: the request can be sent again."""


class Lost(ConnectionError):
    """The connection broke after the request was written: it may have run."""


@functools.lru_cache(maxsize=64)
def address(endpoint: str) -> tuple[str, int]:
    """``http://host:port`` (``[v6]:port`` too) as the (host, port) to connect to."""
    u = urlsplit(endpoint)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ValueError(f"not an http://host:port endpoint: {endpoint!r}")
    return u.hostname, u.port


class Response:
    """One answer of rank 0: ``status`` and ``headers`` (pairs, as sent), the body through ``read`` or ``chunks``.
    ``release`` gives the connection back to the pool if the answer was read to its end (else closes it);
    ``close`` always closes it."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status = resp.status
        self.headers: list[tuple[str, str]] = list(resp.headers.items())

    @property
    def content_type(self) -> str:
        return self._resp.content_type.lower() if "Content-Type" in self._resp.headers else ""

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ``Lost`` if the connection breaks before its end."""
        try:
            async for data in self._resp.content.iter_any():
                yield data
        except (aiohttp.ClientError, OSError) as e:
            raise Lost(f"the connection to rank 0 broke: {e or type(e).__name__}") from None

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, OSError) as e:
            raise Lost(f"the connection to rank 0 broke: {e or type(e).__name__}") from None

    def release(self) -> None:
        if self._resp.content.is_eof():
            self._resp.release()
        else:
            self._resp.close()

    def close(self) -> None:
        self._resp.close()


class Pool:
    """Kept-alive connections to rank 0 endpoints (whichever the front follows), one request on each at a time."""

    def __init__(self, *, idle_s: float = IDLE_S, connect_s: float = CONNECT_S):
        self.idle_s, self.connect_s = idle_s, connect_s
        self._session: aiohttp.ClientSession | None = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the running loop, on first use
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.idle_s),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, skip_auto_headers=_NOT_ADDED,
                read_bufsize=READ_BUFSIZE)
        return self._session

    async def request(self, endpoint: str, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes = b"") -> Response:
        """Send one request and wait for the head of its answer. ``NotSent`` or ``Lost`` when it fails."""
        host, port = address(endpoint)
        url = URL(f"http://{'[' + host + ']' if ':' in host else host}:{port}{target}", encoded=True)
        try:
            resp = await self._get().request(method, url, headers=CIMultiDict(headers), data=body or None,
                                             allow_redirects=False)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise NotSent(f"cannot connect to {host}:{port}: {e}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise Lost(f"the connection to rank 0 broke: {e or type(e).__name__}") from None
        return Response(resp)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
