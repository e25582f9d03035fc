"""A :class:`~xcosd.nodes.CloudNode`'s outgoing side: its replies, from the turn
that made them to the socket.

Replies of one turn of the loop go to the socket together when it ends (a long
turn's, a batch's verification, once the first has waited
:data:`~xcosd.transport.burst.HOLD_S`: xcosd/transport/burst.py), each at once when
its peer's queue there has room and nothing of that peer waits before it (no task:
the common case). Otherwise they go through one bounded outgoing queue per peer,
written by that peer's own task with a :data:`SEND_TIMEOUT_S` deadline per
message: a peer that does not read delays only its own replies; past the bound
they are dropped and counted (``dropped``, ``dropped_outbox``). A peer whose queue
is half full is not served until it drains (the intake's check,
xcosd/nodes/cloud_intake.py), so its flood waits, then is dropped at intake, never
served into replies that would be dropped.

A peer whose key was revoked gets its farewell (typed errors) here too, on a task
of its own, after it was dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import TransportError
from ..protocol.cloud import CloseReason
from ..transport import Listener
from ..transport.burst import Burst
from ..wire.frames import message_bytes
from .cloud_peer import Frames, Peer

#: the node's logger: everything a CloudNode logs goes under one name
log = logging.getLogger("xcosd.nodes.cloud")

#: a reply a peer does not take within this long is dropped (and counted)
SEND_TIMEOUT_S = 1.0
#: replies one peer's sender writes before it lets the loop run other tasks
SEND_BURST = 32


class Delivery:
    """The replies of a node's peers on their way out, with the counters they
    update (``errors_sent``, ``dropped``, ``dropped_outbox``, ``internal_errors``).

    ``max_peer_queue`` and ``max_peer_bytes`` bound what one peer may have waiting.
    ``drained(p)``: a reply of ``p`` left its queue (it may be served again);
    ``unreachable(peer, reason)``: drop a peer its transport no longer reaches."""

    def __init__(self, counters: dict[str, Any], max_peer_queue: int, max_peer_bytes: int, *,
                 drained: Callable[[Peer], None],
                 unreachable: Callable[[bytes, CloseReason], bool]) -> None:
        self.counters = counters
        self.max_peer_queue = max_peer_queue
        self.max_peer_bytes = max_peer_bytes
        self._drained = drained
        self._unreachable = unreachable
        #: the socket replies go to, from the node's start
        self.listener: Listener | None = None
        #: set when the node closes: nothing is sent after it
        self.closed = False
        #: replies queued in this turn of the loop, sent together when it ends (or
        #: once the first has waited HOLD_S: a batch's verification is a long turn)
        self.turn: Burst[tuple[Peer, Frames, int]] = Burst(self._flush_turn)
        #: the typed errors being sent to peers whose key was revoked
        self._farewells: set[asyncio.Task[None]] = set()

    def send(self, p: Peer, kind: str, frames: Frames) -> None:
        """Queue a reply to ``p``; its own task writes it. Past the bound: dropped."""
        c = self.counters
        if kind == "error":
            c["errors_sent"] += 1
        if p.dropped or self.closed or self.listener is None:
            c["dropped"] += 1
            return
        n = message_bytes(frames)
        if p.sender is None and not p.outbox:
            # nothing of this peer waits: its reply joins this turn's, handed to the
            # socket together (xcosd/transport/burst.py)
            self.turn.add((p, frames, n))
            return
        self._to_outbox(p, frames, n)

    def forget(self, p: Peer) -> None:
        """``p`` is dropped: its waiting replies go, and so does its sender (unless
        that is the task dropping it)."""
        p.outbox.clear()
        p.outbox_bytes = 0
        if p.sender is not None and p.sender is not asyncio.current_task():
            p.sender.cancel()

    def farewell(self, peer: bytes, farewell: Sequence[Frames]) -> None:
        """Send ``farewell`` to a peer already dropped, on a task of its own, each
        message within :data:`SEND_TIMEOUT_S`; a peer gone already is told nothing."""
        task = asyncio.get_running_loop().create_task(self._send_farewell(peer, farewell))
        self._farewells.add(task)
        task.add_done_callback(self._farewells.discard)

    async def _send_farewell(self, peer: bytes, farewell: Sequence[Frames]) -> None:
        listener = self.listener
        with contextlib.suppress(Exception):  # gone already: nothing left to tell
            async with asyncio.timeout(SEND_TIMEOUT_S):
                for frames in farewell:
                    assert listener is not None
                    await listener.send(peer, frames)

    def _to_outbox(self, p: Peer, frames: Frames, n: int) -> None:
        """Queue a reply for ``p``'s sender (started if need be); past the bound:
        dropped."""
        if p.outbox and (len(p.outbox) >= self.max_peer_queue
                         or p.outbox_bytes + n > self.max_peer_bytes):
            self.counters["dropped"] += 1
            self.counters["dropped_outbox"] += 1
            return
        p.outbox.append((frames, n))
        p.outbox_bytes += n
        if p.sender is None:
            p.sender = asyncio.get_running_loop().create_task(self._sender(p),
                                                              name="xcosd-cloud-send")

    def _flush_turn(self, turn: list[tuple[Peer, Frames, int]]) -> None:
        """Hand a turn's replies to the socket, in order: each goes at once if its
        peer's queue there has room and nothing of that peer waits before it,
        otherwise to that peer's sender. One burst of sends wakes ZeroMQ's I/O
        thread once, not once per reply."""
        sent = False
        for p, frames, n in turn:
            if p.dropped or self.closed or self.listener is None:
                self.counters["dropped"] += 1
            elif p.sender is None and not p.outbox and self._send_now(p, frames):
                sent = True
            else:
                self._to_outbox(p, frames, n)
        if sent and self.listener is not None:
            self.listener.end_burst()  # only a burst that reached the socket

    def _send_now(self, p: Peer, frames: Frames) -> bool:
        """Hand a reply to the socket at once when that needs no waiting (the peer's
        queue has room): no task, no turn of the loop. Anything else (a full queue,
        an error) is left to the peer's sender, which waits, times out and reports."""
        assert self.listener is not None
        try:
            return self.listener.send_nowait(p.id, frames)
        except TransportError:
            return False
        except Exception:  # a bug must not take the cloud down
            self.counters["internal_errors"] += 1
            log.exception("sending to %s failed", bytes(p.id).hex())
            return False

    async def _sender(self, p: Peer) -> None:
        """Write ``p``'s replies in order; a peer that does not read waits here
        alone, each reply for at most :data:`SEND_TIMEOUT_S`."""
        assert self.listener is not None
        listener = self.listener
        sent = 0
        try:
            while p.outbox and not p.dropped:
                frames, n = p.outbox.popleft()
                p.outbox_bytes -= n
                self._drained(p)  # served again once its replies drain
                try:
                    async with asyncio.timeout(SEND_TIMEOUT_S):  # no task per send
                        await listener.send(p.id, frames)
                except (TransportError, TimeoutError) as e:
                    # the peer is gone or does not read: drop the message, count it
                    self.counters["dropped"] += 1
                    log.debug("dropped a reply to %s: %s", bytes(p.id).hex(), e)
                    if isinstance(e, TransportError) and e.code == "unreachable":
                        self._unreachable(p.id, CloseReason.DISCONNECTED)
                        return
                    if isinstance(e, TransportError) and e.code == "closed":
                        return
                except Exception:  # a bug must not take the cloud down
                    self.counters["internal_errors"] += 1
                    log.exception("sending to %s failed", bytes(p.id).hex())
                sent += 1
                if sent >= SEND_BURST:
                    sent = 0
                    await asyncio.sleep(0)
        finally:
            p.sender = None


__all__ = ["SEND_BURST", "SEND_TIMEOUT_S", "Delivery"]
