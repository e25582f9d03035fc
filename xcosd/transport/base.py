"""The async interface every transport implements.

A transport moves *messages*, each a list of frames (``bytes``-like): the first
frame is the msgpack header, the rest are raw binary buffers (see
``xcosd.wire.frames``). ZeroMQ carries them as multipart messages, TCP as
length-prefixed frames, the in-memory pair as Python objects. The cloud side is a
:class:`Listener` that talks to many peers, each named by an opaque ``peer`` id;
the edge side is a :class:`Connection` to one cloud.

Received frames are always ``bytes``. Every transport meters what it sends and
receives into its :class:`~xcosd.transport.meter.Meter` (``.meter``), adding its
own framing bytes, which it also reports (``framing_overhead(frames)``).

Peer lifetime: ``Listener.recv`` returns ``(peer, None)`` once when a transport
that can see connections (TCP, in-memory) learns that ``peer`` went away, after
every message that peer sent, and never a message from ``peer`` after it. (A TCP
listener that throws a peer out itself, for not reading or for stalling, drops
what that peer had queued and reports the end at once.) ZeroMQ hides connections
(it reconnects under the socket and its heartbeats drop dead links), so over
ZeroMQ a peer's end is the application's business (a session timeout or an
explicit goodbye message).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType

from .meter import Meter

Frames = Sequence[bytes | bytearray | memoryview]


class Connection(ABC):
    """Edge side: one connection to one cloud."""

    meter: Meter

    @abstractmethod
    async def send(self, frames: Frames) -> None:
        """Queue one message; raises :class:`TransportError` once closed."""

    @abstractmethod
    async def recv(self) -> list[bytes]:
        """The next message; raises :class:`TransportError` (code ``closed``) when
        this side was closed or the cloud closed the connection."""

    @abstractmethod
    async def close(self) -> None:
        """Release sockets and tasks; idempotent."""

    def framing_overhead(self, frames: Frames) -> int:
        """Bytes this transport adds on the wire around ``frames`` (its own framing,
        not counted in the frames): what the meter adds to the payload, and what a
        node needs to count a message's wire bytes without asking which transport
        it runs on. Nothing by default (in-memory)."""
        return 0

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class Listener(ABC):
    """Cloud side: one bound endpoint, many peers."""

    #: the bound endpoint, with the real port when bound to port 0
    endpoint: str
    meter: Meter

    @abstractmethod
    async def send(self, peer: bytes, frames: Frames) -> None:
        """Send to one peer; :class:`TransportError` (code ``unreachable``) when the
        peer is unknown or gone."""

    @abstractmethod
    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        """``(peer, frames)``, or ``(peer, None)`` when ``peer`` disconnected."""

    async def recv_many(self, max_n: int) -> list[tuple[bytes, list[bytes] | None]]:
        """What :meth:`recv` returns, for every message already waiting, up to
        ``max_n`` (at least one: it waits for the first). A transport that can take
        what is ready without waiting answers many in one call, so a busy reader pays
        one wake-up per burst instead of one per message; by default, one."""
        return [await self.recv()]

    def send_nowait(self, peer: bytes, frames: Frames) -> bool:
        """Send to ``peer`` at once if that needs no waiting: ``True`` when sent;
        ``False`` when nothing was sent, and :meth:`send` must do it. Raises as
        :meth:`send` does. By default nothing is sent this way."""
        return False

    def end_burst(self) -> None:  # noqa: B027 - optional
        """A burst of :meth:`send_nowait` calls is over (the cloud calls it once a
        turn's replies are handed over). A transport whose I/O runs in a thread of
        its own lets that thread run now (ZeroMQ); by default nothing."""

    @abstractmethod
    async def close(self) -> None:
        """Unbind, drop every peer, release sockets and tasks; idempotent."""

    async def close_peer(self, peer: bytes) -> None:  # noqa: B027 - optional
        """Drop one peer (TCP, memory: close its connection; ZeroMQ: forget its key)."""

    def revoked(self, peer: bytes) -> bool:
        """Whether ``peer`` was cut off because its key was revoked (a CURVE
        ZeroMQ listener: xcosd/transport/revocation.py); by default never."""
        return False

    def framing_overhead(self, frames: Frames) -> int:
        """Bytes this transport adds on the wire around ``frames``; see
        :meth:`Connection.framing_overhead`."""
        return 0

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
