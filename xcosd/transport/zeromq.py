"""The ZeroMQ transport: a ROUTER on the cloud, one DEALER per device connection.

Why these socket options:

* ``ROUTER_MANDATORY`` — a reply to a peer that is gone raises instead of being
  dropped silently, so the cloud can end that session.
* high-water marks (default 1000 messages each way) bound memory per peer while
  leaving room for many in-flight rounds; a full queue makes ``send`` wait.
* ``LINGER 0`` — closing never blocks on unsent data.
* ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``/``TTL``) drop dead links that TCP
  would keep half-open for minutes. libzmq pings at a fixed interval whatever the
  traffic, so their cost grows with the connections, not the idle ones. With
  2,000 devices, pings every second cost the two sides' I/O threads 81 us of
  each round (about a sixth of its CPU); every 5 s (:data:`ZMTP_HEARTBEAT_IVL`,
  timeout 15 s), 22 us. Whether a peer is alive is the nodes' business anyway (the
  edge's pings when idle, the cloud's session timeout); these only reclaim the
  link itself.
* ``MAXMSGSIZE`` = the frame-codec limit: ZeroMQ drops a peer that sends a larger
  frame before the bytes reach Python. libzmq checks each frame, not the message:
  a message of many frames under the limit is received whole, and its total is
  then refused by the node's :func:`~xcosd.wire.frames.check_limits`.

Sends use ``copy=False``; pyzmq copies frames under ``copy_threshold`` anyway
(zero-copy has a fixed cost), so big probability vectors go out without a copy.
Buffers handed to ``send`` must not be changed afterwards.

Why plain sockets under the caller's loop (asyncio or uvloop) and not
``zmq.asyncio``: a ``zmq.asyncio`` call costs a Future, flag-enum arithmetic and
an event-loop turn per message even when the socket is ready, which is most of
the cost of a small message. Here every send and receive is first tried without
blocking (``NOBLOCK``) and only waits, on the socket's file descriptor, when the
socket would block (:class:`Readiness`); a listener hands over every message
that is ready in one call (:meth:`ZmqListener.recv_many`) and sends without a
task when the peer's queue has room (:meth:`ZmqListener.send_nowait`), the way
vLLM's engine core drains its sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import zmq
import zmq.asyncio

from ..errors import TransportError
from ..wire.frames import DEFAULT_LIMITS, Buffer, Limits
from .base import Connection, Frames, Listener
from .burst import Burst
from .curve import ZAP_DOMAIN, CurveClient, CurveServer, apply_client, apply_server
from .fds import fd_limit
from .io_threads import batch_io_threads, yield_to_io_threads
from .meter import Meter
from .revocation import PeerKeys, Received

#: frames at least this large are sent without a copy. A zero-copy send has a
#: fixed cost (a Frame, and pyzmq's collector thread, which takes the interpreter
#: lock, to release the buffer): measured against copying, it loses at 100 KB,
#: breaks even near 256 KB and wins from 1 MB
COPY_THRESHOLD = 256 * 1024
#: seconds between ZMTP pings on each connection, and the silence (also the TTL the
#: pings carry) after which libzmq drops the link (see the module docstring)
ZMTP_HEARTBEAT_IVL = 5.0
ZMTP_HEARTBEAT_TIMEOUT = 15.0
_ctx: zmq.asyncio.Context | None = None


def shared_context() -> zmq.asyncio.Context:
    """One process-wide context for sockets that need no ZAP handler.

    Its socket cap is libzmq's own ceiling, not its default of 1,023: a process that
    runs many edge devices holds one DEALER per device, and at the default its
    1,024th device fails with ``Too many open files`` long before the descriptors
    run out. The descriptors stay the bound (see :mod:`xcosd.transport.fds`)."""
    global _ctx
    if _ctx is None or _ctx.closed:
        _ctx = zmq.asyncio.Context()
        _ctx.set(zmq.MAX_SOCKETS, _ctx.get(zmq.SOCKET_LIMIT))
        batch_io_threads(_ctx)
    return _ctx


def _curve_context() -> zmq.asyncio.Context:
    """A CURVE listener's own context (its ZAP handler belongs to it)."""
    ctx = zmq.asyncio.Context()
    batch_io_threads(ctx)
    return ctx


