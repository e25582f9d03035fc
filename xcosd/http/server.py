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
* **Bounds against a slow or hostile client.** At most ``max_connections``
  connections are served at once (uvicorn answers 503 past it); a request's head
  must arrive whole within ``read_timeout_s`` of the connection opening (or of the
  previous response), else the connection is closed (uvicorn itself has no such
  deadline: a client that trickles a header a byte at a time would hold a
  connection forever); a head is at most ``max_head_bytes`` (h11 answers 400
  past it); an idle keep-alive connection is closed after ``keep_alive_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head."""

    head_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        armed = self.cycle
        loop = asyncio.get_running_loop()

        def expire() -> None:
            # no new request head was parsed since the deadline was armed
            if self.cycle is armed and not self.transport.is_closing():
                self.transport.close()

        handle = loop.call_later(self.head_timeout_s, expire)
        self._head_handle = handle

    def connection_lost(self, exc: Exception | None) -> None:
        h = getattr(self, "_head_handle", None)
        if h is not None:
            h.cancel()
        super().connection_lost(exc)


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """Serve ``app`` (any ASGI app) on ``host:port`` in the running event loop.

    ``await start()`` returns once the socket listens; ``await close()`` stops
    taking connections, lets running responses end for up to ``grace_s`` and then
    cancels them (a streamed generation's cancellation frees its cloud session)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *,
                 max_connections: int = 256, read_timeout_s: float = 10.0,
                 keep_alive_s: float = 5.0, max_head_bytes: int = 64 << 10,
                 grace_s: float = 5.0, name: str = "xcosd-http") -> None:
        if read_timeout_s <= 0 or keep_alive_s <= 0:
            raise ValueError("read_timeout_s and keep_alive_s must be > 0")
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.app = app
        self.host = host
        self._want_port = port
        self.name = name
        protocol = type("_Protocol", (_BoundedH11,), {"head_timeout_s": float(read_timeout_s)})
        self._config = uvicorn.Config(
            app, http=protocol, lifespan="off", log_config=None, access_log=False,
            # uvicorn counts the connection asking among those it compares with the
            # limit: + 1 serves max_connections at once
            limit_concurrency=max_connections + 1,
            timeout_keep_alive=max(1, round(keep_alive_s)),
            timeout_graceful_shutdown=max(1, round(grace_s)),
            h11_max_incomplete_event_size=max_head_bytes, server_header=False, ws="none")
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
