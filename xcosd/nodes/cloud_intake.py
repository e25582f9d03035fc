"""A :class:`~xcosd.nodes.CloudNode`'s intake: the socket read into one bounded
queue per peer, and the peers with messages to serve, in turn order.

No peer can take the event loop or another peer's turn on the way in. The intake
takes every message the socket has ready in one call (up to
:data:`INTAKE_BURST`: one wake-up per burst, not per message) into one bounded
queue per peer, and lets the loop run other tasks after a full burst (a ready
socket answers without ever yielding, so a flood would otherwise hold it). A
message past its peer's bound (``max_peer_queue`` messages or
``4 * max_message_bytes`` bytes) is dropped unread and counted
(``dropped_flood``), or, for a draft, refused ``busy`` (``refused_flood``), which
an edge retries. Control messages past a peer's budget are dropped when served
(:data:`~xcosd.nodes.cloud_peer.CONTROL_RATE`, xcosd/nodes/cloud_peer.py).

A peer is ready to serve when it has messages and nothing holds it: its follow-up
in the worker thread, a hold after an expensive one, or replies backing up (half
its outgoing bound: it is not served until they drain, so a peer that does not
read costs no work whose replies would only be dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import TransportError
from ..protocol.cloud import CloudConfig, CloudConnection, Output
from ..protocol.messages import DraftMsg
from ..transport import Listener
from ..wire.frames import message_bytes
from .cloud_peer import Frames, Peer

#: the node's logger: everything a CloudNode logs goes under one name
log = logging.getLogger("xcosd.nodes.cloud")

#: messages the intake reads in one go (all that are ready, up to this many) before
#: it lets the loop run other tasks: no more than serving takes in a turn
#: (SERVE_BURST), so that under overload what waits stays in the transport's own
#: bounded queues, which push back on the senders, rather than in the peers' queues
INTAKE_BURST = 32


def peek_draft(frames: Frames) -> tuple[int, int] | None:
    """``(s, r)`` when ``frames`` look like a draft (header only, small headers
    only): what a ``busy`` refusal of it needs. Anything else: ``None``."""
    if not frames or len(frames[0]) > 512:
        return None
    try:
        h = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception:
        return None
    if not isinstance(h, dict) or h.get("t") != DraftMsg.TYPE:
        return None
    s, r = h.get("s"), h.get("r")
    if type(s) is not int or type(r) is not int:
        return None
    return s, r


class Intake:
    """The node's peers (``peers``, each with a connection made from ``config`` on
    its first message), their bounded inboxes, and the ones ready to serve
    (``ready``; ``work`` is set when one is added).

    Counters it updates: ``messages``, ``dropped_flood``, ``refused_flood``,
    ``internal_errors``. ``answer(p, out)``: apply a refusal made for ``p``;
    ``revoked(peer, p)``: ``peer``'s key was revoked (``p``: what is kept for it)."""

    def __init__(self, config: CloudConfig, counters: dict[str, Any], max_peer_queue: int,
                 max_peer_bytes: int, *, answer: Callable[[Peer, Output[Any]], None],
                 revoked: Callable[[bytes, Peer | None], None]) -> None:
        self.config = config
        self.counters = counters
        self.max_peer_queue = max_peer_queue
        self.max_peer_bytes = max_peer_bytes
        self._answer = answer
        self._revoked = revoked
        self.peers: dict[bytes, Peer] = {}
        #: peers with messages to serve, in turn order
        self.ready: deque[Peer] = deque()
        self.work = asyncio.Event()

    async def run(self, listener: Listener) -> None:
        """Read the socket into the peers' queues; never hold the loop for long."""
        while True:
            try:
                got = await listener.recv_many(INTAKE_BURST)
            except TransportError as e:
                if e.code == "closed":
                    return
                log.warning("receive failed: %s", e)
                await asyncio.sleep(0.01)
                continue
            for peer, frames in got:
                try:
                    self._take_in(listener, peer, frames)
                except Exception:  # a bug must not take the cloud down
                    self.counters["internal_errors"] += 1
                    log.exception("taking in a message from %s failed", bytes(peer).hex())
            if len(got) >= INTAKE_BURST:
                # a ready socket answers at once: without this, a peer that sends
                # faster than the cloud reads would hold the loop for good
                await asyncio.sleep(0)

    def _take_in(self, listener: Listener, peer: bytes, frames: list[bytes] | None) -> None:
        now = time.monotonic()
        p = self.peers.get(peer)
        if frames is None and listener.revoked(peer):
            self._revoked(peer, p)
            return
        if p is None:
            if frames is None:
                return  # a peer we hold nothing for went away
            p = self.peers[peer] = Peer(peer, CloudConnection(self.config, peer), now)
        p.last_seen = now
        if frames is None:
            p.inbox.append(None)  # after everything it sent; never dropped
        else:
            self.counters["messages"] += 1
            n = message_bytes(frames)
            if p.inbox and (len(p.inbox) >= self.max_peer_queue
                            or p.inbox_bytes + n > self.max_peer_bytes):
                self._overflow(p, frames)
                return
            p.inbox.append((frames, n))
            p.inbox_bytes += n
        self.mark_ready(p)

    def _overflow(self, p: Peer, frames: Frames) -> None:
        """A message past its peer's queue bound: a draft is refused ``busy`` (the
        edge sends it again later), anything else is dropped unread."""
        sr = peek_draft(frames)
        if sr is None:
            self.counters["dropped_flood"] += 1
            return
        self.counters["refused_flood"] += 1
        self._answer(p, p.conn.refuse("busy", f"{len(p.inbox)} messages from this peer are "
                                      "waiting to be served; retry later", *sr))

    def backed_up(self, p: Peer) -> bool:
        """Whether ``p``'s replies are backing up (half its outgoing bound): it is
        then not served until its sender has written them down, so a peer that does
        not read costs the cloud no work whose replies would only be dropped; its
        messages wait in its inbox and past that bound are dropped unread at intake."""
        return (2 * len(p.outbox) >= self.max_peer_queue
                or 2 * p.outbox_bytes >= self.max_peer_bytes)

    def mark_ready(self, p: Peer) -> None:
        """Put ``p`` in the serving order if it has messages and nothing holds it."""
        if (p.inbox and not p.ready and not p.busy and not p.held and not p.dropped
                and not self.backed_up(p)):
            p.ready = True
            self.ready.append(p)
            self.work.set()


__all__ = ["INTAKE_BURST", "Intake", "peek_draft"]
