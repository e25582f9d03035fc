"""The raw-TCP listener against hostile peers, over real loopback sockets.

A listener on the open network meets peers that flood it, never read, connect
and send nothing, send half a message and stop, or open more connections than it
can hold. Each test sets one of them against a healthy peer and checks that the
healthy one is still served, in order and in its turn, and that the hostile one
is bounded, dropped or refused as :class:`~xcosd.transport.tcp.TcpListener`
documents. Waits are for states (``until``) with hang bounds; the only timing
assertion is the end-to-end ratio bound against the same run unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

import xcosd
from xcosd.errors import TransportError
from xcosd.transport import Connection, connect
from xcosd.transport.tcp import TcpListener
from xcosd.wire.frames import decode_message, encode_message, encode_stream

from .helpers.waits import HANG_S, until
from .session_pairs import pair

EP = "tcp://127.0.0.1:0"


def _wire(header: dict[str, object], *buffers: bytes) -> bytes:
    """One message as the stream carries it."""
    return b"".join(bytes(c) for c in encode_stream(encode_message(header, buffers)))


async def _raw(endpoint: str, *, rcvbuf: int | None = None
               ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A hand-driven client socket; ``rcvbuf`` shrinks its receive buffer before
    connecting (so the window it advertises is small too)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, int(port))),
                           HANG_S)
    return await asyncio.open_connection(sock=sock)


async def _read_until_closed(reader: asyncio.StreamReader) -> None:
    """Return once the listener has closed this raw connection (EOF or reset),
    discarding whatever it sent first; fail if it stays open."""
    try:
        while await asyncio.wait_for(reader.read(1 << 16), HANG_S):
            pass
    except ConnectionError:
        pass


class App:
    """The application side of a listener: a receive loop that echoes every
    ``rt`` message to its sender and only counts the others, recording which
    peers were reported gone and the most any peer ever had queued."""

    def __init__(self, lst: TcpListener, *, cost_s: float = 0.0) -> None:
        self.lst = lst
        self.cost_s = cost_s  # CPU each non-round-trip message costs, as a real handler's
        self.others = 0  # messages that were not round trips
        self.ends: list[bytes] = []
        self.rt_peers: set[bytes] = set()
        self.other_peers: set[bytes] = set()
        self.max_queued = 0
        self.max_queued_bytes = 0
        self.send_errors: list[str] = []  # codes of failed echoes
        #: round trips taken while another peer had messages queued ahead in time
        self.rt_behind_others = 0
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                peer, frames = await self.lst.recv()
            except TransportError:
                return
            for p in self.lst.peers:
                n, b = self.lst.queued(p)
                self.max_queued = max(self.max_queued, n)
                self.max_queued_bytes = max(self.max_queued_bytes, b)
            if frames is None:
                self.ends.append(peer)
                continue
            if decode_message(frames)[0].get("t") != "rt":
                self.others += 1
                self.other_peers.add(peer)
                end = time.perf_counter() + self.cost_s
                while time.perf_counter() < end:
                    pass
                continue
            self.rt_peers.add(peer)
            if any(self.lst.queued(p)[0] for p in self.other_peers):
                self.rt_behind_others += 1
            try:
                await self.lst.send(peer, frames)
            except TransportError as e:
                self.send_errors.append(e.code)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _round_trips(c: Connection, n: int, tag: int = 0) -> list[int]:
    """``n`` request/reply round trips through the echo; the order they came back."""
    got = []
    for i in range(n):
        await c.send(encode_message({"t": "rt", "i": i, "tag": tag}, [bytes(i % 50)]))
        header, _ = decode_message(await asyncio.wait_for(c.recv(), HANG_S))
        assert header["tag"] == tag
        got.append(header["i"])
    return got


class Attackers:
    """Hostile peers on their own threads with blocking sockets, as on another
    machine: their sending costs the listener's event loop nothing, so they can
    outpace it, which a flooder on the same loop never could."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        #: how often the listener threw each kind of attacker out
        self.dropped: dict[str, int] = {}

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # it never reads
        s.settimeout(0.1)  # so that it notices stop while flow control holds it back
        s.connect(self.addr)
        return s

    def _start(self, run: Callable[[], None]) -> None:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def flood(self, chunk: bytes, key: str) -> None:
        """Send ``chunk`` over and over as fast as the listener takes it, never
        reading; reconnect when thrown out. Partial sends resume where they
        stopped, so valid messages stay valid. A thread here needs the GIL for
        each send, which a busy loop holds for up to the switch interval: make
        ``chunk`` large (hundreds of KiB) so one send keeps the socket full."""
        self.dropped[key] = 0

        def run() -> None:
            view = memoryview(chunk)
            while not self.stop.is_set():
                try:
                    s = self._connect()
                except OSError:
                    continue
                off = 0
                try:
                    while not self.stop.is_set():
                        try:
                            off = (off + s.send(view[off:])) % len(chunk)
                        except TimeoutError:
                            continue
                except OSError:
                    self.dropped[key] += 1
                finally:
                    s.close()

        self._start(run)

    def hold(self, data: bytes) -> None:
        """Connect, send ``data`` and hold the connection, never reading."""
        def run() -> None:
            with self._connect() as s:
                s.sendall(data)
                self.stop.wait(HANG_S)

        self._start(run)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(HANG_S)
            assert not t.is_alive()


