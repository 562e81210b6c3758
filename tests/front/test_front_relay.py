"""The front's stream relay (front/proxy.py `_stream`) between real sockets: a scripted rank 0 (test_upstream's
`Scripted`) writes server-sent events cut at awkward places, the front's own server (front/listener.py) relays
them to a raw client: whole events only, in order, `[DONE]` at the end; a rank 0 cut mid-event gives the events
before the cut, an error event and `[DONE]`, never half an event."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from test_upstream import Scripted

from clusterctl.front.listener import Listener
from clusterctl.front.proxy import DONE, _stream
from clusterctl.front.upstream import Pool

EVENTS = [b'data: {"n": %d, "text": "%s"}\n\n' % (i, b"x" * (i * 37 % 200)) for i in range(50)]
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def pieces(data: bytes, sizes=(1, 7, 64, 3, 500)) -> list:
    out, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        out += [data[i:i + n], 0.0005]
        i, k = i + n, k + 1
    return out


async def relay(answer) -> tuple[bytes, list]:
    outcomes: list = []
    async with Scripted(answer) as rank0:
        pool = Pool()
        front = SimpleNamespace(healthy=True, _wake=asyncio.Event())

        async def handle(req, body):
            up = await pool.request(rank0.endpoint, "POST", "/v1/completions", [], b"{}")
            t = SimpleNamespace(job_id="j1")
            resp, outcome = await _stream(front, req, up, t, ("Server-Timing", "upstream;dur=1"))
            outcomes.append(outcome)
            return resp

        server = Listener(handle, name="clusterctl", max_body=1 << 20)
        await server.listen("127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        data = await r.read()
        w.close()
        await server.close(grace=0.5)
        await pool.close()
    return data, outcomes


def events_of(data: bytes) -> list[bytes]:
    """The chunked body's events, each one whole as written."""
    head, body = data.split(b"\r\n\r\n", 1)
    assert b"Transfer-Encoding: chunked" in head and b"Server-Timing: upstream;dur=1" in head
    out = b""
    while True:
        size, body = body.split(b"\r\n", 1)
        n = int(size, 16)
        if n == 0:
            break
        chunk, body = body[:n], body[n + 2:]
        assert chunk.endswith(b"\n\n"), chunk  # never half an event
        out += chunk
    return [e + b"\n\n" for e in out.split(b"\n\n") if e]


def test_events_cut_anywhere_arrive_whole_and_in_order():
    data, outcomes = asyncio.run(relay(lambda head, body: [HEAD, *pieces(b"".join(EVENTS) + DONE), "close"]))
    assert events_of(data) == EVENTS + [DONE] and outcomes == ["ok"]


def test_rank0_cut_mid_event_gives_the_whole_ones_then_an_error_and_done():
    stream = b"".join(EVENTS[:10]) + EVENTS[10][:20]  # the connection breaks inside the 11th event
    data, outcomes = asyncio.run(relay(lambda head, body: [HEAD, *pieces(stream), "close"]))
    got = events_of(data)
    assert got[:10] == EVENTS[:10] and got[-1] == DONE and len(got) == 12
    assert json.loads(got[10][6:])["error"]["code"] == "upstream_lost" and outcomes == ["upstream_lost"]
