"""One generation on an edge node, from its open to its result.

A :class:`GenerationRun` owns everything that belongs to one generation: its
sans-I/O :class:`~xcosd.protocol.EdgeSession`, the inbox the node's receive loop
fills for it, its :class:`~xcosd.nodes.stats.GenerationStats` and wire trace, its
:class:`~xcosd.nodes.drafter.Drafter`, its stop-string watch and its uplink bound.
It runs rounds (drafting, in the node's draft thread or on the loop, and speculating
while a verdict is in flight: ``xcosd/nodes/drafter.py``), asks again for late
answers, waits out ``busy`` refusals, and opens its session again after a lost
connection or session. What it shares with the other generations of its node (the
connection, the one draft thread, what the last generations learned) it reaches
through :class:`RunHost`, the part of the node a run uses.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..config import GenerationConfig
from ..errors import BudgetError, ProtocolError, TransportError
from ..methods import FullVectorReply, HybridReply, Space
from ..models.base import LanguageModel
from ..policies.draft_length import DraftLength
from ..policies.tree_policy import RankRates
from ..protocol import pack
from ..protocol.contexts import ContextStore
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
from ..protocol.messages import Close, Error, Message, Open, SessionMessage, VerdictMsg
from ..sampling import SamplingParams
from ..transport import LinkSpec, sequence_latency
from ..transport.base import Connection
from ..vocab import Vocabulary
from ..wire.frames import message_bytes
from .arrivals import Arrival, Arrivals
from .drafter import Drafter
from .edge_connection import LOST_CODES, SESSION_LOST_CODES, ConnectionLost, Lost, SessionLost
from .inbox import Inbox
from .stats import GenerationResult, GenerationStats

#: the share of a round's measured wait (draft sent to verdict) that speculation
#: may fill: a step still running when the verdict arrives delays the next round
SPECULATE_SHARE = 0.8
#: the (method, warpers) settings whose speculation record a node keeps
SPECULATION_RECORDS = 16
#: draft prompt tokens (not cached) from which round 0 drafts nothing and the draft
#: computes its prompt while the open's round trip and the cloud's prefill are in
#: flight: a prompt's prefill costs about a draft step per token on a CPU, a round
#: trip a few dozen steps
PREFILL_OVERLAP = 32
#: the fewest ids of a prompt worth naming by reference rather than sending (a
#: reference costs about as many header bytes as this many ids)
MIN_REFERENCE = 8

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


class StopStrings:
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


def ids_covering(vocab: Vocabulary, ids: Sequence[int], chars: int) -> int:
    """How many of ``ids`` it takes for their text to reach ``chars`` characters (the
    token that completes a stop string is kept whole, as transformers keeps it)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    n = 0
    for k, t in enumerate(ids, 1):
        n += len(dec.decode(vocab.piece(int(t))))
        if n >= chars:
            return k
    return len(ids)


class RunHost(Protocol):
    """What a generation uses of its edge node (:class:`~xcosd.nodes.edge.EdgeNode`):
    the connection (``xcosd/nodes/edge_connection.py``), the one draft thread, and
    what the node's generations share (the live drafters, whose count says whether a
    generation is alone; speculation records; the draft-length and tree policies
    the last measuring generation learned)."""

    draft: LanguageModel
    draft_thread: bool
    arrivals: Arrivals
    on_round: Callable[[RoundObserved], None] | None
    model_link: LinkSpec | None
    answer_timeout_s: float
    resend_after_s: float
    busy_retry_s: float
    _handshake: EdgeHandshake
    _space: Space | None
    _conn: Connection | None
    _epoch: int
    _connected: bool
    _closed: bool
    _last_tx: float
    _overhead: Callable[[list[Any]], int]
    _inboxes: dict[int, Inbox]
    _held_contexts: ContextStore
    _drafters: dict[int, Drafter]
    _spec_rng: np.random.Generator
    _spoke: dict[tuple[str, SamplingParams], tuple[int, int]]
    _learned: DraftLength | None
    _learned_ranks: RankRates | None

    def _lose(self, epoch: int, why: str = ...) -> None: ...

    async def _recover(self, seen_epoch: int) -> None: ...

    async def _busy_pause(self, st: GenerationStats | None, delay: float, since: float) -> float: ...

    async def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def _in_background(self, fn: Callable[..., Any], *args: Any) -> None: ...


