"""An in-process transport: a listener and its connections joined by queues.

Tests and simulations use it to run the real protocol and nodes with no sockets.
Frames are copied to ``bytes`` on send, as a socket would, so a sender may reuse
its buffers. Nothing is added on the wire, so the meter's wire bytes equal the
payload bytes.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from ..errors import TransportError
from .base import Connection, Frames, Listener
from .meter import Meter

_CLOSED: Any = object()
_listeners: dict[str, MemoryListener] = {}
_anon = itertools.count(1)


def _copy(frames: Frames) -> list[bytes]:
    if not frames:
        raise TransportError("a message needs at least one frame", code="bad_frame")
    return [bytes(f) for f in frames]


class MemoryConnection(Connection):
    def __init__(self, listener: MemoryListener, peer: bytes, meter: Meter | None = None):
        self.peer = peer
        self.meter = meter if meter is not None else Meter()
        self._listener: MemoryListener | None = listener
        self._inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._closed = False

    async def send(self, frames: Frames) -> None:
        lst = self._listener
        if self._closed or lst is None:
            raise TransportError("connection is closed", code="closed")
        msg = _copy(frames)
        self.meter.record("up", msg, self.framing_overhead(msg))
        lst._deliver(self.peer, msg)

    async def recv(self) -> list[bytes]:
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        msg = await self._inbox.get()
        if msg is _CLOSED:
            self._closed = True
            self._listener = None
            raise TransportError("the listener closed the connection", code="closed")
        self.meter.record("down", msg, self.framing_overhead(msg))
        return msg

    def _remote_closed(self) -> None:
        self._listener = None
        self._inbox.put_nowait(_CLOSED)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        lst, self._listener = self._listener, None
        if lst is not None:
            lst._peer_gone(self.peer)
        self._inbox.put_nowait(_CLOSED)


class MemoryListener(Listener):
    """Bound under a name (``mem://NAME``) so :func:`connect` can find it."""

    def __init__(self, name: str | None = None, meter: Meter | None = None) -> None:
        name = name or f"anon-{next(_anon)}"
        if name in _listeners:
            raise TransportError(f"mem://{name} is already bound", code="address_in_use")
        self.name = name
        self.endpoint = f"mem://{name}"
        self.meter = meter if meter is not None else Meter()
        self._peers: dict[bytes, MemoryConnection] = {}
        self._inbox: asyncio.Queue[tuple[bytes, list[bytes] | None]] = asyncio.Queue()
        self._ids = itertools.count(1)
        self._closed = False
        _listeners[name] = self

    def _connect(self, meter: Meter | None) -> MemoryConnection:
        if self._closed:
            raise TransportError(f"{self.endpoint} is closed", code="refused")
        peer = next(self._ids).to_bytes(4, "big")
        conn = MemoryConnection(self, peer, meter)
        self._peers[peer] = conn
        return conn

    def _deliver(self, peer: bytes, msg: list[bytes]) -> None:
        self._inbox.put_nowait((peer, msg))

    def _peer_gone(self, peer: bytes) -> None:
        if self._peers.pop(peer, None) is not None and not self._closed:
            self._inbox.put_nowait((peer, None))

    async def send(self, peer: bytes, frames: Frames) -> None:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        conn = self._peers.get(peer)
        if conn is None:
            raise TransportError(f"no peer {peer.hex()}", code="unreachable")
        msg = _copy(frames)
        self.meter.record("down", msg, self.framing_overhead(msg))
        conn._inbox.put_nowait(msg)

    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        item = await self._inbox.get()
        if item[0] is _CLOSED:
            raise TransportError("listener is closed", code="closed")
        if item[1] is not None:
            self.meter.record("up", item[1], self.framing_overhead(item[1]))
        return item

    async def close_peer(self, peer: bytes) -> None:
        conn = self._peers.pop(peer, None)
        if conn is not None:
            conn._remote_closed()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if _listeners.get(self.name) is self:
            del _listeners[self.name]
        for conn in self._peers.values():
            conn._remote_closed()
        self._peers.clear()
        self._inbox.put_nowait((_CLOSED, None))


def memory_listen(endpoint: str = "mem://", meter: Meter | None = None,
                  **_: Any) -> MemoryListener:
    """Bind ``mem://NAME`` (``mem://`` alone: a fresh name); other options are
    accepted for symmetry with the socket transports and ignored."""
    name = endpoint.removeprefix("mem://") or None
    return MemoryListener(name, meter)


def memory_connect(endpoint: str, meter: Meter | None = None, **_: Any) -> MemoryConnection:
    name = endpoint.removeprefix("mem://")
    lst = _listeners.get(name)
    if lst is None:
        raise TransportError(f"nothing listens on {endpoint}", code="refused")
    return lst._connect(meter)


async def memory_pair(meter: Meter | None = None) -> tuple[MemoryListener, MemoryConnection]:
    """A fresh anonymous listener and one connection to it."""
    lst = MemoryListener(None, meter)
    return lst, lst._connect(None)


