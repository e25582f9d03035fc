"""A link emulator around any transport, and the link model as a pure function.

The model (``docs/WIRE.md``, "Transports", the link emulator): a message of ``b`` bytes in one direction takes
``RTT/2 + 8 b / rate`` seconds. :class:`DelayLine` is that model made stateful
and sans-I/O: one serialiser per direction, so a large message delays the ones
queued behind it, plus optional jitter that is clamped so messages never overtake
each other. :class:`LinkConnection` and :class:`LinkListener` apply delay lines to
a real transport (sends are held back on the sender, receipts on the receiver),
so a run can report the *measured* latency next to the *modeled* one from
:func:`sequence_latency`. Wrap one side of a link only, or each direction is
delayed twice.

Bytes counted per message are the frame bytes plus ``LinkSpec.overhead`` (set it
to the transport's framing, e.g. ``4 + 4 * frames`` for TCP, to include it).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import TransportError
from ..wire.frames import message_bytes
from .base import Connection, Frames, Listener
from .meter import Direction, Meter


@dataclass(frozen=True)
class OneWay:
    """One direction of a link: serialisation rate, propagation delay, jitter, and
    the chance that a message is lost or arrives twice (what a flaky radio link or a
    retransmitting middlebox does, so recovery can be exercised over real sockets)."""

    #: bits per second; ``math.inf`` for no serialisation delay
    rate_bps: float = math.inf
    #: one-way propagation delay in seconds (RTT / 2 on a symmetric link)
    delay_s: float = 0.0
    #: extra delay drawn uniformly from ``[0, jitter_s]`` per message
    jitter_s: float = 0.0
    #: probability that a message never arrives
    loss: float = 0.0
    #: probability that a message arrives twice
    duplicate: float = 0.0

    def __post_init__(self) -> None:
        if (not self.rate_bps > 0 or self.delay_s < 0 or self.jitter_s < 0
                or not 0.0 <= self.loss < 1.0 or not 0.0 <= self.duplicate <= 1.0):
            raise ValueError(f"invalid link direction {self}")

    def transfer(self, nbytes: int) -> float:
        return 0.0 if math.isinf(self.rate_bps) else 8.0 * nbytes / self.rate_bps


@dataclass(frozen=True)
class LinkSpec:
    """Both directions of an edge-cloud link (``up`` = edge → cloud)."""

    up: OneWay = field(default_factory=OneWay)
    down: OneWay = field(default_factory=OneWay)
    #: bytes added to every message's size (lower-layer framing)
    overhead: int = 0
    #: seed for the jitter draws
    seed: int = 0

    @classmethod
    def of(cls, *, up_bps: float = math.inf, down_bps: float = math.inf, rtt_s: float = 0.0,
           jitter_s: float = 0.0, overhead: int = 0, seed: int = 0, loss: float = 0.0,
           duplicate: float = 0.0) -> LinkSpec:
        """The usual description: rates per direction and one RTT split evenly (loss
        and duplication apply to each direction)."""
        return cls(OneWay(up_bps, rtt_s / 2, jitter_s, loss, duplicate),
                   OneWay(down_bps, rtt_s / 2, jitter_s, loss, duplicate), overhead, seed)

    def direction(self, d: Direction) -> OneWay:
        return self.up if d == "up" else self.down

    def to_dict(self) -> dict[str, Any]:
        return {"up_bps": self.up.rate_bps, "down_bps": self.down.rate_bps,
                "up_delay_s": self.up.delay_s, "down_delay_s": self.down.delay_s,
                "jitter_s": max(self.up.jitter_s, self.down.jitter_s),
                "loss": max(self.up.loss, self.down.loss),
                "duplicate": max(self.up.duplicate, self.down.duplicate),
                "overhead": self.overhead}


def message_latency(nbytes: int, rate_bps: float, rtt_s: float) -> float:
    """Modeled seconds for one message: ``RTT/2 + 8 * bytes / rate``."""
    return rtt_s / 2 + (0.0 if math.isinf(rate_bps) else 8.0 * nbytes / rate_bps)


def sequence_latency(messages: Iterable[tuple[Direction, int]], spec: LinkSpec) -> float:
    """Modeled seconds for a message sequence ``[(direction, bytes), ...]``.

    Each message is sent when the previous one has arrived if it goes the other
    way (a reply), or right behind it on the same serialiser if it goes the same
    way (so consecutive messages pipeline: only their transfer times add up).
    Jitter is not modeled.
    """
    t = 0.0
    free_at = 0.0
    last: Direction | None = None
    for d, nbytes in messages:
        w = spec.direction(d)
        size = nbytes + spec.overhead
        if d == last:
            free_at += w.transfer(size)
            t = max(t, free_at + w.delay_s)
        else:
            free_at = t + w.transfer(size)
            t = free_at + w.delay_s
        last = d
    return t


class DelayLine:
    """Arrival times for one direction (sans-I/O: the caller passes the clock)."""

    def __init__(self, way: OneWay, rng: random.Random | None = None) -> None:
        self.way = way
        self._rng = rng or random.Random(0)
        self._free_at = -math.inf
        self._last_arrival = -math.inf

    def copies(self) -> int:
        """How many times the next message arrives: 0 (lost), 1, or 2 (duplicated)."""
        w = self.way
        if w.loss and self._rng.random() < w.loss:
            return 0
        if w.duplicate and self._rng.random() < w.duplicate:
            return 2
        return 1

    def schedule(self, now: float, nbytes: int) -> float:
        """When a message of ``nbytes`` handed over at ``now`` arrives."""
        start = max(now, self._free_at)
        self._free_at = start + self.way.transfer(nbytes)
        jitter = self._rng.uniform(0.0, self.way.jitter_s) if self.way.jitter_s else 0.0
        arrival = max(self._free_at + self.way.delay_s + jitter, self._last_arrival)
        self._last_arrival = arrival
        return arrival


class _Outbox:
    """Holds sends back until their arrival time, in order, then hands them on."""

    def __init__(self, line: DelayLine, deliver: Any) -> None:
        self.line, self._deliver = line, deliver
        self._queue: asyncio.Queue[tuple[float, list[bytes]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    def put(self, frames: Frames, overhead: int) -> None:
        if self.error is not None:
            if isinstance(self.error, TransportError):
                raise self.error  # keep the inner transport's code (e.g. unreachable)
            raise TransportError(f"link send failed: {self.error}", code="closed")
        loop = asyncio.get_running_loop()
        msg = [bytes(f) for f in frames]  # the caller may reuse its buffers
        for _ in range(self.line.copies()):
            self._queue.put_nowait((self.line.schedule(loop.time(),
                                                       message_bytes(msg) + overhead), msg))
        if self._task is None:
            self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                at, msg = await self._queue.get()
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._deliver(msg)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surface on the next send
            self.error = e

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None


#: numbers the connections of this process, so each gets its own random stream
_CONNECTIONS = itertools.count()


class LinkConnection(Connection):
    """An edge connection seen through an emulated link."""

    def __init__(self, inner: Connection, spec: LinkSpec) -> None:
        self.inner, self.spec = inner, spec
        # one stream per connection: a reconnect must not meet the same losses again
        # (with one stream per seed, an edge whose hello is lost could never connect)
        rng = random.Random(f"{spec.seed}/{next(_CONNECTIONS)}")
        self._out = _Outbox(DelayLine(spec.up, rng), inner.send)
        self._down = DelayLine(spec.down, rng)
        self._inbox: asyncio.Queue[tuple[float, list[bytes] | BaseException]] = asyncio.Queue()
        self._head: tuple[float, list[bytes] | BaseException] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def meter(self) -> Meter:  # type: ignore[override]
        return self.inner.meter

    def framing_overhead(self, frames: Frames) -> int:
        """The wrapped transport's framing: the emulated link delays messages but
        puts nothing of its own on the wire (``LinkSpec.overhead`` is a model input)."""
        return self.inner.framing_overhead(frames)

    async def send(self, frames: Frames) -> None:
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        self._out.put(frames, self.spec.overhead)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg = await self.inner.recv()
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                self._inbox.put_nowait((loop.time(), e))
                return
            for _ in range(self._down.copies()):
                at = self._down.schedule(loop.time(), message_bytes(msg) + self.spec.overhead)
                self._inbox.put_nowait((at, msg))

    async def recv(self) -> list[bytes]:
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        if self._head is None:
            self._head = await self._inbox.get()
        loop = asyncio.get_running_loop()
        delay = self._head[0] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        _, item = self._head
        if isinstance(item, BaseException):
            raise item  # the head stays: the link is over, every later recv fails too
        self._head = None
        return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._out.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await self.inner.close()


class LinkListener(Listener):
    """A cloud listener whose every peer sits behind its own emulated link."""

    def __init__(self, inner: Listener, spec: LinkSpec) -> None:
        self.inner, self.spec = inner, spec
        self.endpoint = inner.endpoint
        self._rng = random.Random(spec.seed)
        self._out: dict[bytes, _Outbox] = {}
        self._up: dict[bytes, DelayLine] = {}
        self._heap: list[tuple[float, int, bytes, list[bytes] | None]] = []
        self._seq = itertools.count()
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def meter(self) -> Meter:  # type: ignore[override]
        return self.inner.meter

    @property
    def stats(self) -> dict[str, int] | None:
        """The wrapped listener's own counters, if it keeps any (TCP does)."""
        inner = getattr(self.inner, "stats", None)
        return inner if isinstance(inner, dict) else None

    def framing_overhead(self, frames: Frames) -> int:
        """The wrapped transport's framing: the emulated link delays messages but
        puts nothing of its own on the wire (``LinkSpec.overhead`` is a model input)."""
        return self.inner.framing_overhead(frames)

    async def send(self, peer: bytes, frames: Frames) -> None:
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        out = self._out.get(peer)
        if out is None:
            async def deliver(msg: list[bytes], peer: bytes = peer) -> None:
                await self.inner.send(peer, msg)

            out = self._out[peer] = _Outbox(DelayLine(self.spec.down, self._rng), deliver)
        out.put(frames, self.spec.overhead)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                peer, msg = await self.inner.recv()
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                self._error = e
                self._changed.set()
                return
            line = self._up.get(peer)
            if line is None:
                line = self._up[peer] = DelayLine(self.spec.up, self._rng)
            size = 0 if msg is None else message_bytes(msg) + self.spec.overhead
            for _ in range(1 if msg is None else line.copies()):  # a disconnect is not lost
                at = line.schedule(loop.time(), size)
                heapq.heappush(self._heap, (at, next(self._seq), peer, msg))
            self._changed.set()

    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise TransportError("listener is closed", code="closed")
            timeout: float | None = None
            if self._heap:
                at, _, peer, msg = self._heap[0]
                timeout = at - loop.time()
                if timeout <= 0:
                    heapq.heappop(self._heap)
                    if msg is None:
                        await self._forget(peer)
                    return peer, msg
            elif self._error is not None:
                raise self._error
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def _forget(self, peer: bytes) -> None:
        self._up.pop(peer, None)
        out = self._out.pop(peer, None)
        if out is not None:
            await out.close()

    async def close_peer(self, peer: bytes) -> None:
        await self._forget(peer)
        await self.inner.close_peer(peer)

    def revoked(self, peer: bytes) -> bool:
        return self.inner.revoked(peer)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._out):
            await self._forget(peer)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._changed.set()
        await self.inner.close()
