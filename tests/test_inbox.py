"""A generation's inbox (``xcosd/nodes/inbox.py``): items in order, a wait that ends
at its own deadline, and the one timer that serves many waits, whether the next
deadline is later or earlier than the armed one."""

from __future__ import annotations

import asyncio

import pytest

from xcosd.nodes.inbox import Inbox


async def test_queued_items_come_back_in_order_without_waiting() -> None:
    box = Inbox()
    box.put_nowait("a")
    box.put_nowait("b")
    assert await box.get(0.0) == "a"
    assert box.get_nowait() == "b"
    assert box.empty()
    with pytest.raises(IndexError):
        box.get_nowait()


async def test_a_put_wakes_the_waiter() -> None:
    box = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, box.put_nowait, "x")
    assert await asyncio.wait_for(box.get(30.0), 5.0) == "x"
    box.close()


async def test_a_wait_with_nothing_times_out() -> None:
    box = Inbox()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(box.get(0.02), 5.0)
    box.put_nowait("late")  # what comes after the timeout is the next wait's
    assert await box.get(0.02) == "late"


async def test_the_timer_of_an_earlier_wait_does_not_cut_a_later_one_short() -> None:
    """A wait answered before its deadline leaves the timer armed there; the next,
    longer wait must outlast it (the timer re-arms) and get what comes after."""
    box = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_later(0.005, box.put_nowait, 1)
    assert await box.get(0.05) == 1
    loop.call_later(0.15, box.put_nowait, 2)  # after the first wait's deadline
    assert await asyncio.wait_for(box.get(5.0), 5.0) == 2
    box.close()


async def test_a_shorter_deadline_than_the_armed_timer_still_ends_on_time() -> None:
    box = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_later(0.005, box.put_nowait, 1)
    assert await box.get(60.0) == 1  # the timer is now armed a minute out
    with pytest.raises(TimeoutError):  # this wait must not wait for it
        await asyncio.wait_for(box.get(0.02), 5.0)


async def test_a_cancelled_wait_leaves_the_inbox_usable() -> None:
    box = Inbox()
    task = asyncio.ensure_future(box.get(30.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    box.put_nowait("after")
    assert await box.get(0.0) == "after"
    box.close()
