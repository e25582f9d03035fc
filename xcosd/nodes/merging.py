"""When the scheduler holds a partial batch for the sessions it just answered.

With one worker, closed-loop devices split into two groups that take turns: while
group A's batch computes, group B's rounds queue; when A's finishes, B's batch is
already waiting and starts at once (the scheduler starts it before A's verdicts go
out), so A's devices come back to a busy worker and queue in turn. The split keeps
itself going, whatever the devices' speed: measured over ZeroMQ with a target that
costs 20 ms a call plus 0.5 ms a row, 8 devices that each answer within a few
milliseconds ran in batches of 4.2 on average, not 8.

Whether that costs anything depends on the target. For a call costing
``T(rows) = a + b * rows``, two batches cost ``T(x) + T(y)`` and one ``T(x + y)``:
splitting costs the fixed part ``a`` once more per cycle. Holding the waiting
batch until the answered sessions are back costs their turnaround ``R`` (the
device's drafting and two network hops). Merging therefore pays when ``R < a``:
a target whose call has a large fixed part (an accelerator's launch and weight
reads, a CPU model's per-call overhead) and devices that answer quickly. A
near-free model (``a`` about 0) or slow devices (``R`` large: real drafting on a
phone) keep the turns, which then overlap the devices' work with the target's.

:class:`MergePolicy` measures both: ``a`` by a least-squares line through the
recent calls' (rows, seconds), kept from the last window whose sizes varied
enough to fit one; ``R`` as the *fill time* of recent batches, from their verdicts
going out to the last of their sessions being back (a batch whose sessions were
not all back when the next verdicts went out counts as never filled: a hold waits
for the last one, so that is the time it would cost), taken at its
:data:`FILL_QUANTILE` quantile: near the break-even a hold that the last session
misses costs that session a whole batch more, so only a clear win is taken. It
answers how long the batch should be held: until every answered session that is
still open is back, and never longer than ``a`` after the answers went out, which
bounds what a wrong guess can cost by what splitting costs (the ski-rental rule).

A generation's end is a session that will not come back, but a closed-loop peer
(a load generator, a batch job, an agent) opens its next generation at once, and
devices that run in step end their generations in the same round. Measured with
32 such devices against one cloud (a target costing 20 ms a call plus 0.5 ms a
row), every generation boundary split the group: as the old sessions closed,
nothing was expected any more, and the first new session's round started a batch
of one to a few while the rest were still opening. So a session its peer closes
keeps its place, as a *vacancy* for that peer's next new session, when the peer
is a *reopener*: in at least :data:`REOPEN_SHARE` of its last ended sessions (at
least :data:`REOPEN_MIN`) a new session of the same peer sent its first round
before the next verdicts went out. A device that ends a generation and goes
quiet (an interactive user) is no reopener and is not waited for; a reopener
that stops reopening costs a hold, bounded like any other, and soon stops being
one. A vacancy still open when the next verdicts go out counts as a straggler in
the fill time. A place is kept only when holding pays for that batch (a near-free
target never holds, and its batches do not wait for new sessions either); the
scheduler counts kept places among the sessions that could still join a batch
(:meth:`MergePolicy.vacancies`).

Two groups that take turns in batches of equal size give the fit no spread to
separate ``a`` from ``b``. Without a fit the policy therefore probes: once every
:data:`PROBE_EVERY` batches it holds one (no longer than a median call, which is at
least ``a``), and the larger batch that makes gives the fit its second size.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

#: recent calls and turnarounds the estimates are made from
MERGE_WINDOW = 64
#: calls needed before a fixed cost is fitted
MIN_CALLS = 8
#: the fit needs the calls' sizes to vary by at least this ratio (largest / smallest)
MIN_SPREAD = 1.25
#: fill times needed before one is estimated
MIN_FILLS = 4
#: the quantile of recent fill times that must beat the fixed cost
FILL_QUANTILE = 0.9
#: without a fit, one batch in this many is held to measure a larger one
PROBE_EVERY = 32
#: a peer is a reopener when at least this share of its recent ended sessions (at
#: least REOPEN_MIN, the last REOPEN_WINDOW) were followed by a new session of the
#: same peer before the next verdicts
REOPEN_SHARE = 0.9
REOPEN_MIN = 3
REOPEN_WINDOW = 16
#: peers whose record is kept (the least recently ended forgotten first)
MAX_PEERS = 8192


class MergePolicy:
    """Measures the target's fixed cost per call and how soon answered sessions
    are back, and says whether (and until when) a partial batch waits for them.
    Sessions are anything with a ``closed`` attribute, kept by identity; times are
    the caller's (``time.perf_counter`` seconds).

    ``record_call`` may be called from the worker thread (it only appends to a
    bounded deque); everything else runs on the event loop."""

    def __init__(self, window: int = MERGE_WINDOW) -> None:
        self._calls: deque[tuple[int, float]] = deque(maxlen=window)
        #: seconds from a batch's verdicts to the last of its sessions back (inf: not
        #: all back before the next verdicts)
        self._fills: deque[float] = deque(maxlen=window)
        #: the sessions of the batch answered last that are not back yet: the ones
        #: a hold waits for (an older straggler is not worth waiting for)
        self._expected: set[Any] = set()
        self._since = 0.0
        self._unprobed = 0
        #: the decision for the batch answered last, made once (None: not yet)
        self._decision: tuple[float | None] | None = None
        self._fixed: float | None = None
        self._fitted_at = -1
        self._recorded = 0
        #: peer -> places in the batch answered last kept for its next new sessions
        #: (only peers with one still empty)
        self._vacant: dict[Any, int] = {}
        #: peer -> its sessions of that batch that ended, no new one seen since
        self._ended: dict[Any, int] = {}
        #: peer -> whether each of its recent ended sessions was followed in time
        self._reopens: dict[Any, deque[bool]] = {}
        #: partial batches held, and how many of those the answered sessions filled
        self.holds = 0
        self.filled = 0

    # -- measuring -------------------------------------------------------------

    def record_call(self, rows: int, seconds: float) -> None:
        """One target call (with its verification) of ``rows`` rows took ``seconds``."""
        self._calls.append((rows, seconds))
        self._recorded += 1

    def answered(self, sessions: list[Any], now: float) -> None:
        """The verdicts of ``sessions`` are going out now."""
        if self._expected or self._vacant:
            self._fills.append(math.inf)
        for peer, n in self._ended.items():  # no new session came in time
            self._record(peer, [False] * n)
        self._ended.clear()
        self._vacant.clear()
        self._expected = set(sessions)
        self._since = now
        self._unprobed += 1
        self._decision = None

    def returned(self, session: Any, now: float, peer: Any = None, new: bool = False) -> None:
        """``session`` sent its next round; ``new``: its first, a session of ``peer``
        (it takes a place kept for that peer, if there is one)."""
        if new and peer is not None:
            if self._ended.get(peer):
                self._ended[peer] -= 1
                self._record(peer, [True])
            kept = self._vacant.get(peer)
            if kept:
                if kept == 1:
                    del self._vacant[peer]
                else:
                    self._vacant[peer] = kept - 1
                if not self._expected and not self._vacant:
                    self._fills.append(now - self._since)
                return
        self._drop(session, now)

    def forget(self, session: Any, now: float, peer: Any = None) -> None:
        """``session`` ended: nothing more is expected from it. ``peer``: its peer
        closed it, and a reopener's next new session takes its place."""
        if peer is not None and session in self._expected:
            self._ended[peer] = self._ended.get(peer, 0) + 1
            if self.reopener(peer) and self._holding_pays():
                self._vacant[peer] = self._vacant.get(peer, 0) + 1
        self._drop(session, now)

    def vacancies(self) -> int:
        """Places kept for reopeners' new sessions, not taken yet."""
        return sum(self._vacant.values())

    def reopener(self, peer: Any) -> bool:
        """Whether ``peer`` has been opening a new session as soon as one ended."""
        seen = self._reopens.get(peer)
        return (seen is not None and len(seen) >= REOPEN_MIN
                and sum(seen) >= REOPEN_SHARE * len(seen))

    def _record(self, peer: Any, outcomes: list[bool]) -> None:
        seen = self._reopens.pop(peer, None)  # re-inserted: the most recent last
        if seen is None:
            seen = deque(maxlen=REOPEN_WINDOW)
            while len(self._reopens) >= MAX_PEERS:
                del self._reopens[next(iter(self._reopens))]
        seen.extend(outcomes)
        self._reopens[peer] = seen

    def _drop(self, session: Any, now: float) -> None:
        if session in self._expected:
            self._expected.discard(session)
            if not self._expected and not self._vacant:
                self._fills.append(now - self._since)

    def fixed_cost(self) -> float | None:
        """The fitted ``a`` in seconds (``None`` before a fit): the intercept of the
        least-squares line through recent calls, clamped to ``[0, fastest call]``."""
        if self._recorded == self._fitted_at:
            return self._fixed
        self._fitted_at = self._recorded
        calls = tuple(self._calls)  # one C-level copy: the worker appends
        if len(calls) < MIN_CALLS:
            return self._fixed
        rows = [float(r) for r, _ in calls]
        if max(rows) < MIN_SPREAD * max(1.0, min(rows)):
            return self._fixed  # sizes too alike to separate a from b: keep the last fit
        secs = [s for _, s in calls]
        mr, ms = statistics.fmean(rows), statistics.fmean(secs)
        var = sum((r - mr) ** 2 for r in rows)
        slope = sum((r - mr) * (s - ms) for r, s in zip(rows, secs, strict=True)) / var
        self._fixed = max(0.0, min(ms - max(0.0, slope) * mr, min(secs)))
        return self._fixed

    def fill_time(self) -> float | None:
        """Seconds within which :data:`FILL_QUANTILE` of recent batches had every
        session back after their verdicts (``inf`` when more were not all back before
        the next verdicts)."""
        if len(self._fills) < MIN_FILLS:
            return None
        fills = sorted(self._fills)
        return float(fills[min(len(fills) - 1, int(FILL_QUANTILE * len(fills)))])

    # -- deciding ---------------------------------------------------------------

    def pending(self, now: float) -> bool:
        """Whether a session of the batch answered last is still open and has not
        sent its next round, or a place kept for a reopener is still empty."""
        for s in [s for s in self._expected if getattr(s, "closed", False)]:
            self._drop(s, now)
        return bool(self._expected or self._vacant)

    def expected(self, now: float) -> int:
        """How many rounds a hold would wait for: sessions of the batch answered
        last, and places kept for reopeners."""
        self.pending(now)
        return len(self._expected) + self.vacancies()

    def hold_until(self, now: float) -> float | None:
        """Until when the next batch waits for the answered sessions, or ``None``:
        nobody is pending, or merging does not pay."""
        if not self.pending(now):
            return None
        return self._hold()

    def _hold(self) -> float | None:
        if self._decision is None:
            self._decision = (self._decide(),)
        return self._decision[0]

    def _holding_pays(self) -> bool:
        """Whether the batch answered last is one a hold waits for: only then is a
        place kept (else it would only keep the next batch from forming)."""
        return self._hold() is not None

    def _decide(self) -> float | None:
        a, r = self.fixed_cost(), self.fill_time()
        if r is None:
            return None
        if a is None:  # no fit yet: probe now and then, within one median call
            calls = tuple(self._calls)
            if len(calls) < MIN_CALLS or self._unprobed < PROBE_EVERY:
                return None
            a = statistics.median(s for _, s in calls)
            self._unprobed = 0
        if not r < a:
            return None
        return self._since + a

    def to_dict(self) -> dict[str, Any]:
        return {"fixed_cost_s": self._fixed, "fill_time_s": self.fill_time(),
                "holds": self.holds, "holds_filled": self.filled,
                "reopeners": sum(1 for p in self._reopens if self.reopener(p))}


__all__ = ["MergePolicy"]
