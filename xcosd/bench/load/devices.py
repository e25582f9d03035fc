"""The load generator: edge devices in a closed or an open loop, and the device
process that runs a share of them (``python -m xcosd.bench.load``).

Each device is a plain :class:`~xcosd.nodes.EdgeNode`; its rounds are timed through
the node's public ``on_round`` hook, which hands each round to the log of its own
generation (:class:`_RoundLog`; in an open loop one node runs several generations
at once) and ends a generation between two rounds once the measured window is
over. All the devices of
one process share one V_C map: building it is the slow part of a handshake on large
vocabularies, and every device would build the same one.

What a device reports, one dict per generation (the input of
:func:`~xcosd.bench.load.analysis.analyse`): ``device``, ``k`` (its generation
number), ``warmup``, ``start`` / ``end`` / ``first`` (monotonic; ``first``: the end
of the first round that committed a token), ``tokens``, ``error`` (one of
:data:`ERROR_CLASSES` or ``None``), ``message``, ``cut`` (ended by the window, not
an error), ``busy_retries``, ``resumes``, ``up_bytes``, ``down_bytes`` and
``rounds``: one ``(start, end, tokens, up bytes, down bytes, drafted, accepted)``
tuple per round. In an open loop ``start`` is the generation's arrival time.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BusyError, ProtocolError, TransportError, XcosdError
from ...gc_tuning import many_sessions_gc
from ...models.base import LanguageModel
from ...nodes import EdgeNode, RoundObserved
from ...nodes.edge import shared_process_draft_thread
from ...transport.fds import raise_fd_limit
from ...vocab import VocabMap, Vocabulary
from . import pipe
from .config import LoadConfig, draft_spec, target_spec

ERROR_CLASSES = ("timeout", "busy", "protocol", "transport", "other")

#: one round: (start, end, tokens, up bytes, down bytes, drafted, accepted)
Round = tuple[float, float, int, int, int, int, int]


def error_class(e: BaseException) -> str:
    """The report's class of a failed generation's exception."""
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, BusyError):
        return "busy"
    if isinstance(e, ProtocolError):
        return "protocol"
    if isinstance(e, TransportError):
        return "transport"
    return "other"


def load_draft(spec: str, target_vocab: Vocabulary | None) -> LanguageModel:
    """The devices' draft model by spec (:func:`~xcosd.bench.load.config.draft_spec`);
    ``synthetic-draft`` is built over ``target_vocab``."""
    from ...models import SyntheticModel, load_model

    if spec == "synthetic-draft":
        if target_vocab is None:
            raise ValueError("the synthetic draft needs the target's vocabulary: name a "
                             "synthetic target (what the cloud serves) or give a draft")
        return SyntheticModel(target_vocab, skew=0.9, name="synthetic-draft")
    return load_model(spec)


def spec_target_vocab(spec: str | None) -> Vocabulary | None:
    """The target's vocabulary when a device can build it for free (a synthetic
    spec); otherwise ``None``, and each process fetches it from the cloud once."""
    if spec is None or not spec.startswith("synthetic:"):
        return None
    from ...models import load_model

    return load_model(spec).vocab


def device_models(cfg: LoadConfig) -> tuple[LanguageModel, Vocabulary | None]:
    """``(draft, target vocabulary or None)`` for devices in this process: objects
    as given, specs loaded."""
    tv = (cfg.target.vocab if cfg.target is not None and not isinstance(cfg.target, str)
          else spec_target_vocab(target_spec(cfg)))
    if cfg.draft is not None and not isinstance(cfg.draft, str):
        return cfg.draft, tv
    return load_draft(draft_spec(cfg), tv), tv


def arrival_offsets(cfg: LoadConfig) -> list[float]:
    """The open loop's arrival times, in seconds after the go signal: a Poisson
    process of ``cfg.request_rate`` per second (or, with ``cfg.burstiness`` other
    than 1, gamma distributed gaps of that shape and the same mean) drawn from
    ``cfg.seed`` (so every device process draws the same list, and a rerun repeats
    it), over the whole run (warm-up and window) in duration mode, ``devices *
    (warmup_generations + generations)`` of them in generations mode. Arrival ``j``
    is device ``j % devices``'s ``j // devices``-th generation."""
    assert cfg.request_rate is not None
    rng = np.random.default_rng([cfg.seed, 0x0A11])
    mean, shape = 1.0 / cfg.request_rate, cfg.burstiness

    def gap() -> float:
        # the exponential itself at shape 1: the same draws as before the option
        return float(rng.exponential(mean) if shape == 1.0 else rng.gamma(shape, mean / shape))

    out: list[float] = []
    t = 0.0
    if cfg.duration_s is not None:
        horizon = cfg.warmup_s + cfg.duration_s
        while True:
            t += gap()
            if t >= horizon:
                return out
            out.append(t)
    total = cfg.devices * (cfg.warmup_generations + (cfg.generations or 0))
    for _ in range(total):
        t += gap()
        out.append(t)
    return out