def zmtp_overhead(frames: Frames, curve: bool = False) -> int:
    """Bytes ZMTP 3 adds to the frames of one message on the wire.

    A frame has a flags byte and a 1-byte (up to 255) or 8-byte length. Under CURVE
    each frame travels as a MESSAGE command: name (8), nonce (8), MAC (16), flags
    (1), then the frame, itself under a command header. ROUTER routing ids never
    cross the wire.
    """
    total = 0
    for f in frames:  # frame_len inlined: this runs for every message, twice
        n = f.nbytes if type(f) is memoryview else len(f)
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


# Plain ints, not pyzmq's flag enums (whose arithmetic costs microseconds a call),
# and the Cython socket's own send / recv / get: pyzmq's Python layer above them
# type-checks every frame and adds a Python call per frame, several times the cost
# of the send itself for a small message.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get


def _send_parts(sock: zmq.Socket[Any], parts: Sequence[Buffer]) -> None:
    """One multipart message, without blocking (``zmq.Again`` when the queue is
    full: then nothing was sent, ZeroMQ refuses a message at its first frame).
    ``copy=False``: the socket's ``copy_threshold`` decides per frame."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        _send(sock, part, _NOBLOCK if i == last else _MORE_NOBLOCK, False)


def _recv_parts(sock: zmq.Socket[Any],
                keys: PeerKeys | None = None) -> list[bytes]:
    """One multipart message, without blocking (``zmq.Again`` when none is ready).

    Each part is received as a frame and copied out (``Frame.bytes``, the copy a
    copying receive makes): a frame carries its ``more`` flag, where asking the
    socket for ``RCVMORE`` costs an option lookup through pyzmq's enum per part
    (a third of a microsecond each, on every message). ``keys``: a CURVE
    ROUTER's, told the first frame (the peer's routing id, carrying its key)."""
    frame = _recv(sock, _NOBLOCK, False)
    parts = [frame.bytes]
    if keys is not None:
        keys.note(parts[0], frame)
    while frame.more:
        frame = _recv(sock, _NOBLOCK, False)
        parts.append(frame.bytes)
    return parts
#: the longest pause between two tries of a send that would block
SEND_RETRY_MAX_S = 0.05


def _socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A plain (blocking-API) socket in ``ctx``, which may be a ``zmq.asyncio``
    context (a CURVE listener's, whose ZAP handler runs on the loop). Out of
    descriptors or sockets, a :class:`TransportError` that says which limit."""
    try:
        return cast("zmq.Socket[Any]", ctx.socket(kind, socket_class=zmq.Socket))
    except zmq.ZMQError as e:
        if e.errno != errno.EMFILE:
            raise TransportError(f"cannot open a ZeroMQ socket: {e}", code="connect") from e
        raise TransportError(
            f"cannot open another ZeroMQ socket: {e} (each connection takes a socket and "
            f"descriptors; this process may open {fd_limit()} descriptors and its context "
            f"{ctx.get(zmq.MAX_SOCKETS)} sockets: see xcosd/transport/fds.py)",
            code="connect") from e


def _events(sock: zmq.Socket[Any]) -> int:
    return cast(int, _get(sock, _EVENTS))


