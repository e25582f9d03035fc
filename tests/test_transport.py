"""Transports over real loopback sockets (ZeroMQ, TCP) and in memory, under
asyncio and uvloop: round trips, many peers, big buffers, metering, peer ends,
closing."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct

import numpy as np
import pytest
import uvloop

from xcosd.errors import TransportError
from xcosd.transport import Meter, connect, listen
from xcosd.transport.zeromq import zmtp_overhead
from xcosd.wire.frames import Limits, decode_message, encode_message, stream_overhead

from .helpers.waits import HANG_S

KINDS = ["zmq", "tcp", "memory"]


def _ep(kind: str) -> str:
    return "mem://" if kind == "memory" else "tcp://127.0.0.1:0"


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run(loop_kind: str, coro_fn, *args):  # type: ignore[no-untyped-def]
    if loop_kind == "uvloop":
        return uvloop.run(coro_fn(*args))
    return asyncio.run(coro_fn(*args))


async def _echo_round_trips(kind: str) -> None:
    lst = await listen(_ep(kind), transport=kind)
    assert not lst.endpoint.endswith(":0")
    conns = [await connect(lst.endpoint, transport=kind) for _ in range(3)]
    big = np.arange(200_000, dtype=np.float32)
    for i, c in enumerate(conns):
        await c.send(encode_message({"t": "ping", "i": i}, [big[: 10 ** i], b"x" * i]))
    seen = {}
    for _ in conns:
        peer, frames = await asyncio.wait_for(lst.recv(), HANG_S)
        assert frames is not None
        header, bufs = decode_message(frames)
        assert header["t"] == "ping"
        i = header["i"]
        assert np.array_equal(np.frombuffer(bufs[0], dtype=np.float32), big[: 10 ** i])
        assert bytes(bufs[1]) == b"x" * i
        seen[i] = peer
        await lst.send(peer, encode_message({"t": "pong", "i": i}, [big]))
    assert len(set(seen.values())) == 3
    for i, c in enumerate(conns):
        header, bufs = decode_message(await asyncio.wait_for(c.recv(), HANG_S))
        assert header == {"t": "pong", "i": i}
        assert np.array_equal(np.frombuffer(bufs[0], dtype=np.float32), big)
    for c in conns:
        await c.close()
        await c.close()  # idempotent
    await lst.close()
    await lst.close()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_many_peers(kind: str, loop_kind: str) -> None:
    run(loop_kind, _echo_round_trips, kind)


@pytest.mark.parametrize("kind", KINDS)
async def test_order_is_kept(kind: str) -> None:
    async with await listen(_ep(kind), transport=kind) as lst:
        c = await connect(lst.endpoint, transport=kind)
        for i in range(200):
            await c.send(encode_message({"t": "n", "i": i}, [bytes(i)]))
        got = []
        for _ in range(200):
            _, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None
            got.append(decode_message(frames)[0]["i"])
        assert got == list(range(200))
        await c.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_meter_counts_wire_bytes_by_type(kind: str) -> None:
    lst_meter, conn_meter = Meter(), Meter()
    async with await listen(_ep(kind), transport=kind, meter=lst_meter) as lst:
        c = await connect(lst.endpoint, transport=kind, meter=conn_meter)
        up = encode_message({"t": "draft"}, [bytes(300), bytes(10)])
        down = encode_message({"t": "verdict"}, [bytes(5)])
        await c.send(up)
        await c.send(up)
        peer, _ = await asyncio.wait_for(lst.recv(), HANG_S)
        await lst.recv()
        await lst.send(peer, down)
        await asyncio.wait_for(c.recv(), HANG_S)
        payload_up = sum(len(bytes(f)) for f in up)
        over = {"zmq": zmtp_overhead(up), "tcp": stream_overhead(3), "memory": 0}[kind]
        for m in (lst_meter, conn_meter):
            t = m.up["draft"]
            assert (t.messages, t.frames, t.payload) == (2, 6, 2 * payload_up)
            assert t.wire == 2 * (payload_up + over)
            assert m.down["verdict"].messages == 1
            assert m.up_bytes == t.wire
        # each end reports the framing it meters, so a node needs no transport type
        assert c.framing_overhead(up) == lst.framing_overhead(up) == over
        if kind == "tcp":  # 4-byte count + 4-byte length per frame
            assert conn_meter.down_bytes == len(down[0]) + 5 + 4 + 4 * 2
        if kind == "zmq":  # ZMTP: flags + 1-byte or 8-byte length per frame
            assert zmtp_overhead([b"a" * 255, b"b" * 256]) == 2 + 9
        d = conn_meter.to_dict()
        assert d["total"]["up"]["messages"] == 2
        snap = conn_meter.snapshot()
        await c.send(up)
        assert (conn_meter - snap).up["draft"].messages == 1
        await c.close()


@pytest.mark.parametrize("kind", ["zmq", "tcp", "memory"])
async def test_send_to_unknown_peer_is_refused(kind: str) -> None:
    async with await listen(_ep(kind), transport=kind) as lst:
        with pytest.raises(TransportError) as e:
            await lst.send(b"\x00nobody!", [b"\x80"])
        assert e.value.code == "unreachable"


@pytest.mark.parametrize("kind", ["tcp", "memory"])
async def test_peer_end_surfaces_after_its_messages(kind: str) -> None:
    async with await listen(_ep(kind), transport=kind) as lst:
        c = await connect(lst.endpoint, transport=kind)
        await c.send(encode_message({"t": "bye"}))
        await c.close()
        peer, frames = await asyncio.wait_for(lst.recv(), HANG_S)
        assert frames is not None and decode_message(frames)[0]["t"] == "bye"
        peer2, end = await asyncio.wait_for(lst.recv(), HANG_S)
        assert (peer2, end) == (peer, None)
        with pytest.raises(TransportError):
            await lst.send(peer, [b"\x80"])


@pytest.mark.parametrize("kind", ["tcp", "memory"])
async def test_listener_can_drop_a_peer(kind: str) -> None:
    async with await listen(_ep(kind), transport=kind) as lst:
        c = await connect(lst.endpoint, transport=kind)
        await c.send([b"\x80"])
        peer, _ = await asyncio.wait_for(lst.recv(), HANG_S)
        await lst.close_peer(peer)
        with pytest.raises(TransportError) as e:
            await asyncio.wait_for(c.recv(), HANG_S)
        assert e.value.code == "closed"
        await c.close()


@pytest.mark.parametrize("kind", ["tcp", "memory"])
async def test_listener_close_ends_connections(kind: str) -> None:
    lst = await listen(_ep(kind), transport=kind)
    c = await connect(lst.endpoint, transport=kind)
    await c.send([b"\x80"])
    await asyncio.wait_for(lst.recv(), HANG_S)
    await lst.close()
    with pytest.raises(TransportError):
        await asyncio.wait_for(c.recv(), HANG_S)
    await c.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_pending_recv_ends_on_close(kind: str) -> None:
    lst = await listen(_ep(kind), transport=kind)
    waiter = asyncio.ensure_future(lst.recv())
    await asyncio.sleep(0)  # one turn of the loop: the waiter runs into its recv
    assert not waiter.done()  # nothing was sent: it is pending when the close comes
    await lst.close()
    with pytest.raises((TransportError, asyncio.CancelledError)):
        await asyncio.wait_for(waiter, HANG_S)


async def test_tcp_oversized_length_prefix_drops_peer_before_body() -> None:
    async with await listen("tcp://127.0.0.1:0", transport="tcp",
                            limits=Limits(max_bytes=1000)) as lst:
        host, port = lst.endpoint.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        # claims a 1 GB frame and sends none of it
        writer.write(struct.pack(">II", 2, 1) + b"\x80" + struct.pack(">I", 1 << 30))
        await writer.drain()
        _, end = await asyncio.wait_for(lst.recv(), HANG_S)
        assert end is None
        assert await asyncio.wait_for(reader.read(), HANG_S) == b""  # closed by the listener
        writer.close()


async def test_tcp_connection_refuses_oversized_reply() -> None:
    srv_done = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(struct.pack(">I", 1000))  # 1000 frames: over the limit
        await w.drain()
        await srv_done.wait()
        w.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = await connect(f"tcp://127.0.0.1:{port}", transport="tcp")
    with pytest.raises(Exception) as e:
        await asyncio.wait_for(c.recv(), HANG_S)
    assert getattr(e.value, "code", None) == "too_large"
    srv_done.set()
    await c.close()
    server.close()
    await server.wait_closed()


async def test_bind_conflict_and_bad_endpoints() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        for kind in ("zmq", "tcp"):
            with pytest.raises(TransportError) as e:
                await listen(f"tcp://127.0.0.1:{port}", transport=kind)
            assert e.value.code == "address_in_use"
    finally:
        s.close()
    with pytest.raises(TransportError):
        await listen("tcp://127.0.0.1", transport="tcp")
    with pytest.raises(TransportError):
        await listen("tcp://127.0.0.1:0", transport="carrier-pigeon")
    with pytest.raises(TransportError):
        await connect("mem://nobody-here")


async def test_zmq_closing_leaves_no_task_behind() -> None:
    before = {t for t in asyncio.all_tasks() if not t.done()}
    for _ in range(3):
        lst = await listen("tcp://127.0.0.1:0")
        c = await connect(lst.endpoint)
        await c.send([b"\x80"])
        peer, _ = await asyncio.wait_for(lst.recv(), HANG_S)
        await lst.send(peer, [b"\x80"])
        await asyncio.wait_for(c.recv(), HANG_S)
        await c.close()
        await lst.close()
    lst = await listen("tcp://127.0.0.1:0", transport="tcp")
    c = await connect(lst.endpoint, transport="tcp")
    await c.send([b"\x80"])
    await asyncio.wait_for(lst.recv(), HANG_S)
    await c.close()
    await lst.close()
    await asyncio.sleep(0)
    gc.collect()
    after = {t for t in asyncio.all_tasks() if not t.done()}
    assert after <= before


# --------------------------------------------------- draining and sending without waiting


@pytest.mark.parametrize("kind", KINDS)
async def test_recv_many_takes_what_is_ready_in_order(kind: str) -> None:
    """``recv_many`` answers at least one and at most ``max_n`` messages, in the order
    they were sent; ZeroMQ and TCP hand over every message already there in one call
    (the in-memory transport, by default, one)."""
    lst = await listen(_ep(kind), transport=kind)
    conn = await connect(lst.endpoint, transport=kind)
    try:
        for i in range(20):
            await conn.send(encode_message({"t": "ping", "i": i}))
        got: list[int] = []
        calls = 0
        while len(got) < 20:
            batch = await asyncio.wait_for(lst.recv_many(8), HANG_S)
            calls += 1
            assert 1 <= len(batch) <= 8
            got += [decode_message(f)[0]["i"] for _, f in batch if f is not None]
        assert got == list(range(20))
        if kind in ("zmq", "tcp"):
            assert calls < 20  # several per call once they are there
    finally:
        await conn.close()
        await lst.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_send_nowait_sends_or_says_it_did_not(kind: str) -> None:
    """ZeroMQ sends at once to a known peer (``True``) and refuses an unknown one as
    ``send`` does; a transport without the fast path sends nothing (``False``)."""
    lst = await listen(_ep(kind), transport=kind)
    conn = await connect(lst.endpoint, transport=kind)
    try:
        await conn.send(encode_message({"t": "ping"}))
        peer, _ = await asyncio.wait_for(lst.recv(), HANG_S)
        went = lst.send_nowait(peer, encode_message({"t": "pong", "n": 1}))
        assert went is (kind == "zmq")
        if not went:
            await lst.send(peer, encode_message({"t": "pong", "n": 1}))
        assert decode_message(await asyncio.wait_for(conn.recv(), HANG_S))[0]["n"] == 1
        if kind == "zmq":
            with pytest.raises(TransportError) as e:
                lst.send_nowait(b"\x00nobody", encode_message({"t": "pong"}))
            assert e.value.code == "unreachable"
    finally:
        await conn.close()
        await lst.close()


async def test_zmq_send_nowait_refuses_when_the_peer_queue_is_full() -> None:
    """A peer that does not read fills its queue: ``send_nowait`` then sends nothing
    and says so (the node hands that reply to the peer's own sender)."""
    lst = await listen("tcp://127.0.0.1:0", transport="zmq", hwm=2)
    conn = await connect(lst.endpoint, transport="zmq", hwm=2)
    try:
        await conn.send(encode_message({"t": "ping"}))
        peer, _ = await asyncio.wait_for(lst.recv(), HANG_S)
        big = encode_message({"t": "big"}, [bytes(1 << 20)])
        for _ in range(10_000):  # queues and socket buffers fill within a few hundred MB
            if not lst.send_nowait(peer, big):
                break
        else:
            raise AssertionError("a peer that never reads took every message")
    finally:
        await conn.close()
        await lst.close()


async def _pipelined_echo(kind: str, n: int, window: int) -> int:
    """A listener echoing through ``recv_many`` and ``send_nowait`` (``send`` when
    that does not go) while one connection keeps ``window`` messages in flight:
    each side waits on its socket while the other operates on it, so a wake-up
    lost to the socket's edge-triggered descriptor would hang here."""
    lst = await listen(_ep(kind), transport=kind)
    conn = await connect(lst.endpoint, transport=kind)

    async def server() -> None:
        while True:
            for peer, frames in await lst.recv_many(64):
                if frames is None:
                    continue
                if not lst.send_nowait(peer, frames):
                    await lst.send(peer, frames)

    task = asyncio.ensure_future(server())
    got = sent = 0
    try:
        async with asyncio.timeout(HANG_S):
            while got < n:
                while sent < n and sent - got < window:
                    await conn.send(encode_message({"t": "ping", "i": sent}))
                    sent += 1
                header, _ = decode_message(await conn.recv())
                assert header["i"] == got
                got += 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await conn.close()
        await lst.close()
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_pipelined_echo_never_stalls(kind: str, loop_kind: str) -> None:
    assert run(loop_kind, _pipelined_echo, kind, 3000, 64) == 3000


async def test_zmq_connection_sends_queued_messages_in_order() -> None:
    """A connection's sends are queued and handed to ZeroMQ once per turn of the
    loop, in order, and counted when queued; a closed connection refuses more."""
    lst = await listen("tcp://127.0.0.1:0", transport="zmq")
    conn = await connect(lst.endpoint, transport="zmq")
    try:
        for i in range(50):
            await conn.send(encode_message({"t": "ping", "i": i}))
        assert conn.meter.up["ping"].messages == 50
        got: list[int] = []
        while len(got) < 50:
            _, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None
            got.append(decode_message(frames)[0]["i"])
        assert got == list(range(50))
        await conn.close()
        with pytest.raises(TransportError):
            await conn.send(encode_message({"t": "late"}))
    finally:
        await conn.close()
        await lst.close()


async def test_a_burst_of_sends_looks_at_the_socket_once_for_its_waiters() -> None:
    """``send_nowait`` no longer reads the socket's events after every send: the
    receiving task, which may sleep on the edge a send swallowed, is owed one look
    per burst, at ``end_burst`` or at the end of the turn when no burst end comes.
    A receiver waiting through such a burst still gets the message that arrived."""
    async with await listen("tcp://127.0.0.1:0", transport="zmq") as lst:
        c = await connect(lst.endpoint, transport="zmq")
        await c.send(encode_message({"t": "ping"}))
        peer, _ = await asyncio.wait_for(lst.recv(), HANG_S)
        ready = lst._ready  # type: ignore[attr-defined]
        looks: list[None] = []
        real = ready.poke

        def counted() -> None:
            looks.append(None)
            real()

        ready.poke = counted
        for _ in range(5):
            assert lst.send_nowait(peer, encode_message({"t": "pong"}))
        assert looks == []  # none per send
        await asyncio.sleep(0)
        assert len(looks) == 1  # one at the end of the turn
        for _ in range(3):
            assert lst.send_nowait(peer, encode_message({"t": "pong"}))
        lst.end_burst()
        assert len(looks) == 2  # one at the burst's end ...
        await asyncio.sleep(0)
        assert len(looks) == 2  # ... and not again
        waiting = asyncio.ensure_future(lst.recv())
        await asyncio.sleep(0.01)
        for _ in range(8):
            await asyncio.wait_for(c.recv(), HANG_S)
            lst.send_nowait(peer, encode_message({"t": "pong"}))
        await c.send(encode_message({"t": "ping", "n": 2}))
        _, frames = await asyncio.wait_for(waiting, HANG_S)
        assert frames is not None and decode_message(frames)[0] == {"t": "ping", "n": 2}
        await c.close()
