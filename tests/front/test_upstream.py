"""The front's client to rank 0 (front/upstream.py, aiohttp's client) against scripted servers on loopback: real
sockets, answers written byte for byte, so each way an answer can end (framed, chunked, with the connection, cut)
is met, and the two failures (never sent, lost after sending) are told apart."""

from __future__ import annotations

import asyncio
import socket

import pytest

from clusterctl.front.upstream import READ_BUFSIZE, Lost, NotSent, Pool, address


class Scripted:
    """A server that reads each request head (and its Content-Length body) and answers what ``answer`` returns:
    bytes to write, then ``close`` to end the connection. Counts connections and keeps the requests."""

    def __init__(self, answer):
        self.answer, self.connections, self.requests = answer, 0, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.endpoint = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":")[1])
                body = await r.readexactly(n) if n else b""
                self.requests.append((head, body))
                for part in self.answer(head, body):
                    if part == "close":
                        w.close()
                        return
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                        continue
                    w.write(part)
                    await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()


def ok(body: bytes = b'{"ok":true}', ctype: bytes = b"application/json"):
    return lambda head, _: [b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_kept_alive_connections_are_reused_and_the_request_is_sent_as_given():
    async def go():
        async with Scripted(ok()) as s:
            pool = Pool()
            for i in range(3):
                up = await pool.request(s.endpoint, "POST", f"/v1/x?i={i}", [("Authorization", "Bearer k")],
                                        b'{"a":1}')
                assert (up.status, up.content_type, await up.read()) == (200, "application/json", b'{"ok":true}')
                up.release()
            await pool.close()
            return s

    s = run(go())
    assert s.connections == 1
    head, body = s.requests[2]
    assert head.startswith(b"POST /v1/x?i=2 HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in head
    assert b"Content-Length: 7\r\n" in head and body == b'{"a":1}'
    # nothing of aiohttp's own: no User-Agent, Accept or Content-Type the client did not send
    assert b"User-Agent" not in head and b"Accept" not in head and b"Content-Type" not in head


def test_a_stream_arrives_as_it_is_written_and_ends_with_the_connection():
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]

    def answer(head, body):
        yield b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        for e in events:
            yield e
            yield 0.05
        yield "close"

    async def go():
        async with Scripted(answer) as s:
            pool = Pool()
            up = await pool.request(s.endpoint, "POST", "/v1/chat/completions", [], b"{}")
            assert up.content_type == "text/event-stream"
            got = [c async for c in up.chunks()]
            up.release()
            await pool.close()
            return got

    got = run(go())
    assert b"".join(got) == b"".join(events) and len(got) == 3  # one read per event: nothing held back


def test_a_chunked_answer_is_decoded():
    async def go():
        async with Scripted(lambda h, b: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
                                          0.02, b"2\r\nde\r\n0\r\n\r\n"]) as s:
            pool = Pool()
            up = await pool.request(s.endpoint, "GET", "/", [])
            data = await up.read()
            up.release()
            up2 = await pool.request(s.endpoint, "GET", "/", [])  # the same connection, after a chunked answer
            data2 = await up2.read()
            up2.release()
            await pool.close()
            return data, data2, s.connections

    assert run(go()) == (b"abcde", b"abcde", 1)


def test_an_answer_cut_before_its_end_is_lost():
    async def go():
        async with Scripted(lambda h, b: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", "close"]) as s:
            pool = Pool()
            up = await pool.request(s.endpoint, "GET", "/", [])
            with pytest.raises(Lost):
                await up.read()
            up.release()
            await pool.close()

    run(go())


async def one(endpoint: str, method: str = "GET", target: str = "/", body: bytes = b""):
    """One request on a pool of its own, closed after it."""
    pool = Pool()
    try:
        up = await pool.request(endpoint, method, target, [], body)
        return up.status, await up.read()
    finally:
        await pool.close()


def test_a_connection_closed_before_any_answer_is_lost_not_unsent():
    async def go():
        async with Scripted(lambda h, b: ["close"]) as s:
            with pytest.raises(Lost):
                await one(s.endpoint, "POST", "/v1/completions", b"{}")
            assert s.connections == 1  # sent once: never again

    run(go())


def test_nothing_listening_is_not_sent():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def go():
        with pytest.raises(NotSent):
            await one(f"http://127.0.0.1:{port}", "GET", "/health")

    run(go())


def test_an_answer_that_does_not_parse_is_lost():
    async def go():
        async with Scripted(lambda h, b: [b"NOT HTTP AT ALL\r\n\r\n"]) as s:
            with pytest.raises(Lost):
                await one(s.endpoint)

    run(go())


def test_head_ends_without_a_body():
    async def go():
        async with Scripted(lambda h, b: [b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n"]) as s:
            pool = Pool()
            up = await pool.request(s.endpoint, "HEAD", "/health", [])
            assert (up.status, up.header("Content-Length"), await up.read()) == (200, "42", b"")
            up.release()
            await pool.close()

    run(go())


def test_an_idle_connection_is_dropped_after_idle_s():
    async def go():
        async with Scripted(ok()) as s:
            pool = Pool(idle_s=0.1)
            for _ in range(2):
                up = await pool.request(s.endpoint, "GET", "/", [])
                await up.read()
                up.release()
                await asyncio.sleep(0.3)
            await pool.close()
            return s.connections

    assert run(go()) == 2


def test_a_slow_reader_still_gets_every_byte():
    """An answer far larger than what is read ahead (reading from rank 0 pauses meanwhile), read late."""
    big = b"x" * (48 * READ_BUFSIZE)

    async def go():
        async with Scripted(ok(big)) as s:
            pool = Pool()
            up = await pool.request(s.endpoint, "GET", "/", [])
            await asyncio.sleep(0.3)  # the answer arrives while nobody reads it
            data = b"".join([c async for c in up.chunks()])
            up.release()
            await pool.close()
            return data

    assert run(go()) == big


def test_address():
    assert address("http://127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert address("http://[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError):
        address("https://h:1")


def test_header_values_in_utf8_arrive_as_sent():
    async def go():
        answer = b"HTTP/1.1 200 OK\r\nX-A: caf\xc3\xa9\r\nContent-Length: 0\r\n\r\n"
        async with Scripted(lambda head, _: [answer]) as srv:
            pool = Pool()
            up = await pool.request(srv.endpoint, "GET", "/", [("X-Q", "d\u00e9j\u00e0")])
            await up.read()
            up.release()
            await pool.close()
            return dict(up.headers), srv.requests[0][0]

    got, head = run(go())
    assert got["X-A"] == "caf\u00e9" and "X-Q: d\u00e9j\u00e0".encode() in head
