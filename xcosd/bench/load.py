"""``xcosd bench load``: many edge devices against one cloud, closed loop.

One :class:`~xcosd.nodes.CloudNode` serves the target in this process; ``devices``
edge devices, each a real :class:`~xcosd.nodes.EdgeNode` with its own ZeroMQ (or
TCP) connection, run as asyncio tasks in ``procs`` separate worker processes
(default one). Why separate processes: on a machine with few cores the device side
(drafting, msgpack, the protocol state machines of hundreds of sessions) would
otherwise share one interpreter lock with the cloud's event loop and its verify
thread, and the benchmark would measure their contention instead of the
scheduler. ``procs=0`` runs the devices in the cloud's own event loop (tests, or
to see that contention).

Closed loop: every device runs one generation at a time and starts the next as
soon as one ends. Warm-up is excluded: with ``duration_s`` the measured window is
``[start + warmup_s, start + warmup_s + duration_s]`` and generations still running
at its end are cancelled; with ``generations`` each device first runs
``warmup_generations`` and the window is the span in which every device is past
its warm-up and none has finished (the steady state).

What is measured, in the shape ``wrk``/``ghz``/``vllm bench serve`` print:

* throughput: tokens/s and rounds/s, aggregate and per device, from the rounds that
  end inside the window;
* latency: per-token latency (a round's wall time divided by the tokens it emitted,
  one sample per token), round latency, time to first token (``generate`` called
  -> first token committed, session open included), time per output token
  (vLLM's TPOT: ``(end - first token) / (tokens - 1)`` per generation);
* the cloud: batch-size histogram and queue wait of the batches that end inside the
  window, compute time and busy fraction;
* bytes per token up and down (wire bytes of the rounds in the window), acceptance;
* errors by class over the whole run: ``timeout``, ``busy``, ``protocol``,
  ``transport``, ``other``.

With a :class:`~xcosd.models.SyntheticModel` target, whose batch costs
``a + b * rows``, the scheduler's ideal is known: a batch of ``B`` sessions with
``r`` rows each emits ``B * L`` tokens (``L`` tokens per round) in ``a + b * B * r``
seconds, so ``ideal = B * L / (a + b * B * r)`` with ``B = min(devices, max_batch)``
(1 without batching). The measured/ideal ratio is the scheduler's efficiency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pickle
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from ..errors import BusyError, ProtocolError, TransportError, XcosdError
from ..models.base import LanguageModel, Session
from ..nodes import CloudNode, EdgeNode
from ..transport import LinkSpec
from ..vocab import VocabMap, Vocabulary
from .progress import Progress
from .report import machine, summary

log = logging.getLogger(__name__)

#: the default target: a synthetic model over 256 ids costing 20 ms + 0.5 ms per row
DEFAULT_TARGET = "synthetic:256:20:0.5"
ERROR_CLASSES = ("timeout", "busy", "protocol", "transport", "other")
PROMPTS = (
    "Once upon a time",
    "The cloud server verifies a block of drafted tokens in one pass",
    "def merge_sorted(a, b):",
    "In the beginning the network was slow, and the edge device",
    "Speculative decoding between two vocabularies",
    "A short story about a lighthouse keeper:",
    "The quick brown fox",
    "Return a new list containing all items from the iterable",
)


@dataclass
class LoadConfig:
    """Everything that defines one load run (JSON-able, so workers get a copy)."""

    devices: int = 16
    target: str = DEFAULT_TARGET
    #: draft model spec; ``None``: a cost-free SyntheticModel over the target's
    #: vocabulary (flatter than the target, so drafts are sometimes rejected) for a
    #: synthetic target, ``default-draft`` otherwise
    draft: str | None = None
    method: str = "xcosd-e"
    codec: str = "f32"
    draft_len: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    duration_s: float | None = 8.0
    warmup_s: float = 2.0
    generations: int | None = None
    warmup_generations: int = 1
    batching: bool = True
    max_batch: int = 256
    max_wait_s: float = 0.002
    transport: str = "zmq"
    procs: int = 1
    timeout_s: float = 120.0
    seed: int = 0
    link_rate_mbps: float | None = None
    rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if (self.duration_s is None) == (self.generations is None):
            raise ValueError("give exactly one of duration_s and generations")
        if self.procs < 0:
            raise ValueError(f"procs must be >= 0, got {self.procs}")

    @property
    def effective_batch(self) -> int:
        return min(self.devices, self.max_batch) if self.batching else 1

    def link(self) -> LinkSpec | None:
        if self.link_rate_mbps is None and not self.rtt_ms:
            return None
        rate = math.inf if self.link_rate_mbps is None else self.link_rate_mbps * 1e6
        return LinkSpec.of(up_bps=rate, down_bps=rate, rtt_s=self.rtt_ms / 1e3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ------------------------------------------------------------------ models


def draft_spec(cfg: LoadConfig) -> str:
    if cfg.draft is not None:
        return cfg.draft
    return "synthetic-draft" if cfg.target.startswith("synthetic:") else "default-draft"


def load_draft(cfg: LoadConfig, target_vocab: Vocabulary | None) -> LanguageModel:
    from ..models import SyntheticModel, load_model

    spec = draft_spec(cfg)
    if spec == "synthetic-draft":
        assert target_vocab is not None
        return SyntheticModel(target_vocab, skew=0.9, name="synthetic-draft")
    return load_model(spec)


def synthetic_target_vocab(cfg: LoadConfig) -> Vocabulary | None:
    """The target's vocabulary when the device can build it for free (synthetic)."""
    if not cfg.target.startswith("synthetic:"):
        return None
    from ..models import load_model

    return load_model(cfg.target).vocab


