"""Transports: ZeroMQ, raw TCP and an in-memory pair behind one async interface.

``listen`` (cloud) and ``connect`` (edge) pick the implementation by name;
``tcp://127.0.0.1:0`` binds a free port and the listener's ``.endpoint`` says which.
Options common to all: ``meter=`` (a :class:`Meter` to count into) and, for
ZeroMQ and TCP, ``limits=`` (a :class:`~xcosd.wire.frames.Limits`). ZeroMQ also
takes ``hwm``, ``heartbeat_ivl``, ``heartbeat_timeout``, ``copy_threshold`` and
``curve=`` (:class:`CurveServer` to listen, :class:`CurveClient` to connect).

``listen(broker_back_end, transport="replica")`` serves as one replica behind a
:class:`~xcosd.nodes.broker.Broker` (:mod:`xcosd.transport.replica`); edges connect
to the broker's front end with ``zmq``, so there is no ``replica`` connection. A
replica is the client of the broker's back end: its ``curve=`` is a
:class:`CurveClient` (its key pair and the back end's public key).
"""

from __future__ import annotations

from typing import Any

from ..errors import TransportError
from .base import Connection, Frames, Listener
from .curve import CurveClient, CurveServer, KeyPair, load_allowlist
from .link import LinkConnection, LinkListener, LinkSpec, message_latency, sequence_latency
from .meter import Meter, Tally

TRANSPORTS = ("zmq", "tcp", "memory")
#: cloud-side only: a replica behind a broker
LISTEN_ONLY = ("replica",)


def _kind(endpoint: str, transport: str) -> str:
    if transport in LISTEN_ONLY:
        return transport
    if endpoint.startswith("mem://"):
        return "memory"
    if transport not in TRANSPORTS:
        raise TransportError(f"unknown transport {transport!r}; known: {TRANSPORTS}",
                             code="endpoint")
    return transport


async def listen(endpoint: str, transport: str = "zmq", **opts: Any) -> Listener:
    """Bind a cloud-side listener (``transport``: ``zmq``, ``tcp`` or ``memory``), or,
    with ``replica``, connect to a broker's back end as one of its replicas."""
    kind = _kind(endpoint, transport)
    if kind == "replica":
        from .replica import ReplicaListener

        curve = opts.get("curve")
        if curve is not None and not isinstance(curve, CurveClient):
            raise TransportError("a replica connects to the broker's back end: its curve= is "
                                 "a CurveClient (its key pair and the back end's public key)",
                                 code="curve")
        return await ReplicaListener.open(endpoint, **opts)
    if kind == "zmq":
        from .zeromq import ZmqListener

        return ZmqListener(endpoint, **opts)
    if kind == "tcp":
        from .tcp import TcpListener

        return await TcpListener.bind(endpoint, **opts)
    from .memory import memory_listen

    return memory_listen(endpoint, **opts)


async def connect(endpoint: str, transport: str = "zmq", **opts: Any) -> Connection:
    """Connect an edge-side connection to a listener's endpoint."""
    kind = _kind(endpoint, transport)
    if kind in LISTEN_ONLY:
        raise TransportError(f"there is no {kind!r} connection: edges connect to the broker "
                             "with 'zmq'", code="endpoint")
    if kind == "zmq":
        from .zeromq import ZmqConnection

        return ZmqConnection(endpoint, **opts)
    if kind == "tcp":
        from .tcp import TcpConnection

        return await TcpConnection.open(endpoint, **opts)
    from .memory import memory_connect

    return memory_connect(endpoint, **opts)


__all__ = [
    "LISTEN_ONLY",
    "TRANSPORTS",
    "Connection",
    "CurveClient",
    "CurveServer",
    "Frames",
    "KeyPair",
    "LinkConnection",
    "LinkListener",
    "LinkSpec",
    "Listener",
    "Meter",
    "Tally",
    "connect",
    "listen",
    "load_allowlist",
    "message_latency",
    "sequence_latency",
]
