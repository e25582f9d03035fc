"""``Broker``: many target replicas behind one endpoint.

A target replica holds the KV caches of its sessions, so an edge connection must
keep talking to the replica that has them. The broker is the ZeroMQ guide's
load-balancing broker with affinity, kept alive by the "Paranoid Pirate" heartbeats:

* a public **front-end ROUTER**: edges connect there with the ordinary ZeroMQ
  transport, unchanged;
* a **back-end ROUTER**: each replica (a :class:`~xcosd.nodes.CloudNode` on the
  ``replica`` transport, :mod:`xcosd.transport.replica`) connects a DEALER, says
  ``READY`` and heartbeats; the broker heartbeats back and forgets a replica that is
  silent for ``replica_timeout_s``, that it can no longer route to (its connection
  closed: the process died) or that says ``BYE``.

The first message of an edge connection (its ZeroMQ routing id) pins it to the
replica with the fewest pinned edges; from then on its frames go there and only
there, with the routing id as an envelope frame, and only that replica's answers
reach it. The broker reads nothing past the envelope: frames are forwarded as
received, without a copy. When a replica goes, its edges are unpinned; an edge's
next message (at the latest its next ping) pins it to a live replica, which does
not know the connection and answers the protocol's ``handshake`` error. The edge
then connects again (a new routing id, pinned afresh) and resumes every generation
from its committed tokens, so no token is lost or repeated (docs/PROTOCOL.md,
"Faults"). Answers a replica sends for an edge no longer pinned to it are dropped
(and the replica told ``GONE``): an edge never hears two replicas on one connection.

Bounds: the broker keeps no queue of its own except the few messages that arrive
while no replica is registered (at most ``max_parked`` messages and
``max_parked_bytes``, each for at most ``park_s``; the queue is flushed when a
replica registers). Everything else waits in ZeroMQ's pipes, bounded by the
high-water marks; a message for a full pipe is dropped and counted, which the edge
recovers from as from any lost message (it asks again with the same ``seq``).
Every socket call is non-blocking and the poll has a timeout, so the broker thread
never waits on anyone and :meth:`Broker.close` returns within about
:data:`CLOSE_TIMEOUT_S`.

The broker runs in its own thread with its own ZeroMQ context, so forwarding does
not wait for the caller's event loop (``poll`` releases the GIL). Edges pinned to
a replica are forgotten after ``edge_timeout_s`` of silence (edges ping every
second), and the replica is told ``GONE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import zmq

from ..errors import TransportError
from ..transport.curve import REPLICA_ZAP_DOMAIN, ZAP_DOMAIN, CurveServer, apply_server
from ..transport.io_threads import batch_io_threads
from ..transport.replica import (
    BYE,
    DATA,
    GONE,
    HEARTBEAT,
    HEARTBEAT_IVL,
    HEARTBEAT_TIMEOUT,
    PROTOCOL,
    READY,
    RESET,
)

log = logging.getLogger(__name__)

#: messages read from one socket before the other gets its turn
BURST = 64
#: the longest poll: how soon the thread sees a close request when idle
POLL_S = 0.05
#: :meth:`Broker.close` returns within about this long
CLOSE_TIMEOUT_S = 3.0
#: the largest frame a replica may send (an edge refuses larger messages itself)
MAX_BACK_FRAME = 256 << 20

_Frames = Sequence[Any]

# what a send to a replica did
_SENT, _FULL, _GONE = 0, 1, 2


class _Replica:
    __slots__ = ("edges", "id", "joined", "last_seen", "pinned_total", "to_edges", "to_replica")

    def __init__(self, rid: bytes, now: float) -> None:
        self.id = rid
        self.edges: set[bytes] = set()
        self.joined = now
        self.last_seen = now
        #: edges ever pinned here: breaks ties between equally loaded replicas
        self.pinned_total = 0
        self.to_replica = 0
        self.to_edges = 0


class _Edge:
    __slots__ = ("last_seen", "replica")

    def __init__(self, replica: bytes, now: float) -> None:
        self.replica = replica
        self.last_seen = now


class Broker:
    """Forward edge connections to replicas, each pinned to one (see the module
    docstring). An async context manager; the forwarding runs in its own thread.

    ``front``: the endpoint edges connect to (``tcp://0.0.0.0:5555``); ``back``: the
    endpoint replicas connect to (``tcp://127.0.0.1:0`` picks a free port; read
    :attr:`back_endpoint`). ``heartbeat_s``: heartbeats to replicas;
    ``replica_timeout_s``: silence after which a replica is forgotten;
    ``edge_timeout_s``: silence after which an edge is unpinned. ``max_edges``:
    pinned edges at most (messages of further new edges are dropped). ``hwm``: the
    per-edge pipe bound, ``back_hwm`` the per-replica one. ``max_message_bytes``: the
    largest frame an edge may send (ZeroMQ drops a peer that sends more, as on a
    plain cloud). ``curve``: a :class:`~xcosd.transport.CurveServer` for the front
    end (its allowlist: device keys). ``back_curve``: one for the back end (its
    allowlist: the replica keys that may join; ``back_curve.admit`` adds one while
    serving). Without it the back end is plain ZeroMQ, and whoever reaches it can
    join as a replica and answer edges: keep it on loopback or a trusted network,
    or turn it on.
    """

    def __init__(self, front: str = "tcp://127.0.0.1:5555", back: str = "tcp://127.0.0.1:0",
                 *, heartbeat_s: float = HEARTBEAT_IVL,
                 replica_timeout_s: float = HEARTBEAT_TIMEOUT,
                 edge_timeout_s: float = 60.0, max_edges: int = 1 << 16,
                 hwm: int = 1000, back_hwm: int = 10_000, max_parked: int = 1024,
                 max_parked_bytes: int = 64 << 20, park_s: float = 10.0,
                 max_message_bytes: int = 16 << 20,
                 curve: CurveServer | None = None,
                 back_curve: CurveServer | None = None) -> None:
        if heartbeat_s <= 0 or replica_timeout_s <= heartbeat_s:
            raise ValueError("need 0 < heartbeat_s < replica_timeout_s, got "
                             f"{heartbeat_s} and {replica_timeout_s}")
        if max_edges < 1 or max_parked < 0:
            raise ValueError("max_edges must be >= 1 and max_parked >= 0")
        self.front = front
        self.back = back
        self.heartbeat_s = heartbeat_s
        self.replica_timeout_s = replica_timeout_s
        self.edge_timeout_s = edge_timeout_s
        self.max_edges = max_edges
        self.hwm = hwm
        self.back_hwm = back_hwm
        self.max_parked = max_parked
        self.max_parked_bytes = max_parked_bytes
        self.park_s = park_s
        self.max_message_bytes = max_message_bytes
        self.curve = curve
        self.back_curve = back_curve
        self._ctx: zmq.Context[Any] | None = None
        self._auth: Any = None
        self._front: zmq.Socket[Any] | None = None
        self._back: zmq.Socket[Any] | None = None
        self._front_endpoint = ""
        self._back_endpoint = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: held by the thread while it changes the tables; stats() reads under it
        self._lock = threading.Lock()
        self._replicas: dict[bytes, _Replica] = {}
        #: edge routing id -> its replica, least recently heard first
        self._edges: OrderedDict[bytes, _Edge] = OrderedDict()
        self._parked: deque[tuple[float, bytes, _Frames, int]] = deque()
        self._parked_bytes = 0
        self._started_at = 0.0
        self._closed = False
        self.counters: dict[str, Any] = {
            "from_edges": 0, "to_replicas": 0, "from_replicas": 0, "to_edges": 0,
            "replicas_joined": 0, "replicas_lost": {}, "edges_pinned": 0,
            "edges_unpinned": 0, "edges_expired": 0, "edges_unreachable": 0,
            "parked": 0, "dropped_replica_full": 0, "dropped_edge_full": 0,
            "dropped_stale": 0, "dropped_no_replica": 0, "dropped_edges_full": 0,
            "resets_sent": 0, "bad_messages": 0,
        }

    # -- lifecycle -------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The front end's bound endpoint (edges connect here)."""
        return self.front_endpoint

    @property
    def front_endpoint(self) -> str:
        if not self._front_endpoint:
            raise TransportError("the broker is not started", code="closed")
        return self._front_endpoint

    @property
    def back_endpoint(self) -> str:
        """The back end's bound endpoint (replicas connect here)."""
        if not self._back_endpoint:
            raise TransportError("the broker is not started", code="closed")
        return self._back_endpoint

    def _socket(self, hwm: int, max_frame: int) -> zmq.Socket[Any]:
        assert self._ctx is not None
        s = self._ctx.socket(zmq.ROUTER)
        s.linger = 0
        s.sndhwm = hwm
        s.rcvhwm = hwm
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.MAXMSGSIZE, max_frame)
        s.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.replica_timeout_s * 1000))
        s.setsockopt(zmq.HEARTBEAT_TTL, int(self.replica_timeout_s * 1000))
        return s

    @staticmethod
    def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            code = "address_in_use" if e.errno == zmq.EADDRINUSE else "bind"
            raise TransportError(f"cannot bind {endpoint}: {e}", code=code) from e
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)

    async def start(self) -> Broker:
        """Bind both ends (here, so a bad endpoint raises here) and start forwarding."""
        if self._thread is not None or self._closed:
            raise RuntimeError("a broker starts once")
        self._ctx = zmq.Context()
        batch_io_threads(self._ctx)
        try:
            self._front = self._socket(self.hwm, self.max_message_bytes)
            self._back = self._socket(self.back_hwm, MAX_BACK_FRAME)
            if self.curve is not None or self.back_curve is not None:
                from zmq.auth.thread import ThreadAuthenticator

                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
            # each end its own ZAP domain and allowlist: a device key admits no
            # replica, a replica key no device
            for sock, curve, domain in ((self._front, self.curve, ZAP_DOMAIN),
                                        (self._back, self.back_curve, REPLICA_ZAP_DOMAIN)):
                if curve is not None:
                    self._auth.configure_curve_callback(domain=domain,
                                                        credentials_provider=curve)
                    apply_server(sock, curve, domain)
            self._front_endpoint = self._bind(self._front, self.front)
            self._back_endpoint = self._bind(self._back, self.back)
        except BaseException:
            self._release_sockets()
            self._release_context()
            raise
        self._started_at = time.monotonic()
        # the sockets move to the broker thread now; nothing else touches them again
        self._thread = threading.Thread(target=self._run, name="xcosd-broker", daemon=True)
        self._thread.start()
        log.info("broker: edges on %s, replicas on %s", self._front_endpoint,
                 self._back_endpoint)
        return self

    async def close(self) -> None:
        """Stop forwarding and release the sockets; idempotent, bounded."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None:
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            while t.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            if t.is_alive():  # cannot happen: every call in the thread is bounded
                log.error("the broker thread did not stop within %.1fs", CLOSE_TIMEOUT_S)
                return
        else:
            self._release_sockets()
        self._release_context()

    def _release_sockets(self) -> None:
        for s in (self._front, self._back):
            if s is not None:
                s.close(linger=0)
        self._front = self._back = None

    def _release_context(self) -> None:
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> Broker:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- the broker thread ------------------------------------------------------

    def _run(self) -> None:
        front, back = self._front, self._back
        assert front is not None and back is not None
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        next_tick = time.monotonic() + self.heartbeat_s
        try:
            while not self._stop.is_set():
                wait = min(POLL_S, max(0.0, next_tick - time.monotonic()))
                ready = dict(poller.poll(int(wait * 1000)))
                with self._lock:
                    # each side gets a bounded turn: neither a flooding edge nor a
                    # chatty replica can hold the other side back
                    if back in ready:
                        self._drain_back(back)
                    if front in ready:
                        self._drain_front(front)
                    now = time.monotonic()
                    if now >= next_tick:
                        self._tick(now)
                        next_tick = now + self.heartbeat_s
        except Exception:  # a bug must not leave the sockets open
            log.exception("the broker thread failed")
        finally:
            self._release_sockets()

    def _drain_front(self, front: zmq.Socket[Any]) -> None:
        for _ in range(BURST):
            try:
                msg = front.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(msg) < 2:
                continue
            self.counters["from_edges"] += 1
            self._from_edge(msg[0].bytes, msg[1:], time.monotonic())

    def _from_edge(self, edge: bytes, frames: _Frames, now: float) -> None:
        """Forward one edge message to its replica, pinning the edge first if it has
        none (or its replica is gone)."""
        e = self._edges.get(edge)
        if e is not None:
            e.last_seen = now
            self._edges.move_to_end(edge)
        # bounded: each pass either delivers or removes a replica
        for _ in range(len(self._replicas) + 1):
            if e is None:
                rid = self._least_loaded()
                if rid is None:
                    self._park(edge, frames, now)
                    return
                if len(self._edges) >= self.max_edges:
                    self._expire_edges(now)
                    if len(self._edges) >= self.max_edges:
                        self.counters["dropped_edges_full"] += 1
                        return
                e = self._pin(edge, rid, now)
            sent = self._send_back(e.replica, [e.replica, DATA, edge, *frames])
            if sent == _SENT:
                self._replicas[e.replica].to_replica += 1
                self.counters["to_replicas"] += 1
                return
            if sent == _FULL:
                # dropped and counted; the edge asks again with the same seq
                self.counters["dropped_replica_full"] += 1
                return
            e = None  # the replica went away just now: pin the edge elsewhere

    def _send_back(self, rid: bytes, msg: list[Any]) -> int:
        """Send to a replica without waiting: :data:`_SENT`, :data:`_FULL` (its pipe
        is at the high-water mark) or :data:`_GONE` (it is gone: forgotten here)."""
        assert self._back is not None
        try:
            self._back.send_multipart(msg, zmq.NOBLOCK, copy=False)
            return _SENT
        except zmq.Again:
            return _FULL
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._lose_replica(rid, "unreachable")
        return _GONE

    def _least_loaded(self) -> bytes | None:
        if not self._replicas:
            return None
        return min(self._replicas.values(), key=lambda r: (len(r.edges), r.pinned_total)).id

    def _pin(self, edge: bytes, rid: bytes, now: float) -> _Edge:
        r = self._replicas[rid]
        r.edges.add(edge)
        r.pinned_total += 1
        e = self._edges[edge] = _Edge(rid, now)
        self._edges.move_to_end(edge)
        self.counters["edges_pinned"] += 1
        return e

    def _unpin(self, edge: bytes, *, tell: bool) -> None:
        e = self._edges.pop(edge, None)
        if e is None:
            return
        r = self._replicas.get(e.replica)
        if r is not None:
            r.edges.discard(edge)
            if tell:
                self._send_back(r.id, [r.id, GONE, edge])

    def _park(self, edge: bytes, frames: _Frames, now: float) -> None:
        """No replica yet: keep the message (bounded) until one registers."""
        n = sum(len(f) for f in frames)
        if (len(self._parked) >= self.max_parked
                or self._parked_bytes + n > self.max_parked_bytes):
            self.counters["dropped_no_replica"] += 1
            return
        self._parked.append((now, edge, frames, n))
        self._parked_bytes += n
        self.counters["parked"] += 1

    def _drain_back(self, back: zmq.Socket[Any]) -> None:
        c = self.counters
        for _ in range(BURST):
            try:
                msg = back.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            now = time.monotonic()
            rid = msg[0].bytes
            cmd = msg[1].bytes if len(msg) > 1 else b""
            if cmd == READY:
                if len(msg) == 3 and msg[2].bytes == PROTOCOL:
                    self._join(rid, now)
                else:
                    c["bad_messages"] += 1
                    log.warning("broker: replica %s speaks another protocol", rid.hex())
                continue
            r = self._replicas.get(rid)
            if r is None:
                # forgotten (silent too long) or from before a broker restart: it
                # drops its edges and registers again
                if cmd != BYE:
                    c["resets_sent"] += 1
                    with contextlib.suppress(zmq.ZMQError):
                        back.send_multipart([rid, RESET], zmq.NOBLOCK)
                continue
            r.last_seen = now
            if cmd == DATA and len(msg) >= 4:
                c["from_replicas"] += 1
                self._to_edge(r, msg[2].bytes, msg[3:])
            elif cmd == BYE:
                self._lose_replica(rid, "bye")
            elif cmd != HEARTBEAT:
                c["bad_messages"] += 1

    def _to_edge(self, r: _Replica, edge: bytes, frames: _Frames) -> None:
        assert self._front is not None
        e = self._edges.get(edge)
        if e is None or e.replica != r.id:
            # the edge was moved to another replica (or is gone): never let it
            # hear two replicas on one connection
            self.counters["dropped_stale"] += 1
            self._send_back(r.id, [r.id, GONE, edge])
            return
        try:
            self._front.send_multipart([edge, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters["dropped_edge_full"] += 1
            return
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            self.counters["edges_unreachable"] += 1
            self._unpin(edge, tell=True)
            return
        r.to_edges += 1
        self.counters["to_edges"] += 1

    def _join(self, rid: bytes, now: float) -> None:
        old = self._replicas.get(rid)
        if old is not None:
            # registering again means it dropped its edges: move them on
            self._lose_replica(rid, "re-registered")
        self._replicas[rid] = _Replica(rid, now)
        self.counters["replicas_joined"] += 1
        log.info("broker: replica %s joined (%d live)", rid.hex(), len(self._replicas))
        self._send_back(rid, [rid, HEARTBEAT])
        parked, self._parked = self._parked, deque()
        self._parked_bytes = 0
        for t, edge, frames, _n in parked:
            if now - t <= self.park_s:
                self._from_edge(edge, frames, now)
            else:
                self.counters["dropped_no_replica"] += 1

    def _lose_replica(self, rid: bytes, why: str) -> None:
        r = self._replicas.pop(rid, None)
        if r is None:
            return
        for edge in r.edges:
            # the edge's next message pins it to a live replica, which answers
            # "handshake": the edge then resumes its generations there
            self._edges.pop(edge, None)
        self.counters["edges_unpinned"] += len(r.edges)
        lost = self.counters["replicas_lost"]
        lost[why] = lost.get(why, 0) + 1
        # a goodbye is planned; anything else is a fault an operator wants to see
        log.log(logging.INFO if why == "bye" else logging.WARNING,
                "broker: replica %s gone (%s); %d edges to move, %d replicas left",
                rid.hex(), why, len(r.edges), len(self._replicas))

    def _expire_edges(self, now: float) -> None:
        cutoff = now - self.edge_timeout_s
        while self._edges:
            edge, e = next(iter(self._edges.items()))
            if e.last_seen >= cutoff:
                break
            self.counters["edges_expired"] += 1
            self._unpin(edge, tell=True)

    def _tick(self, now: float) -> None:
        """Heartbeats out; silent replicas, silent edges and stale parked messages out."""
        for r in list(self._replicas.values()):
            if now - r.last_seen > self.replica_timeout_s:
                self._lose_replica(r.id, "timeout")
            else:
                self._send_back(r.id, [r.id, HEARTBEAT])
        self._expire_edges(now)
        while self._parked and now - self._parked[0][0] > self.park_s:
            _t, _edge, _frames, n = self._parked.popleft()
            self._parked_bytes -= n
            self.counters["dropped_no_replica"] += 1

    # -- stats --------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, and per replica (by routing id, hex) its pinned edges and traffic."""
        now = time.monotonic()
        with self._lock:
            c = dict(self.counters)
            c["replicas_lost"] = dict(self.counters["replicas_lost"])
            replicas = {r.id.hex(): {"edges": len(r.edges), "to_replica": r.to_replica,
                                     "to_edges": r.to_edges,
                                     "silent_s": round(now - r.last_seen, 3),
                                     "up_s": round(now - r.joined, 3)}
                        for r in self._replicas.values()}
            edges, parked, parked_bytes = len(self._edges), len(self._parked), self._parked_bytes
        return {"front": self._front_endpoint, "back": self._back_endpoint,
                "uptime_s": now - self._started_at if self._started_at else 0.0,
                "replicas_live": len(replicas), "replicas": replicas, "edges": edges,
                "parked_now": parked, "parked_bytes": parked_bytes, **c}

    def pinned(self) -> dict[bytes, bytes]:
        """Edge routing id -> replica routing id, for every pinned edge."""
        with self._lock:
            return {k: e.replica for k, e in self._edges.items()}


__all__ = ["BURST", "CLOSE_TIMEOUT_S", "Broker"]
