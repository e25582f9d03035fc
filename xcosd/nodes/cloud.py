"""``CloudNode``: the target side of xcosd, an async context manager that runs in
the caller's event loop.

It binds a listener (ZeroMQ by default, raw TCP or in-memory on request, with an
optional link emulator and CURVE), feeds every received message through the
sans-I/O :class:`~xcosd.protocol.CloudConnection` of its peer, and hands the
"needs scoring" work to the batching :class:`~xcosd.nodes.scheduler.Scheduler`.
Four tasks run while it is open (take in, serve, schedule, reap), plus one short
task per peer with replies waiting and an optional Prometheus endpoint; all of
them, the worker thread and the socket are gone when the ``async with`` block
exits (:meth:`CloudNode.close` returns within :data:`CLOSE_TIMEOUT_S` whatever the
traffic). It never calls ``asyncio.run``.

The receive path is built so that no peer can take the event loop or another
peer's turn. This module serves; the rest has a module each:

* **Intake** (xcosd/nodes/cloud_intake.py) reads the socket into one bounded queue
  per peer and keeps the peers ready to serve in turn order; control messages past
  a peer's budget are dropped unanswered (xcosd/nodes/cloud_peer.py).
* **Serving** (here) takes the peers round-robin, at most :data:`PEER_TURN`
  messages of one peer per turn, and yields every :data:`SERVE_BURST` messages. A
  follow-up request (sampling candidates or a residual over the vocabulary: the
  expensive message) runs in the scheduler's worker thread; its peer's other
  messages wait until it is done, so each connection's state is only ever touched
  by one thread and in arrival order (verdicts for that peer wait too). Renders
  run in a thread of their own (xcosd/nodes/cloud_renders.py).
* **Replies** leave together at the end of a turn, or through one bounded queue
  and task per peer that does not take them at once
  (xcosd/nodes/cloud_delivery.py): a peer that does not read delays only its own.
* **Reaping** (xcosd/nodes/cloud_liveness.py) drops silent peers and closes idle
  sessions, sooner while the cloud is short of sessions.

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
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from ..errors import ProtocolError, TransportError
from ..models.base import LanguageModel, context_tokens
from ..protocol import pack
from ..protocol.cloud import (
    CloseReason,
    CloudConfig,
    CloudConnection,
    CloudSession,
    Output,
    Rejected,
    RenderNeeded,
    RoundOutcome,
    RoundVerified,
    ScoreNeeded,
    SessionClosed,
    SessionOpened,
)
from ..protocol.messages import (
    MAX_HEADER_BYTES,
    DraftMsg,
    Hello,
    Message,
    Open,
    Ping,
    RequestMsg,
    ServerLimits,
    VocabRequest,
    from_wire,
    session_of,
)
from ..transport import LinkListener, Listener, listen
from ..wire.frames import Limits, decode_message
from .cloud_delivery import SEND_BURST as SEND_BURST
from .cloud_delivery import SEND_TIMEOUT_S as SEND_TIMEOUT_S
from .cloud_delivery import Delivery
from .cloud_intake import INTAKE_BURST as INTAKE_BURST
from .cloud_intake import Intake
from .cloud_liveness import IDLE_PRESSURE as IDLE_PRESSURE
from .cloud_liveness import IDLE_SLACK as IDLE_SLACK
from .cloud_liveness import Liveness
from .cloud_peer import CONTROL_BURST as CONTROL_BURST
from .cloud_peer import CONTROL_RATE as CONTROL_RATE
from .cloud_peer import Frames, Peer
from .cloud_renders import MAX_RENDERS_PER_PEER as MAX_RENDERS_PER_PEER
from .cloud_renders import Renders
from .cloud_settings import BatchPolicy, CloudLimits, CloudPeerSettings
from .drain import Drain, HealthAnswer
from .metrics import tree_shape_label
from .node_kwargs import fold, no_more, renamed
from .scheduler import BatchStats, Scheduler
from .scoring import verifies_on_device

log = logging.getLogger(__name__)

#: messages of one peer served per turn before the next peer's
PEER_TURN = 8
#: messages served before the serving task lets the loop run other tasks
SERVE_BURST = 32
#: :meth:`CloudNode.close` returns within about this long, whatever the traffic
CLOSE_TIMEOUT_S = 3.0
#: a follow-up that took the worker thread longer than this holds its peer back
#: afterwards for FOLLOW_UP_HOLD times as long, so one peer's follow-ups take at
#: most 1 / (1 + FOLLOW_UP_HOLD) of the thread (and of the GIL) from everyone else
FOLLOW_UP_FREE_S = 0.002
FOLLOW_UP_HOLD = 2.0
#: how often a drain looks whether its sessions are done
DRAIN_POLL_S = 0.05
#: how long a drain's hand-off waits for its ``draining`` notices to leave
HAND_OFF_FLUSH_S = 1.0


def _receive_packed(conn: CloudConnection, msg: Message
                    ) -> tuple[Output[Any], list[tuple[str, Frames]], float]:
    """``conn.receive(msg)``, its answers packed, and how long that took: a
    follow-up's work, done in the worker thread (sampling K candidates and packing
    them both cost)."""
    t0 = time.perf_counter()
    out = conn.receive(msg)
    packed: list[tuple[str, Frames]] = [(m.TYPE, pack(m)) for m in out.send]
    return out, packed, time.perf_counter() - t0


class CloudNode:
    """Serve a target model to many edges.

    ``target``: any :class:`~xcosd.models.LanguageModel`. ``bind``: a ZeroMQ-style
    endpoint (``tcp://127.0.0.1:0`` picks a free port; read :attr:`endpoint`).
    ``peers``: how edges reach the node and how long it keeps them
    (:class:`~xcosd.nodes.cloud_settings.CloudPeerSettings`: transport, link, CURVE,
    heartbeats, the silence timeout, idle sessions, the drain, the metrics port);
    ``limits``: what it accepts (:class:`~xcosd.nodes.cloud_settings.CloudLimits`:
    sessions, queues, block and tree sizes, message size, context, methods);
    ``batching``: how it batches the target's calls
    (:class:`~xcosd.nodes.cloud_settings.BatchPolicy`). Each of their fields may also
    be given as a keyword of its name (``max_batch=8``, ``transport="tcp"`` ...),
    which updates the object given (or the defaults); a keyword that none of them
    has is a ``TypeError``. ``timeout_s=`` is the old name of ``silence_timeout_s``
    (deprecated).
    """

    def __init__(self, target: LanguageModel, bind: str = "tcp://127.0.0.1:5555", *,
                 peers: CloudPeerSettings | None = None, limits: CloudLimits | None = None,
                 batching: BatchPolicy | None = None, **settings: Any) -> None:
        renamed("CloudNode", settings, "timeout_s", "silence_timeout_s")
        peers = fold("CloudNode", peers, CloudPeerSettings, settings)
        limits = fold("CloudNode", limits, CloudLimits, settings)
        batching = fold("CloudNode", batching, BatchPolicy, settings)
        no_more("CloudNode", settings)
        holds = context_tokens(target)
        context = limits.context
        if context is not None and 0 < holds < context:
            raise ValueError(f"context={context} exceeds the {holds} ids a session of the "
                             "target holds")
        #: the settings the node was made with; the attributes below are their parts
        self.peer_settings, self.cloud_limits, self.batch_policy = peers, limits, batching
        self.target = target
        self.bind = bind
        self.transport = peers.transport
        self.link = peers.link
        self.curve = peers.curve
        self.silence_timeout_s = peers.silence_timeout_s
        self.session_idle_s = peers.idle_s
        self.max_peer_queue = limits.max_peer_queue
        max_message_bytes = limits.max_message_bytes
        #: bytes one peer may have waiting each way (one message always fits)
        self.max_peer_bytes = 4 * max_message_bytes
        self.limits = ServerLimits(max_message_bytes, limits.max_sessions, limits.max_draft,
                                   peers.heartbeat_s, peers.silence_timeout_s, limits.max_tree,
                                   context=holds if context is None else context)
        # the header bound admits the longest legal prompt: refused as too_large, a
        # prompt could not be answered on its session and its edge would wait forever
        self.frame_limits = Limits(max_bytes=max_message_bytes,
                                   max_frames=64 + max(limits.max_draft, limits.max_tree),
                                   max_header_bytes=MAX_HEADER_BYTES)
        self.server_id = secrets.token_hex(8)
        self.config = CloudConfig(
            target.vocab, target.tokenize, self.limits, self.server_id, methods=limits.methods,
            default_options=(None if limits.method_options is None
                             else {m: dict(o) for m, o in limits.method_options.items()}),
            max_sessions_per_peer=limits.max_sessions_per_peer)
        self.metrics_port = peers.metrics_port
        self.metrics_host = peers.metrics_host
        self.drain_timeout_s = peers.drain_timeout_s
        #: readiness and the graceful drain (sans-I/O)
        self._drain = Drain()
        self._drained: asyncio.Event | None = None
        self._transport_options = dict(peers.transport_options or {})
        self._sched_opts: dict[str, Any] = {
            "max_batch": batching.max_batch, "max_wait_s": batching.max_wait_s,
            "max_queue": limits.max_queue, "max_batch_tokens": batching.max_batch_tokens,
            "merge": batching.merge_batches, "stream": batching.stream_verdicts,
            "keep_waits": batching.keep_queue_waits,
            "on_device": verifies_on_device(target, batching.verify_on_device)}
        self._listener: Listener | None = None
        self._scheduler: Scheduler | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        #: follow-ups in the worker thread
        self._jobs: set[asyncio.Task[Any]] = set()
        self._metrics: Any = None
        self._closed = False
        self._started_at = 0.0
        self.counters: dict[str, Any] = {
            "sessions_opened": 0, "sessions_closed": 0, "sessions_timed_out": 0,
            "sessions_failed": 0, "sessions_idle_reaped": 0, "rounds": 0, "draft_tokens": 0,
            "accepted_tokens": 0, "emitted_tokens": 0, "follow_ups": 0, "messages": 0,
            "errors_sent": 0, "dropped": 0, "dropped_outbox": 0, "dropped_flood": 0, "dropped_control": 0,
            "refused_flood": 0, "follow_ups_held": 0, "peers_dropped": 0, "internal_errors": 0,
            #: peers cut off because their CURVE key was revoked
            "peers_revoked": 0,
            "renders": 0, "tree_rounds": 0,
            "errors_by_code": {},
            #: tree rounds by shape (TreeShape.label)
            "tree_shapes": {},
        }
        #: the peers, their inboxes, and those ready to serve
        self._intake = Intake(self.config, self.counters, self.max_peer_queue, self.max_peer_bytes,
                              answer=self._apply, revoked=self._cut_off)
        #: the replies on their way out
        self._delivery = Delivery(self.counters, self.max_peer_queue, self.max_peer_bytes,
                                  drained=self._intake.mark_ready, unreachable=self._drop_peer)
        #: the render thread and the renders waiting for it
        self._renders = Renders(target, self.counters, self._intake.peers, answer=self._apply)
        #: sessions' last activity; dropping silent peers and idle sessions
        self._liveness = Liveness(self._intake.peers, self.config, self.counters, self._delivery,
                                  silence_timeout_s=self.silence_timeout_s,
                                  session_idle_s=self.session_idle_s,
                                  max_sessions=limits.max_sessions, apply_events=self._apply_events,
                                  forget=self._renders.forget)

    @property
    def timeout_s(self) -> float:
        """Deprecated: :attr:`silence_timeout_s` (a generation's deadline is
        ``GenerationConfig.timeout_s``)."""
        warnings.warn("CloudNode.timeout_s is deprecated: it is silence_timeout_s now",
                      DeprecationWarning, stacklevel=2)
        return self.silence_timeout_s

    @property
    def _peers(self) -> dict[bytes, Peer]:
        """The peers the node holds anything for (the intake's table)."""
        return self._intake.peers

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

    # -- readiness and draining ----------------------------------------------------

    @property
    def draining(self) -> bool:
        """Whether a drain began: no new connection or session is taken."""
        return not self._drain.accepting

    def health(self) -> HealthAnswer:
        """``/health``'s answer: 200 ``ok`` while new sessions are taken, 503
        ``draining`` once a drain began, 503 ``full`` while every session is in use:
        the form a balancer's HTTP check reads (xcosd/nodes/drain.py)."""
        sessions = self.config.sessions
        body = {"uptime_s": round(time.perf_counter() - self._started_at, 3)
                if self._started_at else 0.0,
                "sessions": sessions, "peers": len(self._peers),
                "server_id": self.server_id}
        return self._drain.health(sessions, self.limits.max_sessions, body)

    async def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Leave without losing a token: from now on ``/health`` answers 503 and a
        ``hello`` or ``open`` is refused ``draining`` (its edge connects again,
        through a balancer to another node, and opens or resumes there); running
        generations go on for up to ``timeout_s`` (default ``drain_timeout_s``);
        then every peer still connected is told ``draining`` and its remaining
        sessions are handed off (the edge resumes them elsewhere from their committed
        tokens) and freed here. Returns the drain's counts (``sessions_at_start``,
        ``finished``, ``handed_off``, ``ended_otherwise``, ``refused``,
        ``peers_told``, ``took_s``). The node keeps running until closed; a second
        call waits for the first drain and returns its counts."""
        if self._listener is None or self._closed:
            raise TransportError("the cloud node is not running", code="closed")
        timeout = self.drain_timeout_s if timeout_s is None else timeout_s
        if not self._drain.start(time.monotonic(), timeout, self.config.sessions):
            assert self._drained is not None
            await self._drained.wait()
            return self._drain.report.to_dict()
        self._drained = asyncio.Event()
        log.info("draining: %d sessions have %.1f s to finish", self.config.sessions, timeout)
        while not self._drain.due(time.monotonic(), self.config.sessions):
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.001, self._drain.left_s(time.monotonic()))))
        await self._hand_off()
        report = self._drain.done(time.monotonic())
        self._drained.set()
        log.info("drained: %s", report.to_dict())
        return report.to_dict()

    async def _hand_off(self) -> None:
        """Tell every peer still connected that this node is leaving (its edge
        resumes its sessions elsewhere), let the notices leave, then free the
        peers' sessions here."""
        peers = [p for p in self._peers.values() if not p.dropped]
        sessions = 0
        for p in peers:
            sessions += len(p.conn.sessions)
            self._apply(p, p.conn.refuse("draining", "this cloud is leaving; resume elsewhere"))
        self._delivery.turn.flush()
        self._drain.handed_off(sessions, len(peers))
        loop = asyncio.get_running_loop()
        until = loop.time() + HAND_OFF_FLUSH_S
        while any(p.outbox or p.sender is not None for p in peers) and loop.time() < until:
            await asyncio.sleep(0.01)
        for p in peers:
            self._drop_peer(p.id, CloseReason.SHUTDOWN)

    async def start(self) -> CloudNode:
        opts = dict(self._transport_options)
        if self.transport != "memory" and not self.bind.startswith("mem://"):
            opts.setdefault("limits", self.frame_limits)
        if self.curve is not None:
            opts["curve"] = self.curve
        listener = await listen(self.bind, transport=self.transport, **opts)
        self._listener = LinkListener(listener, self.link) if self.link is not None else listener
        self._delivery.listener = self._listener
        self._scheduler = Scheduler(self.target, self._deliver, **self._sched_opts,
                                    live=lambda: self.config.sessions)
        self._scheduler.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._intake.run(self._listener), name="xcosd-cloud-recv"),
                       loop.create_task(self._serve_loop(), name="xcosd-cloud-serve"),
                       loop.create_task(self._liveness.run(), name="xcosd-cloud-reaper")]
        if self.metrics_port is not None:
            from .metrics import MetricsServer

            self._metrics = MetricsServer(self.stats, self.metrics_host, self.metrics_port,
                                          health=self.health)
            await self._metrics.start()
        self._started_at = time.perf_counter()
        log.info("cloud %s serving %s on %s", self.server_id, self.target.name, self.endpoint)
        return self

    async def close(self) -> None:
        """Stop serving: cancel the tasks, close the socket, stop the worker thread.
        Idempotent. Returns within about :data:`CLOSE_TIMEOUT_S` under any traffic:
        every wait is bounded, and a batch still computing by then is left to finish
        in its thread (its results are discarded)."""
        if self._closed:
            return
        self._closed = True
        self._delivery.closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT_S

        def left(floor: float = 0.0) -> float:
            return max(floor, deadline - loop.time())

        renders = [self._renders.pump] if self._renders.pump is not None else []
        tasks = [*self._tasks, *renders, *self._jobs,
                 *(p.sender for p in self._peers.values() if p.sender is not None)]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=left(0.1))
        self._tasks = []
        if self._metrics is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(left(0.1)):
                    await self._metrics.close()
            self._metrics = None
        if self._scheduler is not None:
            # no verdict is delivered after this; a batch computing is waited for
            # (bounded) before the sessions it uses are ended below
            await self._scheduler.stop(left())
        for p in list(self._peers.values()):
            p.busy, p.dropped = False, True
            p.inbox.clear()
            p.outbox.clear()
            self._apply_events(p.conn.drop(CloseReason.SHUTDOWN))
        self._peers.clear()
        self._intake.ready.clear()
        self._liveness.activity.clear()
        if self._scheduler is not None:
            await self._scheduler.close(left(0.2))
        self._renders.close()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(left(0.2)):
                    await self._listener.close()

    async def __aenter__(self) -> CloudNode:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- serving ------------------------------------------------------------------

    async def _serve_loop(self) -> None:
        """Serve the peers' queues round-robin, a bounded turn each."""
        intake = self._intake
        served = 0
        while True:
            if not intake.ready:
                served = 0
                intake.work.clear()
                await intake.work.wait()
                continue
            p = intake.ready.popleft()
            p.ready = False
            turn = 0
            while (p.inbox and turn < PEER_TURN and not (p.busy or p.held or p.dropped)
                   and not intake.backed_up(p)):
                item = p.inbox.popleft()
                turn += 1
                try:
                    if item is None:
                        self._drop_peer(p.id, CloseReason.DISCONNECTED)
                        break
                    frames, size = item
                    p.inbox_bytes -= size
                    self._handle(p, frames)
                except Exception:  # a bug must not take the cloud down
                    self.counters["internal_errors"] += 1
                    log.exception("handling a message from %s failed", bytes(p.id).hex())
            intake.mark_ready(p)
            served += turn
            if served >= SERVE_BURST:
                served = 0
                await asyncio.sleep(0)

    def _handle(self, p: Peer, frames: Frames) -> None:
        conn = p.conn
        header: Any = None
        try:
            header, buffers = decode_message(frames, limits=self.frame_limits)
            msg: Message = from_wire(header, [bytes(b) for b in buffers])
        except ProtocolError as e:
            # a typed error answers it, out of the same budget: a peer sending
            # garbage without end gets no reply past it
            if p.control_allowed():
                self._apply(p, conn.refuse(e.code, e.message, session_of(header)))
            else:
                self.counters["dropped_control"] += 1
            return
        assert self._scheduler is not None
        if type(msg) in (Ping, VocabRequest) and not p.control_allowed():
            self.counters["dropped_control"] += 1
            return
        if not self._drain.accepting and isinstance(msg, (Hello, Open)):
            # leaving: this edge connects again (through a balancer, elsewhere) and
            # opens or resumes its session there
            self._drain.refused()
            self._apply(p, conn.refuse("draining", "this cloud is draining; connect again",
                                       getattr(msg, "s", None)))
            return
        if isinstance(msg, DraftMsg) and self._scheduler.full():
            self._scheduler.stats.busy_refusals += 1
            if msg.s in conn.sessions:  # its edge is trying: the session is not idle
                self._liveness.seen((p.id, msg.s))
            self._apply(p, conn.refuse(
                "busy", f"the cloud has {self._scheduler.queued} rounds queued; retry later",
                msg.s, msg.r))
            return
        if isinstance(msg, RequestMsg):
            # candidates or a residual over the whole vocabulary: off the loop, and
            # nothing else of this peer runs until it is back (one thread at a time
            # on its connection, its messages in order)
            p.busy = True
            task = asyncio.get_running_loop().create_task(self._follow_up(p, msg),
                                                          name="xcosd-cloud-follow-up")
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)
            return
        out = conn.receive(msg)
        self._touch(p, msg, out)
        if type(msg) is not DraftMsg:  # a draft never asks for a render
            render = next((e for e in out.events if isinstance(e, RenderNeeded)), None)
            if render is not None:
                self._renders.start(p, render)
                return
        self._apply(p, out)

    async def _follow_up(self, p: Peer, msg: RequestMsg) -> None:
        assert self._scheduler is not None
        took = 0.0
        try:
            out, packed, took = await self._scheduler.run(_receive_packed, p.conn, msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.counters["internal_errors"] += 1
            log.exception("a follow-up from %s failed", bytes(p.id).hex())
            out = p.conn.refuse("internal", f"the follow-up failed: {type(e).__name__}",
                                msg.s, msg.r)
            packed = [(m.TYPE, pack(m)) for m in out.send]
        if not p.dropped:
            self._touch(p, msg, out)
        await self._back(p, out, packed, took)

    async def _back(self, p: Peer, out: Output[Any], packed: Sequence[tuple[str, Any]],
                    took: float) -> None:
        """``p``'s work off the loop is done: send its answer, apply what arrived
        meanwhile, and hold the peer a while if the work was expensive."""
        p.busy = False
        if p.dropped:
            return
        self._apply_events(out)
        for kind, frames in packed:
            self._delivery.send(p, kind, frames)
        deferred, p.deferred = p.deferred, []
        for session, outcome in deferred:
            self._apply(p, p.conn.scored(session, outcome))
        if p.gone is not None:
            self._drop_peer(p.id, p.gone)
            return
        if took > FOLLOW_UP_FREE_S:
            # a fair share of the worker thread: this peer's next message waits (its
            # verdicts do not); an honest edge's next draft is a round trip away anyway
            self.counters["follow_ups_held"] += 1
            p.held = True
            try:
                await asyncio.sleep(took * FOLLOW_UP_HOLD)
            finally:
                p.held = False
        self._intake.mark_ready(p)

    def _touch(self, p: Peer, msg: Message, out: Output[Any]) -> None:
        """A draft or follow-up the session accepted: it is in use."""
        if not isinstance(msg, (DraftMsg, RequestMsg)):
            return
        if msg.s in p.conn.sessions and not any(isinstance(e, Rejected) for e in out.events):
            self._liveness.seen((p.id, msg.s))

    def _deliver(self, session: CloudSession, outcome: RoundOutcome) -> None:
        """A verdict from the scheduler: a plain call, no coroutine per round."""
        if self._closed:
            return
        conn = session.conn
        p = self._peers.get(conn.peer)
        if p is None or p.conn is not conn:
            return
        if p.busy:  # its follow-up holds the connection: after it
            p.deferred.append((session, outcome))
            return
        self._apply(p, conn.scored(session, outcome))

    def _apply(self, p: Peer, out: Output[Any]) -> None:
        self._apply_events(out)
        for m in out.send:
            self._delivery.send(p, m.TYPE, pack(m))

    def _apply_events(self, out: Output[Any]) -> None:
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
                if ev.shape is not None:
                    c["tree_rounds"] += 1
                    # a peer picks its shapes: those kept by name are a fixed set
                    shapes = c["tree_shapes"]
                    label = tree_shape_label(ev.shape)
                    shapes[label] = shapes.get(label, 0) + 1
                if not ev.session.closed:
                    self._liveness.seen(ev.session.key)
            elif isinstance(ev, SessionOpened):
                c["sessions_opened"] += 1
                self._liveness.seen(ev.session.key)
            elif isinstance(ev, SessionClosed):
                c["sessions_closed"] += 1
                self._drain.session_ended(by_peer=ev.reason is CloseReason.CLOSED)
                if ev.reason in (CloseReason.TIMEOUT, CloseReason.DISCONNECTED):
                    c["sessions_timed_out"] += 1
                elif ev.reason is CloseReason.ERROR:
                    c["sessions_failed"] += 1
                c["follow_ups"] += ev.session.requests
                key = ev.session.key
                if ev.session.conn.sessions.get(key[1]) is None:
                    self._liveness.ended(key)
                if sched is not None:
                    # its queued work, if any, is skipped when batches form (the
                    # protocol closed the session); its model state is freed
                    sched.free(ev.session, by_peer=ev.reason is CloseReason.CLOSED)
            elif isinstance(ev, Rejected):
                by = c["errors_by_code"]
                by[ev.code] = by.get(ev.code, 0) + 1
                log.debug("refused a message (%s): %s", ev.code, ev.message)

    # -- liveness -------------------------------------------------------------------

    async def reap(self, now: float | None = None) -> int:
        """As of ``now`` (default: ``time.monotonic()``), drop every peer silent for
        more than ``silence_timeout_s`` and free its sessions, and close every session with
        no draft or follow-up for more than ``session_idle_s`` (``IDLE_SLACK`` times
        that unless the cloud is short of sessions) even if its peer still pings,
        unless its round is being verified (the cloud owes it a verdict) or its
        peer has messages waiting to be served (they may be its next draft).
        Returns how many peers and sessions were reaped.

        The reaper task calls this periodically. It is public so a test can make a
        timeout happen at a moment it chooses (a ``now`` past the deadline, with a
        ``silence_timeout_s`` the reaper itself never reaches) instead of sleeping through a
        short timeout and racing the reaper to observe the state before it.
        """
        return await self._liveness.reap(now)

    def _drop_peer(self, peer: bytes, reason: CloseReason) -> bool:
        """End ``peer``'s sessions and forget it (xcosd/nodes/cloud_liveness.py)."""
        return self._liveness.drop_peer(peer, reason)

    def _cut_off(self, peer: bytes, p: Peer | None) -> None:
        """``peer``'s CURVE key was revoked: tell it, drop it
        (xcosd/nodes/cloud_liveness.py)."""
        self._liveness.cut_off(peer, p)

    # -- stats -----------------------------------------------------------------------

    @property
    def batch_stats(self) -> BatchStats | None:
        """The scheduler's live record (``None`` before :meth:`start`): besides the
        totals :meth:`stats` summarises, with ``keep_queue_waits``, every request's
        queue wait in the order its batch ran, so a benchmark can cut a measured
        window out of a run after the fact."""
        return self._scheduler.stats if self._scheduler is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters, the scheduler's batch histogram and timings, and bytes by type."""
        sched = self._scheduler
        c = dict(self.counters)
        c["errors_by_code"] = dict(self.counters["errors_by_code"])
        c["tree_shapes"] = dict(self.counters["tree_shapes"])
        drafted, accepted = c["draft_tokens"], c["accepted_tokens"]
        out: dict[str, Any] = {
            "server_id": self.server_id,
            "target": self.target.name,
            "uptime_s": time.perf_counter() - self._started_at if self._started_at else 0.0,
            "sessions_active": self.config.sessions,
            "peers": len(self._peers),
            "queued": sched.queued if sched else 0,
            "inbox": sum(len(p.inbox) for p in self._peers.values()),
            "outbox": sum(len(p.outbox) for p in self._peers.values()),
            "draining": self.draining,
            #: where batches are warped and verified (xcosd/accel/: next to the rows)
            "verify": "device" if self._sched_opts["on_device"] else "host",
            "drain": self._drain.report.to_dict() if self.draining else None,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / c["rounds"] if c["rounds"] else 0.0,
            **c,
            "scheduler": ({**sched.stats.to_dict(),
                           "merge": sched.merge.to_dict() if sched.merge else None}
                          if sched else {}),
        }
        if self._listener is not None:
            out["bytes"] = self._listener.meter.to_dict()
            transport = getattr(self._listener, "stats", None)  # TCP: refusals, reaping
            if isinstance(transport, dict):
                out["transport"] = dict(transport)
        return out
