"""``CloudNode``: the target side of xcosd, an async context manager that runs in
the caller's event loop.

It binds a listener (ZeroMQ by default, raw TCP or in-memory on request, with an
optional link emulator and CURVE), feeds every received message through the
sans-I/O :class:`~xcosd.protocol.CloudConnection` of its peer, and hands the
"needs scoring" work to the batching :class:`~xcosd.nodes.scheduler.Scheduler`.
Three tasks run while it is open (receive, schedule, reap silent peers), plus an
optional Prometheus endpoint; all of them, the worker thread and the socket are
gone when the ``async with`` block exits. It never calls ``asyncio.run``.

Hostile input: the size limit is checked before anything is decoded, every
defect is answered with a typed error to that peer (or dropped and counted when
no answer is possible, e.g. a peer that does not read), and no other session is
touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from types import TracebackType
from typing import Any

from ..errors import ProtocolError, TransportError
from ..models.base import LanguageModel
from ..protocol import pack
from ..protocol.cloud import (
    CloseReason,
    CloudConfig,
    CloudConnection,
    CloudSession,
    Output,
    Rejected,
    RoundOutcome,
    RoundVerified,
    ScoreNeeded,
    SessionClosed,
    SessionOpened,
)
from ..protocol.messages import (
    MAX_HEADER_BYTES,
    DraftMsg,
    Message,
    ServerLimits,
    from_wire,
    session_of,
)
from ..transport import LinkListener, LinkSpec, Listener, listen
from ..wire.frames import Limits, decode_message
from .scheduler import BatchStats, Scheduler

log = logging.getLogger(__name__)

#: a reply to a peer that does not read within this long is dropped (and counted)
SEND_TIMEOUT_S = 1.0


class CloudNode:
    """Serve a target model to many edges.

    ``target``: any :class:`~xcosd.models.LanguageModel`. ``bind``: a ZeroMQ-style
    endpoint (``tcp://127.0.0.1:0`` picks a free port; read :attr:`endpoint`).
    ``transport``: ``zmq`` (default), ``tcp`` or ``memory``. ``link``: emulate a link
    on every peer. ``curve``: a :class:`~xcosd.transport.CurveServer`. Batching:
    ``max_batch``, ``max_wait_s``. Limits: ``max_sessions``, ``max_queue``,
    ``max_draft``, ``max_message_bytes``. Liveness: the edge pings every
    ``heartbeat_s``; a peer silent for ``timeout_s`` loses its sessions.
    ``method_options``: per-method defaults (``{"xcosd-e": {"K": 8}}``) that an
    edge's own options override. ``metrics_port``: serve Prometheus text there.
    """

    def __init__(self, target: LanguageModel, bind: str = "tcp://127.0.0.1:5555", *,
                 transport: str = "zmq", link: LinkSpec | None = None, curve: Any = None,
                 max_batch: int = 32, max_wait_s: float = 0.002, max_sessions: int = 1024,
                 max_queue: int = 4096, max_draft: int = 32,
                 max_message_bytes: int = 16 << 20, heartbeat_s: float = 1.0,
                 timeout_s: float = 15.0, methods: tuple[str, ...] | None = None,
                 method_options: dict[str, dict[str, Any]] | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 transport_options: dict[str, Any] | None = None) -> None:
        self.target = target
        self.bind = bind
        self.transport = transport
        self.link = link
        self.curve = curve
        self.timeout_s = timeout_s
        self.limits = ServerLimits(max_message_bytes, max_sessions, max_draft, heartbeat_s,
                                   timeout_s)
        # the header bound admits the longest legal prompt: refused as too_large, a
        # prompt could not be answered on its session and its edge would wait forever
        self.frame_limits = Limits(max_bytes=max_message_bytes, max_frames=64 + max_draft,
                                   max_header_bytes=MAX_HEADER_BYTES)
        self.server_id = secrets.token_hex(8)
        self.config = CloudConfig(target.vocab, target.tokenize, self.limits, self.server_id,
                                  methods=methods, default_options=method_options)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self._transport_options = dict(transport_options or {})
        self._sched_opts: dict[str, Any] = {"max_batch": max_batch, "max_wait_s": max_wait_s,
                            "max_queue": max_queue}
        self._listener: Listener | None = None
        self._scheduler: Scheduler | None = None
        self._conns: dict[bytes, CloudConnection] = {}
        self._last_seen: dict[bytes, float] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._metrics: Any = None
        self._closed = False
        self._started_at = 0.0
        self.counters: dict[str, Any] = {
            "sessions_opened": 0, "sessions_closed": 0, "sessions_timed_out": 0,
            "sessions_failed": 0, "rounds": 0, "draft_tokens": 0, "accepted_tokens": 0,
            "emitted_tokens": 0, "follow_ups": 0, "messages": 0, "errors_sent": 0,
            "dropped": 0, "peers_dropped": 0, "internal_errors": 0, "errors_by_code": {},
        }

    # -- lifecycle -------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The bound endpoint (with the real port when bound to port 0)."""
        if self._listener is None:
            raise TransportError("the cloud node is not started", code="closed")
        return self._listener.endpoint

    @property
    def metrics_endpoint(self) -> str | None:
        return self._metrics.url if self._metrics is not None else None

    async def start(self) -> CloudNode:
        opts = dict(self._transport_options)
        if self.transport != "memory" and not self.bind.startswith("mem://"):
            opts.setdefault("limits", self.frame_limits)
        if self.curve is not None:
            opts["curve"] = self.curve
        listener = await listen(self.bind, transport=self.transport, **opts)
        self._listener = LinkListener(listener, self.link) if self.link is not None else listener
        self._scheduler = Scheduler(self.target, self._deliver, **self._sched_opts)
        self._scheduler.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive_loop(), name="xcosd-cloud-recv"),
                       loop.create_task(self._reap_loop(), name="xcosd-cloud-reaper")]
        if self.metrics_port is not None:
            from .metrics import MetricsServer

            self._metrics = MetricsServer(self.stats, self.metrics_host, self.metrics_port)
            await self._metrics.start()
        self._started_at = time.perf_counter()
        log.info("cloud %s serving %s on %s", self.server_id, self.target.name, self.endpoint)
        return self

    async def close(self) -> None:
        """Stop serving: cancel the tasks, close the socket, stop the worker thread.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._metrics is not None:
            await self._metrics.close()
            self._metrics = None
        for conn in list(self._conns.values()):
            self._apply_events(conn.drop(CloseReason.SHUTDOWN))
        self._conns.clear()
        if self._scheduler is not None:
            await self._scheduler.close()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()

    async def __aenter__(self) -> CloudNode:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- receiving ----------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                peer, frames = await self._listener.recv()
            except TransportError as e:
                if e.code == "closed":
                    return
                log.warning("receive failed: %s", e)
                await asyncio.sleep(0.01)
                continue
            if frames is None:
                await self._drop_peer(peer, CloseReason.DISCONNECTED)
                continue
            try:
                await self._handle(peer, frames)
            except Exception:  # a bug must not take the cloud down
                self.counters["internal_errors"] += 1
                log.exception("handling a message from %s failed", bytes(peer).hex())

    async def _handle(self, peer: bytes, frames: list[bytes]) -> None:
        self.counters["messages"] += 1
        conn = self._conns.get(peer)
        if conn is None:
            conn = self._conns[peer] = CloudConnection(self.config, peer)
        self._last_seen[peer] = time.monotonic()
        header: Any = None
        try:
            header, buffers = decode_message(frames, limits=self.frame_limits)
            msg: Message = from_wire(header, [bytes(b) for b in buffers])
        except ProtocolError as e:
            await self._apply(conn, conn.refuse(e.code, e.message, session_of(header)))
            return
        assert self._scheduler is not None
        if isinstance(msg, DraftMsg) and self._scheduler.full():
            self._scheduler.stats.busy_refusals += 1
            await self._apply(conn, conn.refuse(
                "busy", f"the cloud has {self._scheduler.queued} rounds queued; retry later",
                msg.s, msg.r))
            return
        await self._apply(conn, conn.receive(msg))

    async def _deliver(self, session: CloudSession, outcome: RoundOutcome) -> None:
        conn = session.conn
        if self._conns.get(conn.peer) is not conn:
            return
        await self._apply(conn, conn.scored(session, outcome))

    async def _apply(self, conn: CloudConnection, out: Output) -> None:
        self._apply_events(out)
        for m in out.send:
            await self._send(conn, m)

    def _apply_events(self, out: Output) -> None:
        c = self.counters
        sched = self._scheduler
        for ev in out.events:
            if isinstance(ev, ScoreNeeded):
                assert sched is not None
                sched.submit(ev)
            elif isinstance(ev, RoundVerified):
                c["rounds"] += 1
                c["draft_tokens"] += ev.drafted
                c["accepted_tokens"] += ev.accepted
                c["emitted_tokens"] += ev.accepted + 1
            elif isinstance(ev, SessionOpened):
                c["sessions_opened"] += 1
            elif isinstance(ev, SessionClosed):
                c["sessions_closed"] += 1
                if ev.reason in (CloseReason.TIMEOUT, CloseReason.DISCONNECTED):
                    c["sessions_timed_out"] += 1
                elif ev.reason is CloseReason.ERROR:
                    c["sessions_failed"] += 1
                c["follow_ups"] += ev.session.requests
                if sched is not None:
                    # its queued work, if any, is skipped when batches form (the
                    # protocol closed the session); its model state is freed
                    sched.free(ev.session)
            elif isinstance(ev, Rejected):
                by = c["errors_by_code"]
                by[ev.code] = by.get(ev.code, 0) + 1
                log.debug("refused a message (%s): %s", ev.code, ev.message)

    async def _send(self, conn: CloudConnection, msg: Message) -> None:
        if self._listener is None:
            return
        if msg.TYPE == "error":
            self.counters["errors_sent"] += 1
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):  # no task per send, unlike wait_for
                await self._listener.send(conn.peer, pack(msg))
        except (TransportError, TimeoutError) as e:
            # the peer is gone or does not read: drop the message, count it
            self.counters["dropped"] += 1
            log.debug("dropped a %s to %s: %s", msg.TYPE, bytes(conn.peer).hex(), e)
            if isinstance(e, TransportError) and e.code == "unreachable":
                await self._drop_peer(conn.peer, CloseReason.DISCONNECTED)

    # -- liveness -------------------------------------------------------------------

    async def _drop_peer(self, peer: bytes, reason: CloseReason) -> None:
        conn = self._conns.pop(peer, None)
        self._last_seen.pop(peer, None)
        if conn is None:
            return
        if conn.sessions:
            log.info("peer %s %s: freeing %d sessions", bytes(peer).hex(), reason,
                     len(conn.sessions))
        self.counters["peers_dropped"] += 1
        self._apply_events(conn.drop(reason))

    async def reap(self, now: float | None = None) -> int:
        """Drop every peer silent for more than ``timeout_s`` as of ``now`` (default:
        ``time.monotonic()``) and free its sessions; return how many were dropped.

        The reaper task calls this periodically. It is public so a test can make a
        timeout happen at a moment it chooses (a ``now`` past the deadline, with a
        ``timeout_s`` the reaper itself never reaches) instead of sleeping through a
        short timeout and racing the reaper to observe the state before it.
        """
        cutoff = (time.monotonic() if now is None else now) - self.timeout_s
        silent = [p for p, t in self._last_seen.items() if t < cutoff]
        for peer in silent:
            await self._drop_peer(peer, CloseReason.TIMEOUT)
            if self._listener is not None:
                with contextlib.suppress(Exception):
                    await self._listener.close_peer(peer)
        return len(silent)

    async def _reap_loop(self) -> None:
        period = max(0.05, min(1.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            await self.reap()

    # -- stats -----------------------------------------------------------------------

    @property
    def batch_stats(self) -> BatchStats | None:
        """The scheduler's live record (``None`` before :meth:`start`): besides the
        totals :meth:`stats` summarises, every request's queue wait in the order its
        batch ran, so a benchmark can cut a measured window out of a run after the
        fact."""
        return self._scheduler.stats if self._scheduler is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters, the scheduler's batch histogram and timings, and bytes by type."""
        sched = self._scheduler
        c = dict(self.counters)
        c["errors_by_code"] = dict(self.counters["errors_by_code"])
        drafted, accepted = c["draft_tokens"], c["accepted_tokens"]
        out: dict[str, Any] = {
            "server_id": self.server_id,
            "target": self.target.name,
            "uptime_s": time.perf_counter() - self._started_at if self._started_at else 0.0,
            "sessions_active": self.config.sessions,
            "peers": len(self._conns),
            "queued": sched.queued if sched else 0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / c["rounds"] if c["rounds"] else 0.0,
            **c,
            "scheduler": sched.stats.to_dict() if sched else {},
        }
        if self._listener is not None:
            out["bytes"] = self._listener.meter.to_dict()
        return out
