"""Requests that arrive together open together (``xcosd.nodes.arrivals``).

What it holds: a lone request, and any request before a verdict has been seen,
never waits; an open waits while other marked requests are pending and the last
one to reach its open releases the waiters, which go before it in the same turn of
the loop; the wait never outlasts the least recent call time nor ``hold_s``; a mark
that leaves without an open (a refused request) releases the waiters as well; a
cancelled waiter is forgotten; a server waiting for the open to have gone
(:meth:`Arrival.until_sent`) goes on once it has, not when it is ready, and
when the connection is lost as it leaves (the generation then waits to resume).
"""

from __future__ import annotations

import asyncio

import pytest

import xcosd
from xcosd.nodes.arrivals import Arrival, Arrivals

from .helpers.gated import GatedModel
from .helpers.waits import HANG_S, until
from .session_pairs import pair


def _seen(a: Arrivals, *calls: float) -> Arrivals:
    for c in calls:
        a.observe(c)
    return a


async def test_a_lone_request_and_one_before_any_verdict_never_wait() -> None:
    a = _seen(Arrivals(hold_s=HANG_S), 30.0)
    await asyncio.wait_for(a.gather(a.arrived()), HANG_S)  # nobody else pending
    assert a.held == 0 and a.pending == 0
    fresh = Arrivals(hold_s=HANG_S)  # no verdict yet: no bound to wait by
    other = fresh.arrived()
    await asyncio.wait_for(fresh.gather(fresh.arrived()), HANG_S)
    assert fresh.held == 0 and fresh.pending == 1
    other.leave()
    assert fresh.pending == 0


async def test_opens_wait_for_the_pending_and_the_last_releases_them_in_one_turn() -> None:
    a = _seen(Arrivals(hold_s=HANG_S), 30.0, 20.0)
    marks = [a.arrived() for _ in range(3)]
    order: list[str] = []

    async def opener(name: str, mark: Arrival) -> None:
        await a.gather(mark)
        order.append(name)

    first = asyncio.ensure_future(opener("first", marks[0]))
    second = asyncio.ensure_future(opener("second", marks[1]))
    await until(lambda: a.held == 2, "two opens waiting")
    assert not first.done() and not second.done() and a.pending == 1
    # the last one: it releases both and goes after them, with no other turn between
    loop = asyncio.get_running_loop()
    turns = 0

    def tick() -> None:  # once a turn of the loop
        nonlocal turns
        turns += 1
        if turns < 5:
            loop.call_soon(tick)

    loop.call_soon(tick)
    await opener("last", marks[2])
    seen = turns
    assert order == ["first", "second", "last"]
    assert seen == 1  # all three resumed on the turn after the release
    assert a.pending == 0 and a.expired == 0
    await asyncio.gather(first, second)


async def test_the_wait_is_bounded_by_the_least_recent_call() -> None:
    a = _seen(Arrivals(hold_s=HANG_S), 9.0, 0.02, 7.0)
    assert a.bound_s == pytest.approx(0.02)
    stuck = a.arrived()  # a client that never sends its body
    await asyncio.wait_for(a.gather(a.arrived()), HANG_S)
    assert a.held == 1 and a.expired == 1 and a.pending == 1
    stuck.leave()
    assert _seen(Arrivals(hold_s=0.01), 5.0).bound_s == 0.01  # hold_s caps it
    assert Arrivals(hold_s=0.0).bound_s == 0.0
    with pytest.raises(ValueError):
        Arrivals(hold_s=-1)


async def test_a_refused_request_releases_the_waiting_opens() -> None:
    a = _seen(Arrivals(hold_s=HANG_S), 30.0)
    refused = a.arrived()
    waiting = asyncio.ensure_future(a.gather(a.arrived()))
    await until(lambda: a.held == 1, "the open waiting")
    refused.leave()
    refused.leave()  # idempotent: counted once
    await asyncio.wait_for(waiting, HANG_S)
    assert a.pending == 0 and a.expired == 0


async def test_a_cancelled_waiter_is_forgotten_and_the_others_wait_on() -> None:
    a = _seen(Arrivals(hold_s=HANG_S), 30.0)
    late = a.arrived()
    gone = asyncio.ensure_future(a.gather(a.arrived()))
    stays = asyncio.ensure_future(a.gather(a.arrived()))
    await until(lambda: a.held == 2, "two opens waiting")
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert not stays.done()
    late.leave()
    await asyncio.wait_for(stays, HANG_S)
    assert a.pending == 0


async def test_until_sent_waits_for_the_open_to_have_gone() -> None:
    a = _seen(Arrivals(hold_s=HANG_S), 30.0)
    mark = a.arrived()
    waiting = asyncio.ensure_future(mark.until_sent())
    await asyncio.sleep(0)
    mark.leave()  # ready to open is not gone yet
    await asyncio.sleep(0)
    assert not waiting.done() and a.pending == 0
    mark.sent()
    await asyncio.wait_for(waiting, HANG_S)
    await asyncio.wait_for(mark.until_sent(), HANG_S)  # and at once after
    ended = a.arrived()
    ended.sent()  # a generation that ended without an open: it leaves too
    assert a.pending == 0
    await asyncio.wait_for(ended.until_sent(), HANG_S)


async def test_an_open_lost_with_its_connection_counts_as_sent() -> None:
    # a server waiting for the open (its tokenize) goes on when the connection is lost
    # as the open leaves, not only when the generation, resuming, ends
    target, draft = pair()
    gated = GatedModel(draft, hold_score=True)  # round 0 waits in the draft thread
    cloud = await xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0").start()
    async with xcosd.EdgeNode(draft=gated, connect=cloud.endpoint, heartbeat_s=0.05,
                              silence_timeout_s=0.3, connect_timeout_s=HANG_S) as edge:
        mark = edge.arrivals.arrived()
        gen = asyncio.ensure_future(edge.generate("c", max_new_tokens=4, arrival=mark))
        assert await asyncio.to_thread(gated.in_score.wait, HANG_S)
        await cloud.close()
        await until(lambda: not edge.connected, "the edge sees the cloud gone")
        gated.gate.set()  # the open is drafted and its send finds no connection
        await asyncio.wait_for(mark.until_sent(), HANG_S)
        assert not gen.done()  # the generation waits to resume
        gen.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gen
