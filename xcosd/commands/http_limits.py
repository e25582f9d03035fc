"""The options that bound what one HTTP client may hold of ``xcosd edge serve``
(:class:`xcosd.http.ConnectionLimits`), defined once with their defaults.

The defaults are for a server on the open internet: the connections in all scale
with ``--max-in-flight`` (a streamed request holds one for its whole generation,
and some more are kept for requests being read or refused), one address may hold
as many as there are generations (so one client can use every slot, but can never
take every connection), and every deadline is long enough for a slow honest
client and short enough that a stalled one frees its place soon.
"""

from __future__ import annotations

import argparse
from typing import Any

from .options import positive_float, positive_int


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP client limits (with --http; docs/API.md)")
    g.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="connections at once from all clients; one more is refused with "
                        "503 as it connects (default: 4 x --max-in-flight + 16)")
    g.add_argument("--max-connections-per-address", type=positive_int, default=None,
                   metavar="N",
                   help="connections one client address (an IPv6 /64) may hold; one more is "
                        "refused with 429 as it connects (default: --max-in-flight)")
    g.add_argument("--head-timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds a request's whole head may take (from the connection's "
                        "opening or the previous response); past it: 408, closed")
    g.add_argument("--body-timeout", type=positive_float, default=30.0, metavar="S",
                   help="seconds a request's whole body may take once its head has "
                        "arrived; past it: 408, closed")
    g.add_argument("--write-buffer-kib", type=positive_int, default=64, metavar="KIB",
                   help="KiB of a response buffered for a client that does not read it")
    g.add_argument("--write-timeout", type=positive_float, default=10.0, metavar="S",
                   help="seconds a response may wait with that buffer full before its "
                        "client is dropped (a streamed generation ends with it)")


def connection_limits(args: argparse.Namespace) -> Any:
    """The :class:`xcosd.http.ConnectionLimits` the options describe."""
    from ..http import ConnectionLimits

    total = args.max_connections or 4 * args.max_in_flight + 16
    return ConnectionLimits(
        max_connections=total,
        max_per_address=min(total, args.max_connections_per_address or args.max_in_flight),
        head_timeout_s=args.head_timeout, body_timeout_s=args.body_timeout,
        write_buffer_bytes=args.write_buffer_kib << 10, write_timeout_s=args.write_timeout)
