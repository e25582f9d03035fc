"""``HttpServer``: an ASGI app served by uvicorn inside the caller's event loop.

Every HTTP endpoint of xcosd (the edge's OpenAI-compatible API, the cloud's
``/metrics`` and ``/health``) is a Starlette app served through this one class, so
there is one HTTP stack with one set of bounds. uvicorn is the server: it is what
vLLM and most ASGI deployments run, it speaks HTTP/1.1 through h11 (a sans-I/O
parser, like the rest of this project), and it runs as a task of a loop that is
already running, next to the nodes that share it.

What this class adds to a bare ``uvicorn.Server``:

* **Embedding.** ``uvicorn.Server.serve`` takes over SIGINT and SIGTERM for its
  lifetime; a server embedded in someone else's process must not, so the
  signal capture is switched off (the owner decides what a signal means).
  Logging is left to the application's own configuration.
* **Port 0.** The socket is bound before the server starts, so ``port=0`` gets a
  free port and :attr:`url` is known as soon as :meth:`start` returns. Its
  connections have TCP_NODELAY, as uvicorn's own would.
* **Bounds against a slow or hostile client** (:class:`~xcosd.http.limits.ConnectionLimits`,
  enforced by :class:`~xcosd.http.protocol.BoundedH11`): a cap on connections per
  client address and in all, refused as they connect; deadlines on a request's
  whole head and whole body; a bound on what a response buffers for a client that
  does not read it, and on how long it may wait so; a cap on a head's size; an idle
  keep-alive connection closed after ``keep_alive_s``. Every refusal the server
  writes itself is an error object in OpenAI's shape (:mod:`xcosd.http.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from typing import Any

import uvicorn

from .limits import AddressSlots, ConnectionLimits
from .protocol import BoundedH11


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """Serve ``app`` (any ASGI app) on ``host:port`` in the running event loop.

    ``await start()`` returns once the socket listens; ``await close()`` stops
    taking connections, lets running responses end for up to ``grace_s`` and then
    cancels them (a streamed generation's cancellation frees its cloud session).
    ``limits``: what one client may hold (:class:`~xcosd.http.limits.ConnectionLimits`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 limits: ConnectionLimits | None = None, grace_s: float = 5.0,
                 name: str = "xcosd-http") -> None:
        self.app = app
        self.host = host
        self._want_port = port
        self.name = name
        self.limits = limits or ConnectionLimits()
        #: connections held per client address and in all, and those refused
        self.slots = AddressSlots(self.limits)
        protocol = type("_Protocol", (BoundedH11,), {"limits": self.limits,
                                                     "slots": self.slots})
        self._config = uvicorn.Config(
            app, http=protocol, lifespan="off", log_config=None, access_log=False,
            # the protocol refuses a connection over its caps as it is made; uvicorn's
            # own limit would answer 503 only once a head had arrived
            limit_concurrency=None,
            timeout_keep_alive=max(1, round(self.limits.keep_alive_s)),
            timeout_graceful_shutdown=max(1, round(grace_s)),
            h11_max_incomplete_event_size=self.limits.max_head_bytes, server_header=False,
            ws="none")
        self._server = _EmbeddedServer(self._config)
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> HttpServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # the protocol named, not 0: asyncio sets TCP_NODELAY only on sockets whose
        # proto is IPPROTO_TCP, and without it a keep-alive connection's small
        # responses wait out the peer's delayed ACK (about 40 ms each)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._want_port))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name=self.name)
        while not self._server.started:
            if self._task.done():  # startup failed: raise its error here
                await self._task
                raise RuntimeError(f"{self.name}: the HTTP server stopped while starting")
            await asyncio.sleep(0.005)
        return self

    async def __aenter__(self) -> HttpServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._server.server_state.connections)

    async def close(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        task, self._task = self._task, None
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
