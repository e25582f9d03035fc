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
peer's turn:

* **Intake** takes every message the socket has ready in one call (up to
  :data:`INTAKE_BURST`: one wake-up per burst, not per message) into one bounded
  queue per peer, and lets the loop run other tasks after a full burst (a ready
  socket answers without ever yielding, so a flood would otherwise hold it). A
  message past its peer's bound (``max_peer_queue`` messages or
  ``4 * max_message_bytes`` bytes) is dropped unread and counted
  (``dropped_flood``), or, for a draft, refused ``busy`` (``refused_flood``),
  which an edge retries. Control messages (pings, vocabulary requests, frames that
  cannot be decoded) past a peer's :data:`CONTROL_RATE` budget are dropped
  unanswered (``dropped_control``).
* **Serving** takes the peers round-robin, at most :data:`PEER_TURN` messages of
  one peer per turn, and yields every :data:`SERVE_BURST` messages. A follow-up
  request (sampling candidates or a residual over the vocabulary: the expensive
  message) runs in the scheduler's worker thread; its peer's other messages wait
  until it is done, so each connection's state is only ever touched by one thread
  and in arrival order (verdicts for that peer wait too).
* **Replies** of one turn of the loop go to the socket together when it ends (a
  long turn's, a batch's verification, once the first has waited
  :data:`~xcosd.transport.burst.HOLD_S`: xcosd/transport/burst.py), each
  at once when its peer's queue there has room and nothing of that peer waits
  before it (no task: the common case). Otherwise they go through one bounded
  outgoing queue per peer, written by that peer's own task with a
  :data:`SEND_TIMEOUT_S` deadline per message: a peer that does not read delays
  only its own replies; past the bound they are dropped and counted (``dropped``,
  ``dropped_outbox``). A peer whose queue is half full is not served until it
  drains, so its flood waits, then is dropped at intake, never served into replies
  that would be dropped.
* **Reaping**: a peer silent for ``timeout_s`` loses its sessions; a session with
  no draft or follow-up for ``session_idle_s`` is closed even when its peer keeps
  pinging (``sessions_idle_reaped``) while the cloud is short of sessions (at
  :data:`IDLE_PRESSURE` of ``max_sessions``: a hoarder then keeps newcomers out),
  else after :data:`IDLE_SLACK` times as long (an overloaded but honest edge can
  be slow between rounds; closing its session would only make it open again).

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
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import msgpack