class WindowEnded(Exception):
    """Raised between two rounds once the measured window is over."""


@dataclass
class Schedule:
    """Monotonic times every device agrees on (the clock is system-wide on Linux)."""

    go: float
    end: float | None  # duration mode: stop (and cancel) at this time


class _RoundLog:
    """Records the rounds of one generation, and ends it (:class:`WindowEnded`) after
    the round that reaches ``stop_at``, so no round is cut in flight."""

    def __init__(self, stop_at: float) -> None:
        self.stop_at = stop_at
        self.rounds: list[Round] = []

    def __call__(self, r: RoundObserved) -> None:
        self.rounds.append((r.start, r.end, r.tokens, r.uplink_bytes, r.downlink_bytes,
                            r.drafted, r.accepted))
        if r.end >= self.stop_at:
            raise WindowEnded()


#: the log of the generation the current task runs; ``EdgeNode.on_round`` is one
#: hook per node and calls it from inside the generation's own task, so a context
#: variable tells apart the generations an open loop runs at once on one node
_CURRENT: contextvars.ContextVar[_RoundLog | None] = contextvars.ContextVar(
    "xcosd_load_round_log", default=None)


def _route(tally: list[int] | None) -> Callable[[RoundObserved], None]:
    """The ``on_round`` hook of every device: hand the round to its generation's log
    (and count its tokens in ``tally[0]``, the progress bar's)."""

    def on_round(r: RoundObserved) -> None:
        if tally is not None:
            tally[0] += r.tokens
        log = _CURRENT.get()
        if log is not None:
            log(r)

    return on_round


#: the target's greedy decodes, by (target spec, prompt, tokens): the check of
#: ``check_greedy`` in this process
_GREEDY: dict[tuple[str, str, int], list[int]] = {}
_REFERENCE: dict[str, LanguageModel] = {}


def greedy_reference_of(cfg: LoadConfig, prompt: str) -> list[int]:
    """The target's own greedy decode of ``prompt`` (cached; a synthetic target is
    loaded without its costs)."""
    from ...models import load_model
    from ..scale import greedy_reference

    target = cfg.target
    assert target is not None
    spec = target_spec(cfg) or f"object:{id(target)}"
    n = cfg.generation.max_new_tokens
    key = (spec, prompt, n)
    if key not in _GREEDY:
        if spec not in _REFERENCE:
            if not isinstance(target, str):
                _REFERENCE[spec] = target
            elif spec.startswith("synthetic:"):
                _REFERENCE[spec] = load_model(spec, a=0.0, b=0.0)
            else:
                _REFERENCE[spec] = load_model(spec)
        _GREEDY[key] = greedy_reference(_REFERENCE[spec], prompt, n)
    return _GREEDY[key]


