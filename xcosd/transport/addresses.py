"""Where an edge connects: one endpoint or several, a host name with several
addresses, tried in turn with jittered backoff.

An edge's ``connect`` may name several endpoints, comma-separated
(``tcp://10.0.0.1:5555,tcp://10.0.0.2:5555``), and a ``tcp://`` endpoint's host may
be a name that resolves to several addresses (a headless Kubernetes Service, a
round-robin DNS record). Every address is a cloud that serves the same target,
and every reconnect resumes exactly (docs/PROTOCOL.md, "Faults"), so any of them
will do: the edge takes one, and after a loss the next.

:class:`Addresses` is the order, without I/O: the first pass starts at an offset
drawn at random (edges spread over the addresses), and each later attempt takes
the address after the last one tried, so a cloud that left (drained, killed) is
not asked first again. :class:`Backoff` is the pause after a pass in which none
answered: exponential, capped, with "equal jitter" (half the delay fixed, half
drawn), so edges that lost the same cloud at the same moment do not come back in
lockstep. :func:`resolve` expands host names (the only I/O here).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from collections.abc import Sequence

from ..errors import TransportError


def split_endpoints(spec: str) -> list[str]:
    """The endpoints of a comma-separated ``spec`` (blanks dropped, order kept)."""
    out = [part.strip() for part in spec.split(",")]
    out = [p for p in out if p]
    if not out:
        raise TransportError(f"no endpoint in {spec!r}", code="endpoint")
    return out


def _host_port(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://HOST:PORT`` endpoint whose host is a name (not
    an address literal); ``None`` for anything else."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or host.startswith("["):
        return None
    try:
        ipaddress.ip_address(host)
        return None  # already an address
    except ValueError:
        pass
    if host == "*" or not port.isdigit():
        return None
    return host, int(port)


async def resolve(spec: str, *, ipv6: bool = True) -> list[str]:
    """Every address ``spec`` names: its endpoints in order, a host name expanded
    to one endpoint per distinct address (IPv4 first; IPv6 too when ``ipv6``). A
    name that does not resolve is left as it is (the connection then says why)."""
    out: list[str] = []
    loop = asyncio.get_running_loop()
    for ep in split_endpoints(spec):
        hp = _host_port(ep)
        if hp is None:
            out.append(ep)
            continue
        host, port = hp
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            out.append(ep)
            continue
        seen: list[str] = []
        for family, *_rest, addr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
            if family == socket.AF_INET:
                name = f"tcp://{addr[0]}:{port}"
            elif family == socket.AF_INET6 and ipv6:
                name = f"tcp://[{addr[0]}]:{port}"
            else:
                continue
            if name not in seen:
                seen.append(name)
        out.extend(seen or [ep])
    return out


class Addresses:
    """The order in which an edge tries its addresses (module docstring).
    ``rng`` draws the first pass's starting offset (seed it to repeat); ``start``
    gives it instead (a benchmark spreading its devices evenly)."""

    def __init__(self, addresses: Sequence[str], rng: random.Random | None = None,
                 start: int | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._list: list[str] = []
        self._next = 0
        self._started = False
        self.update(addresses)
        if start is not None:
            self._started = True
            self._next = start % len(self._list)

    @property
    def addresses(self) -> list[str]:
        return list(self._list)

    def update(self, addresses: Sequence[str]) -> None:
        """A fresh resolution: keep the turn's place when the list is the same."""
        if not addresses:
            raise TransportError("no address to connect to", code="endpoint")
        if list(addresses) != self._list:
            current = self._list[self._next % len(self._list)] if self._list else None
            self._list = list(addresses)
            self._next = self._list.index(current) if current in self._list else 0

    def pass_(self) -> list[str]:
        """The addresses of the next pass, in order: every address once, the first
        pass from a random one, each later pass from the one after the address the
        previous attempt ended on."""
        n = len(self._list)
        if not self._started:
            self._started = True
            self._next = self._rng.randrange(n)
        start = self._next
        return [self._list[(start + i) % n] for i in range(n)]

    def tried(self, address: str) -> None:
        """``address`` was used (connected, or failed): the next pass starts after it."""
        if address in self._list:
            self._next = (self._list.index(address) + 1) % len(self._list)


class Backoff:
    """Exponential backoff with equal jitter: the ``k``-th pause is drawn uniformly
    from ``[d / 2, d]`` with ``d = min(cap_s, base_s * 2**k)``; :meth:`reset` after a
    success."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 1.0,
                 rng: random.Random | None = None) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {base_s}, {cap_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng if rng is not None else random.Random()
        self._k = 0

    def next(self) -> float:
        d = min(self.cap_s, self.base_s * 2 ** min(self._k, 30))
        self._k += 1
        return d / 2 + self._rng.random() * d / 2

    def reset(self) -> None:
        self._k = 0


__all__ = ["Addresses", "Backoff", "resolve", "split_endpoints"]