class Readiness:
    """Wakes the tasks waiting for a ZeroMQ socket to become readable or writable.

    A ZeroMQ socket's file descriptor signals *edges*: it becomes readable when the
    socket's state may have changed, and any operation on the socket may consume
    that signal while leaving it readable or writable. So a waiter checks
    ``ZMQ_EVENTS`` before it sleeps, the loop's reader callback checks it for every
    waiter, and whoever operates on the socket calls :meth:`poke` afterwards: the
    edge its operation swallowed may be the one a waiter sleeps on. Waiters are few
    (a receiving task, a sender whose peer's queue is full), so nothing here costs a
    message that never has to wait.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future[int | None]]] = []

    def _watch(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._unwatch()
            loop.add_reader(self._fd, self._check)
            self._loop = loop
        return loop

    def _unwatch(self) -> None:
        old, self._loop = self._loop, None
        if old is not None and not old.is_closed():
            old.remove_reader(self._fd)

    async def wait(self, mask: int, events: int | None = None) -> int | None:
        """Return once the socket is ready for ``mask`` (``POLLIN``/``POLLOUT``), or
        :meth:`close` was called. ``events``: ``ZMQ_EVENTS`` as the caller just read
        it, with no operation on the socket since (not asked again).

        Returns the ``ZMQ_EVENTS`` that woke it (``None`` after :meth:`close`). Only
        an operation of the waiter's own kind can take readiness away again (a send
        never takes a queued message), so a sole receiver that sees ``POLLIN`` here
        may receive without asking a second time."""
        loop = self._watch()
        if events is None:
            events = _events(self._sock)
        self.wake(events)  # asking may have taken the edge another waiter sleeps on
        if events & mask:
            return events
        fut: asyncio.Future[int | None] = loop.create_future()
        item = (mask, fut)
        self._waiters.append(item)
        try:
            return await fut
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(item)

    def poke(self) -> None:
        """Wake the waiters the socket is now ready for (call after an operation)."""
        if self._waiters:
            self._check()

    def _check(self) -> None:
        try:
            events = _events(self._sock)
        except zmq.ZMQError:  # closed under us: wake everyone, they see why
            events = _POLLIN | _POLLOUT
        self.wake(events)

    def wake(self, events: int) -> None:
        """Wake the waiters for ``events`` (a ``POLLIN``/``POLLOUT`` mask), ready
        or not: each looks again (a receiver with something to report that is not
        on the socket)."""
        for mask, fut in self._waiters:
            if events & mask and not fut.done():
                fut.set_result(events)

    def close(self) -> None:
        """Stop watching the descriptor (before the socket closes) and wake every
        waiter."""
        self._unwatch()
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_result(None)


async def _send_when_ready(ready: Readiness, try_send: Callable[[], bool]) -> None:
    """Try ``try_send`` each time the socket is writable, backing off between tries
    that fail although it is: a ROUTER is writable while *any* peer's queue has
    room, so its writability alone cannot say when one full peer's has drained."""
    delay = 0.0005
    while True:
        await ready.wait(_POLLOUT)
        if try_send():
            return
        await asyncio.sleep(delay)
        delay = min(SEND_RETRY_MAX_S, delay * 2)




async def recv_burst(sock: zmq.Socket[Any], ready: Readiness, max_n: int,
                     take: Callable[[list[bytes]], Received | None],
                     is_closed: Callable[[], bool],
                     backlog: deque[Received] | None = None,
                     keys: PeerKeys | None = None) -> list[Received]:
    """A listener's ``recv_many``: every message ready on ``sock``, up to ``max_n``,
    each turned by ``take`` into what the node is told (``None``: nothing), after
    waiting for the first. ``backlog``: what to report before the next message is
    read (``take`` may add to it: what a message implies comes before the next).
    ``keys``: a CURVE listener's (:func:`_recv_parts`). One wake-up and one
    readiness check per burst, not per message."""
    out: list[Received] = []
    woke: int | None = None  # what woke the wait (the caller is the only receiver)
    while True:
        if is_closed():
            raise TransportError("listener is closed", code="closed")
        try:
            while len(out) < max_n:
                if backlog:
                    out.append(backlog.popleft())
                    continue
                # asked first: a receive that finds nothing raises, which costs more
                events, woke = (_events(sock) if woke is None else woke), None
                if not events & _POLLIN:
                    break
                item = take(_recv_parts(sock, keys))
                if item is not None:
                    out.append(item)
        except zmq.Again:
            pass
        except zmq.ZMQError as e:
            if not out:
                if is_closed():
                    raise TransportError("listener is closed", code="closed") from e
                raise TransportError(f"recv failed: {e}", code="recv") from e
        finally:
            ready.poke()
        if out:
            return out
        woke = await ready.wait(_POLLIN)


def _hand_over(conns: list[ZmqConnection]) -> None:
    for conn in conns:
        conn._flush()
    yield_to_io_threads()


