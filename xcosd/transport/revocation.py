"""Which CURVE key each ZeroMQ peer holds, so that revoking a key ends its live
connections and not only its next handshake.

ZeroMQ checks a key once, at the CURVE handshake (through the ZAP handler), and
a ROUTER has no way to close one peer's connection. What it does give is the
key: the ZAP handler's User-Id (pyzmq's is the key in Z85) rides on every frame
received from that connection. :class:`PeerKeys` notes it from each peer's first
frame; when its :class:`~xcosd.transport.curve.CurveServer` says keys were
revoked, every peer holding one is reported gone (the node ends its sessions) and
everything it sends after is dropped unread. The device, hearing nothing more,
loses the connection, and its next handshake is refused.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

from .curve import CurveServer

#: what a listener reports: a peer's message, or ``None`` once the peer is gone
Received = tuple[bytes, list[bytes] | None]


class PeerKeys:
    """The CURVE key of each peer of one listener, and the peers whose key left.

    ``on_gone()`` is called after a revocation reported peers gone (the listener
    wakes its receiver, which reports :attr:`backlog`)."""

    def __init__(self, curve: CurveServer, on_gone: Callable[[], None]) -> None:
        self.curve = curve
        self.on_gone = on_gone
        self._keys: dict[bytes, bytes] = {}
        self._revoked: set[bytes] = set()
        #: peers to report gone, before the next message
        self.backlog: deque[Received] = deque()
        curve.watch(self._on_revoked)

    def note(self, peer: bytes, frame: Any) -> None:
        """Learn ``peer``'s key from its message's first frame (a ``zmq.Frame``)."""
        if peer not in self._keys and peer not in self._revoked:
            with contextlib.suppress(Exception):  # no ZAP (a plaintext socket): no key
                self._keys[peer] = str(frame.get("User-Id")).encode()

    def refuses(self, peer: bytes) -> bool:
        """Whether a message from ``peer`` is to be dropped: its key was revoked.
        A key revoked before its peer's first message was noted is found here."""
        if peer in self._revoked:
            return True
        key = self._keys.get(peer)
        if key is not None and not self.curve.admitted(key):
            self._revoke_peer(peer)
            return True
        return False

    def revoked(self, peer: bytes) -> bool:
        """Whether ``peer`` was cut off because its key was revoked."""
        return peer in self._revoked

    def key(self, peer: bytes) -> bytes | None:
        """``peer``'s CURVE public key (Z85), once it sent something."""
        return self._keys.get(peer)

    def forget(self, peer: bytes) -> None:
        """``peer`` is gone; a revoked one stays refused (it may still send)."""
        self._keys.pop(peer, None)

    def close(self) -> None:
        self.curve.unwatch(self._on_revoked)

    def _on_revoked(self, keys: frozenset[bytes]) -> None:
        hit = [p for p, k in self._keys.items() if k in keys and p not in self._revoked]
        for peer in hit:
            self._revoke_peer(peer)
        if hit:
            self.on_gone()

    def _revoke_peer(self, peer: bytes) -> None:
        self._revoked.add(peer)
        self._keys.pop(peer, None)
        self.backlog.append((peer, None))
