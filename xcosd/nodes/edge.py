"""``EdgeNode``: the device side of xcosd, an async context manager that runs in the
caller's event loop.

One EdgeNode holds one connection to a cloud and runs any number of generations
on it concurrently (:meth:`EdgeNode.generate`, :meth:`EdgeNode.stream`). Each
generation is a sans-I/O :class:`~xcosd.protocol.EdgeSession`; the node only
moves its messages, runs its draft model in a worker thread (one thread: the
device has one draft model), keeps the link alive and measures. While a block's
verdict is in flight that thread drafts on past it (speculation, see
``xcosd/nodes/drafter.py``), so the next round's drafts are often ready when the
verdict arrives.

This module is the node's face: its settings, lifecycle, ``generate`` / ``stream``
and the draft thread. The connection is ``xcosd/nodes/edge_connection.py``, the
render requests (``tokenize``, ``chat_prompt``) ``xcosd/nodes/edge_render.py``, and
one generation's rounds ``xcosd/nodes/edge_generation.py``.

Faults: the edge pings every ``heartbeat_s``; when the cloud is silent for
``silence_timeout_s``, the transport fails, the cloud answers that it does not know the
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
:class:`TimeoutError`, as does its own deadline (``GenerationConfig.timeout_s``). The
settings named here are ``xcosd/nodes/edge_settings.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import numpy as np

from ..config import GenerationConfig
from ..errors import TransportError
from ..models.base import ContextModel, LanguageModel
from ..policies.draft_length import DraftLength
from ..policies.tree_policy import RankRates
from ..sampling import SamplingParams
from ..transport import Meter
from ..vocab import VocabMap, Vocabulary
from .arrivals import Arrival, Arrivals
from .drafter import Drafter
from .edge_connection import (
    ATTEMPT_TIMEOUT_S,
    LOST_CODES,
    MAX_RENDERS_IN_FLIGHT,
    RETRY_CONNECT_CODES,
    SESSION_LOST_CODES,
)
from .edge_generation import (
    MIN_REFERENCE,
    PREFILL_OVERLAP,
    SPECULATE_SHARE,
    SPECULATION_RECORDS,
    GenerationRun,
    Prompt,
    RoundObserved,
)
from .edge_render import RenderClient
from .edge_settings import EdgeConnectionSettings, EdgeRunSettings
from .node_kwargs import field_names, fold, no_more, renamed
from .reach import ReachPhase
from .stats import GenerationResult, GenerationStats

__all__ = [
    "ATTEMPT_TIMEOUT_S", "LOOP_DRAFT_MAX_IDS", "LOST_CODES", "MAX_RENDERS_IN_FLIGHT",
    "MIN_REFERENCE", "PREFILL_OVERLAP", "RETRY_CONNECT_CODES", "SESSION_LOST_CODES",
    "SPECULATE_SHARE", "SPECULATION_RECORDS", "EdgeNode", "Prompt", "RoundObserved",
    "drafts_on_loop", "shared_process_draft_thread",
]

#: the keywords an EdgeNode passes on to its GenerationConfig: its fields, and
#: ``stop`` (``GenerationConfig.from_kwargs``' alias of ``stop_strings``)
GENERATION_KEYWORDS = field_names(GenerationConfig) | {"stop"}

#: the longest vocabulary a context model (n-gram, table, synthetic) drafts over on
#: the event loop. A step of one costs about 9 us plus 1.3 ns an id (37 us at 16k
#: ids), less than handing the round to the draft thread; at 200k ids it is 340 us,
#: and a round of such steps on the loop holds up every other generation's verdicts
#: and an HTTP server on the same loop (16 concurrent streams on the embedded pair:
#: a first token after 83-94 ms in process, 29-33 ms with the draft thread)
LOOP_DRAFT_MAX_IDS = 16384


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


class EdgeNode(RenderClient):
    """Drafts on the device and talks to one cloud.

    ``draft``: any :class:`~xcosd.models.LanguageModel`. ``connect``: the cloud's
    endpoint. ``config``: a :class:`~xcosd.config.GenerationConfig`, the defaults of
    every generation on this node; every call may override them again.
    ``connection``: how the node reaches and keeps its cloud
    (:class:`~xcosd.nodes.edge_settings.EdgeConnectionSettings`: transport, link,
    CURVE, heartbeats, the silence timeout, reconnecting, resends, ``busy`` retries);
    ``running``: how it runs generations
    (:class:`~xcosd.nodes.edge_settings.EdgeRunSettings`: the draft thread, the
    arrivals hold, the modeled link). Each of their fields, and each of the
    config's, may also be given as a keyword of its name (``method="xcosd"``,
    ``resend_after_s=1.0``, ``draft_thread=False`` ...), which updates the object
    given (or the defaults); a keyword that none of them has is a ``TypeError``.
    ``timeout_s=`` is the old name of ``silence_timeout_s`` (deprecated: a
    generation's deadline is ``GenerationConfig.timeout_s``). ``target_vocab``: the
    target's vocabulary if the device has it (else it is fetched from the cloud once
    per connection); ``vocab_map``: a ready :class:`~xcosd.vocab.VocabMap` (draft,
    target), so many edges on one machine build it once.

    ``on_round``: called with a :class:`RoundObserved` after every round of every
    generation, in the event loop (keep it cheap). It is how a caller observes rounds
    without subclassing; an exception it raises ends that generation between two
    rounds (the session is closed first) and comes out of :meth:`generate`, which is
    how a benchmark stops its devices at the end of a measured window.

    ``reach`` says where the node stands (:class:`~xcosd.nodes.reach.Reach`:
    ``connecting``, ``connected``, ``unreachable``, ``closed``).

    The node is its connection (:class:`~xcosd.nodes.edge_connection.EdgeConnection`)
    and its render client (:class:`~xcosd.nodes.edge_render.RenderClient`) by
    inheritance, not by holding them: parts that held the node back would make it a
    reference cycle, freed only by a full collection (``xcosd/gc_tuning.py``). Each
    generation is a :class:`~xcosd.nodes.edge_generation.GenerationRun`, which holds
    the node only while it runs.
    """

    def __init__(self, draft: LanguageModel, connect: str = "tcp://127.0.0.1:5555", *,
                 config: GenerationConfig | None = None,
                 connection: EdgeConnectionSettings | None = None,
                 running: EdgeRunSettings | None = None,
                 target_vocab: Vocabulary | None = None, vocab_map: VocabMap | None = None,
                 on_round: Callable[[RoundObserved], None] | None = None,
                 **settings: Any) -> None:
        renamed("EdgeNode", settings, "timeout_s", "silence_timeout_s")
        connection = fold("EdgeNode", connection, EdgeConnectionSettings, settings)
        running = fold("EdgeNode", running, EdgeRunSettings, settings)
        no_more("EdgeNode", {k: v for k, v in settings.items() if k not in GENERATION_KEYWORDS})
        self.draft = draft
        #: how this node runs its generations (EdgeRunSettings)
        self.run_settings = running
        #: the requests a server has accepted and not yet started: a first open
        #: waits for them (bounded), so that those sent together are verified together
        self.arrivals = Arrivals(running.open_hold_s)
        super().__init__(draft, connect, connection, target_vocab=target_vocab,
                         vocab_map=vocab_map)
        self.model_link = running.model_link if running.model_link is not None else connection.link
        self.on_round = on_round
        # validated here, so a wrong setting fails when the node is made, not mid-session
        self.config = GenerationConfig.from_kwargs(config, **settings)
        #: each live generation's draft model session, by session id
        self._drafters: dict[int, Drafter] = {}
        #: the draft-length policy of the last generation that measured its costs
        #: (draft_cost="auto"): the next such generation starts from it
        self._learned: DraftLength | None = None
        #: the tree policy of the last such generation with tree="auto"
        self._learned_ranks: RankRates | None = None
        self._ids = itertools.count(1)
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
        self.draft_thread = (not drafts_on_loop(draft) if running.draft_thread is None
                             else bool(running.draft_thread))

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

    async def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the draft thread (on the loop without one), waited for."""
        if not self.draft_thread:
            return fn(*args)
        job = self._executor.submit(fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return await asyncio.wrap_future(job)

    def _in_background(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn`` in the draft thread, not waited for: the generation's next call
        there queues behind it."""
        job = self._executor.submit(fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _generate(self, prompt: Prompt, cfg: GenerationConfig,
                        on_text: Callable[[str], None] | None,
                        arrival: Arrival | None = None,
                        stats: GenerationStats | None = None) -> GenerationResult:
        try:
            if self._closed:
                raise TransportError("the edge node is closed", code="closed")
            if not self._connected:
                await self._recover(self._epoch)
            run = GenerationRun(self, next(self._ids), prompt, cfg, on_text, arrival, stats)
            return await run.run()
        finally:
            if arrival is not None:  # it ended before its open: none waits for it
                arrival.sent()