from ..errors import ErrorCode, ProtocolError, TransportError, XcosdError
from ..models.base import LanguageModel, context_tokens
from ..policies.tree_policy import DEFAULT_MAX_TREE
from ..protocol import pack
from ..protocol.cloud import (
    CloseReason,
    CloudConfig,
    CloudConnection,
    CloudPhase,
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
    Error,
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
from ..transport import LinkListener, LinkSpec, Listener, listen
from ..transport.burst import Burst
from ..wire.frames import Limits, decode_message, message_bytes
from .drain import Drain, HealthAnswer
from .metrics import tree_shape_label
from .scheduler import BatchStats, Scheduler
from .scoring import verifies_on_device

log = logging.getLogger(__name__)

#: a reply a peer does not take within this long is dropped (and counted)
SEND_TIMEOUT_S = 1.0
#: messages the intake reads in one go (all that are ready, up to this many) before
#: it lets the loop run other tasks: no more than serving takes in a turn
#: (SERVE_BURST), so that under overload what waits stays in the transport's own
#: bounded queues, which push back on the senders, rather than in the peers' queues
INTAKE_BURST = 32
#: messages of one peer served per turn before the next peer's
PEER_TURN = 8
#: messages served before the serving task lets the loop run other tasks
SERVE_BURST = 32
#: replies one peer's sender writes before it lets the loop run other tasks
SEND_BURST = 32
#: control messages (a ping, a vocabulary request, a message that cannot be decoded:
#: each asks for a reply and does no session's work) one peer may send per second,
#: and in one burst; past it they are dropped unanswered (``dropped_control``). An
#: edge pings once a heartbeat and asks for a vocabulary once a connection; a peer
#: past this is flooding, and answering it would spend the loop on replies it may
#: never read (the HTTP/2 ping and settings floods, CVE-2019-9512 and -9515, are the
#: same attack)
CONTROL_RATE = 100.0
CONTROL_BURST = 200.0
#: :meth:`CloudNode.close` returns within about this long, whatever the traffic
CLOSE_TIMEOUT_S = 3.0
#: the share of ``max_sessions`` in use from which idle sessions are closed after
#: ``session_idle_s``; below it, after ``IDLE_SLACK`` times as long
IDLE_PRESSURE = 0.9
IDLE_SLACK = 4.0
#: a follow-up that took the worker thread longer than this holds its peer back
#: afterwards for FOLLOW_UP_HOLD times as long, so one peer's follow-ups take at
#: most 1 / (1 + FOLLOW_UP_HOLD) of the thread (and of the GIL) from everyone else
FOLLOW_UP_FREE_S = 0.002
FOLLOW_UP_HOLD = 2.0
#: render requests of one peer in the render thread or waiting for it; past it: busy
MAX_RENDERS_PER_PEER = 64
#: how often a drain looks whether its sessions are done
DRAIN_POLL_S = 0.05
#: how long a drain's hand-off waits for its ``draining`` notices to leave
HAND_OFF_FLUSH_S = 1.0

_Frames = Sequence[Any]


class _Peer:
    """What the node keeps for one peer: its protocol connection, its messages
    waiting for their turn (``None``: it disconnected), its replies waiting for
    the socket, and whether its follow-up is in the worker thread (``busy``: then
    nothing else touches ``conn`` until it is back)."""

    __slots__ = ("busy", "conn", "control", "control_at", "deferred", "dropped", "gone",
                 "held", "id", "inbox", "inbox_bytes", "last_seen", "outbox", "outbox_bytes",
                 "ready", "renders", "sender")

    def __init__(self, peer: bytes, conn: CloudConnection, now: float) -> None:
        self.id = peer
        self.conn = conn
        self.inbox: deque[tuple[_Frames, int] | None] = deque()
        self.inbox_bytes = 0
        self.outbox: deque[tuple[_Frames, int]] = deque()
        self.outbox_bytes = 0
        self.sender: asyncio.Task[None] | None = None
        self.ready = False
        self.busy = False
        #: its render requests in the render thread or waiting for it
        self.renders = 0
        #: served nothing for a while after an expensive follow-up
        self.held = False
        #: verdicts that arrived while busy, applied when it is back
        self.deferred: list[tuple[CloudSession, RoundOutcome]] = []
        #: a drop asked for while busy, done when it is back
        self.gone: CloseReason | None = None
        self.dropped = False
        self.last_seen = now
        #: its control-message budget (a token bucket: CONTROL_RATE, CONTROL_BURST)
        self.control = CONTROL_BURST
        self.control_at = now


def _receive_packed(conn: CloudConnection, msg: Message
                    ) -> tuple[Output[Any], list[tuple[str, _Frames]], float]:
    """``conn.receive(msg)``, its answers packed, and how long that took: a
    follow-up's work, done in the worker thread (sampling K candidates and packing
    them both cost)."""
    t0 = time.perf_counter()
    out = conn.receive(msg)
    packed: list[tuple[str, _Frames]] = [(m.TYPE, pack(m)) for m in out.send]
    return out, packed, time.perf_counter() - t0


def _peek_draft(frames: _Frames) -> tuple[int, int] | None:
    """``(s, r)`` when ``frames`` look like a draft (header only, small headers
    only): what a ``busy`` refusal of it needs. Anything else: ``None``."""
    if not frames or len(frames[0]) > 512:
        return None
    try:
        h = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception:
        return None
    if not isinstance(h, dict) or h.get("t") != DraftMsg.TYPE:
        return None
    s, r = h.get("s"), h.get("r")
    if type(s) is not int or type(r) is not int:
        return None
    return s, r


class CloudNode:
    """Serve a target model to many edges.

    ``target``: any :class:`~xcosd.models.LanguageModel`. ``bind``: a ZeroMQ-style
    endpoint (``tcp://127.0.0.1:0`` picks a free port; read :attr:`endpoint`).
    ``transport``: ``zmq`` (default), ``tcp`` or ``memory``. ``link``: emulate a link
    on every peer. ``curve``: a :class:`~xcosd.transport.CurveServer` (on the
    ``replica`` transport a :class:`~xcosd.transport.CurveClient`: a replica is the
    client of its broker's back end). Batching:
    ``max_batch``, ``max_wait_s``, ``max_batch_tokens`` (rows one batch scores:
    what bounds the batch a small round waits behind), ``merge_batches`` (a partial
    batch waits for the sessions just answered when that beats a second call:
    ``xcosd/nodes/merging.py``), ``stream_verdicts`` (the loop verifies a scored
    batch session by session and sends each verdict at once while the worker thread
    runs the next call; ``False``: the thread verifies the whole batch after its
    call, the loop sends afterwards). Limits: ``max_sessions``,
    ``max_sessions_per_peer`` (default half of ``max_sessions``: no peer takes every
    session), ``max_queue``, ``max_draft``, ``max_tree`` (nodes of a draft tree; 0:
    chains only, and edges asking for trees draft chains), ``max_message_bytes``, ``max_peer_queue`` (messages
    of one peer waiting to be served, and replies waiting to be sent to it).
    Liveness: the edge pings every ``heartbeat_s``; a peer silent for ``timeout_s``
    loses its sessions, and a session without a draft or follow-up for
    ``session_idle_s`` (default ``timeout_s``) is closed even if its peer pings
    (when sessions are short; else after ``IDLE_SLACK`` times as long).
    ``method_options``: per-method defaults (``{"xcosd-e": {"K": 8}}``) that an
    edge's own options override. ``metrics_port``: serve Prometheus text there.
    ``keep_queue_waits``: keep every request's queue wait in :attr:`batch_stats` (a
    benchmark's cloud; memory that grows with every round served).
    ``verify_on_device``: verify each batch next to the target's logits, in torch on
    its device (xcosd/accel/); ``None`` decides by the target (a model on an
    accelerator does, the CPU keeps the numpy path: :func:`~xcosd.nodes.scoring.verifies_on_device`).
    ``drain_timeout_s``: how long :meth:`drain` lets running generations finish
    before it hands the rest off (xcosd/nodes/drain.py). ``context``: the most
    positions one session holds, its prompt and all it generates (default: what the
    target holds, its ``context_tokens``; 0 when it knows no bound); sent in the
    welcome, and an open past it is refused ``context_length`` before any compute.
    """

    def __init__(self, target: LanguageModel, bind: str = "tcp://127.0.0.1:5555", *,
                 transport: str = "zmq", link: LinkSpec | None = None, curve: Any = None,
                 max_batch: int = 32, max_wait_s: float = 0.002,
                 max_batch_tokens: int | None = 256, merge_batches: bool = True,
                 stream_verdicts: bool = True,
                 max_sessions: int = 1024,
                 max_sessions_per_peer: int | None = None, max_queue: int = 4096, max_draft: int = 32,
                 max_tree: int = DEFAULT_MAX_TREE, max_message_bytes: int = 16 << 20,
                 max_peer_queue: int = 1024,
                 heartbeat_s: float = 1.0, timeout_s: float = 15.0,
                 session_idle_s: float | None = None,
                 methods: tuple[str, ...] | None = None,
                 method_options: dict[str, dict[str, Any]] | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 transport_options: dict[str, Any] | None = None,
                 keep_queue_waits: bool = False, drain_timeout_s: float = 30.0,
                 verify_on_device: bool | None = None, context: int | None = None) -> None:
        if max_peer_queue < 1:
            raise ValueError(f"max_peer_queue must be >= 1, got {max_peer_queue}")
        holds = context_tokens(target)
        if context is not None and context < 1:
            raise ValueError(f"context must be >= 1 position, got {context}")
        if context is not None and 0 < holds < context:
            raise ValueError(f"context={context} exceeds the {holds} ids a session of the "
                             "target holds")
        self.target = target
        self.bind = bind
        self.transport = transport
        self.link = link
        self.curve = curve
        self.timeout_s = timeout_s
        self.session_idle_s = timeout_s if session_idle_s is None else session_idle_s
        self.max_peer_queue = max_peer_queue
        #: bytes one peer may have waiting each way (one message always fits)
        self.max_peer_bytes = 4 * max_message_bytes
        self.limits = ServerLimits(max_message_bytes, max_sessions, max_draft, heartbeat_s,
                                   timeout_s, max_tree,
                                   context=holds if context is None else context)
        # the header bound admits the longest legal prompt: refused as too_large, a
        # prompt could not be answered on its session and its edge would wait forever
        self.frame_limits = Limits(max_bytes=max_message_bytes, max_frames=64 + max(max_draft, max_tree),
                                   max_header_bytes=MAX_HEADER_BYTES)
        self.server_id = secrets.token_hex(8)
        self.config = CloudConfig(target.vocab, target.tokenize, self.limits, self.server_id,
                                  methods=methods, default_options=method_options,
                                  max_sessions_per_peer=max_sessions_per_peer)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        self.drain_timeout_s = drain_timeout_s
        #: readiness and the graceful drain (sans-I/O)
        self._drain = Drain()
        self._drained: asyncio.Event | None = None
        self._transport_options = dict(transport_options or {})
        self._sched_opts: dict[str, Any] = {"max_batch": max_batch, "max_wait_s": max_wait_s,
                                            "max_queue": max_queue,
                                            "max_batch_tokens": max_batch_tokens,
                                            "merge": merge_batches,
                                            "stream": stream_verdicts,
                                            "keep_waits": keep_queue_waits,
                                            "on_device": verifies_on_device(target, verify_on_device)}
        self._listener: Listener | None = None
        self._scheduler: Scheduler | None = None
        self._peers: dict[bytes, _Peer] = {}
        #: peers with messages to serve, in turn order
        self._ready: deque[_Peer] = deque()
        #: replies queued in this turn of the loop, sent together when it ends (or
        #: once the first has waited HOLD_S: a batch's verification is a long turn)
        self._turn: Burst[tuple[_Peer, _Frames, int]] = Burst(self._flush_turn)
        self._work = asyncio.Event()
        #: session key -> when it last had a draft, a follow-up or a verdict
        self._activity: dict[tuple[bytes, int], float] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        #: follow-ups in the worker thread
        self._jobs: set[asyncio.Task[Any]] = set()
        #: the thread that tokenises prompts and renders chats (made on first use),
        #: the renders waiting for it by peer (served round robin), and the task
        #: serving them while any wait
        self._render_threads: ThreadPoolExecutor | None = None
        self._render_waiting: dict[bytes, deque[RenderNeeded]] = {}
        self._render_pump: asyncio.Task[None] | None = None
        self._metrics: Any = None
        self._closed = False
        self._started_at = 0.0
        #: the typed errors being sent to peers whose key was revoked
        self._farewells: set[asyncio.Task[None]] = set()
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
        self._turn.flush()
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
        self._scheduler = Scheduler(self.target, self._deliver, **self._sched_opts,
                                    live=lambda: self.config.sessions)
        self._scheduler.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._intake_loop(), name="xcosd-cloud-recv"),
                       loop.create_task(self._serve_loop(), name="xcosd-cloud-serve"),
                       loop.create_task(self._reap_loop(), name="xcosd-cloud-reaper")]
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT_S

        def left(floor: float = 0.0) -> float:
            return max(floor, deadline - loop.time())

        tasks = [*self._tasks, *self._jobs,
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
        self._ready.clear()
        self._activity.clear()
        if self._scheduler is not None:
            await self._scheduler.close(left(0.2))
        if self._render_threads is not None:
            # an idle thread ends at once; one inside a tokenizer ends when it returns
            self._render_threads.shutdown(wait=False, cancel_futures=True)
            self._render_threads = None
        if self._listener is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(left(0.2)):
                    await self._listener.close()

    async def __aenter__(self) -> CloudNode:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- receiving ----------------------------------------------------------------

    async def _intake_loop(self) -> None:
        """Read the socket into the peers' queues; never hold the loop for long."""
        assert self._listener is not None
        listener = self._listener
        while True:
            try:
                got = await listener.recv_many(INTAKE_BURST)
            except TransportError as e:
                if e.code == "closed":
                    return
                log.warning("receive failed: %s", e)
                await asyncio.sleep(0.01)
                continue
            for peer, frames in got:
                try:
                    self._take_in(peer, frames)
                except Exception:  # a bug must not take the cloud down
                    self.counters["internal_errors"] += 1
                    log.exception("taking in a message from %s failed", bytes(peer).hex())
            if len(got) >= INTAKE_BURST:
                # a ready socket answers at once: without this, a peer that sends
                # faster than the cloud reads would hold the loop for good
                await asyncio.sleep(0)

    def _take_in(self, peer: bytes, frames: list[bytes] | None) -> None:
        now = time.monotonic()
        p = self._peers.get(peer)
        if frames is None and self._listener is not None and self._listener.revoked(peer):
            self._cut_off(peer, p)
            return
        if p is None:
            if frames is None:
                return  # a peer we hold nothing for went away
            p = self._peers[peer] = _Peer(peer, CloudConnection(self.config, peer), now)
        p.last_seen = now
        if frames is None:
            p.inbox.append(None)  # after everything it sent; never dropped
        else:
            self.counters["messages"] += 1
            n = message_bytes(frames)
            if p.inbox and (len(p.inbox) >= self.max_peer_queue
                            or p.inbox_bytes + n > self.max_peer_bytes):
                self._overflow(p, frames)
                return
            p.inbox.append((frames, n))
            p.inbox_bytes += n
        self._mark_ready(p)

    def _cut_off(self, peer: bytes, p: _Peer | None) -> None:
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
            self._drop_peer(peer, CloseReason.DISCONNECTED)
        task = asyncio.get_running_loop().create_task(self._send_farewell(peer, farewell))
        self._farewells.add(task)
        task.add_done_callback(self._farewells.discard)

    async def _send_farewell(self, peer: bytes, farewell: Sequence[_Frames]) -> None:
        listener = self._listener
        with contextlib.suppress(Exception):  # gone already: nothing left to tell
            async with asyncio.timeout(SEND_TIMEOUT_S):
                for frames in farewell:
                    assert listener is not None
                    await listener.send(peer, frames)

    def _overflow(self, p: _Peer, frames: _Frames) -> None:
        """A message past its peer's queue bound: a draft is refused ``busy`` (the
        edge sends it again later), anything else is dropped unread."""
        sr = _peek_draft(frames)
        if sr is None:
            self.counters["dropped_flood"] += 1
            return
        self.counters["refused_flood"] += 1
        self._apply(p, p.conn.refuse("busy", f"{len(p.inbox)} messages from this peer are "
                                     "waiting to be served; retry later", *sr))

    @staticmethod
    def _control_allowed(p: _Peer) -> bool:
        """Take one control message from ``p``'s budget, if it has one left."""
        now = time.monotonic()
        p.control = min(CONTROL_BURST, p.control + (now - p.control_at) * CONTROL_RATE)
        p.control_at = now
        if p.control < 1.0:
            return False
        p.control -= 1.0
        return True

    def _backed_up(self, p: _Peer) -> bool:
        """Whether ``p``'s replies are backing up (half its outgoing bound): it is
        then not served until its sender has written them down, so a peer that does
        not read costs the cloud no work whose replies would only be dropped; its
        messages wait in its inbox and past that bound are dropped unread at intake."""
        return (2 * len(p.outbox) >= self.max_peer_queue
                or 2 * p.outbox_bytes >= self.max_peer_bytes)

    def _mark_ready(self, p: _Peer) -> None:
        if (p.inbox and not p.ready and not p.busy and not p.held and not p.dropped
                and not self._backed_up(p)):
            p.ready = True
            self._ready.append(p)
            self._work.set()

    async def _serve_loop(self) -> None:
        """Serve the peers' queues round-robin, a bounded turn each."""
        served = 0
        while True:
            if not self._ready:
                served = 0
                self._work.clear()
                await self._work.wait()
                continue
            p = self._ready.popleft()
            p.ready = False
            turn = 0
            while (p.inbox and turn < PEER_TURN and not (p.busy or p.held or p.dropped)
                   and not self._backed_up(p)):
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
            self._mark_ready(p)
            served += turn
            if served >= SERVE_BURST:
                served = 0
                await asyncio.sleep(0)

    def _handle(self, p: _Peer, frames: _Frames) -> None:
        conn = p.conn
        header: Any = None
        try:
            header, buffers = decode_message(frames, limits=self.frame_limits)
            msg: Message = from_wire(header, [bytes(b) for b in buffers])
        except ProtocolError as e:
            # a typed error answers it, out of the same budget: a peer sending
            # garbage without end gets no reply past it
            if self._control_allowed(p):
                self._apply(p, conn.refuse(e.code, e.message, session_of(header)))
            else:
                self.counters["dropped_control"] += 1
            return
        assert self._scheduler is not None
        if type(msg) in (Ping, VocabRequest) and not self._control_allowed(p):
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
                self._activity[(p.id, msg.s)] = time.monotonic()
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
                self._start_render(p, render)
                return
        self._apply(p, out)

    def _start_render(self, p: _Peer, ev: RenderNeeded) -> None:
        """Queue ``ev`` for the render thread. A render touches no session, so the
        peer's other messages (its sessions' drafts) go on meanwhile. The thread
        takes the waiting peers' renders round robin, one each in turn, so a peer
        with many (or long) renders waiting delays another's by at most one of its
        own; at most :data:`MAX_RENDERS_PER_PEER` of a peer's wait (``busy`` past
        it). Renders never hold up a batch or a follow-up in the worker thread."""
        if p.renders >= MAX_RENDERS_PER_PEER:
            self._apply(p, p.conn.rendered(ev, error=XcosdError(
                f"{p.renders} renders of this connection are waiting; retry later",
                code="busy")))
            return
        p.renders += 1
        self._render_waiting.setdefault(p.id, deque()).append(ev)
        if self._render_pump is None:
            self._render_pump = asyncio.get_running_loop().create_task(
                self._render_loop(), name="xcosd-cloud-render")
            self._tasks.append(self._render_pump)

    async def _render_loop(self) -> None:
        """Serve the waiting renders, a peer at a time round robin, until none wait."""
        if self._render_threads is None:
            self._render_threads = ThreadPoolExecutor(1, thread_name_prefix="xcosd-render")
        loop = asyncio.get_running_loop()
        try:
            while self._render_waiting:
                peer, queue = next(iter(self._render_waiting.items()))
                ev = queue.popleft()
                del self._render_waiting[peer]
                if queue:  # its next render goes behind every other peer's
                    self._render_waiting[peer] = queue
                try:
                    ids = await loop.run_in_executor(self._render_threads, self._render_ids, ev)
                    out = ev.conn.rendered(ev, ids)
                except XcosdError as e:
                    out = ev.conn.rendered(ev, error=e)
                except Exception as e:
                    self.counters["internal_errors"] += 1
                    log.exception("rendering a prompt for %s failed", bytes(peer).hex())
                    out = ev.conn.rendered(ev, error=XcosdError(
                        f"rendering failed: {type(e).__name__}", code="internal"))
                self.counters["renders"] += 1
                p = self._peers.get(peer)
                if p is not None and p.conn is ev.conn:
                    p.renders -= 1
                    if not p.dropped:
                        self._apply(p, out)
        finally:
            me, self._render_pump = self._render_pump, None
            if me in self._tasks:
                self._tasks.remove(me)

    def _render_ids(self, ev: RenderNeeded) -> list[int]:
        """The target's ids for ``ev`` (render thread)."""
        if ev.chat is None:
            assert ev.text is not None
            return [int(i) for i in self.target.tokenize(ev.text)]
        chat_prompt = getattr(self.target, "chat_prompt", None)
        if chat_prompt is None:
            raise XcosdError(f"the target {self.target.name!r} has no chat template",
                             code="unsupported")
        try:
            ids = chat_prompt([{"role": r, "content": c} for r, c in ev.chat])
        except XcosdError:
            raise
        except Exception as e:  # the template raised (a role order it refuses ...)
            raise XcosdError(f"the target's chat template refused the chat: {e}",
                             code="unsupported") from e
        return [int(i) for i in ids]

    async def _follow_up(self, p: _Peer, msg: RequestMsg) -> None:
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

    async def _back(self, p: _Peer, out: Output[Any], packed: Sequence[tuple[str, Any]],
                    took: float) -> None:
        """``p``'s work off the loop is done: send its answer, apply what arrived
        meanwhile, and hold the peer a while if the work was expensive."""
        p.busy = False
        if p.dropped:
            return
        self._apply_events(out)
        for kind, frames in packed:
            self._queue_out(p, kind, frames)
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
        self._mark_ready(p)

    def _touch(self, p: _Peer, msg: Message, out: Output[Any]) -> None:
        """A draft or follow-up the session accepted: it is in use."""
        if not isinstance(msg, (DraftMsg, RequestMsg)):
            return
        if msg.s in p.conn.sessions and not any(isinstance(e, Rejected) for e in out.events):
            self._activity[(p.id, msg.s)] = time.monotonic()

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

    def _apply(self, p: _Peer, out: Output[Any]) -> None:
        self._apply_events(out)
        for m in out.send:
            self._queue_out(p, m.TYPE, pack(m))

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
                    self._activity[ev.session.key] = time.monotonic()
            elif isinstance(ev, SessionOpened):
                c["sessions_opened"] += 1
                self._activity[ev.session.key] = time.monotonic()
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
                    self._activity.pop(key, None)
                if sched is not None:
                    # its queued work, if any, is skipped when batches form (the
                    # protocol closed the session); its model state is freed
                    sched.free(ev.session, by_peer=ev.reason is CloseReason.CLOSED)
            elif isinstance(ev, Rejected):
                by = c["errors_by_code"]
                by[ev.code] = by.get(ev.code, 0) + 1
                log.debug("refused a message (%s): %s", ev.code, ev.message)

    # -- sending ------------------------------------------------------------------

    def _queue_out(self, p: _Peer, kind: str, frames: _Frames) -> None:
        """Queue a reply to ``p``; its own task writes it. Past the bound: dropped."""
        c = self.counters
        if kind == "error":
            c["errors_sent"] += 1
        if p.dropped or self._closed or self._listener is None:
            c["dropped"] += 1
            return
        n = message_bytes(frames)
        if p.sender is None and not p.outbox:
            # nothing of this peer waits: its reply joins this turn's, handed to the
            # socket together (xcosd/transport/burst.py)
            self._turn.add((p, frames, n))
            return
        self._to_outbox(p, frames, n)

    def _to_outbox(self, p: _Peer, frames: _Frames, n: int) -> None:
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

    def _flush_turn(self, turn: list[tuple[_Peer, _Frames, int]]) -> None:
        """Hand a turn's replies to the socket, in order: each goes at once if its
        peer's queue there has room and nothing of that peer waits before it,
        otherwise to that peer's sender. One burst of sends wakes ZeroMQ's I/O
        thread once, not once per reply."""
        sent = False
        for p, frames, n in turn:
            if p.dropped or self._closed or self._listener is None:
                self.counters["dropped"] += 1
            elif p.sender is None and not p.outbox and self._send_now(p, frames):
                sent = True
            else:
                self._to_outbox(p, frames, n)
        if sent and self._listener is not None:
            self._listener.end_burst()  # only a burst that reached the socket

    def _send_now(self, p: _Peer, frames: _Frames) -> bool:
        """Hand a reply to the socket at once when that needs no waiting (the peer's
        queue has room): no task, no turn of the loop. Anything else (a full queue,
        an error) is left to the peer's sender, which waits, times out and reports."""
        assert self._listener is not None
        try:
            return self._listener.send_nowait(p.id, frames)
        except TransportError:
            return False
        except Exception:  # a bug must not take the cloud down
            self.counters["internal_errors"] += 1
            log.exception("sending to %s failed", bytes(p.id).hex())
            return False

    async def _sender(self, p: _Peer) -> None:
        """Write ``p``'s replies in order; a peer that does not read waits here
        alone, each reply for at most :data:`SEND_TIMEOUT_S`."""
        assert self._listener is not None
        listener = self._listener
        sent = 0
        try:
            while p.outbox and not p.dropped:
                frames, n = p.outbox.popleft()
                p.outbox_bytes -= n
                self._mark_ready(p)  # served again once its replies drain
                try:
                    async with asyncio.timeout(SEND_TIMEOUT_S):  # no task per send
                        await listener.send(p.id, frames)
                except (TransportError, TimeoutError) as e:
                    # the peer is gone or does not read: drop the message, count it
                    self.counters["dropped"] += 1
                    log.debug("dropped a reply to %s: %s", bytes(p.id).hex(), e)
                    if isinstance(e, TransportError) and e.code == "unreachable":
                        self._drop_peer(p.id, CloseReason.DISCONNECTED)
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

    # -- liveness -------------------------------------------------------------------

    def _drop_peer(self, peer: bytes, reason: CloseReason) -> bool:
        """End ``peer``'s sessions and forget it (after its follow-up, if one is in
        the worker thread); whether there was such a peer to drop."""
        p = self._peers.get(peer)
        if p is None or p.gone is not None:
            return False
        if p.busy:
            p.gone = reason
            return True
        del self._peers[peer]
        p.dropped = True
        self._render_waiting.pop(peer, None)
        p.inbox.clear()
        p.inbox_bytes = 0
        p.outbox.clear()
        p.outbox_bytes = 0
        if p.sender is not None and p.sender is not asyncio.current_task():
            p.sender.cancel()
        conn = p.conn
        if conn.sessions:
            log.info("peer %s %s: freeing %d sessions", bytes(peer).hex(), reason,
                     len(conn.sessions))
        self.counters["peers_dropped"] += 1
        self._apply_events(conn.drop(reason))
        return True

    async def reap(self, now: float | None = None) -> int:
        """As of ``now`` (default: ``time.monotonic()``), drop every peer silent for
        more than ``timeout_s`` and free its sessions, and close every session with
        no draft or follow-up for more than ``session_idle_s`` (``IDLE_SLACK`` times
        that unless the cloud is short of sessions) even if its peer still pings,
        unless its round is being verified (the cloud owes it a verdict) or its
        peer has messages waiting to be served (they may be its next draft).
        Returns how many peers and sessions were reaped.

        The reaper task calls this periodically. It is public so a test can make a
        timeout happen at a moment it chooses (a ``now`` past the deadline, with a
        ``timeout_s`` the reaper itself never reaches) instead of sleeping through a
        short timeout and racing the reaper to observe the state before it.
        """
        now = time.monotonic() if now is None else now
        cutoff = now - self.timeout_s
        silent = [p for p in self._peers.values() if p.last_seen < cutoff]
        n = 0
        for p in silent:
            if not self._drop_peer(p.id, CloseReason.TIMEOUT):
                continue
            n += 1
            if self._listener is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        await self._listener.close_peer(p.id)
        return n + self._reap_idle_sessions(now)

    def _reap_idle_sessions(self, now: float) -> int:
        short = self.config.sessions >= IDLE_PRESSURE * self.limits.max_sessions
        cutoff = now - self.session_idle_s * (1.0 if short else IDLE_SLACK)
        n = 0
        for key in [k for k, t in self._activity.items() if t < cutoff]:
            p = self._peers.get(key[0])
            sess = p.conn.sessions.get(key[1]) if p is not None else None
            if p is None or sess is None:
                self._activity.pop(key, None)
                continue
            if p.busy or p.inbox or sess.phase is CloudPhase.SCORING:
                continue
            self.counters["sessions_idle_reaped"] += 1
            self._apply_events(p.conn.end(sess, CloseReason.TIMEOUT))
            n += 1
        return n

    async def _reap_loop(self) -> None:
        period = max(0.05, min(1.0, min(self.timeout_s, self.session_idle_s) / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.reap()
            except Exception:  # a bug must not stop the reaper
                self.counters["internal_errors"] += 1
                log.exception("reaping failed")

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
