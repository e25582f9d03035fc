"""Raw TCP over asyncio streams, with the frame codec's length-prefixed framing.

A message is ``u32 n_frames`` then ``u32 len | bytes`` per frame, big-endian (see
:mod:`xcosd.wire.frames`); :class:`~xcosd.wire.frames.StreamDecoder` cuts the
stream back into messages and refuses an oversized count or length before
reading its body. Any framing error ends that connection: after it the stream
cannot be trusted to be in sync.

The listener names each accepted connection with a fresh 8-byte peer id and
reports its end in-band as ``(peer, None)`` from ``recv``. asyncio and uvloop
both set ``TCP_NODELAY`` on stream sockets, so small messages are not delayed.

The listener faces the open network, so no peer may cost the others service or
the process unbounded memory: each connection has its own bounded inbox, served
in turn; sends never wait for a peer, and one that does not read is dropped once
its unsent bytes pass a bound; silent or half-sent connections are reaped; the
number of connections is capped. :class:`TcpListener` says how, and what it
bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import time
from collections import deque
from urllib.parse import urlsplit

from ..errors import ProtocolError, TransportError
from ..wire.frames import (
    DEFAULT_LIMITS,
    Limits,
    StreamDecoder,
    encode_stream,
    message_bytes,
    stream_overhead,
)
from .base import Connection, Frames, Listener
from .meter import Meter

log = logging.getLogger(__name__)

#: bytes asked of the socket per read
READ_CHUNK = 256 * 1024
#: at most one warning per this many seconds about connections refused over the cap,
#: and one about peers dropped for bad framing
LOG_INTERVAL_S = 10.0
#: bytes a peer behind on its replies must take per ``write_timeout_s`` to stay
MIN_WRITE_PROGRESS = 64 * 1024
#: messages ``TcpListener.recv`` takes in a row before it lets the event loop turn
RECV_BURST = 4
#: the longest ``TcpListener.close`` waits for the server to wind down
CLOSE_TIMEOUT_S = 5.0


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


class _LogThrottle:
    """At most one log line per ``interval`` seconds for an event a hostile peer can
    repeat at will (connecting over the cap, sending garbage and reconnecting);
    the events in between are counted into the next line, not lost."""

    __slots__ = ("at", "interval", "unlogged")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.at = -math.inf
        self.unlogged = 0

    def hit(self) -> int:
        """Count one event; how many to report now (0: stay quiet)."""
        self.unlogged += 1
        now = time.monotonic()
        if now - self.at < self.interval:
            return 0
        n, self.at, self.unlogged = self.unlogged, now, 0
        return n


class _Peer:
    """One accepted connection: its streams, its bounded inbox and its tasks.

    ``inbox`` holds the decoded messages ``recv`` has not taken yet, then ``None``
    once the peer is gone; ``queued`` says whether the peer sits in the listener's
    round-robin of peers with something to take.
    """

    __slots__ = ("id", "inbox", "inbox_bytes", "queued", "reader", "room", "task", "watchdog",
                 "writer", "written")

    def __init__(self, peer_id: bytes, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.id = peer_id
        self.reader, self.writer = reader, writer
        self.task: asyncio.Task[None] | None = None
        self.watchdog: asyncio.Task[None] | None = None
        self.inbox: deque[list[bytes] | None] = deque()
        self.inbox_bytes = 0
        self.room = asyncio.Event()
        self.queued = False
        self.written = 0  # bytes handed to the transport, for the drain watchdog


class TcpListener(Listener):
    """An asyncio server that stays fair and bounded with hostile peers.

    Receiving: one reader task per connection decodes into that connection's own
    inbox of at most ``inbox`` messages and ``inbox_bytes`` bytes (one message of
    any legal size always fits an empty inbox). While the inbox is full the task
    stops reading, so the kernel buffers fill and TCP flow control pushes back on
    that peer alone. ``recv`` takes one message at a time from the connections
    with something queued, in turn (round robin): a flooding peer gets its share,
    never the others'.

    Sending never waits for the peer: ``send`` writes into the connection's
    buffer and returns. A peer whose unsent bytes would pass ``send_buffer_bytes``
    (a message sent into an empty buffer is always taken), or that, with unsent
    bytes over the transport's high-water mark, takes less than
    :data:`MIN_WRITE_PROGRESS` bytes in ``write_timeout_s``, does not read: it is
    dropped (``stats["peers_dropped_slow"]``), its queued messages are discarded
    and ``recv`` reports it gone, ``(peer, None)``.

    Reaping: a connection that completes no message for ``idle_timeout_s``, or
    leaves a message unfinished for ``frame_timeout_s``, is closed and reported
    gone (``stats["peers_timed_out"]``); ``None`` turns either off. The clocks
    stop while the listener itself holds the peer back (full inbox). A partial
    message never holds more than ``limits.max_bytes``: :class:`StreamDecoder`
    refuses a longer one from its length prefixes.

    Admission: over ``max_connections`` live connections a new one is closed at
    accept (``stats["connections_refused"]``, logged at most once per
    :data:`LOG_INTERVAL_S`); the others are untouched.

    Memory per connection is therefore bounded by ``inbox_bytes`` (or one
    message) queued + ``limits.max_bytes`` of partial message + the messages one
    :data:`READ_CHUNK` completes, decoded but not yet queued + ``2 * READ_CHUNK``
    in the stream reader + ``send_buffer_bytes`` (or one message) unsent, plus
    Python's per-message overhead and the kernel's socket buffers; times
    ``max_connections`` for the listener. With the defaults and the cloud's 16 MiB
    messages that is about 40 MiB per connection at worst (a whole message
    queued, another decoded behind it, 8 MiB unsent), some 40 GiB for 1024
    hostile ones: size ``max_connections`` and the limits to the machine.

    The defaults suit an edge on a slow uplink: a 16 MiB message must arrive
    within ``frame_timeout_s`` (30 s: >= ~4.5 Mbit/s), a silent connection lasts
    ``idle_timeout_s`` (60 s; an edge pings every second), and a peer behind on
    its replies must take 64 KiB per ``write_timeout_s`` (10 s: ~52 kbit/s).
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS, meter: Meter | None = None,
                 inbox: int = 64, inbox_bytes: int = 4 << 20,
                 send_buffer_bytes: int = 8 << 20, write_timeout_s: float = 10.0,
                 idle_timeout_s: float | None = 60.0, frame_timeout_s: float | None = 30.0,
                 max_connections: int = 1024) -> None:
        if inbox < 1 or inbox_bytes < 1 or send_buffer_bytes < 1 or max_connections < 1:
            raise ValueError("inbox, inbox_bytes, send_buffer_bytes and max_connections "
                             "must be positive")
        for name, t in (("write_timeout_s", write_timeout_s), ("idle_timeout_s", idle_timeout_s),
                        ("frame_timeout_s", frame_timeout_s)):
            if t is not None and not t > 0:
                raise ValueError(f"{name} must be positive, got {t!r}")
        self.limits = limits
        self.meter = meter if meter is not None else Meter()
        self.inbox, self.inbox_bytes = inbox, inbox_bytes
        self.send_buffer_bytes = send_buffer_bytes
        self.write_timeout_s = write_timeout_s
        self.idle_timeout_s, self.frame_timeout_s = idle_timeout_s, frame_timeout_s
        self.max_connections = max_connections
        self.endpoint = ""
        #: what the listener did to protect itself, for the node's stats
        self.stats: dict[str, int] = {
            "connections_accepted": 0, "connections_refused": 0, "peers_timed_out": 0,
            "peers_timed_out_idle": 0, "peers_timed_out_frame": 0, "peers_dropped_slow": 0,
            "peers_dropped_bad_frame": 0,
        }
        self._server: asyncio.Server | None = None
        self._peers: dict[bytes, _Peer] = {}
        self._ready: deque[_Peer] = deque()
        self._wakeup = asyncio.Event()
        self._ids = itertools.count(1)
        self._closed = False
        self._burst = 0  # messages recv took since the loop last turned
        self._refusal_log = _LogThrottle(LOG_INTERVAL_S)
        self._bad_frame_log = _LogThrottle(LOG_INTERVAL_S)

    @classmethod
    async def bind(cls, endpoint: str, **opts: object) -> TcpListener:
        """Listen on ``endpoint``; ``opts`` are the keyword options of the class."""
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

    # -- accepting -------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed:
            writer.transport.abort()
            return
        if len(self._peers) >= self.max_connections:
            self._refuse(writer)
            return
        peer = next(self._ids).to_bytes(8, "big")
        p = _Peer(peer, reader, writer)
        self._peers[peer] = p
        self.stats["connections_accepted"] += 1
        p.task = asyncio.current_task()
        await self._read_peer(p)

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """Close a connection over the cap at once; a flood of them logs one line
        per interval, not one each."""
        writer.transport.abort()
        self.stats["connections_refused"] += 1
        n = self._refusal_log.hit()
        if n:
            log.warning("refused %d TCP connection(s) over the cap of %d on %s",
                        n, self.max_connections, self.endpoint)

    # -- reading ---------------------------------------------------------------------

    async def _read_peer(self, p: _Peer) -> None:
        decoder = StreamDecoder(self.limits)
        backlog: deque[list[bytes]] = deque()  # decoded, waiting for room in the inbox
        try:
            try:
                if not await self._pump(p, decoder, backlog):
                    return  # timed out: already closed and reported
            except ProtocolError as e:
                self.stats["peers_dropped_bad_frame"] += 1
                n = self._bad_frame_log.hit()
                if n:
                    log.warning("dropping TCP peer %s: %s (%s)%s", p.id.hex(), e, e.code,
                                f"; {n - 1} more dropped for bad framing since the last "
                                "report" if n > 1 else "")
            except (ConnectionError, OSError) as e:
                log.info("TCP peer %s lost: %s", p.id.hex(), e)
            # the stream ended on the peer's side: what it completed before still
            # reaches recv, then its end
            await self._queue(p, backlog)
            self._end(p, report=True, discard=False, abort=False)
        except asyncio.CancelledError:
            # close_peer, close or a drop ended the peer; the accept task must not
            # end cancelled (asyncio's stream callback would log it as an error)
            pass

    async def _pump(self, p: _Peer, decoder: StreamDecoder, backlog: deque[list[bytes]]) -> bool:
        """Read and decode until the peer's stream ends (``True``) or it times out
        (``False``, the peer already dropped). Raises what ended the stream."""
        loop = asyncio.get_running_loop()
        done_at = loop.time()  # the last complete message (or the accept)
        partial_since: float | None = None  # when the unfinished message began
        while True:
            if backlog and await self._queue(p, backlog):
                # the listener held the peer back, not the peer: restart its clocks
                done_at = loop.time()
                if partial_since is not None:
                    partial_since = done_at
            decoder.check()  # an error behind the messages just queued ends the peer now
            idle_at = None if self.idle_timeout_s is None else done_at + self.idle_timeout_s
            frame_at = (None if self.frame_timeout_s is None or partial_since is None
                        else partial_since + self.frame_timeout_s)
            deadline = min((t for t in (idle_at, frame_at) if t is not None), default=None)
            cm = asyncio.timeout_at(deadline)
            try:
                async with cm:
                    data = await p.reader.read(READ_CHUNK)
            except TimeoutError:
                if not cm.expired():
                    raise  # a socket's own ETIMEDOUT: the connection is lost
                kind = "frame" if frame_at is not None and frame_at == deadline else "idle"
                self.stats["peers_timed_out"] += 1
                self.stats[f"peers_timed_out_{kind}"] += 1
                log.info("TCP peer %s timed out (%s): %d bytes of an unfinished message",
                         p.id.hex(), "no message finished" if kind == "idle"
                         else "a message left unfinished", decoder.pending)
                self._end(p, report=True, discard=True, abort=True)
                return False
            if not data:
                return True
            msgs = decoder.feed(data)
            now = loop.time()
            for msg in msgs:
                self.meter.record("up", msg, self.framing_overhead(msg))
            backlog.extend(msgs)
            if msgs:
                done_at = now
            if not decoder.pending:
                partial_since = None
            elif msgs or partial_since is None:
                partial_since = now

    def _has_room(self, p: _Peer, size: int) -> bool:
        return not p.inbox or (len(p.inbox) < self.inbox
                               and p.inbox_bytes + size <= self.inbox_bytes)

    async def _queue(self, p: _Peer, backlog: deque[list[bytes]]) -> bool:
        """Move decoded messages into ``p``'s inbox as room allows (``recv`` makes
        room); ``True`` when it had to wait. Meanwhile nothing is read from the
        peer: that wait is the backpressure."""
        waited = False
        while backlog:
            size = message_bytes(backlog[0])
            while not self._has_room(p, size):
                waited = True
                p.room.clear()
                await p.room.wait()
            p.inbox.append(backlog.popleft())
            p.inbox_bytes += size
            self._mark_ready(p)
        return waited

    def _mark_ready(self, p: _Peer) -> None:
        if not p.queued:
            p.queued = True
            self._ready.append(p)
            self._wakeup.set()

    # -- ending a peer -------------------------------------------------------------

    def _end(self, p: _Peer, *, report: bool, discard: bool, abort: bool) -> None:
        """Forget ``p`` now: stop its tasks and close its socket.

        ``report``: ``recv`` returns ``(peer, None)`` after whatever stays queued.
        ``discard``: drop what it queued (a peer the listener threw out, or one the
        application closed: nobody is to answer it). ``abort``: reset the
        connection rather than let unsent bytes leave first (a peer that does not
        read would hold a graceful close open forever).
        """
        if self._peers.get(p.id) is not p:
            return
        del self._peers[p.id]
        me = asyncio.current_task()
        for t in (p.task, p.watchdog):
            if t is not None and t is not me:
                t.cancel()
        transport = p.writer.transport
        if abort:
            transport.abort()
        else:
            p.writer.close()
            if transport.get_write_buffer_size():
                # unsent replies get a bounded time to leave, then the socket goes
                asyncio.get_running_loop().call_later(self.write_timeout_s, transport.abort)
        if discard:
            p.inbox.clear()
            p.inbox_bytes = 0
            if p.queued and not report:
                self._ready.remove(p)
                p.queued = False
        if report and not self._closed:
            p.inbox.append(None)
            self._mark_ready(p)

    async def _join(self, p: _Peer) -> None:
        """Wait for ``p``'s tasks, cancelled by :meth:`_end`, to finish."""
        me = asyncio.current_task()
        for t in (p.task, p.watchdog):
            if t is not None and t is not me:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    # -- sending -------------------------------------------------------------------

    def framing_overhead(self, frames: Frames) -> int:
        """The stream framing: a frame count and one length per frame."""
        return stream_overhead(len(frames))

    async def send(self, peer: bytes, frames: Frames) -> None:
        """Queue one message to ``peer`` without waiting for it to leave.

        Raises ``unreachable`` for an unknown or closed peer, and for one that
        does not read: when its unsent bytes would pass ``send_buffer_bytes`` it is
        dropped and reported gone instead of taking this message.
        """
        if self._closed:
            raise TransportError("listener is closed", code="closed")
        p = self._peers.get(bytes(peer))
        if p is None or p.writer.is_closing():
            raise TransportError(f"no peer {bytes(peer).hex()}", code="unreachable")
        _check(frames)
        overhead = self.framing_overhead(frames)
        size = message_bytes(frames) + overhead
        transport = p.writer.transport
        unsent = transport.get_write_buffer_size()
        if unsent and unsent + size > self.send_buffer_bytes:
            self._drop_slow(p, f"{unsent} bytes unsent, bound {self.send_buffer_bytes}")
            raise TransportError(f"peer {p.id.hex()} does not read: dropped with {unsent} "
                                 "bytes unsent", code="unreachable")
        p.writer.writelines(encode_stream(frames))
        p.written += size
        self.meter.record("down", frames, overhead)
        if p.watchdog is None and transport.get_write_buffer_size() > \
                transport.get_write_buffer_limits()[1]:
            p.watchdog = asyncio.get_running_loop().create_task(
                self._watch_drain(p), name=f"xcosd-tcp-drain-{p.id.hex()}")

    async def _watch_drain(self, p: _Peer) -> None:
        """Watch a peer whose unsent bytes passed the high-water mark until it reads
        them down to the low-water mark; drop it if in some ``write_timeout_s`` it
        took less than :data:`MIN_WRITE_PROGRESS` bytes. The sender never waits on
        this. Progress rather than a whole drain per deadline, so that an honest
        edge on a slow downlink may take a large message (the vocabulary) for as
        long as it keeps taking it."""
        transport = p.writer.transport
        loop = asyncio.get_running_loop()
        try:
            while True:
                written, unsent = p.written, transport.get_write_buffer_size()
                start = loop.time()
                cm = asyncio.timeout(self.write_timeout_s)
                try:
                    async with cm:
                        await p.writer.drain()
                    return
                except TimeoutError:
                    if not cm.expired():
                        raise
                if loop.time() - start > 1.5 * self.write_timeout_s:
                    continue  # this loop overslept: the window says nothing about the peer
                # bytes that left the buffer for the socket in that window
                taken = (p.written - written) - (transport.get_write_buffer_size() - unsent)
                if taken < MIN_WRITE_PROGRESS:
                    self._drop_slow(p, f"{taken} bytes taken in {self.write_timeout_s} s")
                    return
        except (ConnectionError, OSError):
            pass  # the connection broke: its reader sees the end and reports it
        finally:
            if p.watchdog is asyncio.current_task():
                p.watchdog = None

    def _drop_slow(self, p: _Peer, why: str) -> None:
        if self._peers.get(p.id) is not p:
            return
        self.stats["peers_dropped_slow"] += 1
        log.info("dropping TCP peer %s: it does not read (%s)", p.id.hex(), why)
        self._end(p, report=True, discard=True, abort=True)

    # -- the application's side ------------------------------------------------------

    async def recv(self) -> tuple[bytes, list[bytes] | None]:
        """The next message, taken from the connections with one queued in turn.

        Taking a queued message does not yield to the event loop, so after
        :data:`RECV_BURST` in a row ``recv`` lets the loop turn once: messages that
        arrived meanwhile join the turn, and the application's other tasks run.
        Without it a flooder's full inbox would be served whole between two turns,
        every turn, ahead of a message that just arrived.
        """
        if self._burst >= RECV_BURST:
            self._burst = 0
            await asyncio.sleep(0)
        while True:
            if self._closed:
                raise TransportError("listener is closed", code="closed")
            if self._ready:
                self._burst += 1
                return self._take()
            self._burst = 0
            self._wakeup.clear()
            await self._wakeup.wait()

    async def recv_many(self, max_n: int) -> list[tuple[bytes, list[bytes] | None]]:
        """Every message already queued, up to ``max_n``, taken in the same turn
        order as :meth:`recv` (after waiting for the first): a busy reader pays one
        call per burst, not one per message. A full burst makes the next call let
        the loop turn first, as :data:`RECV_BURST` messages in a row make ``recv``."""
        out = [await self.recv()]
        while len(out) < max_n and self._ready and not self._closed:
            out.append(self._take())
        self._burst = RECV_BURST if len(out) >= max_n else 0
        return out

    def _take(self) -> tuple[bytes, list[bytes] | None]:
        p = self._ready.popleft()
        msg = p.inbox.popleft()
        if p.inbox:
            self._ready.append(p)  # to the back: every other peer goes first
        else:
            p.queued = False
        if msg is not None:
            p.inbox_bytes -= message_bytes(msg)
            p.room.set()
        return p.id, msg

    def queued(self, peer: bytes) -> tuple[int, int]:
        """``(messages, bytes)`` queued from ``peer`` that ``recv`` has not taken
        (its end not counted); ``(0, 0)`` for an unknown peer."""
        p = self._peers.get(bytes(peer))
        if p is None:
            return 0, 0
        return sum(m is not None for m in p.inbox), p.inbox_bytes

    @property
    def peers(self) -> list[bytes]:
        return list(self._peers)

    async def close_peer(self, peer: bytes) -> None:
        """Close one connection; what it queued is discarded and no end is reported
        (the caller knows)."""
        p = self._peers.get(bytes(peer))
        if p is None:
            return
        self._end(p, report=False, discard=True, abort=False)
        await self._join(p)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup.set()  # a pending recv raises
        if self._server is not None:
            self._server.close()
        peers = list(self._peers.values())
        for p in peers:
            # no lingering past the listener: unsent bytes are reset away
            self._end(p, report=False, discard=True,
                      abort=bool(p.writer.transport.get_write_buffer_size()))
        for p in peers:
            await self._join(p)
        self._ready.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._server.wait_closed()