async def _generation(idx: int, k: int, edge: EdgeNode, cfg: LoadConfig, sched: Schedule,
                      start: float, warmup: bool) -> dict[str, Any]:
    """Device ``idx``'s ``k``-th generation, started (or due, in an open loop) at
    ``start``, as the record the module docstring describes."""
    log = _RoundLog(sched.end if sched.end is not None else math.inf)
    _CURRENT.set(log)  # this task's own context: other generations keep theirs
    late = sched.end is not None and time.monotonic() >= sched.end  # got a slot too late
    prompts = cfg.prompt_list
    rec: dict[str, Any] = {"device": idx, "k": k, "warmup": warmup, "start": start,
                           "end": start, "first": None, "tokens": 0, "error": None,
                           "message": None, "cut": False, "busy_retries": 0, "resumes": 0,
                           "up_bytes": 0, "down_bytes": 0, "exact": None}
    try:
        if late:  # an open loop's arrival that waited for a slot past the window
            raise WindowEnded()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the generation
        # in a task of its own, one more task per generation for thousands of devices
        async with asyncio.timeout(max(0.0, start + cfg.timeout_s - time.monotonic())):
            res = await edge.generate(prompts[(idx + k) % len(prompts)],
                                      seed=cfg.seed * 1_000_003 + idx * 10_007 + k)
        if cfg.check_greedy:
            rec["exact"] = list(res.token_ids) == greedy_reference_of(
                cfg, prompts[(idx + k) % len(prompts)])
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
    rec["rounds"] = list(log.rounds)
    rec["first"] = next((r[1] for r in log.rounds if r[2] > 0), None)
    if rec["cut"] or rec["error"]:
        rec["tokens"] = sum(r[2] for r in log.rounds)
    return rec


async def _closed_loop(idx: int, edge: EdgeNode, cfg: LoadConfig,
                       sched: Schedule) -> list[dict[str, Any]]:
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
        # a task of its own, so the round log set in it stays with this generation
        rec = await asyncio.create_task(_generation(
            idx, k, edge, cfg, sched, now, total is not None and k < cfg.warmup_generations))
        gens.append(rec)
        k += 1
        if rec["error"]:
            await asyncio.sleep(0.05)  # back off; never spin on a failing cloud
    return gens


async def _open_loop(ids: Sequence[int], edges: Sequence[EdgeNode], cfg: LoadConfig,
                     sched: Schedule) -> list[dict[str, Any]]:
    """The open loop's share of this process: every arrival of
    :func:`arrival_offsets` whose device is here starts a generation at its time,
    busy device or not. A generation's ``start`` is its arrival time, so a load
    generator that falls behind shows in the latencies instead of hiding
    (coordinated omission)."""
    mine = {i: e for i, e in zip(ids, edges, strict=True)}
    slots = concurrency_slots(cfg, ids)
    gate = None if slots is None else asyncio.Semaphore(slots)

    async def arrive(idx: int, k: int, at: float, warmup: bool) -> dict[str, Any]:
        if gate is None:
            return await _generation(idx, k, mine[idx], cfg, sched, at, warmup)
        async with gate:  # past the cap: wait for a slot, timed from the arrival
            return await _generation(idx, k, mine[idx], cfg, sched, at, warmup)

    tasks: list[asyncio.Task[dict[str, Any]]] = []
    for j, off in enumerate(arrival_offsets(cfg)):
        idx, k = j % cfg.devices, j // cfg.devices
        if idx not in mine:
            continue
        at = sched.go + off
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        warmup = cfg.generations is not None and k < cfg.warmup_generations
        tasks.append(asyncio.create_task(arrive(idx, k, at, warmup)))
    return list(await asyncio.gather(*tasks))


def concurrency_slots(cfg: LoadConfig, ids: Sequence[int]) -> int | None:
    """The share of ``cfg.max_concurrency`` of the devices ``ids`` (one process's):
    device ``j % devices`` owns slot ``j``, so the shares of all processes add up to
    the cap exactly. ``None``: no cap."""
    cap = cfg.max_concurrency
    if cap is None:
        return None
    per, extra = divmod(cap, cfg.devices)
    return sum(per + (i < extra) for i in ids)


def curve_client(cfg: LoadConfig) -> Any:
    """The devices' :class:`~xcosd.transport.CurveClient` (``None``: no CURVE)."""
    if cfg.curve_secret is None or cfg.curve_server_key is None:
        return None
    from ...transport import CurveClient

    return CurveClient.from_files(cfg.curve_secret, cfg.curve_server_key)