async def _cancel(*tasks: asyncio.Task[None]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, ConnectionError, TransportError):
            await t


# ------------------------------------------------------------------- flooding


async def _a_flooder_gets_its_turn_and_no_more() -> None:
    """A peer writing valid messages faster than the application handles them
    fills only its own inbox (never past the bound), and the healthy peer's
    messages are taken in their turn: each round trip waits behind a few of the
    flooder's messages, not behind a queue the flooder keeps full (the shared
    inbox this replaced made it wait for thousands)."""
    lst = await TcpListener.bind(EP)
    app = App(lst, cost_s=50e-6)
    healthy = await connect(lst.endpoint, transport="tcp")
    attackers = Attackers(lst.endpoint)
    attackers.flood(_wire({"t": "junk"}, bytes(100)) * 2000, "flood")
    try:
        # the flooder is flooding: its messages queue up faster than they are taken
        await until(lambda: app.others > 20 * lst.inbox, "the flooder to get going")
        await until(lambda: app.max_queued >= lst.inbox // 2, "the flooder's inbox to fill")
        before = app.others
        n = 100
        assert await _round_trips(healthy, n) == list(range(n))
        during = app.others - before
        assert attackers.dropped["flood"] == 0  # it flooded the whole time
        # the healthy messages were taken while the flooder had its own waiting:
        # in turn, not after the flooder's queue
        assert app.rt_behind_others >= n // 2, app.rt_behind_others
        assert during > 0  # and the flooder was served too, not locked out
        # a round trip is a few turns of the event loop, and recv takes a few
        # messages per turn: it waits for tens of flooder messages at most
        assert during / n <= 2 * lst.inbox, during / n
        assert app.max_queued <= lst.inbox and app.max_queued_bytes <= lst.inbox_bytes
        assert not app.send_errors
    finally:
        attackers.close()
        await healthy.close()
        await app.stop()
        await lst.close()


async def _one_huge_message_fits_an_empty_inbox_but_bytes_are_bounded() -> None:
    """The byte bound holds back a second message, never a first one of any legal
    size: every message still arrives, in order, one at a time."""
    lst = await TcpListener.bind(EP, inbox_bytes=1000)
    c = await connect(lst.endpoint, transport="tcp")
    try:
        for i in range(5):
            await c.send(encode_message({"t": "big", "i": i}, [bytes(5000)]))
        await until(lambda: lst.queued(lst.peers[0])[0] == 1 if lst.peers else False,
                    "the first message to be queued")
        got = []
        for _ in range(5):
            peer, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None
            n, b = lst.queued(peer)
            assert n <= 1 and b <= 5000 + 100
            got.append(decode_message(frames)[0]["i"])
        assert got == list(range(5))
    finally:
        await c.close()
        await lst.close()


# --------------------------------------------------------------- not reading


async def _a_peer_that_never_reads_is_dropped_without_stalling_others() -> None:
    """Sends to a peer that never reads return at once; once its unsent bytes
    would pass ``send_buffer_bytes`` it is dropped, reported gone and refused,
    while another peer's round trips go on unhindered."""
    bound = 256 << 10
    lst = await TcpListener.bind(EP, send_buffer_bytes=bound, write_timeout_s=HANG_S)
    app = App(lst)
    healthy = await connect(lst.endpoint, transport="tcp")
    sr, sw = await _raw(lst.endpoint, rcvbuf=4096)
    sw.write(_wire({"t": "hello-i-never-read"}))
    await sw.drain()
    await until(lambda: app.others == 1, "the sink's message")
    (sink,) = app.other_peers
    assert len(lst.peers) == 2
    big = encode_message({"t": "x"}, [bytes(64 << 10)])
    sent, error = 0, None
    try:
        # far more than the bound plus any kernel buffering; every send returns
        # without waiting for the sink, so this loop and the round trips interleave
        # only where it yields
        async with asyncio.timeout(HANG_S):
            for sent in range(1, 4096):
                try:
                    await lst.send(sink, big)
                except TransportError as e:
                    error = e
                    break
                if sent % 8 == 0:
                    assert await _round_trips(healthy, 1, tag=sent) == [0]
        assert error is not None and error.code == "unreachable", sent
        assert sent * len(big[1]) < 64 * bound  # the kernel's buffers, then the bound
        assert lst.stats["peers_dropped_slow"] == 1
        assert sink not in lst.peers
        await until(lambda: sink in app.ends, "the sink to be reported gone")
        with pytest.raises(TransportError) as e2:
            await lst.send(sink, big)
        assert e2.value.code == "unreachable"
        assert await _round_trips(healthy, 20) == list(range(20))
        await _read_until_closed(sr)
    finally:
        await healthy.close()
        sw.close()
        await app.stop()
        await lst.close()


async def _a_peer_that_stops_reading_misses_the_write_deadline() -> None:
    """Under the byte bound, a peer whose unsent bytes stay over the high-water
    mark for ``write_timeout_s`` is dropped by the deadline instead."""
    lst = await TcpListener.bind(EP, send_buffer_bytes=1 << 30, write_timeout_s=0.2)
    app = App(lst)
    healthy = await connect(lst.endpoint, transport="tcp")
    _, sw = await _raw(lst.endpoint, rcvbuf=4096)
    sw.write(_wire({"t": "hello"}))
    await sw.drain()
    await until(lambda: app.others == 1, "the sink's message")
    (sink,) = app.other_peers
    big = encode_message({"t": "x"}, [bytes(1 << 20)])
    try:
        async with asyncio.timeout(HANG_S):  # sends never wait for the sink
            for _ in range(32):  # 32 MiB: past what the kernel holds for a 4 KiB window
                await lst.send(sink, big)
        await until(lambda: lst.stats["peers_dropped_slow"] == 1, "the write deadline")
        await until(lambda: sink in app.ends, "the sink to be reported gone")
        assert sink not in lst.peers
        assert await _round_trips(healthy, 20) == list(range(20))
    finally:
        await healthy.close()
        sw.close()
        await app.stop()
        await lst.close()


async def _a_slow_but_steady_reader_is_kept() -> None:
    """A peer that keeps reading, only slowly, may take a burst for many times
    ``write_timeout_s``: the deadline is on progress, not on a whole drain, so an
    edge on a slow downlink can take a large message (the vocabulary)."""
    lst = await TcpListener.bind(EP, send_buffer_bytes=1 << 30, write_timeout_s=0.4)
    app = App(lst)
    r, w = await _raw(lst.endpoint, rcvbuf=64 << 10)  # the kernel holds little of it
    w.write(_wire({"t": "hello"}))
    await w.drain()
    await until(lambda: app.others == 1, "the reader's message")
    (peer,) = app.other_peers
    big = encode_message({"t": "x"}, [bytes(1 << 20)])
    total = 8 * (sum(len(f) for f in big) + lst.framing_overhead(big))
    loop = asyncio.get_running_loop()
    try:
        for _ in range(8):
            await lst.send(peer, big)
        t0, got = loop.time(), 0
        async with asyncio.timeout(HANG_S):
            while got < total:  # at most 32 KiB per 5 ms: some 6.5 MB/s, 1.3 s
                data = await r.read(32 << 10)
                assert data, "closed by the listener"
                got += len(data)
                await asyncio.sleep(0.005)
        assert loop.time() - t0 > 2 * lst.write_timeout_s  # deadlines passed
        assert lst.stats["peers_dropped_slow"] == 0 and peer in lst.peers
        assert got == total and not app.ends
    finally:
        w.close()
        await app.stop()
        await lst.close()


# ------------------------------------------------------------------ reaping


async def _idle_and_half_sent_connections_are_reaped() -> None:
    """A connection that sends nothing is closed after ``idle_timeout_s``; one
    that leaves a message unfinished, whether it stops or trickles a byte at a
    time, after ``frame_timeout_s``; a peer that keeps finishing messages stays."""
    lst = await TcpListener.bind(EP, idle_timeout_s=1.0, frame_timeout_s=0.2)
    app = App(lst)
    try:
        healthy = await connect(lst.endpoint, transport="tcp")
        idle_r, idle_w = await _raw(lst.endpoint)
        half_r, half_w = await _raw(lst.endpoint)
        drip_r, drip_w = await _raw(lst.endpoint)
        body = _wire({"t": "never-finished"}, bytes(1000))
        half_w.write(body[:500])  # half a message, then nothing
        await half_w.drain()

        async def drip() -> None:  # a byte every 20 ms: progress, never a message
            # until the listener closes it (uvloop raises RuntimeError on a write then)
            with contextlib.suppress(ConnectionError, RuntimeError):
                for b in body:
                    drip_w.write(bytes([b]))
                    await drip_w.drain()
                    await asyncio.sleep(0.02)

        async def keep_alive() -> None:  # a message every 0.1 s, well inside 1 s
            while True:
                await _round_trips(healthy, 1)
                await asyncio.sleep(0.1)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(drip()), loop.create_task(keep_alive())]
        await until(lambda: lst.stats["peers_timed_out_frame"] == 2, "the frame timeouts",
                    timeout=10)
        await until(lambda: lst.stats["peers_timed_out_idle"] == 1, "the idle timeout",
                    timeout=10)
        for r in (idle_r, half_r, drip_r):
            await _read_until_closed(r)
        assert lst.stats["peers_timed_out"] == 3
        await until(lambda: len(app.ends) == 3, "the three ends to be reported")
        assert len(lst.peers) == 1 and lst.peers[0] in app.rt_peers  # the healthy one
        assert not tasks[1].done()
        await _cancel(*tasks)
        assert await _round_trips(healthy, 5) == list(range(5))
        await healthy.close()
        for w in (idle_w, half_w, drip_w):
            w.close()
    finally:
        await app.stop()
        await lst.close()


