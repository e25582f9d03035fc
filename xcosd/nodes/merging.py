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
        if self._expected:
            self._fills.append(math.inf)
        self._expected = set(sessions)
        self._since = now
        self._unprobed += 1
        self._decision = None

    def returned(self, session: Any, now: float) -> None:
        """``session`` sent its next round."""
        self._drop(session, now)

    def forget(self, session: Any, now: float) -> None:
        """``session`` ended: nothing is expected from it."""
        self._drop(session, now)

    def _drop(self, session: Any, now: float) -> None:
        if session in self._expected:
            self._expected.discard(session)
            if not self._expected:
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
        sent its next round."""
        for s in [s for s in self._expected if getattr(s, "closed", False)]:
            self._drop(s, now)
        return bool(self._expected)

    def expected(self, now: float) -> int:
        """How many sessions of the batch answered last a hold would wait for."""
        self.pending(now)
        return len(self._expected)

    def hold_until(self, now: float) -> float | None:
        """Until when the next batch waits for the answered sessions, or ``None``:
        nobody is pending, or merging does not pay."""
        if not self.pending(now):
            return None
        if self._decision is None:
            self._decision = (self._decide(),)
        return self._decision[0]

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
                "holds": self.holds, "holds_filled": self.filled}


__all__ = ["MergePolicy"]
