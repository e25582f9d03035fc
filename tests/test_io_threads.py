"""ZeroMQ's I/O threads of xcosd's contexts run under SCHED_BATCH where allowed
(xcosd/transport/io_threads.py)."""

from __future__ import annotations

import os
import sys
import time
import types

import pytest
import zmq

from xcosd.transport import io_threads
from xcosd.transport.io_threads import batch_io_threads

linux = pytest.mark.skipif(sys.platform != "linux", reason="scheduling policies are Linux's")


def _policies() -> dict[int, tuple[str, int]]:
    """This process's threads: id -> (name, scheduling policy), from /proc."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, int(fields[38]))  # field 41: policy
    return out


def _new_io_threads(ask: bool) -> list[int]:
    """The policies of the I/O threads a new context starts (``ask``: batch asked)."""
    before = set(_policies())
    ctx = zmq.Context()
    try:
        if ask:
            batch_io_threads(ctx)
        sock = ctx.socket(zmq.DEALER)  # the first socket starts the threads
        deadline = time.monotonic() + 5
        while True:
            new = {t: v for t, v in _policies().items()
                   if t not in before and v[0].startswith("ZMQbg/IO")}
            if new or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        sock.close(0)
        return [policy for _, policy in new.values()]
    finally:
        ctx.term()


@linux
def test_io_threads_run_as_batch_work() -> None:
    if not io_threads._batch_allowed():
        pytest.skip("this system refuses SCHED_BATCH")
    assert _new_io_threads(ask=True) == [os.SCHED_BATCH]
    # the control: libzmq's own default, what the policy changes
    assert _new_io_threads(ask=False) == [os.SCHED_OTHER]


@linux
def test_the_shared_context_asks_for_it() -> None:
    from xcosd.transport.zeromq import shared_context

    ctx = shared_context()
    expect = os.SCHED_BATCH if io_threads._batch_allowed() else -1
    assert ctx.get(zmq.THREAD_SCHED_POLICY) == expect


def test_refused_leaves_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe was refused, nothing is asked of libzmq (which would abort
    the process on a policy the system refuses)."""
    monkeypatch.setattr(io_threads, "_allowed", False)
    ctx = zmq.Context()
    try:
        assert batch_io_threads(ctx) is False
        assert ctx.get(zmq.THREAD_SCHED_POLICY) == -1
    finally:
        ctx.term()


@linux
def test_the_probe_changes_no_thread_that_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe switches a thread of its own, never the caller's."""
    monkeypatch.setattr(io_threads, "_allowed", None)
    before = os.sched_getscheduler(0)
    io_threads._batch_allowed()
    assert os.sched_getscheduler(0) == before == os.SCHED_OTHER


@pytest.mark.parametrize("allowed", [True, False])
def test_a_burst_yields_only_where_the_io_threads_are_batch_work(
        monkeypatch: pytest.MonkeyPatch, allowed: bool) -> None:
    """After a burst the sender yields its core (where the I/O thread it woke may be
    queued behind it) only under the batch policy: with libzmq's defaults the woken
    thread preempts the sender anyway, and a yield would be a wasted system call."""
    from xcosd.transport.zeromq import ZmqListener

    calls: list[None] = []
    monkeypatch.setattr(io_threads, "_allowed", allowed)
    monkeypatch.setattr(os, "sched_yield", lambda: calls.append(None), raising=False)
    io_threads.yield_to_io_threads()
    # its only state: the look at the socket a burst of sends may owe its waiters
    owes = types.SimpleNamespace(_poke_once=lambda: None)
    ZmqListener.end_burst(owes)  # type: ignore[arg-type]
    assert len(calls) == (2 if allowed else 0)


@linux
def test_the_environment_can_keep_libzmqs_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(io_threads, "_allowed", None)
    monkeypatch.setenv(io_threads.POLICY_ENV, "default")
    assert _new_io_threads(ask=True) == [os.SCHED_OTHER]
    assert io_threads._allowed is False
