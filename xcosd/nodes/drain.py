"""A cloud's readiness and its graceful drain, as a sans-I/O state machine.

A balancer (HAProxy, Envoy, a cloud load balancer, a Kubernetes Service) sends new
connections to the nodes whose HTTP health check answers 200, and leaves running
connections where they are. A cloud node holds its sessions' KV caches, so the
affinity it needs is its edges' TCP connections, which any L4 balancer keeps; what
it must say is whether it takes *new* work. :class:`Drain` decides that, and the
steps of leaving without losing a token:

``serving``
    ``/health`` answers 200 unless every session is in use (503 ``full``: a new
    edge would only be refused ``busy``).
``draining`` (:meth:`Drain.start`)
    ``/health`` answers 503 ``draining``, so the balancer stops sending new
    connections here; a ``hello`` or ``open`` that still arrives is refused with the
    typed ``draining`` error, which sends its edge to connect again (and so, through
    the balancer, to another node) and resume exactly there. Running generations go
    on until they end or the deadline passes, whichever is first.
``handing_off`` (:meth:`Drain.due`)
    The deadline passed, or no session is left: every peer still connected is told
    ``draining`` on its connection, and its edge resumes each running generation
    from its committed tokens elsewhere (the protocol's exact resume: docs/PROTOCOL.md,
    "Faults"). The node can then stop.

The counts say what the drain did with the sessions it found: each one either ran
to its end here (``finished``), was handed off (``handed_off``), or ended some
other way (``ended_otherwise``: its edge went silent or failed; a resume covers
those too). ``sessions_at_start == finished + handed_off + ended_otherwise``
always holds, since no session is opened while draining.

The node (``xcosd/nodes/cloud.py``) does the I/O: it feeds the state machine the
time and its session count, and sends what it is told to.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: ``/health``'s answer: status and body
HealthAnswer = tuple[int, Mapping[str, Any]]


class DrainPhase(enum.StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    HANDING_OFF = "handing_off"
    DRAINED = "drained"


@dataclass
class DrainReport:
    """What a drain did (``CloudNode.drain()`` returns it as a dict)."""

    sessions_at_start: int = 0
    finished: int = 0
    handed_off: int = 0
    ended_otherwise: int = 0
    refused: int = 0
    peers_told: int = 0
    started_at: float = 0.0
    deadline_s: float = 0.0
    took_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"sessions_at_start": self.sessions_at_start, "finished": self.finished,
                "handed_off": self.handed_off, "ended_otherwise": self.ended_otherwise,
                "refused": self.refused, "peers_told": self.peers_told,
                "deadline_s": self.deadline_s, "took_s": round(self.took_s, 3)}


class Drain:
    """Readiness and the drain of one cloud node (module docstring). Every method
    takes the time (``now``, monotonic seconds) it applies to, so a test drives it
    without sleeping."""

    def __init__(self) -> None:
        self.phase = DrainPhase.SERVING
        self.report = DrainReport()
        self._deadline = 0.0

    @property
    def accepting(self) -> bool:
        """Whether new connections and sessions are taken."""
        return self.phase is DrainPhase.SERVING

    def health(self, sessions: int, max_sessions: int, body: Mapping[str, Any]) -> HealthAnswer:
        """``/health``: 200 ``ok`` while new sessions are taken, 503 ``draining``
        from the start of a drain, 503 ``full`` while every session is in use."""
        if not self.accepting:
            return 503, {**body, "status": "draining"}
        if sessions >= max_sessions:
            return 503, {**body, "status": "full"}
        return 200, {**body, "status": "ok"}

    def start(self, now: float, deadline_s: float, sessions: int) -> bool:
        """Begin draining with ``sessions`` running; they have until ``now +
        deadline_s``. False (and nothing changes) when a drain already began."""
        if self.phase is not DrainPhase.SERVING:
            return False
        if deadline_s < 0:
            raise ValueError(f"the drain deadline must be >= 0, got {deadline_s}")
        self.phase = DrainPhase.DRAINING
        self._deadline = now + deadline_s
        self.report = DrainReport(sessions_at_start=sessions, started_at=now,
                                  deadline_s=deadline_s)
        return True

    def refused(self) -> None:
        """A ``hello`` or ``open`` was refused ``draining``."""
        self.report.refused += 1

    def session_ended(self, by_peer: bool) -> None:
        """A session that was running when the drain began ended (``by_peer``: its
        edge closed it, the generation done)."""
        if self.phase is not DrainPhase.DRAINING:
            return  # not draining, or ended by the hand-off itself (counted there)
        if by_peer:
            self.report.finished += 1
        else:
            self.report.ended_otherwise += 1

    def left_s(self, now: float) -> float:
        """Seconds until the deadline (0 past it, or when not draining)."""
        if self.phase is not DrainPhase.DRAINING:
            return 0.0
        return max(0.0, self._deadline - now)

    def due(self, now: float, sessions: int) -> bool:
        """Whether the hand-off is due: draining, and no session is left or the
        deadline passed. Once it says so, the phase is ``handing_off``."""
        if self.phase is not DrainPhase.DRAINING:
            return False
        if sessions > 0 and now < self._deadline:
            return False
        self.phase = DrainPhase.HANDING_OFF
        return True

    def handed_off(self, sessions: int, peers: int) -> None:
        """The node told ``peers`` peers to go, with ``sessions`` sessions between them."""
        self.report.handed_off += sessions
        self.report.peers_told += peers

    def done(self, now: float) -> DrainReport:
        """The hand-off is sent: drained."""
        self.phase = DrainPhase.DRAINED
        self.report.took_s = now - self.report.started_at
        return self.report


__all__ = ["Drain", "DrainPhase", "DrainReport", "HealthAnswer"]
