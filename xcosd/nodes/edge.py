"""``EdgeNode``: the device side of xcosd, an async context manager that runs in the
caller's event loop.

One EdgeNode holds one connection to a cloud and runs any number of generations
on it concurrently (:meth:`EdgeNode.generate`, :meth:`EdgeNode.stream`). Each
generation is a sans-I/O :class:`~xcosd.protocol.EdgeSession`; this module only
moves its messages, runs its draft model in a worker thread (one thread: the
device has one draft model), keeps the link alive and measures. While a block's
verdict is in flight that thread drafts on past it (speculation, see
``xcosd/nodes/drafter.py``), so the next round's drafts are often ready when the
verdict arrives.

Faults: the edge pings every ``heartbeat_s``; when the cloud is silent for
``timeout_s``, the transport fails, the cloud answers that it does not know the
connection (it restarted) or that it is leaving (``draining``), the edge reconnects
by itself, in one task of its own (with jittered backoff, for up to
``connect_timeout_s``, or for as long as it takes when that is ``None``, to the
next of its addresses: ``connect`` may name several, or a host name with several,
see ``xcosd/transport/addresses.py``; the states it goes through are
``xcosd/nodes/reach.py``'s). Generations and render requests wait for it, each at
most ``cloud_wait_s`` (``None``: until the reconnecting gives up), so a server in
front of the node holds its requests a bounded time while the cloud is away,
starting, restarting or drained; the connection back resumes every running
generation from its committed tokens: the cloud rebuilds the context from prompt + committed target ids, so no
token is lost or repeated (a round whose verdict was already seen is completed, not
drawn again; see ``xcosd/protocol/edge.py``). An answer that does not come within
``resend_after_s`` is asked for again with the same sequence number (the cloud
repeats it, or computes it if the first message was lost); ``busy`` refusals are
retried after a pause, for at most ``busy_timeout_s``. Every wait has a deadline:
no answer within ``answer_timeout_s`` despite the resends ends the generation with
:class:`TimeoutError`, as does its own ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from types import TracebackType
from typing import Any

import numpy as np

from ..config import GenerationConfig
from ..errors import BudgetError, ErrorCode, ProtocolError, TransportError, XcosdError
from ..methods import FullVectorReply, HybridReply, Method, Space, get_method
from ..methods.tree import DraftTree
from ..models.base import ContextModel, LanguageModel
from ..policies.draft_length import DraftLength
from ..policies.tree_policy import RankRates
from ..protocol import pack
from ..protocol.contexts import Chat, ContextStore, RenderStore
from ..protocol.edge import (
    DraftNeeded,
    EdgeHandshake,
    EdgePhase,
    EdgeSession,
    Finished,
    Retry,
    RoundSettled,
    TokensEmitted,
)
from ..protocol.errors import exception_for
from ..protocol.messages import (
    CHAT_ROLES,
    Close,
    Error,
    Message,
    Open,
    Ping,
    Pong,
    Render,
    Rendered,
    SessionMessage,
    VerdictMsg,
    from_wire,
)
from ..sampling import SamplingParams
from ..transport import LinkConnection, LinkSpec, Meter, connect, sequence_latency
from ..transport.addresses import Addresses, resolve, split_endpoints
from ..transport.base import Connection
from ..vocab import VocabMap, Vocabulary
from ..wire.frames import Limits, decode_message, message_bytes
from .arrivals import HOLD_S, Arrival, Arrivals
from .drafter import Drafter
from .inbox import Inbox
from .reach import Reach, ReachPhase
from .stats import GenerationResult, GenerationStats

log = logging.getLogger(__name__)

#: codes that mean "the cloud no longer has this connection's state" (or is leaving:
#: ``draining``): connect again and resume
LOST_CODES = frozenset({"handshake", "no_session", "draining"})
#: answers to a ``hello`` after which another attempt (another address) may succeed
RETRY_CONNECT_CODES = frozenset({"draining"})
#: with several addresses, the longest one attempt's handshake may take before the
#: next address is tried (ZeroMQ connects lazily: a dead address shows only as silence)
ATTEMPT_TIMEOUT_S = 3.0
#: of those, the one that concerns one session only (the cloud closed it, e.g. as
#: idle, but knows the connection): that session alone is opened again
SESSION_LOST_CODES = frozenset({"no_session"})
#: the share of a round's measured wait (draft sent to verdict) that speculation
#: may fill: a step still running when the verdict arrives delays the next round
SPECULATE_SHARE = 0.8
#: the (method, warpers) settings whose speculation record a node keeps
SPECULATION_RECORDS = 16
#: the longest vocabulary a context model (n-gram, table, synthetic) drafts over on
#: the event loop. A step of one costs about 9 us plus 1.3 ns an id (37 us at 16k
#: ids), less than handing the round to the draft thread; at 200k ids it is 340 us,
#: and a round of such steps on the loop holds up every other generation's verdicts
#: and an HTTP server on the same loop (16 concurrent streams on the embedded pair:
#: a first token after 83-94 ms in process, 29-33 ms with the draft thread)
LOOP_DRAFT_MAX_IDS = 16384
#: draft prompt tokens (not cached) from which round 0 drafts nothing and the draft
#: computes its prompt while the open's round trip and the cloud's prefill are in
#: flight: a prompt's prefill costs about a draft step per token on a CPU, a round
#: trip a few dozen steps
PREFILL_OVERLAP = 32
#: the fewest ids of a prompt worth naming by reference rather than sending (a
#: reference costs about as many header bytes as this many ids)
MIN_REFERENCE = 8
#: render requests (tokenize, chat_prompt) one node has at the cloud at once; the
#: others wait their turn here. Well under the cloud's bound per connection
#: (xcosd/nodes/cloud.py, MAX_RENDERS_PER_PEER, past which it answers ``busy``),
#: so many concurrent callers queue instead of being refused
MAX_RENDERS_IN_FLIGHT = 16

#: a prompt: text, or target token ids (the cloud's context is then exactly those ids)
Prompt = str | Sequence[int] | np.ndarray


@dataclasses.dataclass(frozen=True)
class RoundObserved:
    """One round of one generation as the edge node saw it, passed to
    :attr:`EdgeNode.on_round` (a load benchmark times every round with it, without
    reaching into the node).

    ``start`` / ``end``: :func:`time.monotonic` when the round began (before drafting)
    and when it settled; the clock is system-wide on Linux, so observers in several
    processes can compare them. The counts are this round's share of the
    generation's :class:`~xcosd.nodes.GenerationStats`: target tokens committed, wire
    bytes up and down (busy retries and a method's second trip included), tokens
    drafted and accepted."""

    session: int
    start: float
    end: float
    tokens: int
    uplink_bytes: int
    downlink_bytes: int
    drafted: int
    accepted: int


class _StopStrings:
    """Watches the generated text for stop strings as it streams.

    Pieces are passed on to ``on_text`` only up to the end of the first stop string,
    so a streaming caller never sees text the final result does not contain.
    """

    def __init__(self, stops: Sequence[str], on_text: Callable[[str], None] | None) -> None:
        self.stops = tuple(stops)
        self.on_text = on_text
        self.text = ""
        #: index in ``text`` just past the first stop string, once one appeared
        self.end: int | None = None
        self._longest = max((len(x) for x in self.stops), default=0)

    def feed(self, piece: str) -> None:
        if self.end is not None:
            return
        start = len(self.text)
        self.text += piece
        if self.stops:
            # a new match must end inside ``piece``: start looking just before it
            lo = max(0, start - self._longest + 1)
            ends = [i + len(x) for x in self.stops if (i := self.text.find(x, lo)) >= 0]
            if ends:
                self.end = min(ends)
                piece = self.text[start:self.end]
        if self.on_text is not None and piece:
            self.on_text(piece)


def _ids_covering(vocab: Vocabulary, ids: Sequence[int], chars: int) -> int:
    """How many of ``ids`` it takes for their text to reach ``chars`` characters (the
    token that completes a stop string is kept whole, as transformers keeps it)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    n = 0
    for k, t in enumerate(ids, 1):
        n += len(dec.decode(vocab.piece(int(t))))
        if n >= chars:
            return k
    return len(ids)


def drafts_on_loop(draft: LanguageModel) -> bool:
    """Whether an edge drafts with ``draft`` on its event loop by default: a context
    model whose vocabulary has at most :data:`LOOP_DRAFT_MAX_IDS` ids does; every
    other model drafts in the edge's draft thread."""
    return isinstance(draft, ContextModel) and draft.vocab.size <= LOOP_DRAFT_MAX_IDS


def shared_process_draft_thread(draft: LanguageModel) -> bool | None:
    """``draft_thread`` for one of many edges sharing a process (a load generator's
    simulated devices): a context model drafts on the loop whatever its vocabulary,
    since a draft thread per edge would contend for the GIL and stand for nothing a
    real device does; any other draft keeps the default (``None``)."""
    return False if isinstance(draft, ContextModel) else None


class _Lost:
    """Sentinel put into every session's inbox when the connection is lost."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


class _SessionLost(Exception):
    """Raised inside a generation whose session the cloud no longer has."""


class _ConnectionLost(Exception):
    """Raised inside a generation when the connection of ``epoch`` is gone."""

    def __init__(self, epoch: int) -> None:
        super().__init__(f"connection {epoch} lost")
        self.epoch = epoch


class EdgeNode:
    """Drafts on the device and talks to one cloud.

    ``draft``: any :class:`~xcosd.models.LanguageModel`. ``connect``: the cloud's
    endpoint. ``config``: a :class:`~xcosd.config.GenerationConfig`, the defaults of
    every generation on this node; the keyword settings (``method``, ``codec``,
    ``draft_len``, ``temperature``, ``top_k``, ``top_p``, the draft-length policy
    ``adaptive_draft``, ``draft_cost``, ``draft_confidence``, ``max_draft_len``,
    ``speculate`` (drafting while a verdict is in flight) and the method's own options
    ``K``, ``M``, ``hr_presample``, ``threshold``) update it, and every call may
    override them again. ``target_vocab``: the target's
    vocabulary if the device has it (else it is fetched from the cloud once per
    connection); ``vocab_map``: a ready :class:`~xcosd.vocab.VocabMap` (draft, target),
    so many edges on one machine build it once. ``link``: emulate a link (a
    :class:`~xcosd.transport.LinkSpec`);
    ``model_link``: the link used for modeled time (defaults to ``link``).
    ``curve``: a :class:`~xcosd.transport.CurveClient`. ``draft_thread``: draft in a
    worker thread so the event loop stays free (default: yes, except for a context
    model over at most :data:`LOOP_DRAFT_MAX_IDS` ids, whose steps are cheaper than
    the hand-off: :func:`drafts_on_loop`).

    ``on_round``: called with a :class:`RoundObserved` after every round of every
    generation, in the event loop (keep it cheap). It is how a caller observes rounds
    without subclassing; an exception it raises ends that generation between two
    rounds (the session is closed first) and comes out of :meth:`generate`, which is
    how a benchmark stops its devices at the end of a measured window.

    ``open_hold_s``: how long a generation's first open may wait for the requests a
    server marked as arrived with it (``arrivals``, :class:`~xcosd.nodes.arrivals.Arrivals`),
    so that requests sent together share the cloud's first call (0: never wait).

    ``connect_timeout_s``: how long the node looks for its cloud, at start and after
    a loss, before it gives up (``None``: for as long as it takes). ``cloud_wait_s``:
    the longest a generation or render request waits for a cloud that is not
    connected, new or in flight, before it fails with a ``TransportError`` (code
    ``unreachable``; ``None``: until the node gives up). ``reach`` says where the
    node stands (:class:`~xcosd.nodes.reach.Reach`: ``connecting``, ``connected``,
    ``unreachable``, ``closed``).
    """

    def __init__(self, draft: LanguageModel, connect: str = "tcp://127.0.0.1:5555", *,
                 config: GenerationConfig | None = None,
                 method: str | None = None, codec: str | None = None,
                 draft_len: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 transport: str = "zmq", link: LinkSpec | None = None,
                 model_link: LinkSpec | None = None, curve: Any = None,
                 target_vocab: Vocabulary | None = None, vocab_map: VocabMap | None = None,
                 heartbeat_s: float | None = None,
                 timeout_s: float = 15.0, connect_timeout_s: float | None = 30.0,
                 cloud_wait_s: float | None = None,
                 busy_retry_s: float = 0.05, busy_timeout_s: float = 30.0,
                 resend_after_s: float = 2.0, answer_timeout_s: float | None = None,
                 name: str = "xcosd-edge",
                 max_message_bytes: int = 256 << 20, draft_thread: bool | None = None,
                 transport_options: dict[str, Any] | None = None,
                 on_round: Callable[[RoundObserved], None] | None = None,
                 open_hold_s: float = HOLD_S,
                 **method_options: Any) -> None:
        self.draft = draft
        #: the requests a server has accepted and not yet started: a first open
        #: waits for them (bounded), so that those sent together are verified together
        self.arrivals = Arrivals(open_hold_s)
        #: what ``connect`` names: one endpoint, several (comma-separated) or a host
        #: name with several addresses
        self.endpoint = connect
        split_endpoints(connect)  # a list with nothing in it fails here
        self._addresses: Addresses | None = None
        #: the address of the connection held now (or last held)
        self.address: str | None = None
        self.transport = transport
        self.link = link
        self.model_link = model_link if model_link is not None else link
        self.curve = curve
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        if cloud_wait_s is not None and cloud_wait_s < 0:
            raise ValueError(f"cloud_wait_s must be >= 0 or None, got {cloud_wait_s}")
        self.cloud_wait_s = cloud_wait_s
        #: whether the node holds its cloud, and its connecting's counts
        self.reach = Reach(time.monotonic(), connect_timeout_s)
        #: waits for the cloud that ended at ``cloud_wait_s`` (each failed its request)
        self.waits_expired = 0
        #: why the node last gave up looking for its cloud (``reach`` unreachable)
        self.failure: XcosdError | None = None
        #: why the cloud cut this device off (its key revoked), until a handshake
        #: succeeds again: a generation waiting for the cloud fails with it at once
        self._refused: XcosdError | None = None
        self.busy_retry_s = busy_retry_s
        self.busy_timeout_s = busy_timeout_s
        self.resend_after_s = resend_after_s
        self.answer_timeout_s = answer_timeout_s if answer_timeout_s is not None else 4 * timeout_s
        self.name = name
        self.on_round = on_round
        # validated here, so a wrong setting fails when the node is made, not mid-session
        self.config = GenerationConfig.from_kwargs(
            config, method=method, codec=codec, draft_len=draft_len, temperature=temperature,
            top_k=top_k, top_p=top_p, **method_options)
        self.limits = Limits(max_bytes=max_message_bytes, max_frames=4096,
                             max_header_bytes=16 << 20)
        self._transport_options = dict(transport_options or {})
        if vocab_map is not None:
            if vocab_map.draft.fingerprint != draft.vocab.fingerprint:
                raise ValueError("vocab_map was built for another draft vocabulary")
            target_vocab = vocab_map.target
        # the map's builder holds the draft's vocabulary, not this node: a bound method
        # here would make node and handshake a reference cycle, which only a full
        # collection frees (rare in a process with many sessions: xcosd/gc_tuning.py)
        self._handshake = EdgeHandshake(partial(VocabMap, self.draft.vocab), target_vocab, name,
                                        vocab_map)
        self._space: Space | None = None
        self._conn: Connection | None = None
        self._epoch = 0
        self._connected = False
        self._recv_task: asyncio.Task[None] | None = None
        self._hb_task: asyncio.Task[None] | None = None
        #: the one task that connects (at start, and again after every loss)
        self._connector: asyncio.Task[None] | None = None
        #: set when the connector has something to do
        self._wake = asyncio.Event()
        #: the current stretch of connecting: done once it connected, or with the
        #: reason it gave up
        self._stretch: asyncio.Future[None] | None = None
        #: set (and replaced) at every change of ``reach.phase``
        self._changed = asyncio.Event()
        self._control: asyncio.Queue[Message] = asyncio.Queue()
        self._inboxes: dict[int, Inbox] = {}
        #: each running session's uplink bound (GenerationConfig.max_uplink_bytes)
        self._budgets: dict[int, tuple[int, GenerationStats]] = {}
        #: each live generation's draft model session, by session id
        self._drafters: dict[int, Drafter] = {}
        #: the draft-length policy of the last generation that measured its costs
        #: (draft_cost="auto"): the next such generation starts from it
        self._learned: DraftLength | None = None
        #: the tree policy of the last such generation with tree="auto"
        self._learned_ranks: RankRates | None = None
        self._ids = itertools.count(1)
        #: render requests (tokenize, chat_prompt) waiting for their answer, by number
        self._render_ids = itertools.count(1)
        self._renders: dict[int, asyncio.Future[Message]] = {}
        #: what this connection's cloud holds, as far as this node knows: the renders
        #: and id contexts a next turn names instead of sending (xcosd/protocol/
        #: contexts.py); emptied with each new connection, as the cloud's are
        self._held_renders = RenderStore()
        self._held_contexts = ContextStore()
        self._render_slots = asyncio.Semaphore(MAX_RENDERS_IN_FLIGHT)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="xcosd-draft")
        #: speculated drafts' random numbers (unseeded generations only), and how
        #: the last generation that could speculate was paid, per method and warpers
        #: (whether speculation pays depends on both: Drafter.record)
        self._spec_rng = np.random.default_rng()
        self._spoke: dict[tuple[str, SamplingParams], tuple[int, int]] = {}
        self._jobs: set[Future[Any]] = set()
        # a context model over a short vocabulary drafts a round in well under a
        # millisecond: handing it to a thread would cost more (GIL hand-offs) than it
        # saves (LOOP_DRAFT_MAX_IDS)
        self.draft_thread = (not drafts_on_loop(draft) if draft_thread is None
                             else bool(draft_thread))
        self._last_rx = 0.0
        #: when this edge last sent the cloud anything (a ping is then not needed)
        self._last_tx = 0.0
        self._closed = False
        self._overhead: Callable[[list[Any]], int] = lambda frames: 0
        self.meter: Any = None
        self.resumes = 0

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> EdgeNode:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self, *, wait: bool = True) -> EdgeNode:
        """Start connecting to the cloud. ``wait``: return once connected, or raise
        why the cloud could not be reached within ``connect_timeout_s`` (the node is
        then as before the call). ``wait=False``: return at once, connecting in the
        background (a server that answers while its cloud is away: generations
        wait for it, at most ``cloud_wait_s``; ``connected``, ``reach`` and
        :meth:`reach_changed` say how it goes)."""
        self.meter = Meter()
        loop = asyncio.get_running_loop()
        self.reach.begin(time.monotonic())
        self._begin_stretch()
        self._connector = loop.create_task(self._keep_connected(), name="xcosd-edge-connect")
        self._hb_task = loop.create_task(self._heartbeat_loop(), name="xcosd-edge-heartbeat")
        if wait:
            try:
                await self._until_connected(None)
            except BaseException:
                await self._stop_tasks()
                await self._teardown()
                raise
        return self

    async def _stop_tasks(self) -> None:
        for t in (self._hb_task, self._connector):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._hb_task = self._connector = None

    async def close(self) -> None:
        """Close the connection, stop the tasks and the draft thread."""
        if self._closed:
            return
        self._closed = True
        self._lose(self._epoch)
        if self.reach.phase is not ReachPhase.CLOSED:
            self.reach.close(time.monotonic())
            self._notify()
        if self._stretch is not None and not self._stretch.done():
            self._stretch.set_exception(TransportError("the edge node is closed", code="closed"))
        await self._stop_tasks()
        await self._teardown()
        for job in list(self._jobs):
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(job)
        self._executor.shutdown(wait=True)

    @property
    def vocab_map(self) -> VocabMap | None:
        return self._handshake.vmap

    @property
    def server_id(self) -> str | None:
        w = self._handshake.welcome
        return w.server_id if w is not None else None

    @property
    def connected(self) -> bool:
        """Whether the node holds a live connection to its cloud now (an HTTP front
        reports it as its health)."""
        return self._connected and not self._closed

    @property
    def reconnects(self) -> int:
        """Connections made after the first (each one resumed what was running)."""
        return self.reach.reconnects

    async def reach_changed(self) -> None:
        """Return at the next change of ``reach.phase`` (connected, lost, given up,
        closed): how a server reports its cloud's comings and goings."""
        await self._changed.wait()

    async def wait_connected(self) -> None:
        """Return once the node holds its cloud; raise a ``TransportError`` (code
        ``unreachable``) after ``cloud_wait_s``, or the reason the node gave up
        looking for it. A node that had given up looks again (a fresh
        ``connect_timeout_s``)."""
        await self._until_connected(self.cloud_wait_s)

    @property
    def target_name(self) -> str | None:
        """The cloud's target model name, as its welcome said (``None`` before)."""
        w = self._handshake.welcome
        return w.target_name if w is not None else None

    @property
    def target_size(self) -> int | None:
        """The target vocabulary's size (``None`` before the handshake)."""
        w = self._handshake.welcome
        return w.target_size if w is not None else None

    @property
    def target_context(self) -> int:
        """The most target tokens one session holds, prompt and generation together,
        as the cloud's welcome said (0: no bound known, or before the handshake): a
        generation past it is refused ``context_length`` by the cloud, so the HTTP
        API checks it before it opens one."""
        w = self._handshake.welcome
        return w.limits.context if w is not None else 0

    # -- connection ------------------------------------------------------------------

    async def _teardown(self) -> None:
        self._connected = False
        if self._recv_task is not None:
            self._recv_task.cancel()
            # its end, whatever it raised; a cancellation of the caller's still raises
            # (suppressing CancelledError here swallowed the connecting task's own)
            task = self._recv_task
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: it ended, whatever it raised
            self._recv_task = None
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    def _wire(self, frames: list[Any]) -> int:
        return message_bytes(frames) + self._overhead(frames)

    async def _connect_once(self, address: str, attempt_s: float) -> None:
        opts = dict(self._transport_options)
        opts["meter"] = self.meter
        if self.transport != "memory" and not address.startswith("mem://"):
            opts.setdefault("limits", self.limits)
        if self.curve is not None:
            opts["curve"] = self.curve
        conn: Connection = await connect(address, transport=self.transport, **opts)
        if self.link is not None:
            conn = LinkConnection(conn, self.link)
        self._conn = conn
        self._overhead = conn.framing_overhead
        self._epoch += 1
        self._held_renders.clear()  # a new connection: the cloud holds nothing of ours
        self._held_contexts.clear()
        self._control = asyncio.Queue()
        self._last_rx = time.monotonic()
        self._recv_task = asyncio.get_running_loop().create_task(
            self._receive_loop(conn, self._epoch), name="xcosd-edge-recv")
        hs = self._handshake
        pending: list[Message] = [hs.hello()]
        deadline = time.monotonic() + attempt_s
        while True:
            for m in pending:
                await conn.send(pack(m))
            if hs.ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer to the handshake")
            try:
                async with asyncio.timeout(min(left, self.resend_after_s)):
                    msg = await self._control.get()
            except TimeoutError:
                pending = hs.resend()  # a lost hello or upload: the same step again
                continue
            if isinstance(msg, _Lost):
                raise TransportError("connection lost during the handshake", code="closed")
            try:
                pending = hs.receive(msg).send
            except XcosdError as e:
                if e.code in RETRY_CONNECT_CODES:  # leaving: another address, or later
                    raise TransportError(f"{address}: {e.message}", code=e.code) from e
                raise
        vmap = hs.vmap
        assert vmap is not None
        if self._space is None or self._space.target_size != vmap.target.size:
            self._space = Space.from_vocab_map(vmap)
        if self.heartbeat_s is None and hs.welcome is not None:
            self.heartbeat_s = hs.welcome.limits.heartbeat_s or 1.0
        self._connected = True
        self._refused = None
        self.address = address
        self.reach.connected_now(time.monotonic())
        log.info("edge connected to %s (cloud %s)", address, self.server_id)

    async def _connect_with_retry(self) -> None:
        """Connect to one of the addresses, each pass over them in turn
        (xcosd/transport/addresses.py), with a jittered pause after a pass in which
        none answered, until ``reach`` gives up (past ``connect_timeout_s``, if
        set): then raise why."""
        reach = self.reach
        most_s = (self.timeout_s if self.connect_timeout_s is None
                  else min(self.timeout_s, self.connect_timeout_s))
        while True:
            found = await resolve(self.endpoint, ipv6=self.transport != "zmq")
            if self._addresses is None:
                self._addresses = Addresses(found)
            else:
                self._addresses.update(found)
            several = len(found) > 1
            error: BaseException | None = None
            for address in self._addresses.pass_():
                self._stop_if_asked()
                attempt = reach.attempt_s(time.monotonic(), most_s)
                if several:
                    attempt = min(attempt, ATTEMPT_TIMEOUT_S)
                self._addresses.tried(address)
                try:
                    await self._connect_once(address, attempt)
                except (TransportError, TimeoutError, OSError) as e:
                    await self._teardown()
                    error = e
                    # asyncio's TimeoutError has no text: say what timed out
                    reach.attempt_failed(str(e) or f"no answer within {attempt:g} s")
                    log.info("cloud at %s not reachable (%s)", address, reach.error)
                    if reach.left_s(time.monotonic()) == 0:
                        break
                    continue
                except XcosdError as e:
                    await self._teardown()
                    reach.give_up(time.monotonic(), str(e))
                    raise
                return
            delay = reach.pause(time.monotonic())
            if delay is None:
                raise TransportError(f"cannot reach the cloud at {self.endpoint}: {reach.error} "
                                     f"(tried for {self.connect_timeout_s:g} s)",
                                     code="connect") from error
            log.info("no cloud reachable; retrying in %.2fs", delay)
            self._stop_if_asked()
            await asyncio.sleep(delay)

    def _stop_if_asked(self) -> None:
        """End the connecting task here if it was asked to stop, even where the
        cancellation was swallowed on its way (an await under
        ``contextlib.suppress(CancelledError)`` in code it passes through): a
        retry loop that took it for a failed attempt would go on for ever when
        there is no deadline, and ``close()`` with it."""
        task = asyncio.current_task()
        if self._closed or (task is not None and task.cancelling()):
            raise asyncio.CancelledError

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _begin_stretch(self) -> None:
        """A stretch of connecting begins: its waiters wait on a new future."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # a stretch nobody waited for may end in an error: retrieved here, so it is
        # not reported as an exception never retrieved
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._stretch = fut
        self._wake.set()

    async def _keep_connected(self) -> None:
        """The node's one connecting task: connects whenever ``reach`` says it is
        looking for the cloud (at start, after a loss, after a retry), and ends that
        stretch's future either way."""
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            stretch = self._stretch
            if self._connected or self.reach.phase is not ReachPhase.CONNECTING:
                continue
            try:
                await self._teardown()
                await self._connect_with_retry()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = e if isinstance(e, XcosdError) else TransportError(
                    f"cannot reach the cloud at {self.endpoint}: {type(e).__name__}: {e}",
                    code="connect")
                if not isinstance(e, XcosdError):
                    log.exception("connecting to the cloud failed", exc_info=e)
                if self.reach.phase is ReachPhase.CONNECTING:
                    self.reach.give_up(time.monotonic(), str(err))
                self.failure = err
                log.info("%s", err)  # raised to whoever waits for the cloud
                self._notify()
                if stretch is not None and not stretch.done():
                    stretch.set_exception(err)
                continue
            if self.reach.connects > 1:
                self.resumes += 1
            self._notify()
            if stretch is not None and not stretch.done():
                stretch.set_result(None)

    async def _until_connected(self, bound_s: float | None) -> None:
        """Wait for the connecting task to connect: at most ``bound_s`` (``None``:
        until it gives up, whose reason is raised)."""
        started = time.monotonic()
        while not self._connected:
            if self._closed:
                raise TransportError("the edge node is closed", code="closed")
            if self.reach.phase is ReachPhase.UNREACHABLE:  # a new stretch, asked for now
                self.reach.retry(time.monotonic())
                self._begin_stretch()
                self._notify()
            stretch = self._stretch
            if stretch is None:
                raise TransportError("the edge node is not started (await edge.start(), or "
                                     "use it in `async with`)", code="closed")
            left = None if bound_s is None else bound_s - (time.monotonic() - started)
            try:
                if left is not None and left <= 0:
                    raise TimeoutError
                async with asyncio.timeout(left):
                    if stretch.done() and stretch.exception() is None:
                        await self._changed.wait()  # connected and lost since: the next
                    else:
                        await asyncio.shield(stretch)
            except TimeoutError:
                self.waits_expired += 1
                raise TransportError(
                    f"the cloud at {self.endpoint} is not connected (waited {bound_s:g} s; "
                    f"{self.reach.error or 'connecting'})", code="unreachable") from None
            except XcosdError as e:
                raise copy.copy(e).with_traceback(None) from None  # one raise per waiter

    async def _recover(self, seen_epoch: int) -> None:
        """Wait for the connection that replaces the one of ``seen_epoch`` (the
        connecting task makes it, once per loss however many sessions noticed it),
        at most ``cloud_wait_s``. Called on the connection held, it drops that
        one first (a reconnect, to the next address)."""
        if self._closed:
            raise TransportError("the edge node is closed", code="closed")
        if self._connected and self._epoch == seen_epoch:
            self._lose(seen_epoch, "a reconnect was asked for")
        if self._refused is not None:
            raise copy.copy(self._refused).with_traceback(None)
        await self._until_connected(self.cloud_wait_s)

    def _lose(self, epoch: int, why: str = "the connection was lost") -> None:
        if epoch != self._epoch:
            return
        held = self._connected
        self._connected = False
        lost = _Lost(epoch)
        self._control.put_nowait(lost)  # type: ignore[arg-type]
        for q in self._inboxes.values():
            q.put_nowait(lost)
        if held and not self._closed:
            log.warning("connection to the cloud lost (%s); reconnecting", why)
            self.reach.lost(time.monotonic(), why)
            self._begin_stretch()
            self._notify()

    async def _receive_loop(self, conn: Connection, epoch: int) -> None:
        while True:
            try:
                frames = await conn.recv()
            except TransportError as e:
                log.info("receive failed: %s", e)
                self._lose(epoch, str(e))
                return
            self._last_rx = time.monotonic()
            try:
                header, buffers = decode_message(frames, limits=self.limits)
                msg = from_wire(header, [bytes(b) for b in buffers])
            except ProtocolError as e:
                log.warning("dropped a malformed message from the cloud: %s", e)
                continue
            s = getattr(msg, "s", None)
            if isinstance(msg, Rendered) or (isinstance(msg, Error) and msg.n is not None):
                fut = self._renders.get(msg.n)  # type: ignore[arg-type]
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, Ping):
                with contextlib.suppress(TransportError):
                    await conn.send(pack(Pong(msg.n)))
            elif isinstance(msg, Pong):
                pass
            elif s is not None:
                q = self._inboxes.get(s)
                if q is not None:
                    q.put_nowait((msg, self._wire(frames)))
            elif isinstance(msg, Error) and msg.code in LOST_CODES and self._connected:
                # the cloud restarted and does not know us, or it is leaving
                self._lose(epoch, f"the cloud answered {msg.code}")
            elif isinstance(msg, Error) and msg.code == ErrorCode.CURVE and self._connected:
                # its operator revoked this device's key: the cloud hears it no more
                # (each session was told first); a new handshake is refused too
                self._refused = exception_for(msg.code, msg.message)
                self._lose(epoch, f"the cloud refused this device: {msg.message}")
            else:
                self._control.put_nowait(msg)

    async def _heartbeat_loop(self) -> None:
        n = 0
        while True:
            ivl = self.heartbeat_s or 1.0
            await asyncio.sleep(ivl)
            if not self._connected or self._conn is None:
                continue
            if time.monotonic() - self._last_rx > self.timeout_s:
                # the connecting task reconnects, whether or not a generation waits
                self._lose(self._epoch, f"the cloud was silent for {self.timeout_s:g} s")
                continue
            now = time.monotonic()
            if now - self._last_rx < ivl and now - self._last_tx < ivl:
                # rounds are flowing both ways: each side just heard from the other,
                # which is all a ping and its pong would tell it
                continue
            n += 1
            self._last_tx = now
            with contextlib.suppress(TransportError):
                await self._conn.send(pack(Ping(n)))

    # -- generations ---------------------------------------------------------------

    async def generate(self, prompt: Prompt, max_new_tokens: int | None = None, *,
                       config: GenerationConfig | None = None, method: str | None = None,
                       codec: str | None = None, draft_len: int | None = None,
                       do_sample: bool | None = None, temperature: float | None = None,
                       top_k: int | None = None, top_p: float | None = None,
                       stop: str | Sequence[str] | None = None,
                       stop_strings: str | Sequence[str] | None = None,
                       seed: int | None = None, on_text: Callable[[str], None] | None = None,
                       timeout_s: float | None = None, ignore_eos: bool | None = None,
                       arrival: Arrival | None = None, stats: GenerationStats | None = None,
                       **method_options: Any) -> GenerationResult:
        """Generate up to ``max_new_tokens`` target tokens after ``prompt``.

        ``prompt``: text, or a list of **target** token ids (the cloud's context is then
        exactly those ids, as if the target had been given them). Settings come from
        ``config`` (default: the node's), updated by the keyword names, which are
        transformers' where they overlap (``do_sample=False`` is greedy; ``stop`` is an
        alias of ``stop_strings``). Generation stops at the target's end-of-sequence
        token (``finish_reason "stop"``), at ``max_new_tokens`` (``"length"``), or once
        the output text contains a stop string (``"stop"``; the text ends with it and
        ``token_ids`` end with the token that completed it). ``on_text``, if given, is
        called with each piece of text as it is committed. ``timeout_s``: the whole
        generation's deadline (:class:`TimeoutError` past it). ``ignore_eos``: run
        past the target's end tokens to ``max_new_tokens`` (vLLM's name).
        ``arrival``: the mark a server took when this generation's request arrived
        (``arrivals.arrived()``): the first open goes with those of the requests that
        arrived beside it (:class:`~xcosd.nodes.arrivals.Arrivals`). ``stats``: a
        fresh :class:`GenerationStats` to count into, readable while the generation
        runs and after it failed (what a server meters per client)."""
        cfg = self._config_for(config, max_new_tokens=max_new_tokens, method=method,
                               codec=codec, draft_len=draft_len, do_sample=do_sample,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               stop=stop, stop_strings=stop_strings, seed=seed,
                               timeout_s=timeout_s, ignore_eos=ignore_eos, **method_options)
        return await self._generate(prompt, cfg, on_text, arrival, stats)

    async def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        """``text`` as the target's token ids, tokenised by the cloud's target: the
        context an ``open`` with this text starts from, so ``generate(ids)`` equals
        ``generate(text)`` and the caller knows the prompt's length in the target's
        tokens first. ``timeout_s``: the deadline (default ``answer_timeout_s``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return await self._render(None, text, timeout_s)

    async def chat_prompt(self, messages: Sequence[Mapping[str, str]], *,
                          timeout_s: float | None = None) -> list[int]:
        """A chat as the target's token ids, rendered on the cloud by the **target's**
        chat template with the generation prompt added: ``generate(ids)`` is then the
        target's own answer to the conversation (and ends at its end-of-turn token,
        which the cloud lists among its stop ids). ``messages``: ``{"role", "content"}``
        maps, roles ``system``, ``user``, ``assistant``. A target without a template
        raises :class:`~xcosd.errors.ProtocolError` with code ``unsupported``."""
        chat: list[tuple[str, str]] = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES or not isinstance(content, str):
                raise ValueError(f"messages[{i}]: a role of {', '.join(CHAT_ROLES)} and a "
                                 f"string content, got {role!r}")
            chat.append((str(role), content))
        if not chat:
            raise ValueError("a chat has at least one message")
        return await self._render(tuple(chat), None, timeout_s)

    async def _render(self, chat: Chat | None, text: str | None,
                      timeout_s: float | None) -> list[int]:
        """A render, by reference to an earlier one of this connection where one
        shares its start (the request's rest goes, and the answer's): a chat's next
        turn costs the link its new messages. A reference the cloud no longer holds
        (``no_context``) is asked again whole."""
        epoch = self._epoch
        ref = self._held_renders.longest(text, chat)
        base = None if ref is None else self._held_renders.get(ref[0])
        if ref is not None and base is not None:
            key, keep = ref
            rest_chat = None if chat is None else chat[keep:]
            rest_text = None if text is None else text[keep:]
            try:
                answer = await self._render_request(
                    Render(0, text=rest_text, chat=rest_chat, base=key, keep=keep), timeout_s)
                ids = np.concatenate([base.ids[:answer.keep].astype(np.int64),
                                      answer.ids.astype(np.int64)])
            except ProtocolError as e:
                if e.code != "no_context":
                    raise
                self._held_renders.drop(key)
                ref = None
        if ref is None or base is None:
            answer = await self._render_request(Render(0, text=text, chat=chat), timeout_s)
            ids = answer.ids.astype(np.int64)
        if self._epoch == epoch:  # the cloud that answered holds it now
            self._held_renders.put(text, chat, ids)
            self._held_contexts.put(ids)
        return [int(i) for i in ids.tolist()]

    async def _render_request(self, request: Render, timeout_s: float | None) -> Rendered:
        """Send ``request`` (numbered here) and wait for its answer; asked again
        every ``resend_after_s`` (after a reconnect too) until the deadline. At most
        :data:`MAX_RENDERS_IN_FLIGHT` of a node's requests are at the cloud at once
        (the rest wait here, within their deadline); a ``busy`` answer is asked again
        after a pause, for at most ``busy_timeout_s``, as a generation's is. Without
        a ``timeout_s`` of the caller's, a cloud not connected yet is waited for
        first, as a generation waits for it (``cloud_wait_s``): the default deadline
        is for the answer of a cloud that is there."""
        if self._closed:
            raise TransportError("the edge node is closed", code="closed")
        if timeout_s is None and not self._connected:
            await self._recover(self._epoch)
        n = next(self._render_ids)
        msg = dataclasses.replace(request, n=n)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s if timeout_s is not None
                                       else self.answer_timeout_s), self._render_slots:
                delay, busy_since = self.busy_retry_s, 0.0
                while True:
                    fut: asyncio.Future[Message] = loop.create_future()
                    self._renders[n] = fut
                    answer = await self._render_once(msg, fut)
                    if not (isinstance(answer, Error) and answer.code == "busy"):
                        break
                    busy_since = busy_since or time.monotonic()
                    delay = await self._busy_pause(None, delay, busy_since)
        finally:
            self._renders.pop(n, None)
        if isinstance(answer, Error):
            raise exception_for(answer.code, answer.message)
        assert isinstance(answer, Rendered)
        return answer

    async def _render_once(self, msg: Render, fut: asyncio.Future[Message]) -> Message:
        """Send ``msg`` until ``fut`` (its answer) is set: again every
        ``resend_after_s``, and after a reconnect (the caller holds the deadline)."""
        while True:
            if not self._connected:
                await self._recover(self._epoch)
            conn, epoch = self._conn, self._epoch
            frames = pack(msg)
            welcome = self._handshake.welcome
            if welcome is not None and message_bytes(frames) > welcome.limits.max_message:
                raise ProtocolError("the prompt exceeds the cloud's message limit of "
                                    f"{welcome.limits.max_message} bytes", code="too_large")
            if conn is not None:
                try:
                    await conn.send(frames)
                    self._last_tx = time.monotonic()
                except TransportError as e:
                    self._lose(epoch, str(e))
                    continue
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(fut), self.resend_after_s)

    async def stream(self, prompt: Prompt, max_new_tokens: int | None = None, *,
                     config: GenerationConfig | None = None, method: str | None = None,
                     codec: str | None = None, draft_len: int | None = None,
                     do_sample: bool | None = None, temperature: float | None = None,
                     top_k: int | None = None, top_p: float | None = None,
                     stop: str | Sequence[str] | None = None,
                     stop_strings: str | Sequence[str] | None = None,
                     seed: int | None = None, timeout_s: float | None = None,
                     ignore_eos: bool | None = None, arrival: Arrival | None = None,
                     **method_options: Any) -> AsyncIterator[str]:
        """Like :meth:`generate`, yielding text as it is committed (whole UTF-8
        characters only; never past a stop string). Leaving the loop early closes the
        session on the cloud."""
        cfg = self._config_for(config, max_new_tokens=max_new_tokens, method=method,
                               codec=codec, draft_len=draft_len, do_sample=do_sample,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               stop=stop, stop_strings=stop_strings, seed=seed,
                               timeout_s=timeout_s, ignore_eos=ignore_eos, **method_options)
        q: asyncio.Queue[str | None] = asyncio.Queue()

        def on_text(text: str) -> None:
            if text:
                q.put_nowait(text)

        task = asyncio.get_running_loop().create_task(self._generate(prompt, cfg, on_text,
                                                                     arrival))
        task.add_done_callback(lambda _t: q.put_nowait(None))
        try:
            while True:
                piece = await q.get()
                if piece is None:
                    break
                yield piece
            await task  # re-raise its error, if any
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _config_for(self, config: GenerationConfig | None, **kw: Any) -> GenerationConfig:
        """One call's settings: ``config`` (else the node's) with the keywords given.

        A call that switches method keeps only the node's options the new method takes
        (GenerationConfig.replace), so ``generate(..., method="xcosd")`` on an
        ``xcosd-e`` node with ``K=5`` works, while ``K=5`` named in that call is an error.
        """
        if config is not None and not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
        return GenerationConfig.from_kwargs(config if config is not None else self.config, **kw)

    def _prompt_ids(self, prompt: Prompt) -> np.ndarray | None:
        """A token-id prompt as int64 target ids (checked), ``None`` for text."""
        if isinstance(prompt, str):
            return None
        if isinstance(prompt, bytes | bytearray):
            raise TypeError("a prompt is text or a list of target token ids, not bytes")
        ids = list(prompt)
        if not all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
            raise TypeError("a token-id prompt must hold integers (target token ids)")
        a = np.asarray(ids, dtype=np.int64)
        vmap = self._handshake.vmap
        size = vmap.target.size if vmap is not None else None
        if a.size and (int(a.min()) < 0 or (size is not None and int(a.max()) >= size)):
            raise ValueError(f"prompt token ids must be target ids in 0..{(size or 0) - 1}")
        return a

    def _session(self, s: int, prompt: Prompt, cfg: GenerationConfig) -> EdgeSession:
        m: Method = get_method(cfg.method, codec=cfg.codec, **cfg.method_options())
        params = cfg.sampling_params()
        vmap, welcome = self._handshake.vmap, self._handshake.welcome
        assert vmap is not None and welcome is not None and self._space is not None
        ids = self._prompt_ids(prompt)
        # the draft only conditions on the prompt: a token-id prompt reaches it as the
        # text of those target ids (the cloud gets the ids themselves, see _open)
        text = (vmap.target.decode(ids.tolist()).decode("utf-8", errors="replace")
                if ids is not None else str(prompt))
        base = None
        if ids is not None:  # a context this connection's cloud holds starts it: name it
            base = self._held_contexts.longest(ids)
            if base is not None and base[1] < MIN_REFERENCE:
                base = None
            self._held_contexts.put(ids)
        drafter = self._drafters[s] = Drafter(self.draft, vmap, params, text)
        record = self._spoke.get((m.name, params))
        if record is not None:  # how the last such generation's speculation paid
            drafter.carry(record)
        es = EdgeSession(
            s, method=m, vmap=vmap, space=self._space,
            prompt="" if ids is not None else text,
            max_new_tokens=cfg.max_new_tokens, params=params,
            stop_ids=() if cfg.ignore_eos else welcome.stop_ids,
            draft_len=cfg.draft_len, max_draft=welcome.limits.max_draft, seed=cfg.seed,
            prompt_ids=ids, adaptive_draft=cfg.adaptive_draft,
            draft_confidence=cfg.draft_confidence, max_draft_len=cfg.max_draft_len,
            draft_cost=cfg.resolved_draft_cost(), tree=cfg.tree,
            max_tree=welcome.limits.max_tree, tree_row_codec=cfg.tree_row_codec,
            tree_distinct=cfg.tree_distinct, prompt_base=base)
        # the draft's prompt computed beside the open's round trip, not before it
        es.draft_later = (self.draft_thread and m.drafts
                          and drafter.uncached_prompt() >= PREFILL_OVERLAP)
        if self._learned is not None:  # draft_cost="auto": what the last one measured
            es.drafting.adopt(self._learned)
            if es.drafting.measure and es.tree == "auto" and self._learned_ranks is not None:
                es.tree_rates.adopt(self._learned_ranks)
        return es

    async def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.draft_thread:
            return fn(*args)
        job = self._executor.submit(fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return await asyncio.wrap_future(job)

    async def _generate(self, prompt: Prompt, cfg: GenerationConfig,
                        on_text: Callable[[str], None] | None,
                        arrival: Arrival | None = None,
                        stats: GenerationStats | None = None) -> GenerationResult:
        try:
            return await self._generation(prompt, cfg, on_text, arrival, stats)
        finally:
            if arrival is not None:  # it ended before its open: none waits for it
                arrival.sent()

    async def _generation(self, prompt: Prompt, cfg: GenerationConfig,
                          on_text: Callable[[str], None] | None,
                          arrival: Arrival | None,
                          stats: GenerationStats | None = None) -> GenerationResult:
        if self._closed:
            raise TransportError("the edge node is closed", code="closed")
        if not self._connected:
            await self._recover(self._epoch)
        s = next(self._ids)
        es = self._session(s, prompt, cfg)
        prompt_ids = self._prompt_ids(prompt)
        watch = _StopStrings(cfg.stop_strings, on_text)
        st = stats if stats is not None else GenerationStats()
        st.method, st.codec = es.method.name, es.method.codec.name
        trace: list[tuple[str, int]] = []
        inbox = self._inboxes[s] = Inbox()
        if cfg.max_uplink_bytes is not None:
            self._budgets[s] = (cfg.max_uplink_bytes, st)
        t0 = time.perf_counter()
        speculate = cfg.resolved_speculate()
        try:
            async with asyncio.timeout(cfg.timeout_s):
                # the first round opens the session: its draft rides on the open
                while not es.done and watch.end is None:
                    try:
                        if es.phase is EdgePhase.RESOLVING:  # resumed mid-round (Redo)
                            await self._finish_round(es, inbox, st, trace, watch.feed, None)
                        else:
                            await self._round(es, inbox, st, trace, watch.feed, speculate,
                                              arrival)
                    except _ConnectionLost as lost:
                        await self._resume(es, inbox, st, trace, lost.epoch, prompt_ids)
                    except _SessionLost:  # the cloud closed this session (idle): re-open it
                        st.resumes += 1
                        await self._open(es, inbox, st, trace, prompt_ids)
        finally:
            self._inboxes.pop(s, None)
            self._budgets.pop(s, None)
            inbox.close()
            if es.drafting.measure and es.drafting.step_s is not None:
                self._learned = es.drafting
                if es.tree == "auto":
                    self._learned_ranks = es.tree_rates
            if es.opens and self._connected and self._conn is not None:
                with contextlib.suppress(Exception):
                    await self._send(es.close(), st, None)
            drafter = self._drafters.pop(s)
            st.speculated, st.speculated_used = drafter.speculated, drafter.reused
            if speculate:
                key = (es.method.name, drafter.params)
                self._spoke.pop(key, None)
                self._spoke[key] = drafter.record
                while len(self._spoke) > SPECULATION_RECORDS:  # the oldest settings go
                    del self._spoke[next(iter(self._spoke))]
            with contextlib.suppress(Exception):
                await self._in_worker(drafter.end)
            st.caught_up = drafter.caught_up  # its jobs ran before end, in the one thread
            st.prefilled_beside = drafter.prefilled
        text, token_ids = es.text, list(es.token_ids)
        if watch.end is not None:  # a stop string: the output ends with it
            text = watch.text[:watch.end]
            assert es.vmap is not None
            token_ids = token_ids[:_ids_covering(es.vmap.target, token_ids, watch.end)]
        st.wall_s = time.perf_counter() - t0
        st.tokens = len(token_ids)
        st.finish_reason = "stop" if watch.end is not None else (es.finish_reason or "")
        st.target_calls = st.rounds
        st.modeled_s = st.draft_compute_s + st.cloud_compute_s + (
            sequence_latency(trace, self.model_link) if self.model_link is not None else 0.0)  # type: ignore[arg-type]
        return GenerationResult(text, token_ids, st)

    async def _send(self, msg: Message, st: GenerationStats,
                    trace: list[tuple[str, int]] | None) -> None:
        conn, epoch = self._conn, self._epoch
        if conn is None or not self._connected:
            raise _ConnectionLost(epoch)
        frames = pack(msg)
        size = message_bytes(frames)
        welcome = self._handshake.welcome
        if welcome is not None and size > welcome.limits.max_message:
            # the cloud would refuse it before it can tell whose it is, and this
            # generation would wait for an answer that never comes: fail it here
            raise ProtocolError(f"a {msg.TYPE} message of {size} bytes exceeds the cloud's "
                                f"limit of {welcome.limits.max_message}", code="too_large")
        n = size + self._overhead(frames)
        self._within_budget(msg, n)
        try:
            await conn.send(frames)
        except TransportError as e:
            self._lose(epoch, str(e))
            raise _ConnectionLost(epoch) from e
        self._last_tx = time.monotonic()
        st.count("up", msg.TYPE, n)
        if trace is not None:
            trace.append(("up", n))

    def _within_budget(self, msg: Message, n: int) -> None:
        """Refuse to send ``msg`` (``n`` wire bytes) where its session would pass its
        uplink bound; a ``close`` always goes (it frees the cloud's session)."""
        if not isinstance(msg, SessionMessage) or isinstance(msg, Close):
            return
        bound = self._budgets.get(msg.s)
        if bound is not None and bound[1].uplink_bytes + n > bound[0]:
            raise BudgetError(f"session {msg.s}: a {msg.TYPE} message of {n} bytes would take "
                              f"the bytes sent to the cloud past this generation's bound of "
                              f"{bound[0]} (sent so far: {bound[1].uplink_bytes})")

    async def _next(self, es: EdgeSession, inbox: Inbox, st: GenerationStats,
                    trace: list[tuple[str, int]]) -> Message:
        """The next message for ``es``. An answer that is late is asked for again
        (same ``seq``: see the module docstring), up to ``answer_timeout_s``."""
        deadline = time.monotonic() + self.answer_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"session {es.s}: no answer from the cloud within "
                                   f"{self.answer_timeout_s:g} s")
            try:
                item = await inbox.get(min(self.resend_after_s, left))
            except TimeoutError:
                again = es.resend_last()
                if again is not None:
                    st.resends += 1
                    await self._send(again, st, trace)
                continue
            if not isinstance(item, _Lost):
                break
            if item.epoch == self._epoch or self._closed:
                raise _ConnectionLost(item.epoch)
            # a loss notice from a connection already replaced: ignore it
        msg, n = item
        st.count("down", msg.TYPE, n)
        trace.append(("down", n))
        if isinstance(msg, Error) and msg.code in SESSION_LOST_CODES:
            raise _SessionLost(msg.message)  # this session only: open it again
        if isinstance(msg, Error) and msg.code in LOST_CODES:
            # the cloud does not know this connection any more (it restarted)
            epoch = self._epoch
            self._lose(epoch, f"the cloud answered {msg.code}")
            raise _ConnectionLost(epoch)
        return msg

    async def _busy_pause(self, st: GenerationStats | None, delay: float, since: float) -> float:
        """Wait before retrying a ``busy`` refusal (a generation's, counted in ``st``,
        or a render's); the next delay. Past ``busy_timeout_s`` of refusals the
        request fails (typed ``busy``)."""
        if time.monotonic() - since > self.busy_timeout_s:
            raise exception_for("busy", f"the cloud stayed busy for {self.busy_timeout_s:g} s")
        if st is not None:
            st.busy_retries += 1
        await asyncio.sleep(delay)
        return min(1.0, delay * 2)

    async def _open(self, es: EdgeSession, inbox: Inbox, st: GenerationStats,
                    trace: list[tuple[str, int]], prompt_ids: np.ndarray | None) -> None:
        """Open (or re-open) ``es``: on a new connection or a lost session with a new
        ``open``; after ``busy`` with the same one again (nothing was generated, so
        a seeded generation stays the same)."""
        delay, since = self.busy_retry_s, time.monotonic()
        msg: Message = es.open()
        while True:
            try:
                await self._send(msg, st, trace)
                while True:
                    out = es.receive(await self._next(es, inbox, st, trace))
                    if out.events:
                        break  # else a stale answer was dropped, or the open went
                    for m in out.send:  # again whole (no_context): wait on
                        await self._send(m, st, trace)
                    out.send.clear()
                for m in out.send:  # a redone round's draft (Redo)
                    await self._send(m, st, trace)
            except _ConnectionLost as lost:
                await self._recover(lost.epoch)
                inbox.clear()
                msg = es.open()
                continue
            except _SessionLost:
                msg = es.open()
                continue
            if any(isinstance(e, Retry) for e in out.events):
                delay = await self._busy_pause(st, delay, since)
                msg = es.resend()
                continue
            return

    async def _resume(self, es: EdgeSession, inbox: Inbox, st: GenerationStats,
                      trace: list[tuple[str, int]], epoch: int,
                      prompt_ids: np.ndarray | None) -> None:
        await self._recover(epoch)
        inbox.clear()  # whatever the old connection left behind
        st.resumes += 1
        await self._open(es, inbox, st, trace, prompt_ids)

    async def _round(self, es: EdgeSession, inbox: Inbox, st: GenerationStats,
                     trace: list[tuple[str, int]], on_text: Callable[[str], None] | None,
                     speculate: bool = False, arrival: Arrival | None = None) -> None:
        t = time.perf_counter()
        before = (time.monotonic(), len(es.token_ids), st.uplink_bytes, st.downlink_bytes,
                  st.drafted, st.accepted) if self.on_round is not None else None
        drafter = self._drafters[es.s]
        reused = drafter.reused
        out = es.next_round()
        for ev in out.events:
            if isinstance(ev, DraftNeeded):  # the draft model runs in the worker
                out = es.take(await self._in_worker(drafter.run, ev) if self.draft_thread
                              else drafter.run(ev))
        [msg] = out.send
        drafting_s = time.perf_counter() - t
        st.draft_compute_s += drafting_s
        opening = isinstance(msg, Open)
        if opening:  # with those of the requests that arrived beside it
            await self.arrivals.gather(arrival)
        try:
            await self._send(msg, st, trace)
        finally:
            if opening and arrival is not None:
                # gone, or lost with the connection (its resume opens again
                # later): nothing asked for this request waits behind it any more
                arrival.sent()
        block = getattr(msg, "draft", None)  # a draft's, or round 0's on the open
        drafted = block.length if block is not None else 0
        # what the draft-length policy may measure (draft_cost="auto"): a draft
        # step's seconds (of the tokens drawn now, not the speculated ones taken),
        # and when the draft left (its verdict closes the round)
        # (a tree's draft steps are its depths: each one is a call)
        fresh = (block.shape.depth if isinstance(block, DraftTree)
                 else drafted - (drafter.reused - reused))
        timing = (drafting_s / fresh if fresh else None, time.perf_counter(), drafted)
        stop = (self._speculate(es, drafter) if speculate and drafted and not es.tree_round
                else None)
        if opening and es.draft_later:
            self._in_background(drafter.prefill)
        elif not drafted:
            self._catch_up(es, drafter)
        try:
            await self._finish_round(es, inbox, st, trace, on_text, before, timing, stop)
        finally:
            if stop is not None:
                stop.set()

    def _catch_up(self, es: EdgeSession, drafter: Drafter) -> None:
        """A round that drafted nothing leaves the edge's core idle until its verdict:
        compute the draft context's pending tokens there (the tokens the last rounds
        emitted), so the next round that drafts (a probe of the length policy, most
        often) pays only its draft steps, and the draft step it measures is one.
        Not beside another generation, whose drafts would wait behind it in the one
        draft thread."""
        if (not self.draft_thread or len(self._drafters) > 1 or not es.method.drafts
                or es.remaining < 3):  # after this round's token, no round could draft
            return
        drop, append = es.take_edits()
        if not (drop or append):
            return
        self._in_background(drafter.catch_up, drop, append)

    def _in_background(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn`` in the draft thread, not waited for: the generation's next call
        there queues behind it."""
        job = self._executor.submit(fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    def _speculate(self, es: EdgeSession, drafter: Drafter) -> threading.Event | None:
        """Draft on while the verdict is in flight (see :class:`Drafter`): as many
        steps as the measured wait has room for (none before both are measured,
        nor where drafting does not pay, nor beside another generation, whose
        drafts would wait behind these in the one draft thread, nor while
        verdicts seldom take the speculated path: :meth:`Drafter.worth_speculating`).
        Returns the event that stops it, set when the verdict arrives."""
        policy = es.drafting
        if (policy.step_s is None or policy.fixed_s is None or policy.ceiling == 0
                or len(self._drafters) > 1 or not drafter.worth_speculating()):
            return None
        # the bonus guess, then up to a whole block past it
        n = min(policy.most_next + 1, int(SPECULATE_SHARE * policy.fixed_s / policy.step_s))
        if n < 2:
            return None
        stop = threading.Event()
        args = (n, es.method, es.space, self._spec_rng, stop.is_set)
        if not self.draft_thread:
            drafter.speculate(*args)
            return stop
        job = self._executor.submit(drafter.speculate, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return stop

    async def _finish_round(self, es: EdgeSession, inbox: Inbox,
                            st: GenerationStats, trace: list[tuple[str, int]],
                            on_text: Callable[[str], None] | None,
                            before: tuple[float, int, int, int, int, int] | None,
                            timing: tuple[float | None, float, int] | None = None,
                            stop: threading.Event | None = None) -> None:
        """Feed the round's answers to ``es`` (sending its follow-ups) until it settles;
        ``timing`` (a draft step's seconds, when the draft was sent, the tokens it
        sent for verification) goes to the draft-length policy when the verdict
        arrives."""
        delay, since = self.busy_retry_s, time.monotonic()
        while True:
            reply = await self._next(es, inbox, st, trace)
            if isinstance(reply, VerdictMsg):
                if stop is not None:  # speculation has done what it could
                    stop.set()
                st.cloud_compute_s += reply.compute_us / 1e6
                self.arrivals.observe(reply.compute_us / 1e6)
                if timing is not None:
                    es.drafting.observe(timing[0], time.perf_counter() - timing[1], timing[2])
                    timing = None
            if isinstance(reply, Error) and reply.code not in ("busy", "replay", "no_context"):
                raise exception_for(reply.code, reply.message)
            if isinstance(getattr(reply, "reply", None), FullVectorReply | HybridReply):
                # decoding a vocabulary-sized vector and its residual: off the loop
                out = await self._in_worker(es.receive, reply)
            else:
                out = es.receive(reply)
            for m in out.send:
                await self._send(m, st, trace)
            settled = False
            for ev in out.events:
                if isinstance(ev, Retry):
                    delay = await self._busy_pause(st, delay, since)
                    await self._send(es.resend(), st, trace)
                elif isinstance(ev, TokensEmitted):
                    st.tokens += len(ev.token_ids)  # so far; the end sets the output's
                    if on_text is not None and ev.text:
                        on_text(ev.text)
                elif isinstance(ev, RoundSettled):
                    settled = True
                    st.settle(ev)
                elif isinstance(ev, Finished):
                    settled = True
            if settled:
                if before is not None and self.on_round is not None:
                    t0, n0, up0, down0, d0, a0 = before
                    self.on_round(RoundObserved(
                        es.s, t0, time.monotonic(), len(es.token_ids) - n0,
                        st.uplink_bytes - up0, st.downlink_bytes - down0, st.drafted - d0,
                        st.accepted - a0))
                return
