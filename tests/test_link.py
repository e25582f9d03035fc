"""The link emulator: the serialising delay line (with a fake clock), the modeled
latency as a pure function, and the wrappers around real transports."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from xcosd.transport import (
    LinkConnection,
    LinkListener,
    LinkSpec,
    connect,
    listen,
    message_latency,
    sequence_latency,
)
from xcosd.transport.link import DelayLine, OneWay
from xcosd.wire.frames import decode_message, encode_message, message_bytes

from .helpers.waits import HANG_S, until


def test_message_latency_is_half_rtt_plus_transfer() -> None:
    assert message_latency(1000, 8000.0, 0.1) == pytest.approx(0.05 + 1.0)
    assert message_latency(10**9, math.inf, 0.02) == pytest.approx(0.01)


def test_delay_line_serialises_large_messages_ahead_of_small_ones() -> None:
    line = DelayLine(OneWay(rate_bps=8000.0, delay_s=0.05))
    big = line.schedule(0.0, 1000)  # 1 s on the wire
    small = line.schedule(0.0, 10)  # queued behind it
    assert big == pytest.approx(1.05)
    assert small == pytest.approx(1.0 + 0.01 + 0.05)
    later = line.schedule(5.0, 10)  # an idle line starts fresh
    assert later == pytest.approx(5.0 + 0.01 + 0.05)


def test_jitter_never_reorders() -> None:
    line = DelayLine(OneWay(rate_bps=1e9, delay_s=0.01, jitter_s=0.5), random.Random(1))
    arrivals = [line.schedule(i * 0.001, 100) for i in range(500)]
    assert arrivals == sorted(arrivals)
    assert len(set(arrivals)) > 10  # the jitter does something
    assert all(a >= i * 0.001 + 0.01 for i, a in enumerate(arrivals))


def test_sequence_latency() -> None:
    spec = LinkSpec.of(up_bps=8000.0, down_bps=80_000.0, rtt_s=0.1)
    # a round trip: up then down, each half an RTT plus its transfer
    assert sequence_latency([("up", 100), ("down", 1000)], spec) == pytest.approx(
        0.05 + 0.1 + 0.05 + 0.1)
    # two ups back to back pipeline: only the transfers add
    assert sequence_latency([("up", 100), ("up", 100)], spec) == pytest.approx(0.05 + 0.2)
    assert sequence_latency([], spec) == 0.0
    assert sequence_latency([("up", 0)], LinkSpec.of(rtt_s=0.2, overhead=40)) == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["zmq", "tcp", "memory"])
async def test_link_connection_delays_and_keeps_order(kind: str) -> None:
    spec = LinkSpec.of(up_bps=2e6, down_bps=4e6, rtt_s=0.04, jitter_s=0.01)
    ep = "mem://" if kind == "memory" else "tcp://127.0.0.1:0"
    async with await listen(ep, transport=kind) as lst:
        c = LinkConnection(await connect(lst.endpoint, transport=kind), spec)
        loop = asyncio.get_running_loop()
        msgs = [encode_message({"t": "d", "i": i}, [bytes(5000 if i == 0 else 10)])
                for i in range(5)]
        t0 = loop.time()
        for m in msgs:
            await c.send(m)
        got = []
        for _ in msgs:
            peer, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None
            got.append(decode_message(frames)[0]["i"])
        first_arrival = loop.time() - t0
        assert got == list(range(5))
        # lower bound only: the big message serialises for 20 ms, then half the RTT
        modeled = sequence_latency([("up", message_bytes(m)) for m in msgs], spec)
        assert first_arrival >= modeled - 1e-3
        await lst.send(peer, encode_message({"t": "v"}, [bytes(100)]))
        t1 = loop.time()
        assert decode_message(await asyncio.wait_for(c.recv(), HANG_S))[0] == {"t": "v"}
        assert loop.time() - t1 >= 0.02 - 1e-3
        assert c.meter is c.inner.meter and c.meter.up["d"].messages == 5
        assert c.framing_overhead(msgs[0]) == c.inner.framing_overhead(msgs[0])
        await c.close()


async def test_link_listener_delays_each_peer_on_its_own_link() -> None:
    spec = LinkSpec.of(up_bps=1e6, down_bps=1e6, rtt_s=0.02)
    inner = await listen("tcp://127.0.0.1:0", transport="tcp")
    a = await connect(inner.endpoint, transport="tcp")
    b = await connect(inner.endpoint, transport="tcp")
    # Both messages wait in the TCP listener, A's first, before the link reads them:
    # it then takes them in back to back, so their arrival times differ only by
    # their links (a shared serialiser would hold B 160 ms behind A), never by how
    # fast this machine moved B's bytes.
    await a.send(encode_message({"t": "big"}, [bytes(20_000)]))  # 160 ms on A's link
    await until(lambda: "big" in inner.meter.up, "A's message to reach the listener")
    await b.send(encode_message({"t": "small"}))
    await until(lambda: "small" in inner.meter.up, "B's message to reach the listener")
    lst = LinkListener(inner, spec)
    first = decode_message((await asyncio.wait_for(lst.recv(), HANG_S))[1] or [])[0]
    second_peer, second = await asyncio.wait_for(lst.recv(), HANG_S)
    assert first == {"t": "small"}  # B is not stuck behind A's big message
    assert second is not None and decode_message(second)[0] == {"t": "big"}
    t = asyncio.get_running_loop().time()
    await lst.send(second_peer, encode_message({"t": "reply"}))
    assert decode_message(await asyncio.wait_for(a.recv(), HANG_S))[0] == {"t": "reply"}
    assert asyncio.get_running_loop().time() - t >= 0.01 - 1e-3
    await a.close()
    _, end = await asyncio.wait_for(lst.recv(), HANG_S)
    assert end is None  # the peer's end passes through the link too
    await b.close()
    await lst.close()


async def test_link_recv_keeps_failing_after_the_link_closes() -> None:
    from xcosd.errors import TransportError
    from xcosd.transport.memory import memory_pair

    lst, conn = await memory_pair()
    c = LinkConnection(conn, LinkSpec.of())
    await lst.close()
    for _ in range(2):  # a retry must fail too, not wait forever
        with pytest.raises(TransportError):
            await asyncio.wait_for(c.recv(), HANG_S)
    await c.close()
