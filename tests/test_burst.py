"""The burst of sends of one turn of the event loop (xcosd/transport/burst.py), on
its own and under a ZeroMQ connection: held to the turn's end, but never past
HOLD_S for its oldest message once another is queued."""

from __future__ import annotations

import asyncio
import time

import zmq

from xcosd.transport import connect
from xcosd.transport.burst import HOLD_S, Burst
from xcosd.wire.frames import decode_message, encode_message


def _spin(seconds: float) -> None:
    """Hold the loop (a turn that computes), without yielding it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_turns_items_go_together_when_it_ends() -> None:
    handed: list[list[int]] = []
    burst: Burst[int] = Burst(handed.append, hold_s=60.0)
    for i in range(5):
        burst.add(i)
    assert handed == [] and len(burst) == 5  # nothing before the turn ends
    await asyncio.sleep(0)
    assert handed == [[0, 1, 2, 3, 4]] and len(burst) == 0
    burst.add(5)
    await asyncio.sleep(0)
    assert handed == [[0, 1, 2, 3, 4], [5]]
    await asyncio.sleep(0)  # no empty burst is ever handed on
    assert len(handed) == 2


async def test_a_long_turn_hands_on_its_oldest_items_past_the_hold() -> None:
    handed: list[list[int]] = []
    burst: Burst[int] = Burst(handed.append, hold_s=HOLD_S)
    burst.add(0)
    burst.add(1)
    assert handed == []
    _spin(2 * HOLD_S)  # the same turn goes on, computing
    burst.add(2)  # the first item is past the hold: the burst goes now, this one with it
    assert handed == [[0, 1, 2]]
    burst.add(3)  # a new burst, its own hold
    assert handed == [[0, 1, 2]]
    await asyncio.sleep(0)
    assert handed == [[0, 1, 2], [3]]  # in order, nothing lost or repeated


async def test_a_long_turns_first_message_reaches_the_peer_before_the_turn_ends() -> None:
    """Over real sockets: a bare ROUTER, read while the loop is still held in the
    turn that sent. Within the hold nothing is handed to ZeroMQ until the turn ends;
    past it the next send hands over both."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    a = await connect(f"tcp://127.0.0.1:{port}", transport="zmq")
    b = await connect(f"tcp://127.0.0.1:{port}", transport="zmq")
    try:
        for c in (a, b):  # both connected, and the turn's burst handed over
            await c.send(encode_message({"t": "hi"}))
        await asyncio.sleep(0)
        for _ in range(2):
            assert router.poll(5000)
            router.recv_multipart()

        await a.send(encode_message({"t": "x", "i": 0}))
        assert router.poll(100) == 0  # within the turn and the hold: still queued here
        _spin(2 * HOLD_S)
        await b.send(encode_message({"t": "x", "i": 1}))  # past the hold: both go now
        got = []
        for _ in range(2):  # the loop has not turned since the first send
            assert router.poll(5000)
            got.append(decode_message(router.recv_multipart()[1:])[0]["i"])
        assert sorted(got) == [0, 1]
    finally:
        await a.close()
        await b.close()
        router.close(linger=0)
        ctx.term()