#: per event loop, the connections with messages queued this turn: handed to ZeroMQ
#: together (one wake-up of its I/O thread for many devices' messages, see
#: xcosd/transport/burst.py), not as each is sent
_flushers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Burst[ZmqConnection]] = \
    weakref.WeakKeyDictionary()


def _flusher() -> Burst[ZmqConnection]:
    loop = asyncio.get_running_loop()
    f = _flushers.get(loop)
    if f is None:
        f = _flushers[loop] = Burst(_hand_over)
    return f


class ZmqConnection(Connection):
    """A DEALER connected to one cloud ROUTER.

    :meth:`send` queues the message and returns; the connections of one event loop
    hand what they queued to ZeroMQ together, in order, when the turn of the loop
    ends or a long turn's first message has waited
    :data:`~xcosd.transport.burst.HOLD_S` (:mod:`~xcosd.transport.burst`). A
    message ZeroMQ cannot take yet (its queue to the cloud is full) waits in this
    connection's queue, and :meth:`send` waits while ``hwm`` messages do.
    :meth:`close` hands over what is queued first, as a send that had gone straight
    to ZeroMQ would have been.
    """

    def __init__(self, endpoint: str, *, hwm: int = 1000,
                 heartbeat_ivl: float = ZMTP_HEARTBEAT_IVL,
                 heartbeat_timeout: float = ZMTP_HEARTBEAT_TIMEOUT,
                 limits: Limits = DEFAULT_LIMITS,
                 copy_threshold: int = COPY_THRESHOLD, curve: CurveClient | None = None,
                 meter: Meter | None = None, reconnect_ivl: float = 0.1,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint
        self.meter = meter if meter is not None else Meter()
        self.curve = curve is not None
        self._sock = _socket(context or shared_context(), zmq.DEALER)
        try:
            _common_options(self._sock, hwm, heartbeat_ivl, heartbeat_timeout, limits)
            self._sock.setsockopt(zmq.RECONNECT_IVL, int(reconnect_ivl * 1000))
            self._sock.copy_threshold = copy_threshold
            if curve is not None:
                apply_client(self._sock, curve)
            self._sock.connect(endpoint)
            self._ready = Readiness(self._sock)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise TransportError(f"cannot connect to {endpoint}: {e}", code="connect") from e
        self._closed = False
        #: messages queued by send and not yet handed to ZeroMQ, oldest first
        self._out: deque[list[Buffer]] = deque()
        self._max_out = max(1, hwm)
        #: set while fewer than _max_out wait (send waits on it)
        self._room = asyncio.Event()
        self._room.set()
        #: the task waiting for ZeroMQ to take the queue's head, when it would not
        self._writer: asyncio.Task[None] | None = None
        #: what went wrong handing over a queued message: raised by the next call
        self._error: TransportError | None = None
        #: the loop this connection last sent in and its flusher (looked up once:
        #: the weak map's lookup builds a weak reference, a cost every send paid)
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        self._flush_to: Burst[ZmqConnection] | None = None

    def framing_overhead(self, frames: Frames) -> int:
        """ZMTP's frame headers, and CURVE's box per frame when encrypted."""
        return zmtp_overhead(frames, self.curve)

    def _try_send(self, msg: list[Buffer]) -> bool:
        """One non-blocking send; whether it went (``False``: the queue is full)."""
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        try:
            _send_parts(self._sock, msg)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            raise TransportError(f"send failed: {e}", code="closed" if self._closed
                                 else "send") from e
        finally:
            self._ready.poke()
        return True

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError("connection is closed", code="closed")
        if self._error is not None:
            raise self._error

    async def send(self, frames: Frames) -> None:
        """Queue one message (handed to ZeroMQ with this turn's burst)."""
        msg = _as_zmq(frames)
        while True:
            self._check_usable()
            if len(self._out) < self._max_out:
                break
            self._room.clear()
            await self._room.wait()
        self._out.append(msg)
        # metered when queued, as the TCP stream meters what it buffers
        self.meter.record("up", msg, self.framing_overhead(msg))
        if len(self._out) == 1 and self._writer is None:
            loop = asyncio.get_running_loop()
            flusher = self._flush_to
            if flusher is None or self._flush_loop is not loop:
                flusher = self._flush_to = _flusher()
                self._flush_loop = loop
            flusher.add(self)

    def _flush(self) -> None:
        """Hand the queue to ZeroMQ, in order, as far as it takes it now."""
        out = self._out
        try:
            while out:
                if not self._try_send(out[0]):
                    if self._writer is None:
                        self._writer = asyncio.get_running_loop().create_task(
                            self._write_when_ready(), name="xcosd-zmq-send")
                    break
                out.popleft()
        except TransportError as e:
            out.clear()
            if not self._closed:
                self._error = e
        if len(out) < self._max_out:
            self._room.set()

    async def _write_when_ready(self) -> None:
        try:
            while self._out and not self._closed:
                await _send_when_ready(self._ready, partial(self._try_send, self._out[0]))
                self._out.popleft()
                self._flush_rest()
        except TransportError as e:
            self._out.clear()
            if not self._closed:
                self._error = e
        finally:
            self._writer = None
            self._room.set()

    def _flush_rest(self) -> None:
        """After the head went: the rest as far as ZeroMQ takes it now, the writer
        (the current task) waiting for the remainder."""
        out = self._out
        while out and self._try_send(out[0]):
            out.popleft()
        if len(out) < self._max_out:
            self._room.set()

    async def recv(self) -> list[bytes]:
        sock = self._sock
        events: int | None = None
        while True:
            self._check_usable()
            if events is None or not events & _POLLIN:
                try:
                    # asked first: a receive that finds nothing raises, which costs more
                    events = _events(sock)
                except zmq.ZMQError as e:
                    raise self._recv_error(e) from e
            if not events & _POLLIN:
                # nothing received, so no edge swallowed since that answer: the wait
                # (which wakes the other waiters it allows) starts from it; what woke
                # it is not asked again (this task is the only receiver)
                events = await self._ready.wait(_POLLIN, events)
                continue
            events = None
            try:
                msg = _recv_parts(sock)
            except zmq.Again:
                msg = None
            except zmq.ZMQError as e:
                raise self._recv_error(e) from e
            finally:
                self._ready.poke()
            if msg is None:
                await self._ready.wait(_POLLIN)
                continue
            self.meter.record("down", msg, self.framing_overhead(msg))
            return msg

    def _recv_error(self, e: zmq.ZMQError) -> TransportError:
        if self._closed:
            return TransportError("connection is closed", code="closed")
        return TransportError(f"recv failed: {e}", code="recv")

    async def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(TransportError):
            self._flush_rest()  # what a direct send would already have handed over
        self._closed = True
        self._out.clear()
        self._room.set()
        if self._writer is not None:
            self._writer.cancel()
        self._ready.close()
        self._sock.close(linger=0)


class ZmqListener(Listener):
    """A ROUTER bound to ``endpoint``; peers are ZeroMQ routing ids."""

    def __init__(self, endpoint: str, *, hwm: int = 1000,
                 heartbeat_ivl: float = ZMTP_HEARTBEAT_IVL,
                 heartbeat_timeout: float = ZMTP_HEARTBEAT_TIMEOUT,
                 limits: Limits = DEFAULT_LIMITS,
                 copy_threshold: int = COPY_THRESHOLD, curve: CurveServer | None = None,
                 meter: Meter | None = None) -> None:
        self.meter = meter if meter is not None else Meter()
        self.curve = curve is not None
        self._auth: Any = None
        #: each peer's CURVE key, so a revoked one is cut off (xcosd/transport/revocation.py)
        self._keys: PeerKeys | None = None
        # a ZAP handler belongs to a context: CURVE listeners get their own
        self._ctx = _curve_context() if curve is not None else shared_context()
        self._own_ctx = curve is not None
        self._sock = _socket(self._ctx, zmq.ROUTER)
        self._ready: Readiness | None = None
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
                self._keys = PeerKeys(curve, self._wake_receiver)
            self._sock.bind(endpoint)
            last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
            self._ready = Readiness(self._sock)
        except zmq.ZMQError as e:
            self._release()
            code = "address_in_use" if e.errno == zmq.EADDRINUSE else "bind"
            raise TransportError(f"cannot bind {endpoint}: {e}", code=code) from e
        self._closed = False
        #: a burst of send_nowait calls owes the waiters one look at the socket
        self._poke_due = False

    def framing_overhead(self, frames: Frames) -> int:
        """ZMTP's frame headers, and CURVE's box per frame when encrypted."""
        return zmtp_overhead(frames, self.curve)

    def _try_send(self, peer: bytes, msg: list[Buffer], poke: bool = True) -> bool:
        """One non-blocking send; whether it went (``False``: the peer's queue is full).
        ``poke=False``: the caller looks at the socket for its waiters later."""
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        assert self._ready is not None
        try:
            _send_parts(self._sock, [peer, *msg])
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise TransportError(f"no peer {bytes(peer).hex()}", code="unreachable") from e
            raise TransportError(f"send failed: {e}", code="closed" if self._closed
                                 else "send") from e
        finally:
            if poke:
                self._ready.poke()
        self.meter.record("down", msg, self.framing_overhead(msg))
        return True

    def send_nowait(self, peer: bytes, frames: Frames) -> bool:
        """Send without waiting when ``peer``'s queue has room; ``False`` (nothing
        sent) when it is full.

        The waiters (the receiving task) get one look at the socket per burst, not
        one per send (reading ``ZMQ_EVENTS`` costs a microsecond or two): at
        :meth:`end_burst`, or at the end of this turn of the loop when no burst
        end comes, which is before the loop can sleep on the edge a send swallowed."""
        if not self._poke_due:
            self._poke_due = True
            asyncio.get_running_loop().call_soon(self._poke_once)
        return self._try_send(peer, _as_zmq(frames), poke=False)

    def _poke_once(self) -> None:
        if self._poke_due:
            self._poke_due = False
            if self._ready is not None and not self._closed:
                self._ready.poke()

    def end_burst(self) -> None:
        self._poke_once()
        yield_to_io_threads()

    async def send(self, peer: bytes, frames: Frames) -> None:
        """Send, waiting while ``peer``'s queue is full (bound it with a timeout)."""
        msg = _as_zmq(frames)
        if not self._try_send(peer, msg):
            assert self._ready is not None
            await _send_when_ready(self._ready, lambda: self._try_send(peer, msg))

    async def recv(self) -> Received:
        return (await self.recv_many(1))[0]

    async def recv_many(self, max_n: int) -> list[Received]:
        """Every message ready, up to ``max_n``, after waiting for the first. On a
        CURVE listener, a peer whose key was revoked is reported gone (first) and
        what it sends after is dropped."""
        assert self._ready is not None
        keys = self._keys
        return await recv_burst(self._sock, self._ready, max_n, self._take,
                                lambda: self._closed,
                                keys.backlog if keys is not None else None, keys)

    def revoked(self, peer: bytes) -> bool:
        """Whether ``peer`` was cut off because its CURVE key was revoked."""
        return self._keys is not None and self._keys.revoked(peer)

    def peer_key(self, peer: bytes) -> bytes | None:
        """``peer``'s CURVE public key (Z85) on a CURVE listener, once it sent
        something; ``None`` otherwise."""
        return self._keys.key(peer) if self._keys is not None else None

    def _wake_receiver(self) -> None:
        if self._ready is not None and not self._closed:
            self._ready.wake(_POLLIN)

    def _take(self, msg: list[bytes]) -> Received | None:
        if len(msg) < 2:  # a routing id and no frames: nothing to deliver
            return None
        if self._keys is not None and self._keys.refuses(msg[0]):
            return None  # its key was revoked: reported gone, heard no more
        frames = msg[1:]
        self.meter.record("up", frames, self.framing_overhead(frames))
        return msg[0], frames

    async def close_peer(self, peer: bytes) -> None:
        if self._keys is not None:
            self._keys.forget(peer)

    def _release(self) -> None:
        if self._keys is not None:
            self._keys.close()
        if self._ready is not None:
            self._ready.close()
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
