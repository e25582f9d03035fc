"""The replica transport: a cloud node behind a :class:`~xcosd.nodes.broker.Broker`.

Edges connect to the broker's public ROUTER with the ordinary ZeroMQ transport; the
broker pins each edge connection to one replica and forwards its frames, unchanged,
with the edge's routing id as an envelope. :class:`ReplicaListener` is the replica's
end of that: a DEALER connected to the broker's back-end ROUTER that presents each
edge routing id as a peer, so a plain :class:`~xcosd.nodes.CloudNode` serves
through it (``CloudNode(target, bind="tcp://broker:5556", transport="replica")``)
without knowing that a broker is there.

The back end speaks the ZeroMQ guide's "Paranoid Pirate" pattern. Every message
starts with one command frame:

=========== ============================ =====================================
command     frames after it              meaning
=========== ============================ =====================================
``READY``   protocol name                replica -> broker: register me (again)
``HEARTBEAT`` none                       both ways, every ``heartbeat_ivl``
``DATA``    edge routing id, the frames  both ways: one message of that edge
``GONE``    edge routing id              broker -> replica: that edge is gone
``BYE``     none                         replica -> broker: I am leaving
``RESET``   none                         broker -> replica: I do not know you
=========== ============================ =====================================

A replica that hears nothing from the broker for ``heartbeat_timeout`` assumes the
broker forgot it (a broker forgets a replica silent for as long), reports every edge
it served as gone and registers again; one told ``RESET`` does the same, once: the
RESETs that answer its messages sent before its READY reached the broker are
ignored (the broker's first message after a READY is a heartbeat, and the pipe
keeps order). Its edges
were (or will be) handed to other replicas, so their sessions here are dead either
way: an edge learns that its replica changed from the new replica's ``handshake``
error and resumes every generation there (docs/PROTOCOL.md, "Faults").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from ..errors import TransportError
from ..wire.frames import DEFAULT_LIMITS, Limits
from .base import Frames, Listener
from .meter import Meter
from .zeromq import COPY_THRESHOLD, shared_context, zmtp_overhead

log = logging.getLogger(__name__)

READY = b"\x01"
HEARTBEAT = b"\x02"
DATA = b"\x03"
GONE = b"\x04"
BYE = b"\x05"
RESET = b"\x06"
#: what a replica names in ``READY``; a broker ignores a replica that names another
PROTOCOL = b"xcosd-replica/1"

#: seconds between heartbeats, each way
HEARTBEAT_IVL = 1.0
#: silence after which the other side counts as gone
HEARTBEAT_TIMEOUT = 5.0


class ReplicaListener(Listener):
    """A DEALER connected to a broker's back end; peers are the edges' routing ids.

    ``endpoint``: the broker's back-end endpoint. ``hwm``: messages queued each way
    before ``send`` waits. ``goodbye``: whether :meth:`close` tells the broker
    (``BYE``) so it moves this replica's edges at once; without it the broker learns
    of the departure from the closed connection or the missing heartbeats, as it
    does when a replica process dies. ``limits``: frames larger than
    ``limits.max_bytes`` are refused by ZeroMQ before they reach Python (plus room
    for the envelope).
    """

    def __init__(self, endpoint: str, *, hwm: int = 10_000,
                 heartbeat_ivl: float = HEARTBEAT_IVL,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 limits: Limits = DEFAULT_LIMITS, copy_threshold: int = COPY_THRESHOLD,
                 meter: Meter | None = None, goodbye: bool = True,
                 context: zmq.asyncio.Context | None = None) -> None:
        if heartbeat_ivl <= 0 or heartbeat_timeout <= heartbeat_ivl:
            raise ValueError("need 0 < heartbeat_ivl < heartbeat_timeout, got "
                             f"{heartbeat_ivl} and {heartbeat_timeout}")
        self.endpoint = endpoint
        self.meter = meter if meter is not None else Meter()
        self.heartbeat_ivl = heartbeat_ivl
        self.heartbeat_timeout = heartbeat_timeout
        self.goodbye = goodbye
        #: edges this replica has served and not yet heard are gone
        self._peers: dict[bytes, None] = {}
        #: peers to report gone from :meth:`recv`, before reading the socket again
        self._gone: deque[bytes] = deque()
        #: times this replica said READY (1: never forgotten)
        self.registrations = 0
        #: READY sent and no word from the broker since: a RESET now answers a
        #: message sent before the READY arrived (the pipe is in order), not this one
        self._registering = False
        self._last_rx = time.monotonic()
        self._hb_task: asyncio.Task[None] | None = None
        self._closed = False
        self._sock = (context or shared_context()).socket(zmq.DEALER)
        try:
            self._sock.linger = 0
            self._sock.sndhwm = hwm
            self._sock.rcvhwm = hwm
            # the largest frame an edge may send, as on the ZeroMQ listener
            self._sock.setsockopt(zmq.MAXMSGSIZE, limits.max_bytes)
            self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl * 1000))
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
            self._sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout * 1000))
            self._sock.copy_threshold = copy_threshold
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise TransportError(f"cannot connect to the broker at {endpoint}: {e}",
                                 code="connect") from e

    @classmethod
    async def open(cls, endpoint: str, **opts: object) -> ReplicaListener:
        """Connect, register with the broker and start heartbeating."""
        self = cls(endpoint, **opts)  # type: ignore[arg-type]
        await self._register()
        self._hb_task = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name="xcosd-replica-heartbeat")
        return self

    def framing_overhead(self, frames: Frames) -> int:
        """What the edge's link carries: ZMTP's frame headers (the envelope travels
        only between the broker and this replica)."""
        return zmtp_overhead(frames)

    async def _register(self) -> None:
        self._last_rx = time.monotonic()
        self._registering = True
        self.registrations += 1
        with contextlib.suppress(zmq.Again):
            await self._sock.send_multipart([READY, PROTOCOL], flags=zmq.NOBLOCK)

    def _forget_peers(self) -> None:
        """Report every edge as gone: the broker has handed them to other replicas."""
        self._gone.extend(self._peers)
        self._peers.clear()

    async def send(self, peer: bytes, frames: Frames) -> None:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        if not frames:
            raise TransportError("a message needs at least one frame", code="bad_frame")
        try:
            await self._sock.send_multipart([DATA, peer, *frames], copy=False)
        except zmq.ZMQError as e:
            raise TransportError(f"send failed: {e}", code="closed" if self._closed
                                 else "send") from e
        self.meter.record("down", frames, self.framing_overhead(frames))

    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        while True:
            if self._closed:
                raise TransportError("listener is closed", code="closed")
            if self._gone:
                return self._gone.popleft(), None
            try:
                msg = await self._sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError) as e:
                if self._closed:
                    raise TransportError("listener is closed", code="closed") from e
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise TransportError(f"recv failed: {e}", code="recv") from e
            cmd = msg[0]
            if cmd == RESET:
                # a RESET only says the broker does not know this replica: liveness
                # comes from its other messages, so a READY that got lost is sent
                # again after heartbeat_timeout
                if not self._registering:
                    log.warning("the broker at %s does not know this replica; registering "
                                "again", self.endpoint)
                    self._forget_peers()
                    await self._register()
                continue
            self._last_rx = time.monotonic()
            self._registering = False
            if cmd == DATA and len(msg) >= 3:
                peer, frames = msg[1], msg[2:]
                self._peers[peer] = None
                self.meter.record("up", frames, self.framing_overhead(frames))
                return peer, frames
            if cmd == GONE and len(msg) == 2 and msg[1] in self._peers:
                del self._peers[msg[1]]
                return msg[1], None
            # HEARTBEAT (and anything malformed): liveness only

    async def close_peer(self, peer: bytes) -> None:
        """The node gave up on ``peer`` (silent past its timeout): forget it here."""
        self._peers.pop(peer, None)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_ivl)
            if time.monotonic() - self._last_rx > self.heartbeat_timeout:
                # the broker forgets a replica this silent: start over with it
                log.warning("no word from the broker at %s for %.1fs; registering again",
                            self.endpoint, self.heartbeat_timeout)
                self._forget_peers()
                await self._register()
                continue
            # a full pipe already tells the broker this replica is alive
            with contextlib.suppress(zmq.Again):
                await self._sock.send_multipart([HEARTBEAT], flags=zmq.NOBLOCK)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._hb_task
            self._hb_task = None
        if self.goodbye:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart([BYE], flags=zmq.NOBLOCK)
            # let the I/O thread write it before the socket goes (bounded)
            self._sock.close(linger=100)
        else:
            self._sock.close(linger=0)


__all__ = ["BYE", "DATA", "GONE", "HEARTBEAT", "HEARTBEAT_IVL", "HEARTBEAT_TIMEOUT", "PROTOCOL",
           "READY", "RESET", "ReplicaListener"]