def prompt_ids(node: RunHost, prompt: Prompt) -> np.ndarray | None:
    """A token-id prompt as int64 target ids (checked), ``None`` for text."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("a prompt is text or a list of target token ids, not bytes")
    ids = list(prompt)
    if not all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
        raise TypeError("a token-id prompt must hold integers (target token ids)")
    a = np.asarray(ids, dtype=np.int64)
    vmap = node._handshake.vmap
    size = vmap.target.size if vmap is not None else None
    if a.size and (int(a.min()) < 0 or (size is not None and int(a.max()) >= size)):
        raise ValueError(f"prompt token ids must be target ids in 0..{(size or 0) - 1}")
    return a


class GenerationRun:
    """One generation: session ``s`` of ``node``, for ``prompt`` with the settings
    ``cfg``. Made on a connected node (its handshake is done), it registers its
    drafter and inbox with the node at once; :meth:`run` runs it to its result and
    unregisters them, whatever happens."""

    def __init__(self, node: RunHost, s: int, prompt: Prompt, cfg: GenerationConfig,
                 on_text: Callable[[str], None] | None, arrival: Arrival | None,
                 stats: GenerationStats | None = None) -> None:
        self.node = node
        self.es = self._session(s, prompt, cfg)
        self.drafter = node._drafters[s]
        self.watch = StopStrings(cfg.stop_strings, on_text)
        self.st = st = stats if stats is not None else GenerationStats()
        st.method, st.codec = self.es.method.name, self.es.method.codec.name
        #: each message's direction and wire bytes, for the modeled link time
        self.trace: list[tuple[str, int]] = []
        self.inbox = node._inboxes[s] = Inbox()
        #: the most wire bytes this generation may send (GenerationConfig.max_uplink_bytes)
        self.max_uplink = cfg.max_uplink_bytes
        self.speculate = cfg.resolved_speculate()
        self.arrival = arrival
        self.timeout_s = cfg.timeout_s

    def _session(self, s: int, prompt: Prompt, cfg: GenerationConfig) -> EdgeSession:
        node = self.node
        vmap, welcome = node._handshake.vmap, node._handshake.welcome
        assert vmap is not None and welcome is not None and node._space is not None
        settings = cfg.session_settings(welcome)
        m, params = settings.method, settings.params
        ids = prompt_ids(node, prompt)
        # the draft only conditions on the prompt: a token-id prompt reaches it as the
        # text of those target ids (the cloud gets the ids themselves, in the open)
        text = (vmap.target.decode(ids.tolist()).decode("utf-8", errors="replace")
                if ids is not None else str(prompt))
        base = None
        if ids is not None:  # a context this connection's cloud holds starts it: name it
            base = node._held_contexts.longest(ids)
            if base is not None and base[1] < MIN_REFERENCE:
                base = None
            node._held_contexts.put(ids)
        drafter = node._drafters[s] = Drafter(node.draft, vmap, params, text)
        record = node._spoke.get((m.name, params))
        if record is not None:  # how the last such generation's speculation paid
            drafter.carry(record)
        es = EdgeSession(s, settings, vmap=vmap, space=node._space,
                         prompt="" if ids is not None else text, prompt_ids=ids,
                         prompt_base=base)
        # the draft's prompt computed beside the open's round trip, not before it
        es.draft_later = (node.draft_thread and m.drafts
                          and drafter.uncached_prompt() >= PREFILL_OVERLAP)
        if node._learned is not None:  # draft_cost="auto": what the last one measured
            es.drafting.adopt(node._learned)
            if es.drafting.measure and es.tree == "auto" and node._learned_ranks is not None:
                es.tree_rates.adopt(node._learned_ranks)
        return es

    async def run(self) -> GenerationResult:
        """Run the generation to its end (a stop, its length, a stop string) and
        return its result; its session is closed on the cloud however it ends."""
        node, es, st, watch = self.node, self.es, self.st, self.watch
        s = es.s
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                # the first round opens the session: its draft rides on the open
                while not es.done and watch.end is None:
                    try:
                        if es.phase is EdgePhase.RESOLVING:  # resumed mid-round (Redo)
                            await self._finish_round(None)
                        else:
                            await self._round()
                    except ConnectionLost as lost:
                        await self._resume(lost.epoch)
                    except SessionLost:  # the cloud closed this session (idle): re-open it
                        st.resumes += 1
                        await self._open()
        finally:
            node._inboxes.pop(s, None)
            self.inbox.close()
            if es.drafting.measure and es.drafting.step_s is not None:
                node._learned = es.drafting
                if es.tree == "auto":
                    node._learned_ranks = es.tree_rates
            if es.opens and node._connected and node._conn is not None:
                with contextlib.suppress(Exception):
                    await self._send(es.close(), traced=False)
            drafter = node._drafters.pop(s)
            st.speculated, st.speculated_used = drafter.speculated, drafter.reused
            if self.speculate:
                key = (es.method.name, drafter.params)
                node._spoke.pop(key, None)
                node._spoke[key] = drafter.record
                while len(node._spoke) > SPECULATION_RECORDS:  # the oldest settings go
                    del node._spoke[next(iter(node._spoke))]
            with contextlib.suppress(Exception):
                await node._in_worker(drafter.end)
            st.caught_up = drafter.caught_up  # its jobs ran before end, in the one thread
            st.prefilled_beside = drafter.prefilled
        text, token_ids = es.text, list(es.token_ids)
        if watch.end is not None:  # a stop string: the output ends with it
            text = watch.text[:watch.end]
            assert es.vmap is not None
            token_ids = token_ids[:ids_covering(es.vmap.target, token_ids, watch.end)]
        st.wall_s = time.perf_counter() - t0
        st.tokens = len(token_ids)
        st.finish_reason = "stop" if watch.end is not None else (es.finish_reason or "")
        st.target_calls = st.rounds
        st.modeled_s = st.draft_compute_s + st.cloud_compute_s + (
            sequence_latency(self.trace, node.model_link) if node.model_link is not None else 0.0)  # type: ignore[arg-type]
        return GenerationResult(text, token_ids, st)

    async def _send(self, msg: Message, *, traced: bool = True) -> None:
        """Send ``msg`` on the connection held now (counted in the stats, and in the
        trace if ``traced``); a connection that is gone raises :class:`ConnectionLost`."""
        node = self.node
        conn, epoch = node._conn, node._epoch
        if conn is None or not node._connected:
            raise ConnectionLost(epoch)
        frames = pack(msg)
        size = message_bytes(frames)
        welcome = node._handshake.welcome
        if welcome is not None and size > welcome.limits.max_message:
            # the cloud would refuse it before it can tell whose it is, and this
            # generation would wait for an answer that never comes: fail it here
            raise ProtocolError(f"a {msg.TYPE} message of {size} bytes exceeds the cloud's "
                                f"limit of {welcome.limits.max_message}", code="too_large")
        n = size + node._overhead(frames)
        self._within_budget(msg, n)
        try:
            await conn.send(frames)
        except TransportError as e:
            node._lose(epoch, str(e))
            raise ConnectionLost(epoch) from e
        node._last_tx = time.monotonic()
        self.st.count("up", msg.TYPE, n)
        if traced:
            self.trace.append(("up", n))

    def _within_budget(self, msg: Message, n: int) -> None:
        """Refuse to send ``msg`` (``n`` wire bytes) where this generation would pass
        its uplink bound; a ``close`` always goes (it frees the cloud's session)."""
        if not isinstance(msg, SessionMessage) or isinstance(msg, Close):
            return
        bound, st = self.max_uplink, self.st
        if bound is not None and st.uplink_bytes + n > bound:
            raise BudgetError(f"session {msg.s}: a {msg.TYPE} message of {n} bytes would take "
                              f"the bytes sent to the cloud past this generation's bound of "
                              f"{bound} (sent so far: {st.uplink_bytes})")

    async def _next(self) -> Message:
        """The next message for the session. An answer that is late is asked for again
        (same ``seq``: see ``xcosd/nodes/edge.py``'s docstring), up to
        ``answer_timeout_s``."""
        node, es, st = self.node, self.es, self.st
        deadline = time.monotonic() + node.answer_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"session {es.s}: no answer from the cloud within "
                                   f"{node.answer_timeout_s:g} s")
            try:
                item = await self.inbox.get(min(node.resend_after_s, left))
            except TimeoutError:
                again = es.resend_last()
                if again is not None:
                    st.resends += 1
                    await self._send(again)
                continue
            if not isinstance(item, Lost):
                break
            if item.epoch == node._epoch or node._closed:
                raise ConnectionLost(item.epoch)
            # a loss notice from a connection already replaced: ignore it
        msg, n = item
        st.count("down", msg.TYPE, n)
        self.trace.append(("down", n))
        if isinstance(msg, Error) and msg.code in SESSION_LOST_CODES:
            raise SessionLost(msg.message)  # this session only: open it again
        if isinstance(msg, Error) and msg.code in LOST_CODES:
            # the cloud does not know this connection any more (it restarted)
            epoch = node._epoch
            node._lose(epoch, f"the cloud answered {msg.code}")
            raise ConnectionLost(epoch)
        return msg

    async def _open(self) -> None:
        """Open (or re-open) the session: on a new connection or a lost session with a
        new ``open``; after ``busy`` with the same one again (nothing was generated,
        so a seeded generation stays the same)."""
        node, es = self.node, self.es
        delay, since = node.busy_retry_s, time.monotonic()
        msg: Message = es.open()
        while True:
            try:
                await self._send(msg)
                while True:
                    out = es.receive(await self._next())
                    if out.events:
                        break  # else a stale answer was dropped, or the open went
                    for m in out.send:  # again whole (no_context): wait on
                        await self._send(m)
                    out.send.clear()
                for m in out.send:  # a redone round's draft (Redo)
                    await self._send(m)
            except ConnectionLost as lost:
                await node._recover(lost.epoch)
                self.inbox.clear()
                msg = es.open()
                continue
            except SessionLost:
                msg = es.open()
                continue
            if any(isinstance(e, Retry) for e in out.events):
                delay = await node._busy_pause(self.st, delay, since)
                msg = es.resend()
                continue
            return

    async def _resume(self, epoch: int) -> None:
        """Carry on after the connection of ``epoch`` was lost: wait for the next one
        and open the session again from its committed tokens."""
        await self.node._recover(epoch)
        self.inbox.clear()  # whatever the old connection left behind
        self.st.resumes += 1
        await self._open()

    async def _round(self) -> None:
        node, es, st, drafter = self.node, self.es, self.st, self.drafter
        t = time.perf_counter()
        before = (time.monotonic(), len(es.token_ids), st.uplink_bytes, st.downlink_bytes,
                  st.drafted, st.accepted) if node.on_round is not None else None
        reused = drafter.reused
        out = es.next_round()
        for ev in out.events:
            if isinstance(ev, DraftNeeded):  # the draft model runs in the worker
                out = es.take(await node._in_worker(drafter.run, ev) if node.draft_thread
                              else drafter.run(ev))
        [msg] = out.send
        drafting_s = time.perf_counter() - t
        st.draft_compute_s += drafting_s
        opening = isinstance(msg, Open)
        arrival = self.arrival
        if opening:  # with those of the requests that arrived beside it
            await node.arrivals.gather(arrival)
        try:
            await self._send(msg)
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
        # (a tree's draft steps are its depths, each one a call; a chain's, its drafts
        # not speculated before)
        fresh = (block.depth if block is not None and not block.stays_in_context
                 else drafted - (drafter.reused - reused))
        timing = (drafting_s / fresh if fresh else None, time.perf_counter(), drafted)
        stop = (self._speculate() if self.speculate and drafted and not es.tree_round
                else None)
        if opening and es.draft_later:
            node._in_background(drafter.prefill)
        elif not drafted:
            self._catch_up()
        try:
            await self._finish_round(before, timing, stop)
        finally:
            if stop is not None:
                stop.set()

    def _catch_up(self) -> None:
        """A round that drafted nothing leaves the edge's core idle until its verdict:
        compute the draft context's pending tokens there (the tokens the last rounds
        emitted), so the next round that drafts (a probe of the length policy, most
        often) pays only its draft steps, and the draft step it measures is one.
        Not beside another generation, whose drafts would wait behind it in the one
        draft thread."""
        node, es = self.node, self.es
        if (not node.draft_thread or len(node._drafters) > 1 or not es.method.drafts
                or es.remaining < 3):  # after this round's token, no round could draft
            return
        drop, append = es.take_edits()
        if not (drop or append):
            return
        node._in_background(self.drafter.catch_up, drop, append)

    def _speculate(self) -> threading.Event | None:
        """Draft on while the verdict is in flight (see :class:`Drafter`): as many
        steps as the measured wait has room for (none before both are measured,
        nor where drafting does not pay, nor beside another generation, whose
        drafts would wait behind these in the one draft thread, nor while
        verdicts seldom take the speculated path: :meth:`Drafter.worth_speculating`).
        Returns the event that stops it, set when the verdict arrives."""
        node, es, drafter = self.node, self.es, self.drafter
        policy = es.drafting
        if (policy.step_s is None or policy.fixed_s is None or policy.ceiling == 0
                or len(node._drafters) > 1 or not drafter.worth_speculating()):
            return None
        # the bonus guess, then up to a whole block past it
        n = min(policy.most_next + 1, int(SPECULATE_SHARE * policy.fixed_s / policy.step_s))
        if n < 2:
            return None
        stop = threading.Event()
        args = (n, es.method, es.space, node._spec_rng, stop.is_set)
        if not node.draft_thread:
            drafter.speculate(*args)
            return stop
        node._in_background(drafter.speculate, *args)
        return stop

    async def _finish_round(self, before: tuple[float, int, int, int, int, int] | None,
                            timing: tuple[float | None, float, int] | None = None,
                            stop: threading.Event | None = None) -> None:
        """Feed the round's answers to the session (sending its follow-ups) until it
        settles; ``timing`` (a draft step's seconds, when the draft was sent, the
        tokens it sent for verification) goes to the draft-length policy when the
        verdict arrives."""
        node, es, st = self.node, self.es, self.st
        on_text = self.watch.feed
        delay, since = node.busy_retry_s, time.monotonic()
        while True:
            reply = await self._next()
            if isinstance(reply, VerdictMsg):
                if stop is not None:  # speculation has done what it could
                    stop.set()
                st.cloud_compute_s += reply.compute_us / 1e6
                node.arrivals.observe(reply.compute_us / 1e6)
                if timing is not None:
                    es.drafting.observe(timing[0], time.perf_counter() - timing[1], timing[2])
                    timing = None
            if isinstance(reply, Error) and reply.code not in ("busy", "replay", "no_context"):
                raise exception_for(reply.code, reply.message)
            if isinstance(getattr(reply, "reply", None), FullVectorReply | HybridReply):
                # decoding a vocabulary-sized vector and its residual: off the loop
                out = await node._in_worker(es.receive, reply)
            else:
                out = es.receive(reply)
            for m in out.send:
                await self._send(m)
            settled = False
            for ev in out.events:
                if isinstance(ev, Retry):
                    delay = await node._busy_pause(st, delay, since)
                    await self._send(es.resend())
                elif isinstance(ev, TokensEmitted):
                    st.tokens += len(ev.token_ids)  # so far; the end sets the output's
                    if ev.text:
                        on_text(ev.text)
                elif isinstance(ev, RoundSettled):
                    settled = True
                    st.settle(ev)
                elif isinstance(ev, Finished):
                    settled = True
            if settled:
                if before is not None and node.on_round is not None:
                    t0, n0, up0, down0, d0, a0 = before
                    node.on_round(RoundObserved(
                        es.s, t0, time.monotonic(), len(es.token_ids) - n0,
                        st.uplink_bytes - up0, st.downlink_bytes - down0, st.drafted - d0,
                        st.accepted - a0))
                return
