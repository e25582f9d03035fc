"""A generation's inbox: the messages the edge's receive loop routes to one session,
and a wait on them that ends at a deadline.

Why not an ``asyncio.Queue`` under ``asyncio.timeout``: a generation waits once a
round, and the timeout context costs a timer handle, a heap push and a cancel each
time, about a tenth of a load generator's per-round work with dozens of devices in
one process. The deadline here moves forward every round (the resend interval
after the wait began), so one timer serves many waits: when it fires it either
ends a wait whose deadline has passed or re-arms itself for the later deadline the
current wait has. A wait whose deadline is earlier than the armed timer (a
shorter timeout than the last) re-arms it at once, so no wait outlasts its own.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

#: a timer may run this much before its time (the loop's clock resolution); its
#: wait then counts as over instead of re-arming for a sliver
_EARLY_S = 1e-3


class Inbox:
    """Messages for one session, oldest first, and at most one waiter."""

    __slots__ = ("_deadline", "_items", "_timer", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def put_nowait(self, item: Any) -> None:
        """Add ``item`` and wake the waiter (called from the loop's thread)."""
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        """The oldest item; ``IndexError`` when there is none."""
        return self._items.popleft()

    def clear(self) -> None:
        """Drop whatever is queued (what a replaced connection left behind)."""
        self._items.clear()

    async def get(self, timeout: float) -> Any:
        """The oldest item, waiting up to ``timeout`` seconds for one; ``TimeoutError``
        when none came. One waiter at a time (the session's generation)."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._deadline = deadline
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline, self._expire)
        fut = self._waiter = loop.create_future()
        try:
            await fut
        finally:
            self._waiter = None
        if not self._items:
            raise TimeoutError
        return self._items.popleft()

    def _expire(self) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # nobody waits: the next wait arms a timer of its own
        loop = w.get_loop()
        if self._deadline - loop.time() <= _EARLY_S:
            w.set_result(None)  # woken with nothing: the wait times out
        else:
            self._timer = loop.call_at(self._deadline, self._expire)

    def close(self) -> None:
        """Cancel the timer (the generation is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


__all__ = ["Inbox"]
