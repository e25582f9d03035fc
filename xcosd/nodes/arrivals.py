"""Requests that arrive together open their sessions together.

The cloud verifies whatever rounds are queued when its target is free, and starts
at once when every session it knows of has a round queued (xcosd/nodes/scheduler.py):
it cannot tell that more sessions are about to open. So a generation whose open
reaches an idle cloud alone gets a target call of its own, and the opens arriving
a moment later wait for that whole call before theirs starts. Requests that an
edge's clients send together do not reach the edge's loop together: each is read,
parsed and started in turn. Measured through the OpenAI API (xcosd/api/app.py) with
16 streams from one ``openai`` client and a target costing 20 ms a call plus
0.5 ms a row: the opens left over 7.4 ms, the first alone, and the other 15 waited
22 ms for its call before their own (60 ms) started.

The edge knows what the cloud cannot: which requests it has accepted and not yet
started. A server marks each request when it arrives (:meth:`Arrivals.arrived`),
hands the mark to the generation it starts (``EdgeNode.generate(arrival=...)``),
and the generation's first open, once drafted, waits (:meth:`Arrivals.gather`)
while other marked requests have yet to reach theirs, so the opens leave in one
turn of the loop and share the cloud's first call. A mark whose request ends
without a generation (refused, malformed, its client gone) is dropped
(:meth:`Arrival.leave`). A lone request never waits; nor does a generation
started without a mark while none is pending.

The wait is bounded from the first open that waits, by the ski-rental rule:
going alone costs the late requests the lone call's time, so a wait no longer
than that costs at most what it can save. A call's time is the cloud's own
account of it, the ``compute_us`` of each verdict (its call, and verification up
to it): the bound is the least of the last :data:`CALLS_SEEN` verdicts', never
more than ``hold_s`` (a client that sends its body slowly, or never, holds other
requests' opens at most that long). Nothing waits before a verdict has been seen.
Against a remote accelerator whose call costs tens of milliseconds the opens wait
for each other; against a cheap target that computes beside the edge a wait would
only delay the first request, and it is as short as the call (the embedded n-gram
pair's least call, by the cloud's account: 0.3 ms).

Once the open has gone the edge says so (:meth:`Arrival.sent`): a server with more
to ask of the cloud for the request (the API's tokenize of a text prompt, for its
length in tokens) asks after it (:meth:`Arrival.until_sent`), or the question would
reach the cloud ahead of the opens that waited for each other.
"""

from __future__ import annotations

import asyncio
from collections import deque

#: the longest a generation's first open waits for the requests that arrived with it
HOLD_S = 0.025
#: how many recent verdicts' compute times bound the wait (their least)
CALLS_SEEN = 32


class Arrival:
    """One request's mark, from its arrival until its generation's first open is
    ready to go (or it ends without one): :meth:`leave` once, either way. The edge
    also says when that open has gone (:meth:`sent`): a server that has more to ask
    of the cloud for the request (the prompt's length in tokens) asks after it
    (:meth:`until_sent`), so that it does not reach the cloud ahead of the opens."""

    __slots__ = ("_arrivals", "_left", "_sent", "_sent_fut")

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._left = False
        self._sent = False
        self._sent_fut: asyncio.Future[None] | None = None

    @property
    def pending(self) -> bool:
        return not self._left

    def leave(self) -> None:
        """This request no longer opens a session to be waited for (idempotent)."""
        if not self._left:
            self._left = True
            self._arrivals._left()

    def sent(self) -> None:
        """Its generation's first open has gone to the cloud, or it ended without
        one: it leaves, and :meth:`until_sent` returns (idempotent)."""
        self.leave()
        self._sent = True
        if self._sent_fut is not None and not self._sent_fut.done():
            self._sent_fut.set_result(None)

    async def until_sent(self) -> None:
        """Wait until :meth:`sent`."""
        if self._sent:
            return
        if self._sent_fut is None:
            self._sent_fut = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._sent_fut)


class Arrivals:
    """The requests of one edge that arrived and have not yet reached their first
    open, and the opens waiting for them."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        #: marked requests that have not reached their first open
        self.pending = 0
        #: opens that waited, and of them those released by ``hold_s`` (not by the
        #: last pending request reaching its open)
        self.held = 0
        self.expired = 0
        #: the cloud's compute seconds of recent verdicts
        self._calls: deque[float] = deque(maxlen=CALLS_SEEN)
        self._waiters: list[asyncio.Future[None]] = []
        self._deadline: asyncio.TimerHandle | None = None

    def observe(self, compute_s: float) -> None:
        """A verdict's compute time, by the cloud's account (its call, and its
        verification up to this verdict)."""
        if compute_s >= 0:
            self._calls.append(compute_s)

    @property
    def bound_s(self) -> float:
        """How long an open may wait now: the least recent call time, at most
        ``hold_s`` (0 before any verdict)."""
        return min(self.hold_s, min(self._calls)) if self._calls else 0.0

    def arrived(self) -> Arrival:
        """Mark a request that has arrived: opens wait for it until it :meth:`~Arrival.leave` s."""
        self.pending += 1
        return Arrival(self)

    async def gather(self, arrival: Arrival | None = None) -> None:
        """Before a generation's first open: ``arrival`` (its request's mark) leaves,
        then wait while other marked requests are pending, at most :attr:`bound_s`
        from the first open of this group that waited. The last one to arrive here
        releases the others, and goes after them in the same turn of the loop."""
        waiting = bool(self._waiters)
        if arrival is not None:
            arrival.leave()
        if not self.pending:
            if waiting:
                # released by this one's leave: they resume on the loop's next turn,
                # and this one's open goes after theirs, in the same turn
                await asyncio.sleep(0)
            return
        bound = self.bound_s
        if bound <= 0 and self._deadline is None:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        self.held += 1
        if self._deadline is None:
            self._deadline = loop.call_later(bound, self._expire)
        try:
            await fut
        finally:
            if not fut.done():  # cancelled while waiting: the others wait on
                self._waiters.remove(fut)

    def _left(self) -> None:
        self.pending -= 1
        if not self.pending:
            self._release()

    def _expire(self) -> None:
        self._deadline = None
        self.expired += len(self._waiters)
        self._release()

    def _release(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
