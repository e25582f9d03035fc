"""``xcosd bench soak``: many edge devices against one cloud for a while, with faults
injected all along, every generation checked token by token.

Why a soak: the fault tests check each recovery path on its own (a cloud restart,
a lost message, a vanished device). A soak runs them all at once, with enough
devices and for long enough that they overlap (a device killed while the cloud
restarts, a duplicated draft reaching a cloud that has just reaped its session ...),
and it watches what only a long run shows: memory that keeps growing, sessions the
cloud never frees, a wait that never ends.

What runs: ``devices`` :class:`~xcosd.nodes.EdgeNode` s in this event loop against
one :class:`~xcosd.nodes.CloudNode`, each generating greedily (temperature 0), back
to back, from prompts drawn from a fixed pool. Greedy makes every output checkable:
it must equal the target's own greedy decode of its prompt, computed once per
prompt with the target model directly. Any difference is a token lost, repeated
or wrong (a *mismatch*), whatever fault caused it.

Faults, throughout the run:

* **device kills**: at random times (a Poisson process, ``kill_rate`` per second) a
  device in the middle of a generation dies: its generation is cancelled and its
  connection dropped without a Close, so only the cloud's timeout (ZeroMQ) or the
  closed connection (TCP) can free its session. A fresh device takes its place.
* **cloud restarts** (``restarts``, evenly spaced): the CloudNode is closed and a new
  one bound to the same endpoint; every edge must notice, reconnect and resume its
  generation from its committed tokens.
* **a lossy link** on every device: each message, each direction, is lost with
  probability ``loss`` and duplicated with probability ``duplicate``; the edges
  resend late answers (``resend_after_s``) and the cloud answers repeats from its
  record.

The report (:func:`soak` returns it, ``--json`` writes it; ``schema_version``
:data:`SCHEMA_VERSION`) counts tokens and generations, mismatches by kind, kills,
restarts, edge errors by exception class, the cloud's ``errors_by_code`` and
``internal_errors`` summed over every cloud instance (a restart starts its counters
from zero), the sessions still open on the cloud once every device has closed (after
a bounded wait for the reaper), and the process RSS sampled every
``sample_every_s``. Every wait has a deadline: a recovery that hangs shows up as
an unfinished generation or a failed check, never as a soak that does not end.

The default pair (``bytes``) is two n-gram models over byte-level vocabularies (the
256 bytes plus 48 frequent byte pairs of the training text each, 40 of them shared):
rows of about 300 entries, so hundreds of devices and their cloud fit on two cores,
while the pair is still a real cross-vocabulary pair: the 4-gram draft disagrees
with the 5-gram target on about a third of the tokens (rejections), and the
target's 8 own pair tokens are target-only (V_O). ``embedded`` is the default
n-gram pair (o200k -> Llama 3, rows of 128k-200k entries): far more work per round,
for fewer devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import GenerationConfig
from ..errors import TransportError
from .progress import Progress
from .report import OUT_DIR, heap_mb, machine, rss_mb, summary, table

if TYPE_CHECKING:  # the nodes load the transports: imported when a soak runs, so that
    # building the CLI's parser (which reads SoakConfig's defaults) stays cheap
    from ..models.base import LanguageModel
    from ..nodes import CloudNode, EdgeNode, GenerationResult, RoundObserved
    from ..transport import LinkSpec
    from ..vocab import VocabMap, Vocabulary

#: bumped when a field of the report changes meaning or goes away
SCHEMA_VERSION = 1
#: where ``xcosd bench soak`` writes by default (and the results generator reads)
OUT_FILE = OUT_DIR / "soak.json"

#: the model pairs a soak can run (see the module docstring)
PAIRS = ("bytes", "embedded")

#: documents of the default corpus the ``bytes`` pair trains on: a quarter of it, so
#: the first run on a machine trains in a few seconds (the models are cached after)
BYTE_PAIR_DOCS = 2000
#: byte-pair tokens both sides of the ``bytes`` pair add to the 256 bytes, and those
#: each side has alone (the target's are V_O): enough shared ones that the greedy
#: draft agrees with the target about 70 % of the time (a few tokens per round),
#: enough private ones that rejections and V_O tokens are frequent
BYTE_PAIR_SHARED = 40
BYTE_PAIR_OWN = 8

#: RSS growth from the warm-up sample to the end of the run still called flat
FLAT_GROWTH = 1.10

#: the kinds of mismatch :func:`mismatch_kind` tells apart
MISMATCH_KINDS = ("lost", "repeated", "wrong", "short", "long")

#: examples of each failure kept in the report (the counts are complete)
EXAMPLES = 5

#: RSS samples the results text quotes, at most about (every k-th of a long run)
SERIES_POINTS = 60


@dataclass
class SoakConfig:
    """Everything that defines one soak run (JSON-able: :meth:`to_dict`).

    Sizes: ``devices`` running at any time for ``duration_s`` seconds. Generation:
    ``method`` / ``codec`` / ``draft_len``, greedy, ``max_new_tokens`` per
    generation, prompts from a pool of ``prompts``. Faults: ``kill_rate`` device
    kills per second on average, ``restarts`` cloud restarts (the cloud is down for
    ``restart_down_s`` each time), message ``loss`` and ``duplicate`` probabilities.
    Timers: the edges ping every ``heartbeat_s`` and give up on a silent cloud after
    ``edge_timeout_s``; the cloud reaps a silent peer after ``cloud_timeout_s``; a
    late answer is asked for again after ``resend_after_s``; one generation may take
    ``generation_timeout_s``. Memory: RSS is sampled every ``sample_every_s``, and
    the sample at ``warmup_fraction`` of the run is the baseline of the growth.
    """

    devices: int = 256
    duration_s: float = 60.0
    pair: str = "bytes"
    method: str = "xcosd-e"
    codec: str = "f32"
    draft_len: int = 4
    max_new_tokens: int = 48
    prompts: int = 64
    loss: float = 0.01
    duplicate: float = 0.01
    kill_rate: float = 1.0
    restarts: int = 1
    restart_down_s: float = 0.25
    heartbeat_s: float = 0.5
    edge_timeout_s: float = 5.0
    cloud_timeout_s: float = 5.0
    resend_after_s: float = 2.0
    generation_timeout_s: float = 60.0
    transport: str = "zmq"
    seed: int = 0
    warmup_fraction: float = 0.2
    sample_every_s: float = 1.0

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        for name in ("duration_s", "heartbeat_s", "edge_timeout_s", "cloud_timeout_s",
                     "resend_after_s", "generation_timeout_s", "sample_every_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.pair not in PAIRS:
            raise ValueError(f"pair must be one of {', '.join(PAIRS)}, got {self.pair!r}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss!r}")
        if not 0.0 <= self.duplicate <= 1.0:
            raise ValueError(f"duplicate must be in [0, 1], got {self.duplicate!r}")
        if not (math.isfinite(self.kill_rate) and self.kill_rate >= 0):
            raise ValueError(f"kill_rate must be a finite number >= 0, got {self.kill_rate!r}")
        if self.restarts < 0 or self.prompts < 1 or self.restart_down_s < 0:
            raise ValueError("restarts and restart_down_s must be >= 0, prompts >= 1")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}")
        if self.transport not in ("zmq", "tcp"):
            raise ValueError(f"transport must be zmq or tcp, got {self.transport!r}")
        self.generation()  # the method, codec and lengths are checked where they are used

    def generation(self, seed: int | None = None) -> GenerationConfig:
        """What every device generates with: greedy, so the output is checkable."""
        return GenerationConfig(method=self.method, codec=self.codec, draft_len=self.draft_len,
                                do_sample=False, max_new_tokens=self.max_new_tokens,
                                timeout_s=self.generation_timeout_s, seed=seed)

    def link(self, seed: int) -> LinkSpec | None:
        """One device's lossy link (``None``: a perfect one)."""
        from ..transport import LinkSpec

        if not self.loss and not self.duplicate:
            return None
        return LinkSpec.of(loss=self.loss, duplicate=self.duplicate, seed=seed)

    @property
    def settle_s(self) -> float:
        """How long the cloud may take, after every device closed, to free the last
        sessions: a device killed just before the end is only reaped after
        ``cloud_timeout_s`` (and the reaper runs every quarter of it)."""
        return 2 * self.cloud_timeout_s + 10.0

    @property
    def drain_s(self) -> float:
        """How long the generations running at the end of the window may take to finish."""
        return self.generation_timeout_s + 10.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------- the pair