async def _the_clocks_stop_while_the_listener_holds_a_peer_back() -> None:
    """A peer whose inbox is full is not read, through no fault of its own: it is
    not reaped for silence while the application is slow to take its messages."""
    lst = await TcpListener.bind(EP, inbox=2, idle_timeout_s=0.2, frame_timeout_s=0.1)
    _, w = await _raw(lst.endpoint)
    try:
        w.write(_wire({"t": "m"}, bytes(100)) * 50 + _wire({"t": "m"}, bytes(100))[:30])
        await w.drain()
        await until(lambda: bool(lst.peers) and lst.queued(lst.peers[0])[0] == 2,
                    "the inbox to fill")
        await asyncio.sleep(0.5)  # the application is slow: more than both timeouts
        assert lst.stats["peers_timed_out"] == 0
        for _ in range(50):
            _, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None
        # now the peer itself stalls on the half message it left: that is its fault
        _, end = await asyncio.wait_for(lst.recv(), HANG_S)
        assert end is None and lst.stats["peers_timed_out_frame"] == 1
    finally:
        w.close()
        await lst.close()


# --------------------------------------------------------------- admission


async def _connections_over_the_cap_are_refused_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """Over ``max_connections`` a new connection is closed at accept, counted and
    logged once, not once each; the existing ones keep working, and a slot freed
    by a leaving peer is given to the next one."""
    lst = await TcpListener.bind(EP, max_connections=3)
    app = App(lst)
    conns = [await connect(lst.endpoint, transport="tcp") for _ in range(3)]
    try:
        for i, c in enumerate(conns):
            assert await _round_trips(c, 2, tag=i) == [0, 1]
        with caplog.at_level(logging.WARNING, logger="xcosd.transport.tcp"):
            extra = [await _raw(lst.endpoint) for _ in range(8)]
            await until(lambda: lst.stats["connections_refused"] == 8, "the refusals")
            for r, _ in extra:
                await _read_until_closed(r)
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1
        assert len(lst.peers) == 3 and lst.stats["connections_accepted"] == 3
        for i, c in enumerate(conns):
            assert await _round_trips(c, 3, tag=i) == [0, 1, 2]
        await conns[0].close()
        await until(lambda: len(app.ends) == 1, "the leaving peer's end")
        conns[0] = await connect(lst.endpoint, transport="tcp")
        assert await _round_trips(conns[0], 2, tag=9) == [0, 1]
        assert lst.stats["connections_accepted"] == 4
        for _, w in extra:
            w.close()
    finally:
        for c in conns:
            await c.close()
        await app.stop()
        await lst.close()


