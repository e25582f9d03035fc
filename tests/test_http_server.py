"""``xcosd.http.HttpServer``: uvicorn embedded in the caller's loop, over real
sockets on loopback. It leaves the process's signal handlers alone, gets a free
port for port 0, gives its connections TCP_NODELAY (else a keep-alive client waits
out a delayed ACK on every response), drops a client whose request head does not
arrive in time, and lets nothing run on after ``close``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from xcosd.http import ConnectionLimits, HttpServer

from .helpers.slow_http import trickle_head
from .helpers.waits import HANG_S, until


async def _hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hi")


def _app() -> Starlette:
    return Starlette(routes=[Route("/", _hello)])


async def test_serves_on_a_free_port_and_leaves_signals_alone() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    async with HttpServer(_app()) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        assert {s: signal.getsignal(s) for s in before} == before
        async with httpx.AsyncClient() as c:
            assert (await c.get(server.url + "/")).text == "hi"
    assert {s: signal.getsignal(s) for s in before} == before
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_connections_have_tcp_nodelay() -> None:
    async with HttpServer(_app()) as server, httpx.AsyncClient() as c:
        await c.get(server.url + "/")
        conns = list(server._server.server_state.connections)
        assert conns
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_a_head_that_does_not_arrive_in_time_is_dropped() -> None:
    async with HttpServer(_app(), limits=ConnectionLimits(head_timeout_s=0.3)) as server:
        r1, w1 = await asyncio.open_connection("127.0.0.1", server.port)  # sends nothing
        r2, w2 = await asyncio.open_connection("127.0.0.1", server.port)

        trickler = asyncio.get_running_loop().create_task(
            trickle_head(r2, w2, b"GET / HTTP/1.1\r\n"))
        async with httpx.AsyncClient() as c:  # meanwhile others are served
            assert (await c.get(server.url + "/")).status_code == 200
        # one that sent nothing is closed; one that sent part of a head is told why
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(r1.read(), HANG_S) == b""
        got = await asyncio.wait_for(r2.read(), HANG_S)
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == "head_timeout"
        await asyncio.wait_for(trickler, HANG_S)
        await until(lambda: server.connections == 0, "the server to let go of them")
        # a keep-alive connection gets the same deadline for its next request's head
        async with httpx.AsyncClient() as c:
            assert (await c.get(server.url + "/")).status_code == 200
        for w in (w1, w2):
            w.close()
