"""The cyclic garbage collector's setting for processes that hold many sessions.

Python collects its youngest generation every 700 net allocations of container
objects. A process that serves (or, as a load generator, plays) thousands of
sessions keeps every round's messages, futures and rows alive across a whole
round trip of all the others, so nearly all of them survive the young collections,
are promoted, and make the full collections both frequent and long (each walks
every session's objects). Measured with 2,000 devices in one load-generator
process: about 15 % of its time went to the collector, full collections taking
over 100 ms each; raising the first threshold to :data:`GEN0_THRESHOLD` lets most
of a round's objects die young, and ``xcosd serve`` with ``xcosd bench load`` ran
21-34 % more rounds a second in three alternating pairs of runs, while 64 devices
ran no slower. A cloud with thousands of sessions keeps objects the same way.

The price is that a full collection becomes rare (about every five million net
allocations), so garbage in a reference cycle stays until then: what these
processes drop must be freed by reference counting alone. The tests in
``tests/test_gc_tuning.py`` hold the nodes to that for an edge node that generated
and closed (with the cloud's side of its session) and for the cloud's refusals of a
hostile peer's messages.

Only the processes xcosd owns are tuned (``xcosd serve`` and its replicas, the
``xcosd bench`` commands and their device processes); an application that embeds
the nodes keeps whatever collector settings it chose.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

#: the youngest generation's threshold for a process with many sessions (Python's
#: default is 700): a few tens of thousands of short-lived objects, megabytes at
#: most, wait for the next young collection
GEN0_THRESHOLD = 50_000


@contextlib.contextmanager
def many_sessions_gc() -> Iterator[None]:
    """Within it, the collector's first threshold is at least
    :data:`GEN0_THRESHOLD` (a higher one, or collection disabled, is left as is;
    the older generations keep theirs); the thresholds before it come back after.
    Also a decorator, for a command's ``run``: a command called from Python (a
    test, an application) leaves the caller's collector as it found it."""
    before = gc.get_threshold()
    if before[0] and before[0] < GEN0_THRESHOLD:  # 0: collection is disabled
        gc.set_threshold(GEN0_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


__all__ = ["GEN0_THRESHOLD", "many_sessions_gc"]