# ------------------------------------------- the listener's tests, on both loops


Runner = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def on_loop(request: pytest.FixtureRequest) -> Runner:
    """Run a test body on asyncio's own loop or on uvloop: the listener serves both,
    and their transports differ in how they buffer and report writes."""
    return uvloop.run if request.param == "uvloop" else asyncio.run


def test_a_flooder_gets_its_turn_and_no_more(on_loop: Runner) -> None:
    on_loop(_a_flooder_gets_its_turn_and_no_more())


def test_one_huge_message_fits_an_empty_inbox_but_bytes_are_bounded(on_loop: Runner) -> None:
    on_loop(_one_huge_message_fits_an_empty_inbox_but_bytes_are_bounded())


def test_a_peer_that_never_reads_is_dropped_without_stalling_others(on_loop: Runner) -> None:
    on_loop(_a_peer_that_never_reads_is_dropped_without_stalling_others())


def test_a_peer_that_stops_reading_misses_the_write_deadline(on_loop: Runner) -> None:
    on_loop(_a_peer_that_stops_reading_misses_the_write_deadline())


def test_a_slow_but_steady_reader_is_kept(on_loop: Runner) -> None:
    on_loop(_a_slow_but_steady_reader_is_kept())


def test_idle_and_half_sent_connections_are_reaped(on_loop: Runner) -> None:
    on_loop(_idle_and_half_sent_connections_are_reaped())


