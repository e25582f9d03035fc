"""Waiting in tests for a state, never for a length of time.

A test that sleeps "long enough" for something to happen fails on a loaded
machine, and one that asserts it happened within a window fails there too. These
helpers wait for the state itself and return as soon as it holds. Their deadline
only turns a hang into a failure, so it is generous: a slow machine never reaches
it, a broken program does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: seconds before a wait for a state gives up: far beyond any healthy run
HANG_S = 60.0


async def until(cond: Callable[[], object], what: str, timeout: float = HANG_S,
                poll: float = 0.002) -> None:
    """Return once ``cond()`` is true; fail with ``what`` after ``timeout`` seconds.

    ``poll`` is how often the condition is looked at, not a guess at how long
    anything takes.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"still waiting after {timeout:.0f} s for {what}")
        await asyncio.sleep(poll)
