"""A :class:`~xcosd.nodes.CloudNode`'s liveness: which peers and sessions still
hold the cloud's resources, and letting go of those that do not.

* A peer silent for ``silence_timeout_s`` loses its sessions and is dropped; so is one the
  transport reports gone (a disconnect, an unreachable peer), and one whose CURVE
  key was revoked, which is told so first (xcosd/transport/revocation.py).
* A session with no draft or follow-up for ``session_idle_s`` is closed even when
  its peer keeps pinging (``sessions_idle_reaped``) while the cloud is short of
  sessions (at :data:`IDLE_PRESSURE` of ``max_sessions``: a hoarder then keeps
  newcomers out), else after :data:`IDLE_SLACK` times as long (an overloaded but
  honest edge can be slow between rounds; closing its session would only make it
  open again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ..errors import ErrorCode
from ..protocol import pack
from ..protocol.cloud import CloseReason, CloudConfig, CloudPhase, Output
from ..protocol.messages import Error
from .cloud_delivery import SEND_TIMEOUT_S, Delivery
from .cloud_peer import Peer

#: the node's logger: everything a CloudNode logs goes under one name
log = logging.getLogger("xcosd.nodes.cloud")

#: the share of ``max_sessions`` in use from which idle sessions are closed after
#: ``session_idle_s``; below it, after ``IDLE_SLACK`` times as long
IDLE_PRESSURE = 0.9
IDLE_SLACK = 4.0


class Liveness:
    """When each session last had work (``activity``), and the dropping of peers
    (from ``peers``) and sessions that no longer use the cloud.

    Counters it updates: ``peers_dropped``, ``peers_revoked``,
    ``sessions_idle_reaped``, ``internal_errors``. ``apply_events(out)``: count and
    act on what ending a connection or session produced; ``forget(peer)``: drop
    what else the node queued for ``peer`` (its renders)."""

    def __init__(self, peers: dict[bytes, Peer], config: CloudConfig, counters: dict[str, Any],
                 delivery: Delivery, *, silence_timeout_s: float, session_idle_s: float,
                 max_sessions: int, apply_events: Callable[[Output[Any]], None],
                 forget: Callable[[bytes], None]) -> None:
        self.peers = peers
        self.config = config
        self.counters = counters
        self.delivery = delivery
        self.silence_timeout_s = silence_timeout_s
        self.session_idle_s = session_idle_s
        self.max_sessions = max_sessions
        self._apply_events = apply_events
        self._forget = forget
        #: session key -> when it last had a draft, a follow-up or a verdict
        self.activity: dict[tuple[bytes, int], float] = {}

    def seen(self, key: tuple[bytes, int]) -> None:
        """The session ``key`` had work just now: it is in use."""
        self.activity[key] = time.monotonic()

    def ended(self, key: tuple[bytes, int]) -> None:
        """The session ``key`` is over: nothing left to reap."""
        self.activity.pop(key, None)

    def drop_peer(self, peer: bytes, reason: CloseReason) -> bool:
        """End ``peer``'s sessions and forget it (after its follow-up, if one is in
        the worker thread); whether there was such a peer to drop."""
        p = self.peers.get(peer)
        if p is None or p.gone is not None:
            return False
        if p.busy:
            p.gone = reason
            return True
        del self.peers[peer]
        p.dropped = True
        self._forget(peer)
        p.inbox.clear()
        p.inbox_bytes = 0
        self.delivery.forget(p)
        conn = p.conn
        if conn.sessions:
            log.info("peer %s %s: freeing %d sessions", bytes(peer).hex(), reason,
                     len(conn.sessions))
        self.counters["peers_dropped"] += 1
        self._apply_events(conn.drop(reason))
        return True

    def cut_off(self, peer: bytes, p: Peer | None) -> None:
        """``peer``'s CURVE key was revoked (xcosd/transport/revocation.py): each of
        its sessions is told so with a typed error (code ``curve``), then the
        connection itself, and the peer is dropped now, its waiting messages
        unread; its sessions end as a disconnected peer's do. The listener hears
        it no more."""
        self.counters["peers_revoked"] += 1
        why = "this device's key was revoked by the cloud's operator"
        sessions = sorted(p.conn.sessions) if p is not None else []
        farewell = [pack(Error(ErrorCode.CURVE, why, s=s)) for s in sessions]
        farewell.append(pack(Error(ErrorCode.CURVE, why)))
        log.info("peer %s: its key was revoked; ending %d sessions", bytes(peer).hex(),
                 len(sessions))
        if p is not None:
            self.drop_peer(peer, CloseReason.DISCONNECTED)
        self.delivery.farewell(peer, farewell)

    async def reap(self, now: float | None = None) -> int:
        """:meth:`CloudNode.reap <xcosd.nodes.CloudNode.reap>`: drop the silent
        peers and close the idle sessions as of ``now``; how many."""
        now = time.monotonic() if now is None else now
        cutoff = now - self.silence_timeout_s
        silent = [p for p in self.peers.values() if p.last_seen < cutoff]
        n = 0
        for p in silent:
            if not self.drop_peer(p.id, CloseReason.TIMEOUT):
                continue
            n += 1
            listener = self.delivery.listener
            if listener is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        await listener.close_peer(p.id)
        return n + self._reap_idle_sessions(now)

    def _reap_idle_sessions(self, now: float) -> int:
        short = self.config.sessions >= IDLE_PRESSURE * self.max_sessions
        cutoff = now - self.session_idle_s * (1.0 if short else IDLE_SLACK)
        n = 0
        for key in [k for k, t in self.activity.items() if t < cutoff]:
            p = self.peers.get(key[0])
            sess = p.conn.sessions.get(key[1]) if p is not None else None
            if p is None or sess is None:
                self.activity.pop(key, None)
                continue
            if p.busy or p.inbox or sess.phase is CloudPhase.SCORING:
                continue
            self.counters["sessions_idle_reaped"] += 1
            self._apply_events(p.conn.end(sess, CloseReason.TIMEOUT))
            n += 1
        return n

    async def run(self) -> None:
        """Reap every quarter of the shorter timeout (between 0.05 s and 1 s)."""
        period = max(0.05, min(1.0, min(self.silence_timeout_s, self.session_idle_s) / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap()
            except Exception:  # a bug must not stop the reaper
                self.counters["internal_errors"] += 1
                log.exception("reaping failed")


__all__ = ["IDLE_PRESSURE", "IDLE_SLACK", "Liveness"]
