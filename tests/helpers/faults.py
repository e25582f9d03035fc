"""An edge and a cloud in one process with faults injected between them.

The sans-I/O machines make every fault a few lines: each message is, by a seeded
coin, dropped, duplicated or held back and delivered later, out of order (messages
are passed as objects: their wire form is the fault-free law tests' and the wire
tests' subject, and skipping it keeps N = 20,000 affordable); before a message reaches the cloud, the
cloud may restart (a new :class:`~xcosd.protocol.CloudConnection` with a new
:class:`~xcosd.protocol.CloudConfig`: every session, every V_C map and its random
streams gone). The edge reacts as :class:`~xcosd.nodes.EdgeNode` does: a
``handshake`` or ``no_session`` error means the cloud lost it (handshake again,
then :meth:`EdgeSession.open` resumes the generation); nothing left in flight means
an answer was lost (:meth:`EdgeSession.resend_last`, the node's ``resend_after_s``).

What must hold through all of it is the output law, checked by
``tests/test_law_faults.py`` with the same checks as the fault-free law tests.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xcosd.errors import XcosdError
from xcosd.nodes.drafter import Drafter
from xcosd.nodes.pump import Pump, free_model_state
from xcosd.nodes.scoring import score_batch, score_on_device
from xcosd.protocol import (
    CloudConfig,
    CloudConnection,
    DraftNeeded,
    EdgeHandshake,
    EdgeSession,
    Message,
    Open,
    RequestMsg,
    ScoreNeeded,
    SessionClosed,
)
from xcosd.protocol.messages import Error

#: error codes that mean "the cloud lost this connection's state" (as the node reads them)
LOST = frozenset({"handshake", "no_session"})


@dataclass
class Faults:
    """Per-message probabilities (each message, either direction) and the chance
    that the cloud restarts before a message reaches it."""

    drop: float = 0.05
    duplicate: float = 0.05
    delay: float = 0.05
    restart: float = 0.08
    #: before a follow-up request: restarts there are what a redone round (Redo) is for
    restart_on_request: float = 0.3


@dataclass
class FaultCounts:
    dropped: int = 0
    duplicated: int = 0
    delayed: int = 0
    restarts: int = 0
    resumes: int = 0
    resends: int = 0
    redone: int = 0
    stale: int = 0
    #: tokens drafted while a verdict was in flight, and those a later round drafted
    speculated: int = 0
    reused: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)
    #: faults (dropped, duplicated, delayed, a restart before it) that hit an open
    #: carrying round 0's block
    open_round: int = 0


class FaultyLink:
    """Runs generations between ``pump``'s edge side and a cloud that misbehaves
    as :class:`Faults` says (see the module docstring)."""

    def __init__(self, pump: Pump, faults: Faults, seed: int) -> None:
        self.pump = pump
        self.faults = faults
        self.rng = np.random.default_rng(seed)
        self.counts = FaultCounts()
        #: every cloud event (tests read and clear it)
        self.events: list[object] = []
        self.cloud = self._new_cloud()
        self._hs_cloud: CloudConnection | None = None
        self._handshake()

    def _new_cloud(self) -> CloudConnection:
        p = self.pump
        cfg = CloudConfig(p.target.vocab, p.target.tokenize, p.limits, "faulty")
        return CloudConnection(cfg, b"edge")

    def _handshake(self) -> None:
        """Connection setup, not faulted (it is per connection, not per generation)."""
        hs = EdgeHandshake(lambda tv: self.pump.vmap, self.pump.target.vocab)
        pending = list(self._to_cloud(hs.hello()))
        while pending:
            for m in hs.receive(pending.pop(0)).send:
                pending += self._to_cloud(m)
        assert hs.ready
        self._hs_cloud = self.cloud

    # -- the cloud --------------------------------------------------------------------

    def _to_cloud(self, msg: Message) -> list[Message]:
        """Deliver ``msg`` to the cloud now; its answers."""
        out = self.cloud.receive(msg)
        self.events += out.events
        send = list(out.send)
        for ev in out.events:
            if isinstance(ev, SessionClosed):
                free_model_state(self.pump.target, ev.session)
            elif isinstance(ev, ScoreNeeded):
                # as the pump scores: next to the target's rows where it verifies there
                score = score_on_device if self.pump.on_device else score_batch
                [outcome] = score(self.pump.target, [ev])
                scored = self.cloud.scored(ev.session, outcome)
                self.events += scored.events
                send += scored.send
        return send

    # -- a generation -----------------------------------------------------------------

    def generate(self, method: str, *, seed: int, session_cls: type[EdgeSession] = EdgeSession,
                 speculate: bool = False, drafter_cls: type[Drafter] | None = None,
                 **kw: Any) -> EdgeSession:
        """One generation through the faults. ``speculate``: after each draft leaves,
        the drafter drafts on past it (:meth:`Drafter.speculate`) as many tokens as
        a random share of the wait allows, 0 to the round's ceiling plus one, drawn
        from the faults' generator (the timing), never from the edge's; ``drafter_cls``:
        the drafter's class instead of :class:`Drafter`."""
        pump, rng, f, c = self.pump, self.rng, self.faults, self.counts
        es = pump.session(method, seed=seed, **kw)
        if drafter_cls is not None:
            pump.drafters[es.s].__class__ = drafter_cls
        if session_cls is not EdgeSession:
            es.__class__ = session_cls
        up: deque[Message] = deque()
        down: deque[Message] = deque()
        held: list[tuple[deque[Message], Message]] = []

        def send(q: deque[Message], m: Message) -> None:
            u = rng.random()
            if u < f.drop + f.duplicate + f.delay and getattr(m, "draft", None) is not None \
                    and isinstance(m, Open):
                c.open_round += 1
            if u < f.drop:
                c.dropped += 1
            elif u < f.drop + f.duplicate:
                c.duplicated += 1
                q.extend((m, m))
            elif u < f.drop + f.duplicate + f.delay:
                c.delayed += 1
                held.append((q, m))
            else:
                q.append(m)

        def edge_out(out: Any) -> None:
            for m in out.send:
                send(up, m)

        def draft_if_ready() -> None:
            if es.phase.value in ("ready", "new"):  # new: round 0 rides on the open
                out = es.next_round()
                for ev in out.events:
                    if isinstance(ev, DraftNeeded):
                        out = es.take(pump.drafters[es.s].run(ev))
                edge_out(out)
                if speculate:
                    n = int(rng.integers(0, es.drafting.ceiling + 4))
                    pump.drafters[es.s].speculate(n, es.method, es.space, es.rng)

        draft_if_ready()
        steps = 0
        while not es.done:
            steps += 1
            if steps > 10_000:
                raise AssertionError(f"generation did not finish: phase {es.phase}")
            if down:
                msg = down.popleft()
                if isinstance(msg, Error) and msg.code in LOST:
                    # the cloud restarted and does not know us: connect again, resume
                    if self._hs_cloud is not self.cloud:
                        self._handshake()
                    c.resumes += 1
                    c.by_phase[es.phase.value] = c.by_phase.get(es.phase.value, 0) + 1
                    send(up, es.open())
                    continue
                stale = es.stale
                out = es.receive(msg)
                c.stale += es.stale - stale
                c.redone += sum(1 for m in out.send if getattr(m, "redo", None) is not None)
                edge_out(out)
                draft_if_ready()
            elif up:
                p = f.restart_on_request if isinstance(up[0], RequestMsg) else f.restart
                if rng.random() < p:
                    c.restarts += 1
                    c.open_round += isinstance(up[0], Open) and up[0].draft is not None
                    for gone in self.cloud.sessions.values():  # the old node's sessions
                        free_model_state(self.pump.target, gone)
                    self.cloud = self._new_cloud()
                for m in self._to_cloud(up.popleft()):
                    send(down, m)
            elif held:
                q, m = held.pop(int(rng.integers(len(held))))
                q.append(m)
            else:  # nothing in flight: the answer was lost; ask again
                again = es.resend_last()
                if again is None:
                    raise AssertionError(f"stuck in phase {es.phase}")
                c.resends += 1
                send(up, again)
        with contextlib.suppress(XcosdError):  # the cloud may have restarted meanwhile
            self._to_cloud(es.close())
        drafter = pump.drafters.pop(es.s)
        c.speculated += drafter.speculated
        c.reused += drafter.reused
        drafter.end()
        return es
