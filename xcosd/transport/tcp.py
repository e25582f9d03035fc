"""Raw TCP over asyncio streams, with the frame codec's length-prefixed framing.

A message is ``u32 n_frames`` then ``u32 len | bytes`` per frame, big-endian (see
:mod:`xcosd.wire.frames`); :class:`~xcosd.wire.frames.StreamDecoder` cuts the
stream back into messages and refuses an oversized count or length before
reading its body. Any framing error ends that connection: after it the stream
cannot be trusted to be in sync.

The listener names each accepted connection with a fresh 8-byte peer id and
reports its end in-band as ``(peer, None)`` from ``recv``. asyncio and uvloop
both set ``TCP_NODELAY`` on stream sockets, so small messages are not delayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
from urllib.parse import urlsplit

from ..errors import ProtocolError, TransportError
from ..wire.frames import DEFAULT_LIMITS, Limits, StreamDecoder, encode_stream, stream_overhead
from .base import Connection, Frames, Listener
from .meter import Meter

log = logging.getLogger(__name__)

#: bytes asked of the socket per read
READ_CHUNK = 256 * 1024


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> ``(host, port)``; ``*`` means every interface."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname is None:
        raise TransportError(f"expected tcp://HOST:PORT, got {endpoint!r}", code="endpoint")
    host = parts.hostname
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise TransportError(f"no port in {endpoint!r}", code="endpoint")
    return ("0.0.0.0" if host == "*" else host), port


def _format(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _check(frames: Frames) -> None:
    if not frames:
        raise TransportError("a message needs at least one frame", code="bad_frame")


class TcpConnection(Connection):
    """One stream to a :class:`TcpListener`; reads happen inside ``recv``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 endpoint: str, limits: Limits, meter: Meter | None) -> None:
        self.endpoint = endpoint
        self.meter = meter if meter is not None else Meter()
        self._reader, self._writer = reader, writer
        self._decoder = StreamDecoder(limits)
        self._ready: list[list[bytes]] = []
        self._closed = False

    @classmethod
    async def open(cls, endpoint: str, *, limits: Limits = DEFAULT_LIMITS,
                   meter: Meter | None = None, timeout: float = 10.0) -> TcpConnection:
        host, port = parse_tcp_endpoint(endpoint)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    timeout)
        except (OSError, TimeoutError) as e:
            raise TransportError(f"cannot connect to {endpoint}: {e}", code="connect") from e
        return cls(reader, writer, endpoint, limits, meter)

    def framing_overhead(self, frames: Frames) -> int:
        """The stream framing: a frame count and one length per frame."""
        return stream_overhead(len(frames))

    async def send(self, frames: Frames) -> None:
        if self._closed or self._writer.is_closing():
            raise TransportError("connection is closed", code="closed")
        _check(frames)
        self._writer.writelines(encode_stream(frames))
        self.meter.record("up", frames, self.framing_overhead(frames))
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise TransportError(f"send failed: {e}", code="closed") from e

    async def recv(self) -> list[bytes]:
        while not self._ready:
            if self._closed:
                raise TransportError("connection is closed", code="closed")
            try:
                self._decoder.check()  # an error held back behind delivered messages
            except ProtocolError:
                await self.close()
                raise
            try:
                data = await self._reader.read(READ_CHUNK)
            except (ConnectionError, OSError) as e:
                await self.close()
                raise TransportError(f"connection lost: {e}", code="closed") from e
            if not data:
                await self.close()
                raise TransportError("the listener closed the connection", code="closed")
            try:
                self._ready.extend(self._decoder.feed(data))
            except ProtocolError:
                await self.close()
                raise
        msg = self._ready.pop(0)
        self.meter.record("down", msg, self.framing_overhead(msg))
        return msg

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


class _Peer:
    __slots__ = ("reader", "task", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.task: asyncio.Task[None] | None = None


class TcpListener(Listener):
    """An asyncio server; one reader task per peer feeds a bounded inbox, so a
    slow consumer pushes back on the peers through TCP flow control."""

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS, meter: Meter | None = None,
                 inbox: int = 1000) -> None:
        self.limits = limits
        self.meter = meter if meter is not None else Meter()
        self.endpoint = ""
        self._server: asyncio.Server | None = None
        self._peers: dict[bytes, _Peer] = {}
        self._inbox: asyncio.Queue[tuple[bytes, list[bytes] | None]] = asyncio.Queue(inbox)
        self._ids = itertools.count(1)
        self._closed = False

    @classmethod
    async def bind(cls, endpoint: str, **opts: object) -> TcpListener:
        host, port = parse_tcp_endpoint(endpoint)
        self = cls(**opts)  # type: ignore[arg-type]
        try:
            self._server = await asyncio.start_server(self._accept, host, port,
                                                      limit=READ_CHUNK)
        except OSError as e:
            code = "address_in_use" if e.errno == errno.EADDRINUSE else "bind"
            raise TransportError(f"cannot bind {endpoint}: {e}", code=code) from e
        sockname = self._server.sockets[0].getsockname()
        self.endpoint = _format(sockname[0], sockname[1])
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed:
            writer.close()
            return
        peer = next(self._ids).to_bytes(8, "big")
        p = _Peer(reader, writer)
        self._peers[peer] = p
        p.task = asyncio.current_task()
        await self._read_peer(peer, p)

    async def _read_peer(self, peer: bytes, p: _Peer) -> None:
        decoder = StreamDecoder(self.limits)
        try:
            while True:
                data = await p.reader.read(READ_CHUNK)
                if not data:
                    break
                for msg in decoder.feed(data):
                    self.meter.record("up", msg, self.framing_overhead(msg))
                    await self._inbox.put((peer, msg))
                decoder.check()  # an error behind those messages ends the peer now
        except ProtocolError as e:
            log.warning("dropping TCP peer %s: %s (%s)", peer.hex(), e, e.code)
        except (ConnectionError, OSError) as e:
            log.info("TCP peer %s lost: %s", peer.hex(), e)
        except asyncio.CancelledError:
            pass
        finally:
            if self._peers.pop(peer, None) is not None:
                p.writer.close()
                if not self._closed:
                    with contextlib.suppress(asyncio.QueueFull):
                        # the end-of-peer event must not be lost; wait for room
                        await self._inbox.put((peer, None))

    def framing_overhead(self, frames: Frames) -> int:
        """The stream framing: a frame count and one length per frame."""
        return stream_overhead(len(frames))

    async def send(self, peer: bytes, frames: Frames) -> None:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        p = self._peers.get(bytes(peer))
        if p is None or p.writer.is_closing():
            raise TransportError(f"no peer {bytes(peer).hex()}", code="unreachable")
        _check(frames)
        p.writer.writelines(encode_stream(frames))
        self.meter.record("down", frames, self.framing_overhead(frames))
        try:
            await p.writer.drain()
        except (ConnectionError, OSError) as e:
            raise TransportError(f"send to {peer.hex()} failed: {e}", code="unreachable") from e

    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        item = await self._inbox.get()
        if not item[0]:
            raise TransportError("listener is closed", code="closed")
        return item

    @property
    def peers(self) -> list[bytes]:
        return list(self._peers)

    async def close_peer(self, peer: bytes) -> None:
        p = self._peers.pop(bytes(peer), None)
        if p is None:
            return
        p.writer.close()
        if p.task is not None and p.task is not asyncio.current_task():
            p.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await p.task

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for peer in list(self._peers):
            await self.close_peer(peer)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        # wake a pending recv
        while True:
            try:
                self._inbox.put_nowait((b"", None))
                break
            except asyncio.QueueFull:
                self._inbox.get_nowait()