def _pair_tokens(docs: Sequence[str], n: int) -> list[bytes]:
    """The ``n`` most frequent byte pairs of ``docs`` (ties by byte value): tokens a
    byte-level vocabulary can add so that its tokenizer merges common text."""
    counts = np.zeros(1 << 16, dtype=np.int64)
    for d in docs:
        b = np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        if b.size > 1:
            counts += np.bincount(b[:-1] * 256 + b[1:], minlength=1 << 16)
    order = np.argsort(-counts, kind="stable")[:n]
    return [bytes([int(c) >> 8, int(c) & 255]) for c in order]


def _byte_vocabulary(name: str, pairs: Sequence[bytes]) -> Vocabulary:
    from ..vocab import Vocabulary

    tokens = [bytes([i]) for i in range(256)] + list(pairs) + [b"<eos>"]
    eos = len(tokens) - 1
    return Vocabulary(name, tokens, special=[eos], roles={"eos": eos})


def byte_pair() -> tuple[LanguageModel, LanguageModel]:
    """``(target, draft)`` of the ``bytes`` pair (module docstring): a 5-gram target
    and a 4-gram draft over two byte-level vocabularies that share the 256 bytes and
    the most frequent byte pairs of the text, and differ in the next ones (the
    target takes the even ranks, the draft the odd ones). Trained on part of the
    default corpus, cached like every n-gram model."""
    from ..models import NgramModel, default_corpus

    docs = default_corpus()[:BYTE_PAIR_DOCS]
    n, k = BYTE_PAIR_SHARED, BYTE_PAIR_OWN
    pairs = _pair_tokens(docs, n + 2 * k)
    target = NgramModel.load_or_train(
        _byte_vocabulary("soak-bytes-t", pairs[:n] + pairs[n::2]), 5, docs)
    draft = NgramModel.load_or_train(
        _byte_vocabulary("soak-bytes-d", pairs[:n] + pairs[n + 1::2]), 4, docs)
    return target, draft


def load_pair(name: str) -> tuple[LanguageModel, LanguageModel]:
    """``(target, draft)`` for one of :data:`PAIRS`."""
    if name == "bytes":
        return byte_pair()
    if name == "embedded":
        from ..models import default_pair

        draft, target = default_pair()
        return target, draft
    raise ValueError(f"unknown pair {name!r}; known: {', '.join(PAIRS)}")


def soak_prompts(n: int, seed: int) -> list[str]:
    """``n`` distinct prompts: snippets of the default corpus (12-60 characters
    starting at a word), so the devices' contexts differ as real prompts do."""
    from ..models import default_corpus

    docs = [d for d in default_corpus() if len(d.strip()) >= 80]
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    for _ in range(50 * n):
        if len(out) == n:
            break
        d = docs[rng.randrange(len(docs))]
        starts = [0, *(i + 1 for i, c in enumerate(d[:-60]) if c == " ")]
        a = rng.choice(starts)
        p = " ".join(d[a:a + rng.randint(12, 60)].split())
        if p and p not in seen:
            seen.add(p)
            out.append(p)
    if len(out) < n:
        raise ValueError(f"the corpus gave only {len(out)} distinct prompts of {n}")
    return out


def stop_ids(vocab: Vocabulary) -> frozenset[int]:
    """The ids that end a generation: the ones the cloud announces (eos, eot)."""
    return frozenset(vocab.roles[r] for r in ("eos", "eot") if r in vocab.roles)


def greedy_reference(target: LanguageModel, prompt: str, max_new_tokens: int,
                     stops: frozenset[int]) -> list[int]:
    """The target's own greedy continuation of ``prompt``: what a lossless greedy
    generation must produce. Ties go to the lowest id, as the warper breaks them."""
    s = target.start(target.tokenize(prompt))
    out: list[int] = []
    try:
        for _ in range(max_new_tokens):
            t = int(np.argmax(target.score([(s, [])])[0][-1]))
            out.append(t)
            if t in stops:
                break
            target.append(s, [t])
    finally:
        target.end(s)
    return out


def mismatch_kind(got: Sequence[int], want: Sequence[int]) -> str | None:
    """``None`` when ``got == want``, else what went wrong at the first difference:
    ``lost`` (a token of ``want`` is missing there and the rest follows), ``repeated``
    (an extra token there, the rest follows), ``short`` / ``long`` (one is a prefix of
    the other), ``wrong`` (anything else)."""
    got, want = list(got), list(want)
    if got == want:
        return None
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
             min(len(got), len(want)))
    if i == len(got):
        return "short"
    if i == len(want):
        return "long"
    rest = got[i:]
    if rest == want[i + 1:i + 1 + len(rest)]:
        return "lost"
    if got[i + 1:] == want[i:i + len(got) - i - 1]:
        return "repeated"
    return "wrong"