def test_the_clocks_stop_while_the_listener_holds_a_peer_back(on_loop: Runner) -> None:
    on_loop(_the_clocks_stop_while_the_listener_holds_a_peer_back())


def test_connections_over_the_cap_are_refused_quietly(on_loop: Runner,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    on_loop(_connections_over_the_cap_are_refused_quietly(caplog))


def test_options_are_checked() -> None:
    """A zero or negative bound would refuse everything or reap at once: refused
    when the listener is made, not met as a puzzle under load."""
    bad: list[dict[str, Any]] = [
        {"inbox": 0}, {"inbox_bytes": 0}, {"max_connections": 0}, {"send_buffer_bytes": 0},
        {"idle_timeout_s": 0.0}, {"frame_timeout_s": -1.0}, {"write_timeout_s": 0}]
    for opts in bad:
        with pytest.raises(ValueError):
            TcpListener(**opts)
    TcpListener(idle_timeout_s=None, frame_timeout_s=None)  # None: that reaping is off


# -------------------------------------------------------------- end to end


async def _generate(edge: xcosd.EdgeNode) -> tuple[list[int], float]:
    """The seeded T=1 generation: its tokens and its wall seconds."""
    t0 = time.perf_counter()
    res = await asyncio.wait_for(edge.generate(
        "ab", max_new_tokens=60, temperature=1.0, top_k=0, top_p=1.0, seed=11), HANG_S)
    return res.token_ids, time.perf_counter() - t0


async def test_a_cloud_under_attack_still_serves_an_edge_exactly() -> None:
    """A real CloudNode over raw TCP, a seeded T=1 generation by a real EdgeNode:
    with hostile peers flooding the same listener the edge gets the very same
    tokens, within 5x its unloaded time + 2 s."""
    target, draft = pair(eos_mass=0.0)
    opts = {"send_buffer_bytes": 64 << 10}
    async with xcosd.CloudNode(target=target, bind=EP, transport="tcp",
                               transport_options=opts) as cloud:
        edge = xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, transport="tcp",
                              method="xcosd-e", codec="f32")
        async with edge:
            await _generate(edge)  # warm: first-use costs stay out of the baseline
            quiet, quiet_s = await _generate(edge)
            # one floods pings and unknown types and never reads the replies, one
            # floods garbage and reconnects each time it is thrown out, one holds a
            # connection after half a message
            attackers = Attackers(cloud.endpoint)
            attackers.flood((_wire({"t": "ping", "n": 1})
                             + _wire({"t": "nonsense"}, bytes(200))) * 1000, "flood")
            attackers.flood(os.urandom(4096), "garbage")
            attackers.hold(struct.pack(">II", 1, 1000) + bytes(10))
            before = cloud.stats()["messages"]
            try:
                # the flood is being served: the cloud is handling its messages
                await until(lambda: cloud.stats()["messages"] > before + 1000,
                            "the attack to start")
                start = cloud.stats()["messages"]
                loaded, loaded_s = await _generate(edge)
                flood = cloud.stats()["messages"] - start
            finally:
                attackers.close()
    assert loaded == quiet and len(quiet) == 60
    assert loaded_s <= 5 * quiet_s + 2.0, (loaded_s, quiet_s)
    # the attack went on through the generation: garbage senders were thrown out,
    # and meanwhile the cloud handled far more hostile messages than the edge's
    # own (about two per round)
    assert attackers.dropped["garbage"] >= 1 and flood > 500, (attackers.dropped, flood)