class RecordingModel:
    """A :class:`~xcosd.models.LanguageModel` that forwards to ``inner`` and records
    every :meth:`score` call as ``(start, end, sessions, rows)`` (monotonic clock):
    the batches the cloud ran, timestamped, so a window can be cut after the fact."""

    def __init__(self, inner: LanguageModel) -> None:
        self.inner = inner
        self.name = inner.name
        self.vocab = inner.vocab
        self.calls: list[tuple[float, float, int, int]] = []

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

    def start(self, prompt_ids: Sequence[int]) -> Session:
        return self.inner.start(prompt_ids)

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        t0 = time.monotonic()
        out = self.inner.score(batch)
        self.calls.append((t0, time.monotonic(), len(batch), sum(r.shape[0] for r in out)))
        return out

    def append(self, session: Session, ids: Sequence[int]) -> None:
        self.inner.append(session, ids)

    def rollback(self, session: Session, length: int) -> None:
        self.inner.rollback(session, length)

    def end(self, session: Session) -> None:
        self.inner.end(session)


# ------------------------------------------------------------------ devices


class WindowEnded(Exception):
    """Raised between two rounds once the measured window is over."""


class BenchEdge(EdgeNode):
    """An :class:`EdgeNode` that timestamps every round it runs and shares one
    V_C map among all the devices of a process (building it is the slow part of a
    handshake on large vocabularies, and every device would build the same one)."""

    def __init__(self, *args: Any, maps: dict[tuple[str, str], VocabMap] | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._maps = maps if maps is not None else {}
        #: (start, end, tokens, up bytes, down bytes, drafted, accepted)
        self.rounds: list[tuple[float, float, int, int, int, int, int]] = []
        #: monotonic time after which no new round starts (the generation ends with
        #: :class:`WindowEnded` between rounds, so no round is cut in flight)
        self.stop_at = math.inf

    def _build_map(self, target_vocab: Vocabulary) -> VocabMap:
        key = (self.draft.vocab.fingerprint, target_vocab.fingerprint)
        vmap = self._maps.get(key)
        if vmap is None:
            vmap = self._maps[key] = VocabMap(self.draft.vocab, target_vocab)
        return vmap

    async def _round(self, es: Any, inbox: Any, st: Any, trace: Any, on_text: Any) -> None:
        n0, up0, down0 = len(es.token_ids), st.uplink_bytes, st.downlink_bytes
        d0, a0 = st.drafted, st.accepted
        t0 = time.monotonic()
        if t0 >= self.stop_at:
            raise WindowEnded()
        await super()._round(es, inbox, st, trace, on_text)
        self.rounds.append((t0, time.monotonic(), len(es.token_ids) - n0,
                            st.uplink_bytes - up0, st.downlink_bytes - down0,
                            st.drafted - d0, st.accepted - a0))


@dataclass
class Schedule:
    """Monotonic times every device agrees on (the clock is system-wide on Linux)."""

    go: float
    end: float | None  # duration mode: stop (and cancel) at this time


def error_class(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, BusyError):
        return "busy"
    if isinstance(e, ProtocolError):
        return "protocol"
    if isinstance(e, TransportError):
        return "transport"
    return "other"


async def _device(idx: int, edge: BenchEdge, cfg: LoadConfig, sched: Schedule) -> list[dict[str, Any]]:
    """One closed-loop device: generate, record, repeat."""
    await asyncio.sleep(max(0.0, sched.go - time.monotonic()))
    gens: list[dict[str, Any]] = []
    k = 0
    total = None if cfg.generations is None else cfg.warmup_generations + cfg.generations
    while True:
        now = time.monotonic()
        if sched.end is not None and now >= sched.end:
            break
        if total is not None and k >= total:
            break
        deadline = now + cfg.timeout_s
        edge.stop_at = sched.end if sched.end is not None else math.inf
        edge.rounds = []
        rec: dict[str, Any] = {"device": idx, "k": k, "warmup": total is not None
                               and k < cfg.warmup_generations, "start": now, "end": now,
                               "first": None, "tokens": 0, "error": None, "message": None,
                               "cut": False, "busy_retries": 0, "resumes": 0,
                               "up_bytes": 0, "down_bytes": 0}
        try:
            res = await asyncio.wait_for(
                edge.generate(PROMPTS[(idx + k) % len(PROMPTS)], cfg.max_new_tokens,
                              seed=cfg.seed * 1_000_003 + idx * 10_007 + k),
                deadline - now)
            st = res.stats
            rec.update(tokens=st.tokens, busy_retries=st.busy_retries, resumes=st.resumes,
                       up_bytes=st.uplink_bytes, down_bytes=st.downlink_bytes)
        except WindowEnded:
            rec["cut"] = True  # the window ended between two rounds: not an error
        except TimeoutError as e:
            rec["error"], rec["message"] = "timeout", str(e) or "no answer in time"
        except XcosdError as e:
            rec["error"], rec["message"] = error_class(e), str(e)
        except Exception as e:
            rec["error"], rec["message"] = "other", f"{type(e).__name__}: {e}"
        rec["end"] = time.monotonic()
        rec["rounds"] = list(edge.rounds)
        first = next((r[1] for r in edge.rounds if r[2] > 0), None)
        rec["first"] = first
        if rec["cut"] or rec["error"]:
            rec["tokens"] = sum(r[2] for r in edge.rounds)
        gens.append(rec)
        k += 1
        if rec["error"]:
            await asyncio.sleep(0.05)  # back off; never spin on a failing cloud
    return gens


async def run_devices(cfg: LoadConfig, endpoint: str, ids: Sequence[int],
                      wait_go: Callable[[], Awaitable[Schedule]],
                      on_ready: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Connect one :class:`BenchEdge` per device id, wait for the go signal, run the
    closed loop, close. Returns every generation's record."""
    tv = synthetic_target_vocab(cfg)
    draft = load_draft(cfg, tv)
    maps: dict[tuple[str, str], VocabMap] = {}
    link = cfg.link()

    def make() -> BenchEdge:
        return BenchEdge(draft, endpoint, method=cfg.method, codec=cfg.codec,
                         draft_len=cfg.draft_len, temperature=cfg.temperature, top_k=cfg.top_k,
                         top_p=cfg.top_p, transport=cfg.transport, link=link,
                         target_vocab=tv, timeout_s=max(15.0, cfg.timeout_s),
                         busy_retry_s=0.01, name=f"bench-edge-{ids[0] if ids else 0}",
                         maps=maps)

    edges: list[BenchEdge] = []
    try:
        if ids:
            first = make()
            await first.start()  # fetches the target vocabulary once, builds the map
            edges.append(first)
            if tv is None and first.vocab_map is not None:
                tv = first.vocab_map.target
            for i in range(1, len(ids), 32):
                batch = [make() for _ in ids[i:i + 32]]
                await asyncio.gather(*(e.start() for e in batch))
                edges.extend(batch)
        if on_ready is not None:
            on_ready()
        sched = await wait_go()
        per = await asyncio.gather(*(_device(i, e, cfg, sched)
                                     for i, e in zip(ids, edges, strict=True)))
    finally:
        await asyncio.gather(*(e.close() for e in edges), return_exceptions=True)
    return [g for gs in per for g in gs]


def _write(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def _read(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(stream.read(struct.unpack(">Q", head)[0]))


def worker_main() -> None:
    """A device process (``python -m xcosd.bench.load``): read the job from stdin,
    connect, say ready, wait for go, run, write the records to stdout. Pipes and a
    fresh interpreter (not :mod:`multiprocessing`) keep it independent of how the
    parent was started."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the result pipe
    cfg_dict, endpoint, ids = _read(inp)
    cfg = LoadConfig.from_dict(cfg_dict)

    async def main() -> list[dict[str, Any]]:
        async def wait_go() -> Schedule:
            msg = await asyncio.to_thread(_read, inp)
            return Schedule(*msg[1:])

        return await run_devices(cfg, endpoint, ids, wait_go,
                                 on_ready=lambda: _write(out, ("ready", len(ids))))

    try:
        _write(out, ("done", asyncio.run(main())))
    except BaseException as e:  # report, never leave the parent waiting
        with contextlib.suppress(Exception):
            _write(out, ("failed", f"{type(e).__name__}: {e}"))
        raise


# ------------------------------------------------------------------ the run


async def run_load(cfg: LoadConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Run one load test in the current event loop and return its report."""
    from ..models import load_model

    target = RecordingModel(load_model(cfg.target))
    devices = list(range(cfg.devices))
    cloud = CloudNode(target, bind="tcp://127.0.0.1:0", transport=cfg.transport,
                      max_batch=cfg.max_batch if cfg.batching else 1,
                      max_wait_s=cfg.max_wait_s if cfg.batching else 0.0,
                      max_sessions=max(1024, 2 * cfg.devices), max_queue=max(4096, 4 * cfg.devices),
                      timeout_s=max(15.0, cfg.timeout_s))
    records: list[dict[str, Any]] = []
    t_run = time.monotonic()
    async with cloud:
        sched_stats = getattr(getattr(cloud, "_scheduler", None), "stats", None)
        bar = Progress(_planned_s(cfg), enabled=progress,
                       label=f"{cfg.devices} devices{'' if cfg.batching else ' (no batching)'} ")
        go_at: list[float] = []

        def schedule() -> Schedule:
            go = time.monotonic() + 0.05
            go_at.append(go)
            end = None if cfg.duration_s is None else go + cfg.warmup_s + cfg.duration_s
            return Schedule(go, end)

        if cfg.procs == 0:
            async def wait_go() -> Schedule:
                return schedule()

            task = asyncio.ensure_future(run_devices(cfg, cloud.endpoint, devices, wait_go))
            await _watch(task, cloud, cfg, bar, go_at)
            records = task.result()
        else:
            records = await _run_procs(cfg, cloud, devices, schedule, bar, go_at)
        bar.close()
        cloud_stats = cloud.stats()
        waits = list(sched_stats.queue_waits) if sched_stats is not None else None
    return analyse(cfg, records, target.calls, waits, cloud_stats, go_at[0] if go_at else t_run,
                   _target_costs(target.inner))


def _planned_s(cfg: LoadConfig) -> float:
    if cfg.duration_s is not None:
        return cfg.warmup_s + cfg.duration_s
    return float(cfg.warmup_generations + (cfg.generations or 0))


async def _watch(task: asyncio.Future[Any], cloud: CloudNode, cfg: LoadConfig, bar: Progress,
                 go_at: list[float]) -> None:
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if go_at:
            el = time.monotonic() - go_at[0]
            phase = "warm-up" if cfg.duration_s is not None and el < cfg.warmup_s else "measuring"
            c = cloud.counters
            bar.update(el, c["emitted_tokens"], c["errors_sent"], phase)


async def _run_procs(cfg: LoadConfig, cloud: CloudNode, devices: list[int],
                     schedule: Callable[[], Schedule], bar: Progress,
                     go_at: list[float]) -> list[dict[str, Any]]:
    n = min(cfg.procs, len(devices))
    parts = [devices[i::n] for i in range(n)]
    procs: list[asyncio.subprocess.Process] = []

    async def send(p: asyncio.subprocess.Process, obj: Any) -> None:
        assert p.stdin is not None
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        p.stdin.write(struct.pack(">Q", len(data)) + data)
        await p.stdin.drain()

    async def recv(p: asyncio.subprocess.Process) -> Any:
        assert p.stdout is not None
        try:
            head = await p.stdout.readexactly(8)
            return pickle.loads(await p.stdout.readexactly(struct.unpack(">Q", head)[0]))
        except asyncio.IncompleteReadError:
            await p.wait()
            return ("failed", f"the device process exited with status {p.returncode}")

    try:
        for part in parts:
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "xcosd.bench.load", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, limit=1 << 30)
            procs.append(p)
            await send(p, (cfg.to_dict(), cloud.endpoint, part))
        for p in procs:
            msg = await recv(p)
            if msg[0] != "ready":
                raise RuntimeError(f"a device process failed to start: {msg[1]}")
        sched = schedule()
        for p in procs:
            await send(p, ("go", sched.go, sched.end))
        gathered = asyncio.ensure_future(asyncio.gather(*(recv(p) for p in procs)))
        await _watch(gathered, cloud, cfg, bar, go_at)
        records: list[dict[str, Any]] = []
        for msg in gathered.result():
            if msg[0] != "done":
                raise RuntimeError(f"a device process failed: {msg[1]}")
            records.extend(msg[1])
        return records
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                p.kill()
                await p.wait()


def _target_costs(model: Any) -> tuple[float, float] | None:
    a, b = getattr(model, "a", None), getattr(model, "b", None)
    if isinstance(a, float) and isinstance(b, float):
        return a, b
    return None


def run_load_sync(cfg: LoadConfig, *, progress: bool | None = None) -> dict[str, Any]:
    return asyncio.run(run_load(cfg, progress=progress))


# ------------------------------------------------------------------ analysis


def window_of(cfg: LoadConfig, records: list[dict[str, Any]], go: float) -> tuple[float, float]:
    """The measured window (see the module docstring)."""
    if cfg.duration_s is not None:
        return go + cfg.warmup_s, go + cfg.warmup_s + cfg.duration_s
    by_dev: dict[int, list[dict[str, Any]]] = {}
    for g in records:
        by_dev.setdefault(g["device"], []).append(g)
    w0 = max((max((g["end"] for g in gs if g["warmup"]), default=go) for gs in by_dev.values()),
             default=go)
    w1 = min((max(g["end"] for g in gs) for gs in by_dev.values()), default=go)
    if w1 <= w0:  # too few generations for a common steady state: use all measured ones
        measured = [g for g in records if not g["warmup"]]
        w0 = min((g["start"] for g in measured), default=go)
        w1 = max((g["end"] for g in measured), default=go)
    return w0, w1


def analyse(cfg: LoadConfig, records: list[dict[str, Any]],
            calls: list[tuple[float, float, int, int]], queue_waits: list[float] | None,
            cloud_stats: dict[str, Any], go: float,
            costs: tuple[float, float] | None) -> dict[str, Any]:
    """Cut the window and compute the report (pure: a test can feed it records)."""
    w0, w1 = window_of(cfg, records, go)
    span = max(w1 - w0, 1e-9)
    rounds = [(g["device"], r) for g in records for r in g["rounds"] if w0 <= r[1] <= w1]
    tokens = sum(r[2] for _, r in rounds)
    up = sum(r[3] for _, r in rounds)
    down = sum(r[4] for _, r in rounds)
    drafted = sum(r[5] for _, r in rounds)
    accepted = sum(r[6] for _, r in rounds)

    per_dev: dict[int, dict[str, Any]] = {
        i: {"device": i, "tokens": 0, "rounds": 0} for i in range(cfg.devices)}
    tok_lat: list[float] = []
    for dev, r in rounds:
        per_dev[dev]["tokens"] += r[2]
        per_dev[dev]["rounds"] += 1
        if r[2] > 0:
            tok_lat.extend([(r[1] - r[0]) / r[2]] * r[2])
    for d in per_dev.values():
        d["tokens_per_s"] = d["tokens"] / span
        d["rounds_per_s"] = d["rounds"] / span

    in_window = [g for g in records if g["start"] >= w0 and not g.get("warmup")]
    ttft = [g["first"] - g["start"] for g in in_window if g["first"] is not None and g["first"] <= w1]
    done = [g for g in in_window if g["end"] <= w1 and not g["error"] and not g["cut"]]
    tpot = [(g["end"] - g["first"]) / (g["tokens"] - 1) for g in done
            if g["first"] is not None and g["tokens"] > 1]

    errors = dict.fromkeys(ERROR_CLASSES, 0)
    messages: list[str] = []
    for g in records:
        if g["error"]:
            errors[g["error"]] += 1
            if len(messages) < 5:
                messages.append(f"{g['error']}: {g['message']}")
    busy_retries = sum(g["busy_retries"] for g in records)
    errors["busy"] += busy_retries

    batches = [c for c in calls if w0 <= c[1] <= w1]
    hist: dict[str, int] = {}
    for c in batches:
        hist[str(c[2])] = hist.get(str(c[2]), 0) + 1
    hist = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    batch_compute = sum(c[1] - c[0] for c in batches)
    waits: list[float] = []
    if queue_waits is not None and len(calls) and sum(c[2] for c in calls) == len(queue_waits):
        pos = 0
        for c in calls:  # the scheduler records its waits batch by batch, in order
            if w0 <= c[1] <= w1:
                waits.extend(queue_waits[pos:pos + c[2]])
            pos += c[2]

    n_rounds = len(rounds)
    report: dict[str, Any] = {
        "kind": "load",
        "config": cfg.to_dict(),
        "draft": draft_spec(cfg),
        "window_s": span,
        "devices": cfg.devices,
        "tokens": tokens,
        "rounds": n_rounds,
        "tokens_per_s": tokens / span,
        "rounds_per_s": n_rounds / span,
        "per_device": [per_dev[i] for i in sorted(per_dev)],
        "per_device_tokens_per_s": summary(d["tokens_per_s"] for d in per_dev.values()),
        "token_latency_ms": summary(tok_lat, 1e3),
        "round_latency_ms": summary((r[1] - r[0] for _, r in rounds), 1e3),
        "ttft_ms": summary(ttft, 1e3),
        "tpot_ms": summary(tpot, 1e3),
        "generations": {"started": len(records), "measured_completed": len(done),
                        "cut_at_end": sum(1 for g in records if g["cut"]),
                        "warmup": sum(1 for g in records if g.get("warmup"))},
        "bytes": {"up_total": up, "down_total": down,
                  "up_per_token": up / tokens if tokens else 0.0,
                  "down_per_token": down / tokens if tokens else 0.0},
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1.0 + accepted / n_rounds if n_rounds else 0.0,
        "tokens_per_round": tokens / n_rounds if n_rounds else 0.0,
        "batches": len(batches),
        "batched_requests": sum(c[2] for c in batches),
        "batch_size_histogram": hist,
        "mean_batch_size": (sum(c[2] for c in batches) / len(batches)) if batches else 0.0,
        "queue_wait_ms": summary(waits, 1e3),
        "cloud": {"compute_s": batch_compute, "busy_fraction": batch_compute / span,
                  "mean_batch_compute_ms": 1e3 * batch_compute / len(batches) if batches else 0.0,
                  "errors_by_code": cloud_stats.get("errors_by_code", {}),
                  "sessions_opened": cloud_stats.get("sessions_opened", 0),
                  "dropped": cloud_stats.get("dropped", 0)},
        "errors": errors,
        "errors_total": sum(errors.values()),
        "error_messages": messages,
        "machine": machine(),
    }
    report["ideal"] = ideal(cfg, costs, report)
    return report


def ideal(cfg: LoadConfig, costs: tuple[float, float] | None,
          report: dict[str, Any]) -> dict[str, Any] | None:
    """The cost model's best throughput for this run's batch size (synthetic targets)."""
    if costs is None or not report["rounds"]:
        return None
    a, b = costs
    rows = 1.0 + report["drafted"] / report["rounds"]  # d + 1 rows per session
    per_round = report["tokens_per_round"]
    batch = cfg.effective_batch
    t = a + b * batch * rows
    best = batch * per_round / t if t > 0 else math.inf
    return {"a_s": a, "b_s": b, "batch": batch, "rows_per_session": rows,
            "tokens_per_round": per_round, "batch_time_s": t, "tokens_per_s": best,
            "efficiency": report["tokens_per_s"] / best if best and math.isfinite(best) else None}


# ------------------------------------------------------------------ scaling


def run_scaling(base: LoadConfig, devices: Sequence[int] = (1, 4, 16, 64, 256),
                batching: Sequence[bool] = (True, False), *,
                progress: bool | None = None) -> dict[str, Any]:
    """One run per (devices, batching); each report keeps its summary only."""
    points = []
    for on in batching:
        for n in devices:
            cfg = LoadConfig(**{**base.to_dict(), "devices": n, "batching": on})
            rep = run_load_sync(cfg, progress=progress)
            rep.pop("per_device", None)
            points.append(rep)
            log.info("%d devices, batching %s: %.0f tokens/s", n, on, rep["tokens_per_s"])
    return {"kind": "load-scaling", "base": base.to_dict(), "points": points,
            "machine": machine()}


def scaling_rows(scaling: dict[str, Any]) -> list[list[Any]]:
    """``[devices, batching, tokens/s, ideal, efficiency, mean batch, p50 ms, p99 ms,
    errors]`` per point, and the gain of batching at equal devices."""
    by = {(p["devices"], p["config"]["batching"]): p for p in scaling["points"]}
    rows = []
    for p in scaling["points"]:
        idl = p.get("ideal") or {}
        off = by.get((p["devices"], False))
        gain = (p["tokens_per_s"] / off["tokens_per_s"]
                if p["config"]["batching"] and off and off["tokens_per_s"] else None)
        rows.append([p["devices"], "on" if p["config"]["batching"] else "off",
                     p["tokens_per_s"], idl.get("tokens_per_s"), idl.get("efficiency"),
                     p["mean_batch_size"], p["token_latency_ms"]["p50"],
                     p["token_latency_ms"]["p99"], p["errors_total"], gain])
    return rows


SCALING_HEADER = ["devices", "batching", "tokens/s", "ideal tokens/s", "efficiency",
                  "mean batch", "token p50 ms", "token p99 ms", "errors", "gain vs off"]


def format_report(rep: dict[str, Any]) -> str:
    """A wrk-style text summary of one run."""
    c = rep["config"]
    lines = [
        f"{rep['devices']} devices x closed loop, {c['method']}/{c['codec']}, target "
        f"{c['target']}, draft {rep['draft']}, batching "
        f"{'on (max ' + str(c['max_batch']) + ')' if c['batching'] else 'off'}, "
        f"{c['transport']}, {c['procs'] or 'in-process'} device process(es)",
        f"window {rep['window_s']:.2f} s: {rep['tokens']:,} tokens, {rep['rounds']:,} rounds, "
        f"{rep['tokens_per_s']:,.1f} tokens/s, {rep['rounds_per_s']:,.1f} rounds/s",
        "  latency (ms)      p50      p90      p99      max",
    ]
    for name, key in (("per token", "token_latency_ms"), ("round", "round_latency_ms"),
                      ("first token", "ttft_ms"), ("TPOT", "tpot_ms"),
                      ("queue wait", "queue_wait_ms")):
        s = rep[key]
        lines.append(f"  {name:<13} {s['p50']:8.2f} {s['p90']:8.2f} {s['p99']:8.2f} {s['max']:8.2f}"
                     f"   (n={s['count']})")
    pd = rep["per_device_tokens_per_s"]
    lines += [
        f"  per device tokens/s: min {pd['min']:.1f}  p50 {pd['p50']:.1f}  max {pd['max']:.1f}",
        f"  acceptance rate {rep['acceptance_rate']:.3f}, mean acceptance length "
        f"{rep['mean_acceptance_length']:.2f}, tokens/round {rep['tokens_per_round']:.2f}",
        f"  bytes/token up {rep['bytes']['up_per_token']:.1f}, down "
        f"{rep['bytes']['down_per_token']:.1f}",
        f"  cloud: {rep['batches']} batches, mean size {rep['mean_batch_size']:.1f}, busy "
        f"{100 * rep['cloud']['busy_fraction']:.0f}% of the window; sizes "
        + ", ".join(f"{k}x{v}" for k, v in list(rep["batch_size_histogram"].items())[:12])
        + (" ..." if len(rep["batch_size_histogram"]) > 12 else ""),
        "  errors: " + ", ".join(f"{k} {v}" for k, v in rep["errors"].items())
        + f" (total {rep['errors_total']})",
    ]
    idl = rep.get("ideal")
    if idl:
        lines.append(
            f"  ideal (a={1e3 * idl['a_s']:g} ms, b={1e3 * idl['b_s']:g} ms/row, B={idl['batch']}, "
            f"{idl['rows_per_session']:.2f} rows, {idl['tokens_per_round']:.2f} tokens/round): "
            f"{idl['tokens_per_s']:,.1f} tokens/s -> efficiency {idl['efficiency']:.2f}")
    for m in rep.get("error_messages", []):
        lines.append(f"  ! {m}")
    return "\n".join(lines)


__all__ = ["DEFAULT_TARGET", "ERROR_CLASSES", "BenchEdge", "LoadConfig", "RecordingModel",
           "analyse", "format_report", "ideal", "run_devices", "run_load", "run_load_sync",
           "run_scaling", "scaling_rows", "window_of"]


if __name__ == "__main__":
    worker_main()