# --------------------------------------------------------------------- the run


#: the CloudNode counters summed over the cloud's instances in the report
CLOUD_COUNTERS = ("sessions_opened", "sessions_closed", "sessions_timed_out",
                  "sessions_idle_reaped", "sessions_failed", "peers_dropped", "rounds",
                  "emitted_tokens", "follow_ups", "messages", "errors_sent", "dropped",
                  "dropped_outbox", "dropped_flood", "dropped_control", "refused_flood",
                  "internal_errors")


class _Device:
    """One device slot's current edge, its loop task and where its generation is."""

    def __init__(self, idx: int, edge: EdgeNode) -> None:
        self.idx = idx
        self.edge = edge
        self.task: asyncio.Task[None] | None = None
        self.in_flight = False
        self.rounds = 0  # rounds of the generation in flight
        self.killed = False


class _Soak:
    """The state of one run; :meth:`run` is the whole of it."""

    def __init__(self, cfg: SoakConfig, target: LanguageModel, draft: LanguageModel,
                 vmap: VocabMap, prompts: list[str], refs: list[list[int]],
                 progress: Progress) -> None:
        self.cfg = cfg
        self.target, self.draft, self.vmap = target, draft, vmap
        self.prompts, self.refs = prompts, refs
        self.bar = progress
        self.rng = random.Random(cfg.seed)
        self.cloud: CloudNode | None = None
        self.endpoint = ""
        self.clouds: list[dict[str, Any]] = []  # stats of each closed cloud instance
        self.devices: dict[int, _Device] = {}
        self.next_idx = 0
        self.background: set[asyncio.Task[Any]] = set()  # replacements connecting
        self.dying: set[asyncio.Task[Any]] = set()  # killed devices being torn down
        self.stopping = False
        self.t0 = 0.0
        self.phase = "start"
        # counts
        self.started = self.completed = self.killed = self.failed = self.unfinished = 0
        #: tokens of completed (and checked) generations; tokens committed in the
        #: window, whatever became of their generation (what tokens/s counts)
        self.tokens = self.committed = 0
        self.mismatches: Counter[str] = Counter()
        self.mismatch_examples: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.error_examples: list[str] = []
        self.start_errors: Counter[str] = Counter()
        self.kills = self.kills_skipped = self.kill_overruns = self.replaced = 0
        self.restarts_done = 0
        self.restart_s: list[float] = []
        self.gen_stats: Counter[str] = Counter()
        self.samples: list[dict[str, Any]] = []
        self.gen_wall_s: list[float] = []
        self.loop_lag_s = 0.0
        self.cpu0 = time.process_time()

    # -- devices -----------------------------------------------------------------

    def _edge(self, idx: int) -> EdgeNode:
        from ..nodes import EdgeNode
        from ..nodes.edge import shared_process_draft_thread

        c = self.cfg
        return EdgeNode(self.draft, self.endpoint, config=c.generation(),
                        transport=c.transport, link=c.link(c.seed * 1_000_003 + idx),
                        vocab_map=self.vmap, heartbeat_s=c.heartbeat_s,
                        silence_timeout_s=c.edge_timeout_s, connect_timeout_s=3 * c.edge_timeout_s,
                        resend_after_s=c.resend_after_s, busy_retry_s=0.02,
                        draft_thread=shared_process_draft_thread(self.draft), name=f"soak-{idx}")

    async def _start_device(self) -> _Device:
        """A new device, connected (the node retries for ``3 * edge_timeout_s``; this
        deadline only bounds a start that hangs)."""
        idx = self.next_idx
        self.next_idx += 1
        edge = self._edge(idx)
        try:
            async with asyncio.timeout(4 * self.cfg.edge_timeout_s + 10.0):
                await edge.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(edge.close(), 10.0)
            raise
        dev = _Device(idx, edge)

        def on_round(r: RoundObserved) -> None:
            dev.rounds += 1
            if not self.stopping:
                self.committed += r.tokens

        edge.on_round = on_round
        self.devices[idx] = dev
        return dev

    def _launch(self, dev: _Device) -> None:
        dev.task = asyncio.get_running_loop().create_task(self._loop(dev), name=f"soak-{dev.idx}")

    async def _loop(self, dev: _Device) -> None:
        """One device: greedy generations back to back until the window ends; each
        finished one is checked against the reference."""
        c = self.cfg
        k = 0
        while not self.stopping:
            p = self.rng.randrange(len(self.prompts))
            dev.in_flight, dev.rounds = True, 0
            self.started += 1
            try:
                res = await dev.edge.generate(
                    self.prompts[p], config=c.generation(c.seed * 1_000_003 + dev.idx * 10_007 + k))
            except asyncio.CancelledError:
                if dev.killed:
                    self.killed += 1
                else:
                    self.unfinished += 1
                raise
            except Exception as e:
                self.failed += 1
                self.errors[type(e).__name__] += 1
                if len(self.error_examples) < EXAMPLES:
                    self.error_examples.append(f"device {dev.idx}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.05)  # never spin on a failing cloud
                continue
            finally:
                dev.in_flight = False
                k += 1
            self._check(dev, p, res)

    def _check(self, dev: _Device, p: int, res: GenerationResult) -> None:
        self.completed += 1
        n = len(res.token_ids)
        self.tokens += n
        st = res.stats
        self.gen_wall_s.append(st.wall_s)
        for f in ("rounds", "drafted", "accepted", "resumes", "resends", "busy_retries"):
            self.gen_stats[f] += int(getattr(st, f))
        kind = mismatch_kind(res.token_ids, self.refs[p])
        if kind is None:
            return
        self.mismatches[kind] += 1
        if len(self.mismatch_examples) < EXAMPLES:
            want = self.refs[p]
            at = next((i for i, (a, b) in enumerate(zip(res.token_ids, want, strict=False))
                       if a != b), min(n, len(want)))
            self.mismatch_examples.append({
                "device": dev.idx, "prompt": self.prompts[p], "kind": kind, "at": at,
                "got": list(res.token_ids[max(0, at - 3):at + 5]),
                "want": list(want[max(0, at - 3):at + 5]), "resumes": st.resumes,
                "resends": st.resends, "finish_reason": st.finish_reason})

    # -- faults ------------------------------------------------------------------

    async def _kill(self, dev: _Device) -> None:
        """Kill ``dev`` as a power cut would: no Close for its session, no goodbye.

        EdgeNode's own ways out are orderly (a cancelled generation says Close
        before it ends). Marking the node disconnected first, which is what a lost
        link does to it, leaves the cancelled generation no connection to say Close
        on; closing the node then drops the socket. The cloud learns of the death
        only from its timeout (ZeroMQ) or the dropped connection (TCP)."""
        dev.killed = True
        self.devices.pop(dev.idx, None)
        dev.edge._connected = False
        if dev.task is not None:
            dev.task.cancel()
            done, _ = await asyncio.wait([dev.task], timeout=10.0)
            if not done:
                self.kill_overruns += 1
        try:
            await asyncio.wait_for(dev.edge.close(), 10.0)
        except Exception:  # a close past its deadline, or one that failed
            self.kill_overruns += 1
        # the soak's own references in a cycle (the cancelled task's frames hold the
        # device, the device its task; the node's round hook, the device): let go of
        # them, so the dead device is freed now and the memory figures are the
        # library's, not garbage of this harness waiting for a full collection
        dev.task = None
        dev.edge.on_round = None

    async def _start_retrying(self, deadline: float) -> _Device | None:
        """A new device, as a real one would get going: a failed start (counted by
        exception class, never hidden) is tried again, until ``deadline`` or the end
        of the window."""
        while True:
            try:
                return await self._start_device()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.start_errors[type(e).__name__] += 1
                if len(self.error_examples) < EXAMPLES:
                    self.error_examples.append(f"device start: {type(e).__name__}: {e}")
                if self.stopping or time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(0.1)

    async def _replace(self) -> None:
        """A fresh device for a killed one."""
        dev = await self._start_retrying(self.t0 + self.cfg.duration_s)
        if dev is not None:
            if self.stopping:  # the window ended while it connected
                self.devices.pop(dev.idx, None)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(dev.edge.close(), 10.0)
                return
            self.replaced += 1
            self._launch(dev)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    async def _killer(self) -> None:
        if not self.cfg.kill_rate:
            return
        rng = random.Random(self.cfg.seed + 1)
        end = self.t0 + self.cfg.duration_s
        while True:
            await asyncio.sleep(rng.expovariate(self.cfg.kill_rate))
            if time.monotonic() >= end or self.stopping:
                return
            live = [d for d in self.devices.values() if d.in_flight and not d.killed]
            mid = [d for d in live if d.rounds > 0]  # mid-generation: a round already done
            pool = mid or live
            if not pool:
                self.kills_skipped += 1
                continue
            dev = pool[rng.randrange(len(pool))]
            self.kills += 1
            # torn down and replaced in the background, so that a slow teardown does not
            # hold back the next kill (the kills stay a Poisson process)
            t = asyncio.get_running_loop().create_task(self._kill(dev))
            self.dying.add(t)
            t.add_done_callback(self.dying.discard)
            self._spawn(self._replace())

    async def _bind(self) -> CloudNode:
        """A cloud on :attr:`endpoint` (the first time: on a free port). A restarted
        one binds as soon as the port is free again: ZeroMQ releases a closed
        socket's port in its I/O thread, a moment after ``close``."""
        from ..nodes import CloudNode

        c = self.cfg
        bind = self.endpoint or "tcp://127.0.0.1:0"
        deadline = time.monotonic() + 30.0
        while True:
            node = CloudNode(self.target, bind=bind, transport=c.transport,
                             silence_timeout_s=c.cloud_timeout_s, heartbeat_s=c.heartbeat_s,
                             max_sessions=max(1024, 4 * c.devices),
                             max_queue=max(4096, 8 * c.devices))
            try:
                return await node.start()
            except TransportError as e:
                if e.code != "address_in_use" or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.01)

    async def _close_cloud(self) -> None:
        cloud, self.cloud = self.cloud, None
        if cloud is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cloud.close(), 15.0)
        self.clouds.append(cloud.stats())

    async def _restarter(self) -> None:
        c = self.cfg
        for k in range(c.restarts):
            at = self.t0 + c.duration_s * (k + 1) / (c.restarts + 1)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            t = time.monotonic()
            await self._close_cloud()
            await asyncio.sleep(c.restart_down_s)
            self.cloud = await self._bind()
            self.restarts_done += 1
            self.restart_s.append(round(t - self.t0, 2))

    async def _sampler(self) -> None:
        """Samples every ``sample_every_s``; how late each tick wakes up is the event
        loop's lag (a callback that blocks the loop shows there)."""
        k = 0
        warm_at = self.cfg.warmup_fraction * self.cfg.duration_s
        collected = False
        while True:
            due = self.t0 + k * self.cfg.sample_every_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self.loop_lag_s = max(self.loop_lag_s, time.monotonic() - due)
            # the memory baseline after a full collection (see _sample): the first
            # sample at warm_at or later, as memory_summary picks its baseline
            collect = not collected and time.monotonic() - self.t0 >= warm_at
            collected = collected or collect
            self._sample(collect=collect)
            k += 1

    def _sample(self, phase: str | None = None, *, collect: bool = False) -> None:
        """One sample: memory, progress, and what tells a stall's cause apart (the
        process's CPU seconds, all threads: flat while nothing moves means the machine
        starved it; rising means it was busy with something that produced nothing).

        ``collect``: run a full garbage collection first (marked ``collected``), as
        the warm-up sample and the end of the window do. Between collections the
        heap also holds garbage that waits for one (reference cycles that lived
        past a young collection), so only samples taken right after one tell what
        the process keeps alive from what it has not yet freed."""
        if collect:
            gc.collect()
        t = time.monotonic() - self.t0
        st = self.cloud.stats() if self.cloud is not None else None
        self.samples.append({
            "t": round(t, 2), "phase": phase or self.phase, "rss_mb": round(rss_mb(), 1),
            **heap_mb(), **({"collected": True} if collect else {}),
            "cpu_s": round(time.process_time() - self.cpu0, 2),
            "tokens": self.committed, "generations": self.completed, "kills": self.kills,
            "devices": len(self.devices),
            "cloud_sessions": st["sessions_active"] if st is not None else None,
            "cloud_queued": st["queued"] if st is not None else None,
            "cloud_inbox": st["inbox"] if st is not None else None})
        self.bar.update(min(t, self.cfg.duration_s), self.committed,
                        self.failed + sum(self.mismatches.values()), self.phase)

    # -- the whole run -----------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        c = self.cfg
        t_start = time.monotonic()
        self.cloud = await self._bind()
        self.endpoint = self.cloud.endpoint
        tasks: list[asyncio.Task[Any]] = []
        try:
            # at most 32 handshakes at a time (each builds state on the cloud), the
            # next one starting as soon as one is done, not when its whole wave is
            deadline = time.monotonic() + 60.0
            gate = asyncio.Semaphore(32)

            async def start() -> None:
                async with gate:
                    await self._start_retrying(deadline)

            await asyncio.gather(*(start() for _ in range(c.devices)))
            if not self.devices:
                raise RuntimeError("no device could connect to the cloud: "
                                   + "; ".join(self.error_examples))
            setup_s = time.monotonic() - t_start
            self.t0 = time.monotonic()
            self.phase = "running"
            for dev in list(self.devices.values()):
                self._launch(dev)
            loop = asyncio.get_running_loop()
            tasks = [loop.create_task(self._sampler()), loop.create_task(self._killer()),
                     loop.create_task(self._restarter())]
            await asyncio.sleep(max(0.0, self.t0 + c.duration_s - time.monotonic()))
            self.stopping = True
            self._sample("end", collect=True)
            # the window is over: no new generation starts, running ones finish
            self.phase = "draining"
            for t in tasks[1:]:
                if not t.done():
                    t.cancel()
            await asyncio.wait(tasks[1:], timeout=30.0)
            if self.dying:  # killed devices still being torn down (each has deadlines)
                await asyncio.wait(list(self.dying), timeout=30.0)
            killer_error, restart_error = (
                t.exception() if t.done() and not t.cancelled() else None for t in tasks[1:])
            if self.cloud is None:  # cancelled between a close and its rebind
                self.cloud = await self._bind()
            background = list(self.background)
            for t in background:
                t.cancel()
            if background:
                await asyncio.wait(background, timeout=15.0)
            loops = [d.task for d in self.devices.values() if d.task is not None]
            t_drain = time.monotonic()
            if loops:
                await asyncio.wait(loops, timeout=c.drain_s)
            for t in loops:
                t.cancel()  # past the deadline: counted as unfinished
            if loops:
                await asyncio.wait(loops, timeout=10.0)
            drain_s = time.monotonic() - t_drain
            self.phase = "closing"
            closing = [asyncio.ensure_future(asyncio.wait_for(d.edge.close(), 15.0))
                       for d in self.devices.values()]
            if closing:
                await asyncio.wait(closing, timeout=30.0)
            self._sample("closed")
            # every device is gone: the cloud must free every session, within a bound
            self.phase = "settling"
            t_settle = time.monotonic()
            cloud = self.cloud
            assert cloud is not None
            while (cloud.stats()["sessions_active"] or cloud.stats()["peers"]) \
                    and time.monotonic() - t_settle < c.settle_s:
                await asyncio.sleep(0.05)
            settle_s = time.monotonic() - t_settle
            final = cloud.stats()
            self._sample("settled")
        finally:
            for t in tasks:
                t.cancel()
            for d in list(self.devices.values()):
                if d.task is not None:
                    d.task.cancel()
            for t in list(self.background):
                t.cancel()
            for t in list(self.dying):
                t.cancel()
            pending = [*tasks, *self.background, *self.dying,
                       *(d.task for d in self.devices.values() if d.task is not None)]
            if pending:
                await asyncio.wait(pending, timeout=10.0)
            for d in list(self.devices.values()):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(d.edge.close(), 10.0)
            await self._close_cloud()
            self.bar.close()
        return self._report(final, setup_s, drain_s, settle_s, killer_error, restart_error,
                            time.monotonic() - t_start)

    def _report(self, final: dict[str, Any], setup_s: float, drain_s: float, settle_s: float,
                killer_error: BaseException | None, restart_error: BaseException | None,
                wall_s: float) -> dict[str, Any]:
        c = self.cfg
        clouds = self.clouds
        summed = {k: sum(int(s.get(k, 0)) for s in clouds) for k in CLOUD_COUNTERS}
        by_code: Counter[str] = Counter()
        for s in clouds:
            by_code.update(s.get("errors_by_code", {}))
        memory = memory_summary(self.samples, c.duration_s, c.warmup_fraction)
        mism = sum(self.mismatches.values())
        accounted = self.completed + self.killed + self.failed + self.unfinished
        checks = {
            "no_mismatch": mism == 0,
            "no_internal_error": summed["internal_errors"] == 0,
            "no_generation_error": self.failed == 0,
            "no_device_start_error": not self.start_errors,
            "all_generations_accounted": self.unfinished == 0 and accounted == self.started,
            "no_session_left": final["sessions_active"] == 0,
            "no_peer_left": final["peers"] == 0,
            "restarts_done": self.restarts_done == c.restarts and restart_error is None,
            "kills_bounded": self.kill_overruns == 0 and killer_error is None,
        }
        drafted = self.gen_stats["drafted"]
        return {
            "kind": "soak", "schema_version": SCHEMA_VERSION, "config": c.to_dict(),
            "pair": {"name": c.pair, "target": self.target.name, "draft": self.draft.name,
                     "target_vocab": self.target.vocab.size, "draft_vocab": self.draft.vocab.size,
                     "v_c": len(self.vmap.common_target_ids),
                     "v_o": int(self.vmap.other_mask.sum())},
            "window_s": c.duration_s, "setup_s": round(setup_s, 2), "drain_s": round(drain_s, 2),
            "settle_s": round(settle_s, 2), "settle_limit_s": c.settle_s,
            "drain_limit_s": c.drain_s, "wall_s": round(wall_s, 2),
            "tokens_checked": self.tokens, "tokens_committed": self.committed,
            "tokens_per_s": self.committed / c.duration_s,
            "generations": {"started": self.started, "completed": self.completed,
                            "killed": self.killed, "failed": self.failed,
                            "unfinished": self.unfinished},
            "generations_per_s": self.completed / c.duration_s,
            "acceptance_rate": self.gen_stats["accepted"] / drafted if drafted else 0.0,
            "generation_s": summary(self.gen_wall_s),
            "edge": {k: self.gen_stats[k] for k in ("rounds", "drafted", "accepted", "resumes",
                                                    "resends", "busy_retries")},
            "mismatches": mism, "mismatches_by_kind": {k: self.mismatches[k] for k in MISMATCH_KINDS},
            "mismatch_examples": self.mismatch_examples,
            "kills": self.kills, "kills_skipped": self.kills_skipped,
            "kill_overruns": self.kill_overruns, "replaced": self.replaced,
            "cloud_restarts": self.restarts_done, "restart_at_s": self.restart_s,
            "restart_error": _describe(restart_error), "killer_error": _describe(killer_error),
            "edge_errors": dict(self.errors), "edge_error_examples": self.error_examples,
            "device_start_errors": dict(self.start_errors),
            "cloud": {"instances": len(clouds), **summed, "errors_by_code": dict(by_code),
                      "per_instance": [{k: s.get(k) for k in ("server_id", "uptime_s",
                                                              *CLOUD_COUNTERS, "errors_by_code")}
                                       for s in clouds]},
            "sessions_left": final["sessions_active"], "peers_left": final["peers"],
            "loop_lag_max_s": round(self.loop_lag_s, 3),
            "cpu_cores_mean": round(cpu_cores({"samples": self.samples}), 3),
            "memory": memory, "samples": self.samples, "checks": checks,
            "ok": all(checks.values()), "machine": machine(),
        }


