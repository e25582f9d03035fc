"""The ZeroMQ transport: a ROUTER on the cloud, one DEALER per device connection.

Why these socket options:

* ``ROUTER_MANDATORY`` — a reply to a peer that is gone raises instead of being
  dropped silently, so the cloud can end that session.
* high-water marks (default 1000 messages each way) bound memory per peer while
  leaving room for many in-flight rounds; a full queue makes ``send`` wait.
* ``LINGER 0`` — closing never blocks on unsent data.
* ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``/``TTL``) drop dead links that TCP
  would keep half-open for minutes.
* ``MAXMSGSIZE`` = the frame-codec limit: ZeroMQ drops a peer that sends a larger
  frame before the bytes reach Python. libzmq checks each frame, not the message:
  a message of many frames under the limit is received whole, and its total is
  then refused by the node's :func:`~xcosd.wire.frames.check_limits`.

Sends use ``copy=False``; pyzmq copies frames under ``copy_threshold`` anyway
(zero-copy has a fixed cost), so big probability vectors go out without a copy.
Buffers handed to ``send`` must not be changed afterwards. Sockets use
``zmq.asyncio`` in the caller's loop (asyncio or uvloop).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq
import zmq.asyncio

from ..errors import TransportError
from ..wire.frames import DEFAULT_LIMITS, Buffer, Limits, frame_len
from .base import Connection, Frames, Listener
from .curve import ZAP_DOMAIN, CurveClient, CurveServer, apply_client, apply_server
from .meter import Meter

#: frames at least this large are sent without a copy
COPY_THRESHOLD = 64 * 1024
_ctx: zmq.asyncio.Context | None = None


def shared_context() -> zmq.asyncio.Context:
    """One process-wide context for sockets that need no ZAP handler."""
    global _ctx
    if _ctx is None or _ctx.closed:
        _ctx = zmq.asyncio.Context()
    return _ctx


def zmtp_overhead(frames: Frames, curve: bool = False) -> int:
    """Bytes ZMTP 3 adds to the frames of one message on the wire.

    A frame has a flags byte and a 1-byte (up to 255) or 8-byte length. Under CURVE
    each frame travels as a MESSAGE command: name (8), nonce (8), MAC (16), flags
    (1), then the frame, itself under a command header. ROUTER routing ids never
    cross the wire.
    """
    total = 0
    for f in frames:
        n = frame_len(f)
        if curve:
            n += 33
            total += 33
        total += 2 if n <= 255 else 9
    return total


def _common_options(sock: zmq.Socket, hwm: int, heartbeat_ivl: float,
                    heartbeat_timeout: float, limits: Limits) -> None:
    sock.linger = 0
    sock.sndhwm = hwm
    sock.rcvhwm = hwm
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_bytes)
    if heartbeat_ivl > 0:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))


def _as_zmq(frames: Frames) -> list[Buffer]:
    if not frames:
        raise TransportError("a message needs at least one frame", code="bad_frame")
    return list(frames)


class ZmqConnection(Connection):
    """A DEALER connected to one cloud ROUTER."""

    def __init__(self, endpoint: str, *, hwm: int = 1000, heartbeat_ivl: float = 1.0,
                 heartbeat_timeout: float = 5.0, limits: Limits = DEFAULT_LIMITS,
                 copy_threshold: int = COPY_THRESHOLD, curve: CurveClient | None = None,
                 meter: Meter | None = None, reconnect_ivl: float = 0.1,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint
        self.meter = meter if meter is not None else Meter()
        self.curve = curve is not None
        self._sock = (context or shared_context()).socket(zmq.DEALER)
        try:
            _common_options(self._sock, hwm, heartbeat_ivl, heartbeat_timeout, limits)
            self._sock.setsockopt(zmq.RECONNECT_IVL, int(reconnect_ivl * 1000))
            self._sock.copy_threshold = copy_threshold
            if curve is not None:
                apply_client(self._sock, curve)
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise TransportError(f"cannot connect to {endpoint}: {e}", code="connect") from e
        self._closed = False

    def framing_overhead(self, frames: Frames) -> int:
        """ZMTP's frame headers, and CURVE's box per frame when encrypted."""
        return zmtp_overhead(frames, self.curve)

    async def send(self, frames: Frames) -> None:
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        msg = _as_zmq(frames)
        try:
            await self._sock.send_multipart(msg, copy=False)
        except zmq.ZMQError as e:
            raise TransportError(f"send failed: {e}", code="closed" if self._closed
                                 else "send") from e
        self.meter.record("up", msg, self.framing_overhead(msg))

    async def recv(self) -> list[bytes]:
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        try:
            msg = await self._sock.recv_multipart()
        except (zmq.ZMQError, asyncio.CancelledError) as e:
            if self._closed:
                raise TransportError("connection is closed", code="closed") from e
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TransportError(f"recv failed: {e}", code="recv") from e
        self.meter.record("down", msg, self.framing_overhead(msg))
        return msg

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)


class ZmqListener(Listener):
    """A ROUTER bound to ``endpoint``; peers are ZeroMQ routing ids."""

    def __init__(self, endpoint: str, *, hwm: int = 1000, heartbeat_ivl: float = 1.0,
                 heartbeat_timeout: float = 5.0, limits: Limits = DEFAULT_LIMITS,
                 copy_threshold: int = COPY_THRESHOLD, curve: CurveServer | None = None,
                 meter: Meter | None = None) -> None:
        self.meter = meter if meter is not None else Meter()
        self.curve = curve is not None
        self._auth: Any = None
        # a ZAP handler belongs to a context: CURVE listeners get their own
        self._ctx = zmq.asyncio.Context() if curve is not None else shared_context()
        self._own_ctx = curve is not None
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            _common_options(self._sock, hwm, heartbeat_ivl, heartbeat_timeout, limits)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.copy_threshold = copy_threshold
            if curve is not None:
                from zmq.auth.asyncio import AsyncioAuthenticator

                self._auth = AsyncioAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                                    credentials_provider=curve)
                apply_server(self._sock, curve)
            self._sock.bind(endpoint)
            last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
        except zmq.ZMQError as e:
            self._release()
            code = "address_in_use" if e.errno == zmq.EADDRINUSE else "bind"
            raise TransportError(f"cannot bind {endpoint}: {e}", code=code) from e
        self._closed = False

    def framing_overhead(self, frames: Frames) -> int:
        """ZMTP's frame headers, and CURVE's box per frame when encrypted."""
        return zmtp_overhead(frames, self.curve)

    async def send(self, peer: bytes, frames: Frames) -> None:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        msg = _as_zmq(frames)
        try:
            await self._sock.send_multipart([peer, *msg], copy=False)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise TransportError(f"no peer {bytes(peer).hex()}", code="unreachable") from e
            raise TransportError(f"send failed: {e}", code="closed" if self._closed
                                 else "send") from e
        self.meter.record("down", msg, self.framing_overhead(msg))

    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        while True:
            if self._closed:
                raise TransportError("listener is closed", code="closed")
            try:
                msg = await self._sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError) as e:
                if self._closed:
                    raise TransportError("listener is closed", code="closed") from e
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise TransportError(f"recv failed: {e}", code="recv") from e
            if len(msg) < 2:  # a routing id and no frames: nothing to deliver
                continue
            frames = msg[1:]
            self.meter.record("up", frames, self.framing_overhead(frames))
            return msg[0], frames

    def _release(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
