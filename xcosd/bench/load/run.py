"""Running a load test: the cloud in this process, the devices in ``procs`` device
processes (or in this event loop), then the analysis; and the scaling sweep.

Why separate processes: on a machine with few cores the device side (drafting,
msgpack, the protocol state machines of hundreds of sessions) would otherwise share
one interpreter lock with the cloud's event loop and its verify thread, and the
benchmark would measure their contention instead of the scheduler. ``procs=0`` runs
the devices in the cloud's own event loop (tests, or to see that contention).

The cloud is observed from outside: its target is wrapped in a
:class:`RecordingModel` that timestamps every batch, and the queue waits come from
:attr:`CloudNode.batch_stats <xcosd.nodes.CloudNode.batch_stats>`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...models.base import LanguageModel, Session
from ...nodes import CloudNode
from ..progress import Progress
from ..report import machine
from . import pipe
from .analysis import Batch, analyse
from .config import LoadConfig
from .devices import Schedule, run_devices

log = logging.getLogger(__name__)


class RecordingModel:
    """A :class:`~xcosd.models.LanguageModel` that forwards to ``inner`` and records
    every :meth:`score` call as ``(start, end, sessions, rows)`` (monotonic clock):
    the batches the cloud ran, timestamped, so a window can be cut after the fact."""

    def __init__(self, inner: LanguageModel) -> None:
        self.inner = inner
        self.name = inner.name
        self.vocab = inner.vocab
        self.calls: list[Batch] = []

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


async def run_load(cfg: LoadConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Run one load test in the current event loop and return its report."""
    from ...models import load_model

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
        batch_stats = cloud.batch_stats
        waits = list(batch_stats.queue_waits) if batch_stats is not None else None
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
        await pipe.send(p.stdin, obj)

    async def recv(p: asyncio.subprocess.Process) -> Any:
        assert p.stdout is not None
        try:
            return await pipe.recv(p.stdout)
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
    """:func:`run_load` in a fresh event loop (the CLI's entry)."""
    return asyncio.run(run_load(cfg, progress=progress))


def run_scaling(base: LoadConfig, devices: Sequence[int] = (1, 4, 16, 64, 256),
                batching: Sequence[bool] = (True, False), *,
                progress: bool | None = None) -> dict[str, Any]:
    """One run per (devices, batching); each report keeps its summary only."""
    points = []
    for on in batching:
        for n in devices:
            cfg = dataclasses.replace(base, devices=n, batching=on)
            rep = run_load_sync(cfg, progress=progress)
            rep.pop("per_device", None)
            points.append(rep)
            log.info("%d devices, batching %s: %.0f tokens/s", n, on, rep["tokens_per_s"])
    return {"kind": "load-scaling", "base": base.to_dict(), "points": points,
            "machine": machine()}


__all__ = ["RecordingModel", "run_load", "run_load_sync", "run_scaling"]
