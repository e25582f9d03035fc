"""The edge node's link to its cloud: reaching it, keeping it, losing it.

An edge node holds one connection at a time and runs every generation and render
request over it. :class:`EdgeConnection` is that connection's half of the node: one
task connects (at start and again after every loss, with jittered backoff, to the
next of the cloud's addresses: ``xcosd/transport/addresses.py``; the states it goes
through are ``xcosd/nodes/reach.py``'s), one receives and routes what the cloud sends
(a session's messages to its inbox, a render's answer to its waiter, the rest to the
handshake), one pings while the link is quiet and declares it lost after
``silence_timeout_s`` of silence. Each connection has an epoch: a loss wakes everything
waiting on that epoch's connection (a :class:`Lost` in every inbox), and whoever
noticed it waits in :meth:`EdgeConnection._recover` for the one that replaces it.

It is kept apart from the generations (``xcosd/nodes/edge_generation.py``) and the
render requests (``xcosd/nodes/edge_render.py``) so that what a loss does, and what
a reconnect restores, reads in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

from ..errors import ErrorCode, ProtocolError, TransportError, XcosdError
from ..methods import Space
from ..models.base import LanguageModel
from ..protocol import pack
from ..protocol.contexts import ContextStore, RenderStore
from ..protocol.edge import EdgeHandshake
from ..protocol.errors import exception_for
from ..protocol.messages import Error, Message, Ping, Pong, Rendered, from_wire
from ..transport import LinkConnection, connect
from ..transport.addresses import Addresses, resolve, split_endpoints
from ..transport.base import Connection
from ..vocab import VocabMap, Vocabulary
from ..wire.frames import Limits, decode_message, message_bytes
from .edge_settings import EdgeConnectionSettings
from .inbox import Inbox
from .reach import Reach, ReachPhase
from .stats import GenerationStats

#: the edge node's one logger, whichever of its modules writes
log = logging.getLogger("xcosd.nodes.edge")

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
#: render requests (tokenize, chat_prompt) one node has at the cloud at once; the
#: others wait their turn here. Well under the cloud's bound per connection
#: (xcosd/nodes/cloud_renders.py, MAX_RENDERS_PER_PEER, past which it answers ``busy``),
#: so many concurrent callers queue instead of being refused
MAX_RENDERS_IN_FLIGHT = 16


class Lost:
    """Sentinel put into every session's inbox when the connection is lost."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


class SessionLost(Exception):
    """Raised inside a generation whose session the cloud no longer has."""


class ConnectionLost(Exception):
    """Raised inside a generation when the connection of ``epoch`` is gone."""

    def __init__(self, epoch: int) -> None:
        super().__init__(f"connection {epoch} lost")
        self.epoch = epoch


class EdgeConnection:
    """The connection half of an edge node (:class:`~xcosd.nodes.edge.EdgeNode`
    documents the settings): the transport held now and its epoch, the connecting,
    receiving and heartbeat tasks, the handshake, and the routes of what arrives
    (session inboxes, render waiters). It starts nothing itself: the node starts the
    tasks and closes them."""

    def __init__(self, draft: LanguageModel, connect: str, settings: EdgeConnectionSettings, *,
                 target_vocab: Vocabulary | None, vocab_map: VocabMap | None) -> None:
        #: what ``connect`` names: one endpoint, several (comma-separated) or a host
        #: name with several addresses
        self.endpoint = connect
        split_endpoints(connect)  # a list with nothing in it fails here
        #: the settings the connection was made with (EdgeConnectionSettings); the
        #: attributes below are their parts (``heartbeat_s`` becomes the cloud's
        #: when unset)
        self.connection_settings = settings
        self._addresses: Addresses | None = None
        #: the address of the connection held now (or last held)
        self.address: str | None = None
        self.transport = settings.transport
        self.link = settings.link
        self.curve = settings.curve
        self.heartbeat_s = settings.heartbeat_s
        self.silence_timeout_s = settings.silence_timeout_s
        self.connect_timeout_s = settings.connect_timeout_s
        self.cloud_wait_s = settings.cloud_wait_s
        #: whether the node holds its cloud, and its connecting's counts
        self.reach = Reach(time.monotonic(), settings.connect_timeout_s)
        #: waits for the cloud that ended at ``cloud_wait_s`` (each failed its request)
        self.waits_expired = 0
        #: why the node last gave up looking for its cloud (``reach`` unreachable)
        self.failure: XcosdError | None = None
        #: why the cloud cut this device off (its key revoked), until a handshake
        #: succeeds again: a generation waiting for the cloud fails with it at once
        self._refused: XcosdError | None = None
        self.busy_retry_s = settings.busy_retry_s
        self.busy_timeout_s = settings.busy_timeout_s
        self.resend_after_s = settings.resend_after_s
        self.answer_timeout_s = settings.answer_deadline_s
        self.name = settings.name
        self.limits = Limits(max_bytes=settings.max_message_bytes, max_frames=4096,
                             max_header_bytes=16 << 20)
        self._transport_options = dict(settings.transport_options or {})
        if vocab_map is not None:
            if vocab_map.draft.fingerprint != draft.vocab.fingerprint:
                raise ValueError("vocab_map was built for another draft vocabulary")
            target_vocab = vocab_map.target
        # the map's builder holds the draft's vocabulary, not this node: a bound method
        # here would make node and handshake a reference cycle, which only a full
        # collection frees (rare in a process with many sessions: xcosd/gc_tuning.py)
        self._handshake = EdgeHandshake(partial(VocabMap, draft.vocab), target_vocab, self.name,
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
        #: each running generation's inbox, by session id
        self._inboxes: dict[int, Inbox] = {}
        #: render requests (tokenize, chat_prompt) waiting for their answer, by number
        self._render_ids = itertools.count(1)
        self._renders: dict[int, asyncio.Future[Message]] = {}
        #: what this connection's cloud holds, as far as this node knows: the renders
        #: and id contexts a next turn names instead of sending (xcosd/protocol/
        #: contexts.py); emptied with each new connection, as the cloud's are
        self._held_renders = RenderStore()
        self._held_contexts = ContextStore()
        self._render_slots = asyncio.Semaphore(MAX_RENDERS_IN_FLIGHT)
        self._last_rx = 0.0
        #: when this edge last sent the cloud anything (a ping is then not needed)
        self._last_tx = 0.0
        self._closed = False
        self._overhead: Callable[[list[Any]], int] = lambda frames: 0
        self.meter: Any = None
        self.resumes = 0

    @property
    def timeout_s(self) -> float:
        """Deprecated: :attr:`silence_timeout_s` (``timeout_s`` is a generation's
        deadline, ``GenerationConfig.timeout_s``)."""
        warnings.warn("EdgeNode.timeout_s is deprecated: it is silence_timeout_s now",
                      DeprecationWarning, stacklevel=2)
        return self.silence_timeout_s

    @property
    def server_id(self) -> str | None:
        w = self._handshake.welcome
        return w.server_id if w is not None else None

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

    async def _stop_tasks(self) -> None:
        for t in (self._hb_task, self._connector):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._hb_task = self._connector = None

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
            if isinstance(msg, Lost):
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
        most_s = (self.silence_timeout_s if self.connect_timeout_s is None
                  else min(self.silence_timeout_s, self.connect_timeout_s))
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
        lost = Lost(epoch)
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
            if time.monotonic() - self._last_rx > self.silence_timeout_s:
                # the connecting task reconnects, whether or not a generation waits
                self._lose(self._epoch,
                           f"the cloud was silent for {self.silence_timeout_s:g} s")
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
