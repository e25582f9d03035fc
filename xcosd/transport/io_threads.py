"""ZeroMQ's I/O threads run as batch work (Linux ``SCHED_BATCH``), so that waking
one does not take the core from the event loop that woke it.

Why: a send whose pipe the I/O thread is not reading wakes that thread through an
eventfd, and so does nearly every send of a process with many connections (a load
generator's devices, one DEALER each; a cloud answering many peers), since each
pipe falls asleep between its messages. Under Linux's default policy a thread
woken on a busy machine preempts the thread that woke it at once: the event loop
is switched out in the middle of its burst of sends, the I/O thread moves one
message, sleeps, and is woken again by the next send. With every core busy (a
load test on two cores: the cloud and the devices' process) a third of the sends
cost 16-64 us instead of 1-4 us.

``SCHED_BATCH`` changes only that: the thread keeps its nice value and its share
of the CPU, and on an idle core it runs at once, but a wake-up does not preempt
the running thread. The I/O thread then runs on another core, or on this one
once the sender has handed over its burst (:func:`yield_to_io_threads`) or waits
for its sockets, and moves the whole burst in one go. Measured with 64 devices against a
near-free target on two cores: a send 11-13 us -> 3.6-3.8 us on average, and
7 % more rounds/s (medians of 5 alternating runs; docs/RESULTS.md, "Framework cost
per round").

libzmq applies the policy when it starts the thread and aborts the process if
the system refuses it, so the policy is asked for only where this process has
just been allowed to set it on a thread of its own (Linux; not under a sandbox
that forbids ``sched_setscheduler``) and the asking thread runs under the default
policy (a new thread inherits its caller's, and libzmq would carry a real-time
priority over to ``SCHED_BATCH``, which refuses it). Anywhere else the contexts
keep libzmq's defaults, as they do when the environment sets
:data:`POLICY_ENV` to ``default`` (an application that schedules its threads
itself).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import zmq

#: ``default`` here keeps libzmq's scheduling for xcosd's I/O threads
POLICY_ENV = "XCOSD_IO_THREAD_POLICY"

_allowed: bool | None = None


def _batch_allowed() -> bool:
    """Whether a thread of this process may switch itself to ``SCHED_BATCH`` (asked
    once, on a short-lived thread, so no thread that stays is changed)."""
    global _allowed
    if _allowed is None:
        ok = [False]
        wanted = os.environ.get(POLICY_ENV, "batch").strip().lower() != "default"
        if wanted and sys.platform == "linux" and hasattr(os, "SCHED_BATCH"):

            def probe() -> None:
                try:
                    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
                    ok[0] = os.sched_getscheduler(0) == os.SCHED_BATCH
                except OSError:
                    ok[0] = False

            t = threading.Thread(target=probe, name="xcosd-sched-probe", daemon=True)
            t.start()
            t.join()
        _allowed = ok[0]
    return _allowed


def batch_io_threads(ctx: zmq.Context[Any]) -> bool:
    """Ask ``ctx`` to start its I/O threads under ``SCHED_BATCH`` (before its first
    socket: libzmq applies it when a thread starts). Returns whether it was asked
    (``False`` where the system does not allow it; the defaults stay)."""
    if not _batch_allowed() or os.sched_getscheduler(0) not in (os.SCHED_OTHER,
                                                                 os.SCHED_BATCH):
        return False
    ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return True


def yield_to_io_threads() -> None:
    """Called after a burst of sends: let an I/O thread that the burst woke, and that
    waits behind this thread on its core, run now.

    The other half of ``SCHED_BATCH``. Where the scheduler puts the woken thread on
    the sender's core (the other one busy, or a virtual CPU the host has parked),
    it would otherwise wait until the loop blocks, which in a turn that answers
    dozens of sessions is milliseconds after the messages were handed over. One
    ``sched_yield`` a burst bounds that wait by the burst's own hold
    (:data:`~xcosd.transport.burst.HOLD_S`) and still costs one switch per burst,
    not one per message. Measured (one replica, 32 devices, 2 cores): the I/O
    threads' wait for a core 0.7 ms -> 0.08 ms per wake-up. A no-op where the
    contexts keep libzmq's defaults (their threads preempt the sender anyway)."""
    if _allowed:
        os.sched_yield()


__all__ = ["POLICY_ENV", "batch_io_threads", "yield_to_io_threads"]
