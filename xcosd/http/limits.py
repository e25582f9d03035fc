"""What one HTTP client may hold of a server, and the count that enforces it.

A server's connections are a shared resource: a client that opens many and sends
nothing, or sends a head or a body a byte at a time, or stops reading what it asked
for, holds them without doing anything with them. :class:`ConnectionLimits` names
every bound the server puts on that (:mod:`xcosd.http.protocol` enforces them), and
:class:`AddressSlots` counts connections per client address and in all, so that a
client over its share is refused the moment it connects while other addresses are
still served.

An IPv6 client is counted by its /64 prefix: one host is usually given a whole /64
and can pick any address in it, so counting single addresses would give it no cap
at all. An IPv4 client (or an IPv4-mapped IPv6 one) is counted by its address.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds an :class:`~xcosd.http.HttpServer` puts on its clients. The
    defaults are meant for a server on the open internet."""

    #: connections served at once, from all clients; one more is refused (503)
    max_connections: int = 256
    #: connections one client address (an IPv6 /64) may hold; one more is refused (429)
    max_per_address: int = 64
    #: seconds a request's whole head may take to arrive, from the connection's
    #: opening or the previous response's end (not a deadline per read: a head
    #: trickled a byte at a time is dropped all the same); past it: 408, closed
    head_timeout_s: float = 10.0
    #: seconds a request's whole body may take to arrive once its head has; past it:
    #: 408 (if no response has started), closed
    body_timeout_s: float = 30.0
    #: bytes of a response the server buffers for a client that does not read them
    #: (the transport's high-water mark); past it the response waits for the client
    write_buffer_bytes: int = 64 << 10
    #: seconds a response may wait with its buffer full; past it the client is
    #: dropped (a streamed generation is cancelled with its connection)
    write_timeout_s: float = 10.0
    #: bytes of a request head still incomplete (400 past it)
    max_head_bytes: int = 64 << 10
    #: seconds an idle keep-alive connection is kept
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_address", "write_buffer_bytes",
                     "max_head_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("head_timeout_s", "body_timeout_s", "write_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


def address_key(host: str | None) -> str:
    """The key a client is counted under: its IPv4 address, or its IPv6 /64."""
    if host is None:  # a Unix socket: one local client
        return "local"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class AddressSlots:
    """Connections held per client address (:func:`address_key`) and in all.

    :meth:`refusal` says whether a connection from an address would be refused,
    :meth:`take` holds a slot for one admitted and :meth:`give` returns it."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.held: dict[str, int] = {}
        self.total = 0
        #: connections refused since the start, and those refused still open (kept
        #: a moment to read their request: xcosd/http/protocol.py)
        self.refused = 0
        self.lingering = 0

    def refusal(self, host: str | None) -> int | None:
        """The status a connection from ``host`` is refused with now (503: the
        server is full, else 429: its address is at its cap), or ``None``."""
        if self.total >= self.limits.max_connections:
            return 503
        if self.held.get(address_key(host), 0) >= self.limits.max_per_address:
            return 429
        return None

    def take(self, host: str | None) -> str:
        """Hold a slot for a connection from ``host``; returns the key to give back."""
        key = address_key(host)
        self.held[key] = self.held.get(key, 0) + 1
        self.total += 1
        return key

    def give(self, key: str) -> None:
        n = self.held.get(key, 0) - 1
        if n > 0:
            self.held[key] = n
        else:
            self.held.pop(key, None)
        self.total -= 1
