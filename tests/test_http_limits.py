"""``xcosd.http.HttpServer`` against careless and hostile clients, over real sockets
on loopback (the whole of 127/8 is loopback, so 127.0.0.2 is another client
address): a client address over its connection cap is refused at once with an
error object while other addresses are served, the server as a whole too; a body
that does not arrive whole in time gets 408; a client that stops reading a
streamed response is dropped once its buffer has stayed full, which ends the
response's producer; a head that is not HTTP gets a 400 error object."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from xcosd.http import ConnectionLimits, HttpServer
from xcosd.http.limits import address_key

from .helpers.waits import HANG_S, until


class _Streams:
    """An app whose ``/stream`` sends chunks for as long as its client stays, and
    notes when a stream's producer has ended."""

    def __init__(self) -> None:
        self.ended = 0
        self.bodies: list[bytes] = []

    async def hello(self, request: Request) -> PlainTextResponse:
        return PlainTextResponse("hi")

    async def echo(self, request: Request) -> PlainTextResponse:
        body = await request.body()
        self.bodies.append(body)
        return PlainTextResponse(str(len(body)))

    async def stream(self, request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"x" * 4096
                    await asyncio.sleep(0)
            finally:
                self.ended += 1

        return StreamingResponse(chunks())

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/", self.hello), Route("/echo", self.echo,
                                                               methods=["POST"]),
                                 Route("/stream", self.stream)])


async def _connect(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _get(url: str, source: str) -> httpx.Response:
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(transport=transport, timeout=HANG_S) as c:
        return await c.get(url + "/")


def _error(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_an_address_key_is_the_ipv4_address_or_the_ipv6_64() -> None:
    assert address_key("127.0.0.2") == "127.0.0.2"
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9")
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key(None) == "local"


async def test_an_address_over_its_cap_is_refused_at_once_and_others_are_served() -> None:
    limits = ConnectionLimits(max_connections=6, max_per_address=3, head_timeout_s=HANG_S)
    async with HttpServer(_Streams().app(), limits=limits) as server:
        held = [await _connect(server.port, "127.0.0.1") for _ in range(3)]
        for _, w in held:  # each sends part of a head and stalls
            w.write(b"GET / HTTP/1.1\r\n")
        await until(lambda: server.slots.total == 3, "three held connections")
        # one more from that address: an error object at once, then the close
        r, w = await _connect(server.port, "127.0.0.1")
        status, err = _error(await asyncio.wait_for(r.read(), HANG_S))
        assert status == 429 and err["code"] == "too_many_connections"
        assert err["type"] == "rate_limit_error"
        w.close()
        # another address is served all the while
        assert (await _get(server.url, "127.0.0.2")).text == "hi"
        # the server as a whole: full at 6, then 503 for anyone
        more = [await _connect(server.port, f"127.0.0.{3 + i}") for i in range(3)]
        await until(lambda: server.slots.total == 6, "six held connections")
        r, w = await _connect(server.port, "127.0.0.9")
        status, err = _error(await asyncio.wait_for(r.read(), HANG_S))
        assert status == 503 and err["code"] == "server_full"
        w.close()
        assert server.slots.refused == 2
        for _, w in held + more:
            w.close()
        await until(lambda: server.slots.total == 0 and not server.slots.held,
                    "every slot given back")
        assert (await _get(server.url, "127.0.0.1")).text == "hi"


async def test_a_body_that_does_not_arrive_whole_in_time_gets_408() -> None:
    app = _Streams()
    async with HttpServer(app.app(), limits=ConnectionLimits(body_timeout_s=0.3)) as server:
        r, w = await _connect(server.port, "127.0.0.1")
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")

        async def trickle() -> None:  # a byte at a time, each well inside the deadline
            with contextlib.suppress(ConnectionError):
                while not r.at_eof():
                    w.write(b"a")
                    await w.drain()
                    await asyncio.sleep(0.02)

        trickler = asyncio.ensure_future(trickle())
        status, err = _error(await asyncio.wait_for(r.read(), HANG_S))
        assert status == 408 and err["code"] == "body_timeout"
        await asyncio.wait_for(trickler, HANG_S)
        await until(lambda: server.slots.total == 0, "the connection let go")
        assert app.bodies == []  # the application never got a partial body as whole
        # a body that comes whole in time is read as usual
        async with httpx.AsyncClient() as c:
            assert (await c.post(server.url + "/echo", content=b"b" * 5000)).text == "5000"


async def test_a_client_that_stops_reading_is_dropped_once_its_buffer_stays_full() -> None:
    app = _Streams()
    limits = ConnectionLimits(write_buffer_bytes=16 << 10, write_timeout_s=0.3)
    async with HttpServer(app.app(), limits=limits) as server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
        try:
            await until(lambda: app.ended == 1, "the stream's producer to end")
            await until(lambda: server.slots.total == 0, "the reader dropped")
        finally:
            sock.close()
        # a reader that reads is served
        async with httpx.AsyncClient() as c, c.stream("GET", server.url + "/stream") as resp:
            got = 0
            async for chunk in resp.aiter_bytes():
                got += len(chunk)
                if got > 1 << 20:
                    break
        assert got > 1 << 20


@pytest.mark.parametrize("head", [b"\x00\xff garbage\r\n\r\n",
                                  b"GET / HTTP/1.1\r\nX: " + b"a" * 5000])
async def test_a_head_that_is_not_http_gets_a_400_error_object(head: bytes) -> None:
    async with HttpServer(_Streams().app(), limits=ConnectionLimits(max_head_bytes=1024)) as s:
        r, w = await _connect(s.port, "127.0.0.1")
        w.write(head)
        status, err = _error(await asyncio.wait_for(r.read(), HANG_S))
        assert status == 400 and err["code"] == "invalid_http"
        assert err["type"] == "invalid_request_error"
        w.close()


def test_edge_serve_options_make_the_servers_limits() -> None:
    from xcosd.cli import build_parser
    from xcosd.commands.http_limits import connection_limits

    p = build_parser()
    base = ["edge", "serve", "--http", "127.0.0.1:0"]
    d = connection_limits(p.parse_args([*base, "--max-in-flight", "10"]))
    assert (d.max_connections, d.max_per_address) == (4 * 10 + 16, 10)
    assert (d.head_timeout_s, d.body_timeout_s, d.write_timeout_s) == (10.0, 30.0, 10.0)
    assert d.write_buffer_bytes == 64 << 10
    a = connection_limits(p.parse_args([
        *base, "--max-connections", "50", "--max-connections-per-address", "80",
        "--head-timeout", "2", "--body-timeout", "3", "--write-buffer-kib", "16",
        "--write-timeout", "4"]))
    # an address never holds more than the whole server
    assert (a.max_connections, a.max_per_address) == (50, 50)
    assert (a.head_timeout_s, a.body_timeout_s, a.write_timeout_s) == (2.0, 3.0, 4.0)
    assert a.write_buffer_bytes == 16 << 10
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--head-timeout", "0"])
