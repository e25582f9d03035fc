"""Whether an edge holds its cloud, and how it keeps trying while it does not, as
a sans-I/O state machine.

An edge that serves others (an HTTP front: ``xcosd edge serve``) must outlive its
cloud's absences: a cloud still loading its model, restarting, or drained. It
keeps running, says what it is doing (``/health``), holds requests a bounded time
and connects the moment the cloud answers, as a proxy does with its upstream.
:class:`Reach` is that bookkeeping; the node's connection (``xcosd/nodes/edge_connection.py``)
does the I/O and feeds it the time.

Phases (:class:`ReachPhase`, changed only through :data:`REACH_TRANSITIONS`)::

    connecting ─handshake done─► connected ─lost─► connecting
        └─gave up (past connect_timeout_s, or an answer retrying cannot change:
          another protocol version, another vocabulary)─► unreachable ─retry─► connecting
    any ─close─► closed

``connecting`` covers the first connection and every reconnection alike: an
outsider sees the same thing (no cloud now, one being looked for). Each stretch
of ``connecting`` tries the addresses in passes with a jittered exponential pause
after a pass in which none answered (:class:`~xcosd.transport.addresses.Backoff`);
it ends connected, or unreachable once its deadline (``connect_timeout_s`` after
it began; ``None``: no deadline) has passed.
"""

from __future__ import annotations

import enum
from typing import Any

from ..transport.addresses import Backoff

#: the first pause after a pass of failed attempts, and the longest: a cloud that
#: comes back is found within about a second, and an absent one costs a
#: connection attempt a second
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0


class ReachPhase(enum.StrEnum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    UNREACHABLE = "unreachable"
    CLOSED = "closed"


class ReachStep(enum.StrEnum):
    CONNECTED = "connected"
    LOST = "lost"
    GAVE_UP = "gave_up"
    RETRY = "retry"
    CLOSE = "close"


#: every legal move; anything else is a programming error (ValueError)
REACH_TRANSITIONS: dict[tuple[ReachPhase, ReachStep], ReachPhase] = {
    (ReachPhase.CONNECTING, ReachStep.CONNECTED): ReachPhase.CONNECTED,
    (ReachPhase.CONNECTING, ReachStep.GAVE_UP): ReachPhase.UNREACHABLE,
    (ReachPhase.CONNECTED, ReachStep.LOST): ReachPhase.CONNECTING,
    (ReachPhase.UNREACHABLE, ReachStep.RETRY): ReachPhase.CONNECTING,
    **{(p, ReachStep.CLOSE): ReachPhase.CLOSED for p in ReachPhase},
}


class Reach:
    """The edge's hold on its cloud (module docstring). ``now`` is monotonic
    seconds, given to every step that depends on time, so a test drives it
    without sleeping; ``backoff`` defaults to :data:`BACKOFF_BASE_S` ..
    :data:`BACKOFF_CAP_S`."""

    def __init__(self, now: float, connect_timeout_s: float | None = 30.0,
                 backoff: Backoff | None = None) -> None:
        if connect_timeout_s is not None and connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0 or None, got {connect_timeout_s}")
        self.connect_timeout_s = connect_timeout_s
        self.backoff = backoff if backoff is not None else Backoff(BACKOFF_BASE_S, BACKOFF_CAP_S)
        self.phase = ReachPhase.CONNECTING
        #: when the phase began
        self.since = now
        #: handshakes completed (the first connection and every reconnection)
        self.connects = 0
        #: connections lost once held
        self.losses = 0
        #: attempts that failed (an address that did not answer, or refused)
        self.failed_attempts = 0
        #: stretches of ``connecting`` that ended unreachable
        self.gave_up = 0
        #: why the last attempt failed (``None`` once connected)
        self.error: str | None = None
        self._deadline = self._deadline_from(now)

    def begin(self, now: float) -> None:
        """The node starts looking for its cloud: the first stretch's clock (its
        deadline, ``waited_s``) starts now rather than when the node was made."""
        if self.phase is ReachPhase.CONNECTING and self.connects == 0:
            self.since = now
            self._deadline = self._deadline_from(now)

    def _deadline_from(self, now: float) -> float | None:
        return None if self.connect_timeout_s is None else now + self.connect_timeout_s

    def _advance(self, step: ReachStep, now: float) -> None:
        nxt = REACH_TRANSITIONS.get((self.phase, step))
        if nxt is None:
            raise ValueError(f"{step.value} is not allowed while {self.phase.value}")
        if nxt is not self.phase:
            self.phase, self.since = nxt, now

    @property
    def connected(self) -> bool:
        return self.phase is ReachPhase.CONNECTED

    @property
    def reconnects(self) -> int:
        """Connections made after the first."""
        return max(0, self.connects - 1)

    def waited_s(self, now: float) -> float:
        """How long the cloud has been missing (0 while connected)."""
        return 0.0 if self.connected else now - self.since

    def left_s(self, now: float) -> float | None:
        """Seconds left before this stretch of ``connecting`` gives up (``None``:
        it never does)."""
        return None if self._deadline is None else max(0.0, self._deadline - now)

    def attempt_s(self, now: float, most_s: float) -> float:
        """How long the next attempt's handshake may take: ``most_s``, cut to the
        time left before the deadline (never under 50 ms, so the last attempt is
        still one)."""
        left = self.left_s(now)
        return most_s if left is None else min(most_s, max(0.05, left))

    def attempt_failed(self, error: str) -> None:
        """An attempt failed, with its reason."""
        self.failed_attempts += 1
        self.error = error

    def pause(self, now: float) -> float | None:
        """After a pass in which no address answered: the pause before the next
        pass, or ``None`` when the deadline would pass first, and the phase is then
        ``unreachable``."""
        delay = self.backoff.next()
        if self._deadline is not None and now + delay > self._deadline:
            self._advance(ReachStep.GAVE_UP, now)
            self.gave_up += 1
            return None
        return delay

    def give_up(self, now: float, error: str) -> None:
        """An answer retrying cannot change (another protocol version or
        vocabulary, a refused key): unreachable at once."""
        self.error = error
        self._advance(ReachStep.GAVE_UP, now)
        self.gave_up += 1

    def retry(self, now: float) -> None:
        """Look for the cloud again after having given up (a new request asks
        for it): a fresh stretch, with its own deadline and backoff."""
        self._advance(ReachStep.RETRY, now)
        self._deadline = self._deadline_from(now)
        self.backoff.reset()

    def connected_now(self, now: float) -> None:
        """The handshake is done."""
        self._advance(ReachStep.CONNECTED, now)
        self.connects += 1
        self.error = None
        self.backoff.reset()

    def lost(self, now: float, why: str) -> None:
        """The connection held is gone (the transport failed, the cloud was silent,
        restarted or left): look for it again, with a fresh deadline."""
        self._advance(ReachStep.LOST, now)
        self.losses += 1
        self.error = why
        self._deadline = self._deadline_from(now)

    def close(self, now: float) -> None:
        self._advance(ReachStep.CLOSE, now)

    def health(self, now: float) -> dict[str, Any]:
        """What an HTTP front says of the cloud in its ``/health`` body."""
        out: dict[str, Any] = {"state": self.phase.value, "connected": self.connected,
                               "reconnects": self.reconnects}
        if not self.connected:
            out["waiting_s"] = round(self.waited_s(now), 3)
            if self.error is not None:
                out["error"] = self.error
        return out


__all__ = ["BACKOFF_BASE_S", "BACKOFF_CAP_S", "REACH_TRANSITIONS", "Reach", "ReachPhase",
           "ReachStep"]