async def run_devices(cfg: LoadConfig, endpoint: str, ids: Sequence[int],
                      wait_go: Callable[[], Awaitable[Schedule]],
                      on_ready: Callable[[], None] | None = None, *,
                      draft: LanguageModel | None = None,
                      target_vocab: Vocabulary | None = None,
                      tally: list[int] | None = None) -> list[dict[str, Any]]:
    """Connect one :class:`~xcosd.nodes.EdgeNode` per device id, wait for the go
    signal, run the closed or open loop, close. Returns every generation's record.

    ``draft`` / ``target_vocab``: the models of :func:`device_models` (what it gives
    when ``draft`` is ``None``); ``tally``: ``[tokens]``, counted as rounds end."""
    if draft is None:
        draft, target_vocab = device_models(cfg)
    link = cfg.link()
    curve = curve_client(cfg)
    vmap: VocabMap | None = None
    hook = _route(tally)
    draft_thread = shared_process_draft_thread(draft)

    def make() -> EdgeNode:
        # every setting of a generation comes from cfg.generation; only the seed is
        # given per call (LoadConfig's docstring says why)
        assert draft is not None
        return EdgeNode(draft, endpoint, config=cfg.generation, transport=cfg.transport,
                        link=link, curve=curve, target_vocab=target_vocab, vocab_map=vmap,
                        silence_timeout_s=max(15.0, cfg.timeout_s), busy_retry_s=0.01,
                        connect_timeout_s=cfg.connect_timeout_s, on_round=hook,
                        draft_thread=draft_thread, name=f"bench-edge-{ids[0] if ids else 0}")

    edges: list[EdgeNode] = []
    try:
        if ids:
            first = make()
            await first.start()  # fetches the target vocabulary once, builds the map
            edges.append(first)
            vmap = first.vocab_map  # the others reuse it
            for i in range(1, len(ids), 32):
                batch = [make() for _ in ids[i:i + 32]]
                await asyncio.gather(*(e.start() for e in batch))
                edges.extend(batch)
        if on_ready is not None:
            on_ready()
        sched = await wait_go()
        if cfg.request_rate is not None:
            return await _open_loop(ids, edges, cfg, sched)
        per = await asyncio.gather(*(_closed_loop(i, e, cfg, sched)
                                     for i, e in zip(ids, edges, strict=True)))
    finally:
        await asyncio.gather(*(e.close() for e in edges), return_exceptions=True)
    return [g for gs in per for g in gs]


@many_sessions_gc()  # thousands of devices' objects (xcosd/gc_tuning.py)
def worker_main() -> None:
    """A device process (``python -m xcosd.bench.load``): read the job from stdin,
    connect, say ready, wait for go, run, write the records to stdout (framed by
    :mod:`~xcosd.bench.load.pipe`). Pipes and a fresh interpreter (not
    :mod:`multiprocessing`) keep it independent of how the parent was started.

    The job names the draft and the target by spec (the parent resolved the
    defaults): a model object cannot travel, which is why a run whose draft is one
    keeps its devices in-process (:class:`~xcosd.bench.load.config.LoadConfig`)."""
    raise_fd_limit()  # a DEALER and a TCP socket per device (xcosd.transport.fds)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the result pipe
    cfg_dict, endpoint, ids, draft_name, target_name = pipe.read(inp)

    async def main() -> list[dict[str, Any]]:
        cfg = LoadConfig.from_dict({**cfg_dict, "draft": draft_name, "target": target_name})
        tv = spec_target_vocab(target_name)
        draft = load_draft(draft_name, tv)

        async def wait_go() -> Schedule:
            msg = await asyncio.to_thread(pipe.read, inp)
            return Schedule(*msg[1:])

        return await run_devices(cfg, endpoint, ids, wait_go,
                                 on_ready=lambda: pipe.write(out, ("ready", len(ids))),
                                 draft=draft, target_vocab=tv)

    try:
        pipe.write(out, ("done", asyncio.run(main())))
    except BaseException as e:  # report, never leave the parent waiting
        with contextlib.suppress(Exception):
            pipe.write(out, ("failed", f"{type(e).__name__}: {e}"))
        raise


__all__ = ["ERROR_CLASSES", "Round", "Schedule", "WindowEnded", "arrival_offsets",
           "concurrency_slots", "curve_client", "device_models", "error_class", "load_draft", "run_devices",
           "spec_target_vocab", "worker_main"]
