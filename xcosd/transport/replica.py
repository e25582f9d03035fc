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
from ..wire.frames import DEFAULT_LIMITS, Buffer, Limits
from .base import Frames, Listener
from .curve import CurveClient, apply_client
from .io_threads import yield_to_io_threads
from .meter import Meter
from .zeromq import (
    _POLLIN,
    COPY_THRESHOLD,
    Readiness,
    Received,
    _as_zmq,
    _send_parts,
    _send_when_ready,
    _socket,
    recv_burst,
    shared_context,
    zmtp_overhead,
)

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
    for the envelope). ``curve``: a :class:`~xcosd.transport.CurveClient` (this
    replica's key pair, the back end's public key) for a broker whose back end has
    CURVE on; a broker admits only the replica keys it allows.

    It moves messages as :class:`~xcosd.transport.zeromq.ZmqListener` does, and for
    the same reason (a replica answers a whole batch at once): the socket's own
    non-blocking calls, no future per message; :meth:`send_nowait` hands a verdict
    to ZeroMQ without a task, and :meth:`recv_many` takes every message waiting in
    one wake-up.
    """

    def __init__(self, endpoint: str, *, hwm: int = 10_000,
                 heartbeat_ivl: float = HEARTBEAT_IVL,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 limits: Limits = DEFAULT_LIMITS, copy_threshold: int = COPY_THRESHOLD,
                 meter: Meter | None = None, goodbye: bool = True,
                 curve: CurveClient | None = None,
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
        #: edges to report gone from :meth:`recv`, before reading the socket again
        self._gone: deque[Received] = deque()
        #: times this replica said READY (1: never forgotten)
        self.registrations = 0
        #: READY sent and no word from the broker since: a RESET now answers a
        #: message sent before the READY arrived (the pipe is in order), not this one
        self._registering = False
        self._last_rx = time.monotonic()
        self._hb_task: asyncio.Task[None] | None = None
        self._closed = False
        self._sock = _socket(context or shared_context(), zmq.DEALER)
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
            if curve is not None:
                apply_client(self._sock, curve)
            self._sock.connect(endpoint)
            self._ready = Readiness(self._sock)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise TransportError(f"cannot connect to the broker at {endpoint}: {e}",
                                 code="connect") from e

    @classmethod
    async def open(cls, endpoint: str, **opts: object) -> ReplicaListener:
        """Connect, register with the broker and start heartbeating."""
        self = cls(endpoint, **opts)  # type: ignore[arg-type]
        self._register()
        self._hb_task = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name="xcosd-replica-heartbeat")
        return self

    def framing_overhead(self, frames: Frames) -> int:
        """What the edge's link carries: ZMTP's frame headers (the envelope travels
        only between the broker and this replica)."""
        return zmtp_overhead(frames)

    def _command(self, parts: list[Buffer]) -> None:
        """A control message, sent if the pipe takes it now: one that does not is
        dropped (a full pipe already tells the broker this replica is alive, and a
        READY that got lost is sent again after ``heartbeat_timeout``)."""
        try:
            _send_parts(self._sock, parts)
        except zmq.Again:
            pass
        finally:
            self._ready.poke()

    def _register(self) -> None:
        self._last_rx = time.monotonic()
        self._registering = True
        self.registrations += 1
        self._command([READY, PROTOCOL])

    def _forget_peers(self) -> None:
        """Report every edge as gone: the broker has handed them to other replicas."""
        self._gone.extend((peer, None) for peer in self._peers)
        self._peers.clear()

    def _try_send(self, peer: bytes, msg: list[Buffer]) -> bool:
        """One non-blocking send; whether it went (``False``: the pipe is full)."""
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        try:
            _send_parts(self._sock, [DATA, peer, *msg])
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            raise TransportError(f"send failed: {e}", code="closed" if self._closed
                                 else "send") from e
        finally:
            self._ready.poke()
        self.meter.record("down", msg, self.framing_overhead(msg))
        return True

    def send_nowait(self, peer: bytes, frames: Frames) -> bool:
        """Send without waiting when the pipe to the broker has room; ``False``
        (nothing sent) when it is full."""
        if not frames:
            raise TransportError("a message needs at least one frame", code="bad_frame")
        return self._try_send(peer, _as_zmq(frames))

    def end_burst(self) -> None:
        yield_to_io_threads()

    async def send(self, peer: bytes, frames: Frames) -> None:
        """Send, waiting while the pipe to the broker is full (bound it with a
        timeout)."""
        if not frames:
            raise TransportError("a message needs at least one frame", code="bad_frame")
        msg = _as_zmq(frames)
        if not self._try_send(peer, msg):
            await _send_when_ready(self._ready, lambda: self._try_send(peer, msg))

    async def recv(self) -> Received:
        return (await self.recv_many(1))[0]

    async def recv_many(self, max_n: int) -> list[Received]:
        """Every edge message and departure ready, up to ``max_n``, in the order they
        came, after waiting for the first; the broker's commands are handled here."""
        return await recv_burst(self._sock, self._ready, max_n, self._received,
                                lambda: self._closed, self._gone)

    def _received(self, msg: list[bytes]) -> Received | None:
        """What one message from the broker means for the node, if anything."""
        cmd = msg[0]
        if cmd == RESET:
            # a RESET only says the broker does not know this replica: liveness
            # comes from its other messages, so a READY that got lost is sent
            # again after heartbeat_timeout
            if not self._registering:
                log.warning("the broker at %s does not know this replica; registering "
                            "again", self.endpoint)
                self._forget_peers()
                self._register()
            return None
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
        return None  # HEARTBEAT (and anything malformed): liveness only

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
                self._register()
                self._ready.wake(_POLLIN)  # a receiver asleep reports the gone edges
                continue
            self._command([HEARTBEAT])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._hb_task
            self._hb_task = None
        linger = 0
        if self.goodbye:
            with contextlib.suppress(zmq.ZMQError):
                self._command([BYE])
            linger = 100  # let the I/O thread write it before the socket goes (bounded)
        self._ready.close()
        self._sock.close(linger=linger)


__all__ = ["BYE", "DATA", "GONE", "HEARTBEAT", "HEARTBEAT_IVL", "HEARTBEAT_TIMEOUT", "PROTOCOL",
           "READY", "RESET", "ReplicaListener"]
