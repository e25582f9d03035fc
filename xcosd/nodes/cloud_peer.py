"""What a :class:`~xcosd.nodes.CloudNode` keeps for one peer, and that peer's
control budget.

Every part of the node works on these records: the intake fills a peer's inbox
(xcosd/nodes/cloud_intake.py), the serving loop empties it into its protocol
connection (xcosd/nodes/cloud.py), the delivery writes its outbox
(xcosd/nodes/cloud_delivery.py), and the liveness side drops it
(xcosd/nodes/cloud_liveness.py). One plain record with slots, rather than one
object per concern, because a message to one peer touches several of these fields
in one step and the record is on every message's path.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..protocol.cloud import CloseReason, CloudConnection, CloudSession, RoundOutcome

#: control messages (a ping, a vocabulary request, a message that cannot be decoded:
#: each asks for a reply and does no session's work) one peer may send per second,
#: and in one burst; past it they are dropped unanswered (``dropped_control``). An
#: edge pings once a heartbeat and asks for a vocabulary once a connection; a peer
#: past this is flooding, and answering it would spend the loop on replies it may
#: never read (the HTTP/2 ping and settings floods, CVE-2019-9512 and -9515, are the
#: same attack)
CONTROL_RATE = 100.0
CONTROL_BURST = 200.0

#: one message's frames, as the transport hands them over
Frames = Sequence[Any]


class Peer:
    """What the node keeps for one peer: its protocol connection, its messages
    waiting for their turn (``None``: it disconnected), its replies waiting for
    the socket, and whether its follow-up is in the worker thread (``busy``: then
    nothing else touches ``conn`` until it is back)."""

    __slots__ = ("busy", "conn", "control", "control_at", "deferred", "dropped", "gone",
                 "held", "id", "inbox", "inbox_bytes", "last_seen", "outbox", "outbox_bytes",
                 "ready", "renders", "sender")

    def __init__(self, peer: bytes, conn: CloudConnection, now: float) -> None:
        self.id = peer
        self.conn = conn
        self.inbox: deque[tuple[Frames, int] | None] = deque()
        self.inbox_bytes = 0
        self.outbox: deque[tuple[Frames, int]] = deque()
        self.outbox_bytes = 0
        self.sender: asyncio.Task[None] | None = None
        self.ready = False
        self.busy = False
        #: its render requests in the render thread or waiting for it
        self.renders = 0
        #: served nothing for a while after an expensive follow-up
        self.held = False
        #: verdicts that arrived while busy, applied when it is back
        self.deferred: list[tuple[CloudSession, RoundOutcome]] = []
        #: a drop asked for while busy, done when it is back
        self.gone: CloseReason | None = None
        self.dropped = False
        self.last_seen = now
        #: its control-message budget (a token bucket: CONTROL_RATE, CONTROL_BURST)
        self.control = CONTROL_BURST
        self.control_at = now

    def control_allowed(self) -> bool:
        """Take one control message from this peer's budget, if it has one left."""
        now = time.monotonic()
        self.control = min(CONTROL_BURST, self.control + (now - self.control_at) * CONTROL_RATE)
        self.control_at = now
        if self.control < 1.0:
            return False
        self.control -= 1.0
        return True


__all__ = ["CONTROL_BURST", "CONTROL_RATE", "Frames", "Peer"]
