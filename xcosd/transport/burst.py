"""A burst: what one turn of the event loop queued to send, handed on together.

Every message handed to an idle ZeroMQ I/O thread wakes it (a system call, and a
switch to that thread: xcosd/transport/io_threads.py); every write to a TCP socket
is a system call. A process that sends many small messages a turn (a load
generator's devices each sending a draft, a cloud sending a batch's verdicts) saves
both by queueing them and sending them together when the turn ends.

A turn can be long, though: one that drafts for dozens of devices, or verifies a
whole batch, runs for milliseconds, and the first message queued in it would wait
for all of that although its round waits for it. So a burst is also handed on as
soon as its oldest item is :data:`HOLD_S` old, at the next item queued: batching
then costs a message at most about that much latency (plus the item that noticed
it), and costs at most one more hand-over per interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

#: the longest the oldest item of a burst waits for its turn to end, checked when
#: the next item is queued
HOLD_S = 0.0005

T = TypeVar("T")


class Burst(Generic[T]):
    """Items queued during one turn of the loop, passed to ``hand`` (in order) when
    the turn ends, or when an item is queued once the oldest is ``hold_s`` old.
    Holds no reference to the loop: the loop that queued the first item of a burst
    runs its hand-over."""

    def __init__(self, hand: Callable[[list[T]], None], hold_s: float = HOLD_S) -> None:
        self._hand = hand
        self.hold_s = hold_s
        self._items: list[T] = []
        #: when the oldest queued item was queued
        self._since = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        items = self._items
        now = time.perf_counter()
        if not items:
            asyncio.get_running_loop().call_soon(self.flush)
            self._since = now
        items.append(item)
        if now - self._since > self.hold_s:
            self.flush()

    def flush(self) -> None:
        """Hand on what is queued now (nothing when empty)."""
        items, self._items = self._items, []
        if items:
            self._hand(items)


__all__ = ["HOLD_S", "Burst"]