def _describe(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


def memory_summary(samples: Sequence[dict[str, Any]], duration_s: float,
                   warmup_fraction: float) -> dict[str, Any]:
    """RSS after warm-up (the first sample at ``warmup_fraction`` of the window) and
    at the end of the window, their ratio, whether that is flat (within
    :data:`FLAT_GROWTH`), and the slope over the window's second half in MiB per
    minute; the series is every sample of the window.

    ``late_slopes`` splits that slope where the samples carry
    :func:`~xcosd.bench.report.heap_mb`'s fields: the C heap in use and held free
    (MiB per minute) and the interpreter's small blocks (blocks per minute). RSS
    that grows while all three are level is memory the allocators keep (arenas,
    libzmq's queue chunks), not objects that pile up."""
    window = [s for s in samples if s["phase"] in ("running", "end")]
    warm_at = warmup_fraction * duration_s
    warm = next((s for s in window if s["t"] >= warm_at), window[-1] if window else None)
    end = next((s for s in reversed(window) if s["phase"] == "end"),
               window[-1] if window else None)
    w = warm["rss_mb"] if warm else 0.0
    e = end["rss_mb"] if end else 0.0
    growth = e / w if w else 0.0
    # the slope over the second half of the window: a process still warming up
    # (allocator arenas, socket buffers) levels off, a leak keeps its slope
    late = [s for s in window if s["t"] >= duration_s / 2]
    slopes = {k: _per_minute(late, k) for k in ("heap_used_mb", "heap_free_mb", "py_blocks")
              if late and all(k in s for s in late)}
    kept = [s for s in window if s.get("collected")]
    return {"series_mb": [[s["t"], s["rss_mb"]] for s in window],
            "after_collection": _kept(kept[0], kept[-1]) if len(kept) >= 2 else None,
            "start_mb": window[0]["rss_mb"] if window else 0.0,
            "warm_at_s": warm["t"] if warm else 0.0, "warm_mb": w, "end_mb": e,
            "peak_mb": max((s["rss_mb"] for s in window), default=0.0),
            "after_close_mb": next((s["rss_mb"] for s in samples if s["phase"] == "settled"), None),
            "growth": growth, "flat": bool(w) and growth <= FLAT_GROWTH,
            "late_slope_mb_per_min": _per_minute(late, "rss_mb"),
            "late_slopes": slopes,
            "flat_within": FLAT_GROWTH}


def _kept(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What the process held after the warm-up sample's full collection (``a``) and
    after the end's (``b``), and the growth per generation completed in between:
    memory that every generation leaves behind shows here however the collector's
    timing moves the samples in between. The soak's own records count too: one
    wall time per completed generation (its percentiles) and one sample a tick."""
    gens = max(1, b["generations"] - a["generations"])
    out: dict[str, Any] = {"from_s": a["t"], "to_s": b["t"],
                           "generations": b["generations"] - a["generations"]}
    for k in ("rss_mb", "heap_used_mb", "py_blocks"):
        if k in a and k in b:
            out[k] = [a[k], b[k]]
            out[f"{k}_per_generation"] = (b[k] - a[k]) / gens
    return out


def _per_minute(samples: Sequence[dict[str, Any]], key: str) -> float | None:
    """The least-squares slope of ``key`` over ``samples``, per minute (``None``
    with fewer than 3)."""
    if len(samples) < 3:
        return None
    return float(np.polyfit([s["t"] for s in samples], [s[key] for s in samples], 1)[0]) * 60


async def soak(config: SoakConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Run one soak in the running event loop and return its report (module
    docstring). Loads the pair and computes every prompt's reference first."""
    from ..vocab import VocabMap

    target, draft = load_pair(config.pair)
    vmap = VocabMap(draft.vocab, target.vocab)
    prompts = soak_prompts(config.prompts, config.seed)
    stops = stop_ids(target.vocab)
    refs = [greedy_reference(target, p, config.max_new_tokens, stops) for p in prompts]
    bar = Progress(config.duration_s, enabled=progress, label=f"soak {config.devices} devices ")
    return await _Soak(config, target, draft, vmap, prompts, refs, bar).run()


def run_soak(config: SoakConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """:func:`soak` from synchronous code. Called where an event loop is already
    running (a notebook, a test), it runs in a thread of its own with its own loop,
    so the caller's loop is neither reused nor blocked by a nested ``asyncio.run``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(soak(config, progress=progress))
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["report"] = asyncio.run(soak(config, progress=progress))
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, name="xcosd-soak")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return dict(box["report"])


# --------------------------------------------------------------------- output


def summary_rows(rep: dict[str, Any]) -> list[list[Any]]:
    """The (metric, value) rows the CLI prints and docs/RESULTS.md shows."""
    g, m, cl, gs = rep["generations"], rep["memory"], rep["cloud"], rep["generation_s"]
    err = ", ".join(f"{k} {v}" for k, v in sorted(rep["edge_errors"].items())) or "none"
    starts = ", ".join(f"{k} {v}" for k, v in sorted(rep["device_start_errors"].items())) or "none"
    codes = ", ".join(f"{k} {v}" for k, v in sorted(cl["errors_by_code"].items())) or "none"
    kinds = ", ".join(f"{k} {v}" for k, v in rep["mismatches_by_kind"].items() if v)
    return [
        ["tokens/s (committed in the window)", f"{rep['tokens_per_s']:,.1f}"],
        ["generations completed / killed / failed / unfinished",
         f"{g['completed']:,} / {g['killed']} / {g['failed']} / {g['unfinished']}"],
        ["tokens checked (completed generations)", f"{rep['tokens_checked']:,}"],
        ["seconds per generation (p50 / p99 / max)",
         f"{gs['p50']:.2f} / {gs['p99']:.2f} / {gs['max']:.2f}"],
        ["acceptance rate", f"{rep['acceptance_rate']:.3f}"],
        ["mismatches (lost / repeated / wrong tokens)",
         f"{rep['mismatches']}" + (f" ({kinds})" if kinds else "")],
        ["device kills (replaced)", f"{rep['kills']} ({rep['replaced']})"],
        ["cloud restarts", f"{rep['cloud_restarts']}"],
        ["edge resumes / resends / busy retries",
         f"{rep['edge']['resumes']} / {rep['edge']['resends']} / {rep['edge']['busy_retries']}"],
        ["failed generations by exception", err],
        ["failed device starts by exception", starts],
        ["cloud errors by code", codes],
        ["cloud internal errors", f"{cl['internal_errors']}"],
        ["cloud sessions timed out / idle-reaped",
         f"{cl['sessions_timed_out']} / {cl['sessions_idle_reaped']}"],
        ["sessions left after close", f"{rep['sessions_left']} (after {rep['settle_s']:.1f} s)"],
        ["RSS start / warm / end / peak (MiB)",
         f"{m['start_mb']:.0f} / {m['warm_mb']:.0f} / {m['end_mb']:.0f} / {m['peak_mb']:.0f}"],
        ["RSS growth warm -> end",
         f"{m['growth']:.3f} ({'flat' if m['flat'] else 'NOT flat'}, within "
         f"{100 * (m['flat_within'] - 1):.0f} %)"],
        ["RSS slope over the second half (MiB/min)", _slope(m)],
        ["of it: C heap in use / held free (MiB/min), Python blocks (/min)", _split(m)],
        ["after a full collection, warm -> end: Python blocks / C heap in use (MiB)",
         _kept_text(m)],
    ]


def cpu_cores(rep: dict[str, Any]) -> float:
    """The process's mean CPU use over the window, in cores (all its threads)."""
    s = [x for x in rep["samples"] if x["phase"] in ("running", "end") and "cpu_s" in x]
    if len(s) < 2 or s[-1]["t"] <= s[0]["t"]:
        return 0.0
    return float((s[-1]["cpu_s"] - s[0]["cpu_s"]) / (s[-1]["t"] - s[0]["t"]))


def _slope(m: dict[str, Any]) -> str:
    v = m.get("late_slope_mb_per_min")
    return "n/a" if v is None else f"{v:+.2f}"


def _split(m: dict[str, Any]) -> str:
    """:func:`memory_summary`'s ``late_slopes``, as the report prints them."""
    sl = m.get("late_slopes") or {}

    def one(k: str, fmt: str) -> str:
        v = sl.get(k)
        return "n/a" if v is None else format(v, fmt)

    return (f"{one('heap_used_mb', '+.2f')} / {one('heap_free_mb', '+.2f')}, "
            f"{one('py_blocks', '+,.0f')}")


def _kept_text(m: dict[str, Any]) -> str:
    """:func:`memory_summary`'s ``after_collection``, as the report prints it."""
    k = m.get("after_collection")
    if not k:
        return "n/a"
    parts = []
    if "py_blocks" in k:
        a, b = k["py_blocks"]
        parts.append(f"{a:,} -> {b:,} ({k['py_blocks_per_generation']:+.2f} per generation)")
    if "heap_used_mb" in k:
        a, b = k["heap_used_mb"]
        parts.append(f"{a:.1f} -> {b:.1f} ({1024 * k['heap_used_mb_per_generation']:+.3f} "
                     "KiB per generation)")
    return " / ".join(parts) or "n/a"


def headline(rep: dict[str, Any]) -> str:
    """One line: what ran, with which faults."""
    c, p = rep["config"], rep["pair"]
    return (f"soak: {c['devices']} devices x {rep['window_s']:g} s against one cloud "
            f"({c['transport']}); pair {p['name']} ({p['draft']} -> {p['target']}), "
            f"{c['method']}/{c['codec']}, greedy, {c['max_new_tokens']} tokens per generation; "
            f"faults: {100 * c['loss']:g} % loss and {100 * c['duplicate']:g} % duplicates per "
            f"message, {c['kill_rate']:g} kills/s, {c['restarts']} cloud restart(s)")


def format_report(rep: dict[str, Any]) -> str:
    """The short table the CLI prints, and the checks that failed."""
    lines = [headline(rep), "", table(summary_rows(rep), ["metric", "value"])]
    bad = [k for k, v in rep["checks"].items() if not v]
    lines += ["", "checks: " + ("all passed" if not bad else "FAILED " + ", ".join(bad))]
    if not rep["memory"]["flat"]:
        lines.append("memory: RSS grew by more than "
                     f"{100 * (rep['memory']['flat_within'] - 1):.0f} % after warm-up")
    for ex in rep["mismatch_examples"]:
        lines.append(f"mismatch: {ex}")
    for ex in rep["edge_error_examples"]:
        lines.append(f"edge error: {ex}")
    return "\n".join(lines)


#: the heading of the docs/RESULTS.md section (:func:`section_lines`)
SECTION_HEADING = "## Soak"


def section_lines(rep: dict[str, Any] | None, image: str | None = None,
                  control: dict[str, Any] | None = None) -> list[str]:
    """The docs/RESULTS.md section for a report (``None``: the file is missing).
    ``image``: the plot's path relative to docs/; ``control``: the report of
    ``python -m xcosd.bench.zmq_memory`` (bare pyzmq), quoted for a run over ZeroMQ.
    Every number and every verdict is computed from the reports."""
    if rep is None:
        return [SECTION_HEADING, "", f"{OUT_FILE} is missing: run `xcosd bench soak`.", ""]
    c, p, g, m = rep["config"], rep["pair"], rep["generations"], rep["memory"]
    at = ", ".join(f"{t:g} s" for t in rep["restart_at_s"]) or "never"
    lines = [
        f"{SECTION_HEADING}: {c['devices']} devices x {rep['window_s']:g} s with faults", "",
        f"Command: `{rep.get('command', 'xcosd bench soak')}` (`{OUT_FILE}`, schema_version "
        f"{rep['schema_version']}).", "",
        f"{c['devices']} `EdgeNode`s (in the cloud's event loop) generate greedily, back to "
        f"back, against one `CloudNode` over {c['transport']}: {c['method']}/{c['codec']}, "
        f"draft length {c['draft_len']}, {c['max_new_tokens']} tokens per generation, prompts "
        f"from a pool of {c['prompts']}; pair `{p['name']}` ({p['draft']} -> {p['target']}, "
        f"|V_C| = {p['v_c']}, |V_O| = {p['v_o']}). Faults throughout: a device in the middle "
        f"of a generation is killed at random, {c['kill_rate']:g} per second on average (its "
        "generation cancelled, its connection dropped without a Close, a new device in its "
        f"place), the cloud is closed and started again on the same endpoint "
        f"({c['restarts']} restart(s), at {at}), and every message is lost with probability "
        f"{c['loss']:g} and duplicated with probability {c['duplicate']:g}, each direction. "
        "Every completed generation is compared with the target's own greedy decode of its "
        "prompt: a lost, repeated or wrong token is a mismatch. After the window the "
        f"running generations finish (within {rep['drain_limit_s']:g} s), every device "
        f"closes, and the cloud has {rep['settle_limit_s']:g} s to free every session (a "
        f"killed device's session is only reaped after the {c['cloud_timeout_s']:g} s "
        "timeout).", "",
        table(summary_rows(rep), ["metric", "value"], markdown=True), ""]
    if image:
        lines += [f"![soak]({image})", ""]
    bad = [k for k, v in rep["checks"].items() if not v]
    verdict = (f"All {len(rep['checks'])} checks passed." if not bad
               else f"Checks failed: {', '.join(bad)} (of {len(rep['checks'])}).")
    acc = g["completed"] + g["killed"] + g["failed"] + g["unfinished"]
    text = [f"{verdict} {rep['mismatches']} mismatches in {g['completed']:,} completed "
            f"generations ({rep['tokens_checked']:,} tokens checked); {acc:,} of "
            f"{g['started']:,} started generations accounted for (completed, killed or "
            f"failed); {rep['sessions_left']} sessions and {rep['peers_left']} peers left on "
            f"the cloud {rep['settle_s']:.1f} s after the last device closed; "
            f"{rep['cloud']['internal_errors']} internal errors."]
    for key, what in (("edge_errors", "Generations that failed, by exception"),
                      ("device_start_errors", "Device starts that failed, by exception")):
        if rep[key]:
            text.append(f"{what}: " + ", ".join(f"{k} {v}" for k, v in sorted(rep[key].items()))
                        + ".")
    if rep["edge_error_examples"]:
        seen = Counter(rep["edge_error_examples"])
        text.append("First errors: " + "; ".join(f"`{e}`" + (f" ({n}x)" if n > 1 else "")
                                                 for e, n in seen.items()) + ".")
    # at most about SERIES_POINTS of the samples in the text (the plot has them all)
    step = max(1, math.ceil(len(m["series_mb"]) / SERIES_POINTS))
    series = ", ".join(f"{mb:.0f}" for _, mb in m["series_mb"][::step])
    text.append(f"Process RSS (cloud and devices together) every "
                f"{step * c['sample_every_s']:g} s, "
                f"MiB: {series}. After warm-up ({m['warm_at_s']:g} s) {m['warm_mb']:.1f} MiB, at "
                f"the end {m['end_mb']:.1f} MiB: x{m['growth']:.3f}, "
                + ("flat" if m["flat"] else "**not flat**")
                + f" (within {100 * (m['flat_within'] - 1):.0f} %); over the second half of "
                f"the window RSS moved {_slope(m)} MiB per minute"
                + (f" (the C heap in use and held free, MiB per minute, and the "
                   f"interpreter's small blocks, per minute: {_split(m)})"
                   if m.get("late_slopes") else "")
                + (f"; after a full collection at the warm-up sample and at the end, "
                   f"Python blocks / C heap in use went {_kept_text(m)} over "
                   f"{m['after_collection']['generations']:,} generations (the soak keeps "
                   "one wall time per generation and one sample a tick of its own). Both "
                   "are taken right after a full collection because between two the heap "
                   "may also hold garbage waiting for the next (reference cycles that "
                   "outlived the young collections), which RSS alone would count as kept; "
                   "over ZeroMQ, RSS also climbs before the baseline as libzmq allocates "
                   "each connection's queue memory"
                   if m.get("after_collection") else "")
                + ". The process used "
                f"{cpu_cores(rep):.2f} cores on average over the window (cloud, its worker "
                "thread and every device share one interpreter). The event loop woke up "
                f"at most {rep['loop_lag_max_s']:.2f} s late.")
    if control is not None and c["transport"] == "zmq":
        cs = control["series_mb"]
        text.append(
            f"The memory baseline is sampled at {100 * c['warmup_fraction']:g} % of the run "
            "because of libzmq: it allocates each connection's queue memory (chunks of 256 "
            "messages, one freed chunk kept as a spare) only as that connection's first few "
            "hundred messages pass, so a process with many connections that each carry a "
            "few messages a second grows for minutes before it is flat. The control, "
            f"`python -m xcosd.bench.zmq_memory` (bare pyzmq {control['pyzmq']}, libzmq "
            f"{control['zmq']}, no xcosd code: {control['connections']} connections at "
            f"{control['messages_per_connection_per_s']:.1f} messages/s each), went from "
            f"{control['first_mb']:g} to {control['end_mb']:g} MiB over "
            f"{cs[-1][0]:g} s and was within 1 MiB of its end from "
            f"{control['flat_from_s']} s on.")
    return [*lines, " ".join(text), ""]


def plot(rep: dict[str, Any], path: str | Path) -> Path:
    """RSS and tokens/s over the run, the cloud restarts marked."""
    from .plots import _plt, _save

    plt = _plt()
    s = [x for x in rep["samples"] if x["phase"] in ("running", "end")]
    t = [x["t"] for x in s]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(t, [x["rss_mb"] for x in s], color="tab:blue", label="RSS (MiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    rate = [0.0] + [(b["tokens"] - a["tokens"]) / max(b["t"] - a["t"], 1e-9)
                    for a, b in itertools.pairwise(s)]
    ax2.plot(t, rate, color="tab:orange", label="tokens/s")
    ax2.set_ylabel("tokens/s", color="tab:orange")
    ax2.set_ylim(bottom=0)
    for r in rep["restart_at_s"]:
        ax.axvline(r, color="gray", linestyle="--", linewidth=1)
    ax.set_title(f"soak: {rep['config']['devices']} devices, {rep['kills']} kills, "
                 f"{rep['cloud_restarts']} cloud restart(s) (dashed)")
    return _save(fig, path)


__all__ = ["OUT_FILE", "PAIRS", "SCHEMA_VERSION", "SECTION_HEADING", "SoakConfig", "byte_pair",
           "cpu_cores", "format_report", "greedy_reference", "headline", "load_pair",
           "memory_summary", "mismatch_kind", "plot", "rss_mb", "run_soak", "section_lines", "soak",
           "soak_prompts", "summary_rows"]
