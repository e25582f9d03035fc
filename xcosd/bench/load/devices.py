"""The load generator: closed-loop edge devices, and the device process that runs a
share of them (``python -m xcosd.bench.load``).

Each device is a plain :class:`~xcosd.nodes.EdgeNode`; its rounds are timed through
the node's public ``on_round`` hook (:class:`_RoundLog`), which also ends a
generation between two rounds once the measured window is over. All the devices of
one process share one V_C map: building it is the slow part of a handshake on large
vocabularies, and every device would build the same one.

What a device reports, one dict per generation (the input of
:func:`~xcosd.bench.load.analysis.analyse`): ``device``, ``k`` (its generation
number), ``warmup``, ``start`` / ``end`` / ``first`` (monotonic; ``first``: the end
of the first round that committed a token), ``tokens``, ``error`` (one of
:data:`ERROR_CLASSES` or ``None``), ``message``, ``cut`` (ended by the window, not
an error), ``busy_retries``, ``resumes``, ``up_bytes``, ``down_bytes`` and
``rounds``: one ``(start, end, tokens, up bytes, down bytes, drafted, accepted)``
tuple per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import BusyError, ProtocolError, TransportError, XcosdError
from ...models.base import LanguageModel
from ...nodes import EdgeNode, RoundObserved
from ...vocab import VocabMap, Vocabulary
from . import pipe
from .config import PROMPTS, LoadConfig, draft_spec

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


def load_draft(cfg: LoadConfig, target_vocab: Vocabulary | None) -> LanguageModel:
    """The devices' draft model (:func:`~xcosd.bench.load.config.draft_spec`)."""
    from ...models import SyntheticModel, load_model

    spec = draft_spec(cfg)
    if spec == "synthetic-draft":
        assert target_vocab is not None
        return SyntheticModel(target_vocab, skew=0.9, name="synthetic-draft")
    return load_model(spec)


def synthetic_target_vocab(cfg: LoadConfig) -> Vocabulary | None:
    """The target's vocabulary when the device can build it for free (synthetic)."""
    if not cfg.target.startswith("synthetic:"):
        return None
    from ...models import load_model

    return load_model(cfg.target).vocab


class WindowEnded(Exception):
    """Raised between two rounds once the measured window is over."""


@dataclass
class Schedule:
    """Monotonic times every device agrees on (the clock is system-wide on Linux)."""

    go: float
    end: float | None  # duration mode: stop (and cancel) at this time


class _RoundLog:
    """An ``EdgeNode.on_round`` hook: records the rounds of one generation, and ends
    it (:class:`WindowEnded`) after the round that reaches ``stop_at``, so no round
    is cut in flight."""

    def __init__(self, stop_at: float) -> None:
        self.stop_at = stop_at
        self.rounds: list[Round] = []

    def __call__(self, r: RoundObserved) -> None:
        self.rounds.append((r.start, r.end, r.tokens, r.uplink_bytes, r.downlink_bytes,
                            r.drafted, r.accepted))
        if r.end >= self.stop_at:
            raise WindowEnded()


async def _device(idx: int, edge: EdgeNode, cfg: LoadConfig, sched: Schedule) -> list[dict[str, Any]]:
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
        log = edge.on_round = _RoundLog(sched.end if sched.end is not None else math.inf)
        rec: dict[str, Any] = {"device": idx, "k": k, "warmup": total is not None
                               and k < cfg.warmup_generations, "start": now, "end": now,
                               "first": None, "tokens": 0, "error": None, "message": None,
                               "cut": False, "busy_retries": 0, "resumes": 0,
                               "up_bytes": 0, "down_bytes": 0}
        try:
            res = await asyncio.wait_for(
                edge.generate(PROMPTS[(idx + k) % len(PROMPTS)],
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
        rec["rounds"] = list(log.rounds)
        rec["first"] = next((r[1] for r in log.rounds if r[2] > 0), None)
        if rec["cut"] or rec["error"]:
            rec["tokens"] = sum(r[2] for r in log.rounds)
        gens.append(rec)
        k += 1
        if rec["error"]:
            await asyncio.sleep(0.05)  # back off; never spin on a failing cloud
    return gens


async def run_devices(cfg: LoadConfig, endpoint: str, ids: Sequence[int],
                      wait_go: Callable[[], Awaitable[Schedule]],
                      on_ready: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Connect one :class:`~xcosd.nodes.EdgeNode` per device id, wait for the go
    signal, run the closed loop, close. Returns every generation's record."""
    tv = synthetic_target_vocab(cfg)
    draft = load_draft(cfg, tv)
    link = cfg.link()
    vmap: VocabMap | None = None

    def make() -> EdgeNode:
        # every setting of a generation comes from cfg.generation; only the seed is
        # given per call (LoadConfig's docstring says why)
        return EdgeNode(draft, endpoint, config=cfg.generation, transport=cfg.transport,
                        link=link, target_vocab=tv, vocab_map=vmap,
                        timeout_s=max(15.0, cfg.timeout_s), busy_retry_s=0.01,
                        name=f"bench-edge-{ids[0] if ids else 0}")

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
        per = await asyncio.gather(*(_device(i, e, cfg, sched)
                                     for i, e in zip(ids, edges, strict=True)))
    finally:
        await asyncio.gather(*(e.close() for e in edges), return_exceptions=True)
    return [g for gs in per for g in gs]


def worker_main() -> None:
    """A device process (``python -m xcosd.bench.load``): read the job from stdin,
    connect, say ready, wait for go, run, write the records to stdout (framed by
    :mod:`~xcosd.bench.load.pipe`). Pipes and a fresh interpreter (not
    :mod:`multiprocessing`) keep it independent of how the parent was started."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the result pipe
    cfg_dict, endpoint, ids = pipe.read(inp)
    cfg = LoadConfig.from_dict(cfg_dict)

    async def main() -> list[dict[str, Any]]:
        async def wait_go() -> Schedule:
            msg = await asyncio.to_thread(pipe.read, inp)
            return Schedule(*msg[1:])

        return await run_devices(cfg, endpoint, ids, wait_go,
                                 on_ready=lambda: pipe.write(out, ("ready", len(ids))))

    try:
        pipe.write(out, ("done", asyncio.run(main())))
    except BaseException as e:  # report, never leave the parent waiting
        with contextlib.suppress(Exception):
            pipe.write(out, ("failed", f"{type(e).__name__}: {e}"))
        raise


__all__ = ["ERROR_CLASSES", "Round", "Schedule", "WindowEnded", "error_class", "load_draft",
           "run_devices", "synthetic_target_vocab", "worker_main"]
