"""Running a load test: the cloud in this process (or, with ``connect``, a cloud
running elsewhere), the devices in ``procs`` device processes (or in this event
loop), then the analysis; and the scaling sweep.

Why separate processes: on a machine with few cores the device side (drafting,
msgpack, the protocol state machines of hundreds of sessions) would otherwise share
one interpreter lock with the cloud's event loop and its verify thread, and the
benchmark would measure their contention instead of the scheduler. ``procs=0`` runs
the devices in the cloud's own event loop (tests, or to see that contention).

The cloud this run starts is observed from outside: its target is wrapped in a
:class:`RecordingModel` that timestamps every batch, and the queue waits come from
:attr:`CloudNode.batch_stats <xcosd.nodes.CloudNode.batch_stats>`. A cloud reached
with ``connect`` is measured from the devices' side only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...models.base import LanguageModel, ModelWrapper, Session
from ...nodes import CloudNode
from ...transport.fds import raise_fd_limit
from ..progress import Progress
from ..report import machine
from . import cpu, pipe
from .analysis import Batch, analyse
from .config import BATCHING_MODES, DEFAULT_TARGET, LoadConfig, draft_spec, target_spec
from .devices import Schedule, arrival_offsets, device_models, run_devices

log = logging.getLogger(__name__)


class RecordingModel(ModelWrapper):
    """A :class:`~xcosd.models.LanguageModel` that forwards to ``inner`` and records
    every :meth:`score` call as ``(start, end, sessions, rows)`` (monotonic clock):
    the batches the cloud ran, timestamped, so a window can be cut after the fact."""

    def __init__(self, inner: LanguageModel) -> None:
        super().__init__(inner)
        self.calls: list[Batch] = []

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        t0 = time.monotonic()
        out = self.inner.score(batch)
        self.calls.append((t0, time.monotonic(), len(batch), sum(r.shape[0] for r in out)))
        return out


async def run_load(cfg: LoadConfig, *, progress: bool | None = None) -> dict[str, Any]:
    """Run one load test in the current event loop and return its report.

    A coroutine, so a caller already inside an event loop (a notebook, a service,
    a pytest-asyncio test) awaits it there; :func:`run_load_sync` is the entry for
    code without one. With ``cfg.connect`` no cloud is started and the cloud's
    fields of the report are ``None`` (nothing here observed it). The process's
    soft limit on open descriptors is raised first (:mod:`xcosd.transport.fds`):
    the cloud started here holds a connection per device."""
    raise_fd_limit()
    if cfg.connect is not None:
        return await _measure(cfg, cfg.connect, None, None, progress)
    from ...models import load_model

    model = cfg.target if cfg.target is not None and not isinstance(cfg.target, str) \
        else load_model(cfg.target or DEFAULT_TARGET)
    target = RecordingModel(model)
    cloud = CloudNode(target, bind="tcp://127.0.0.1:0", transport=cfg.transport,
                      max_batch=cfg.max_batch if cfg.batching else 1,
                      max_wait_s=cfg.max_wait_s if cfg.batching else 0.0,
                      merge_batches=cfg.merge_batches and cfg.batching,
                      stream_verdicts=cfg.stream_verdicts,
                      max_sessions=max(1024, 2 * cfg.devices), max_queue=max(4096, 4 * cfg.devices),
                      silence_timeout_s=max(15.0, cfg.timeout_s), keep_queue_waits=True)
    async with cloud:
        return await _measure(cfg, cloud.endpoint, cloud, target, progress)


async def _measure(cfg: LoadConfig, endpoint: str, cloud: CloudNode | None,
                   target: RecordingModel | None, progress: bool | None) -> dict[str, Any]:
    """Run the devices against ``endpoint`` and analyse; ``cloud`` / ``target``: the
    cloud this run started and its recorded target (``None`` with ``connect``)."""
    devices = list(range(cfg.devices))
    tally = [0]  # tokens of in-process devices, for the progress bar of a remote cloud
    t_run = time.monotonic()
    bar = Progress(_planned_s(cfg), enabled=progress,
                   label=f"{cfg.devices} devices{'' if cfg.batching else ' (no batching)'} ")
    go_at: list[float] = []

    def schedule() -> Schedule:
        go = time.monotonic() + 0.05
        go_at.append(go)
        end = None if cfg.duration_s is None else go + cfg.warmup_s + cfg.duration_s
        return Schedule(go, end)

    def counts() -> tuple[int, int]:
        if cloud is not None:
            return cloud.counters["emitted_tokens"], cloud.counters["errors_sent"]
        return tally[0], 0

    # the processes whose CPU the window is measured on: (pid, loop thread id)
    here = (os.getpid(), threading.get_native_id())
    device_pids: list[tuple[int, int]] = [here] if cfg.procs == 0 else []
    cloud_pids = [here] if cloud is not None and cfg.procs != 0 else []
    sampler = (asyncio.ensure_future(_window_cpu(cfg, go_at, device_pids, cloud_pids))
               if cfg.duration_s is not None else None)
    try:
        if cfg.procs == 0:
            async def wait_go() -> Schedule:
                return schedule()

            draft, tv = await asyncio.to_thread(device_models, cfg)
            task = asyncio.ensure_future(run_devices(cfg, endpoint, devices, wait_go,
                                                     draft=draft, target_vocab=tv,
                                                     tally=tally))
            await _watch(task, cfg, bar, go_at, counts)
            records = task.result()
        else:
            records = await _run_procs(cfg, endpoint, devices, schedule, bar, go_at, counts,
                                       device_pids)
        samples = await sampler if sampler is not None else None
    finally:
        if sampler is not None and not sampler.done():
            sampler.cancel()
    bar.close()
    scheduled = len(arrival_offsets(cfg)) if cfg.request_rate is not None else None
    go = go_at[0] if go_at else t_run
    if cloud is None or target is None:
        rep = analyse(cfg, records, None, None, None, go, None, scheduled=scheduled)
    else:
        batch_stats = cloud.batch_stats
        waits = list(batch_stats.queue_waits) if batch_stats is not None else None
        rep = analyse(cfg, records, target.calls, waits, cloud.stats(), go,
                      _target_costs(target.inner), scheduled=scheduled)
    rep["cpu"] = _cpu_report(samples, rep["rounds"], shared=cloud is not None
                             and cfg.procs == 0)
    return rep


#: what the window's CPU sampler hands back: the devices' and the cloud's samples
#: at the window's start and end, and the window's measured length
_CpuSamples = tuple[list[Any], list[Any], list[Any], list[Any], float]


async def _window_cpu(cfg: LoadConfig, go_at: list[float], device_pids: list[tuple[int, int]],
                      cloud_pids: list[tuple[int, int]]) -> _CpuSamples:
    """Sample the CPU of the devices' processes and of the cloud started here at the
    measured window's start and end (duration mode; see :mod:`.cpu`)."""
    while not go_at:
        await asyncio.sleep(0.01)
    assert cfg.duration_s is not None
    start = go_at[0] + cfg.warmup_s
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    dev0 = [cpu.sample(p, t) for p, t in device_pids]
    cl0 = [cpu.sample(p, t) for p, t in cloud_pids]
    t0 = time.monotonic()
    await asyncio.sleep(max(0.0, start + cfg.duration_s - time.monotonic()))
    dev1 = [cpu.sample(p, t) for p, t in device_pids]
    cl1 = [cpu.sample(p, t) for p, t in cloud_pids]
    return dev0, dev1, cl0, cl1, time.monotonic() - t0


def _cpu_report(samples: _CpuSamples | None, rounds: int, *,
                shared: bool) -> dict[str, Any] | None:
    """The report's ``cpu`` field (docs/LOAD.md); ``None`` when not measured."""
    if samples is None:
        return None
    dev0, dev1, cl0, cl1, window = samples
    devices = cpu.side(dev0, dev1, window, rounds)
    if devices is None:
        return None
    return {"window_s": window, "devices": devices,
            "cloud": cpu.side(cl0, cl1, window, rounds) if cl0 else None, "shared": shared}


def _planned_s(cfg: LoadConfig) -> float:
    if cfg.duration_s is not None:
        return cfg.warmup_s + cfg.duration_s
    return float(cfg.warmup_generations + (cfg.generations or 0))


async def _watch(task: asyncio.Future[Any], cfg: LoadConfig, bar: Progress,
                 go_at: list[float], counts: Callable[[], tuple[int, int]]) -> None:
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if go_at:
            el = time.monotonic() - go_at[0]
            phase = "warm-up" if cfg.duration_s is not None and el < cfg.warmup_s else "measuring"
            bar.update(el, *counts(), phase)


async def _run_procs(cfg: LoadConfig, endpoint: str, devices: list[int],
                     schedule: Callable[[], Schedule], bar: Progress, go_at: list[float],
                     counts: Callable[[], tuple[int, int]],
                     pids: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Run the devices in ``cfg.procs`` device processes; each process's id goes
    into ``pids`` (its event loop runs on its main thread, whose id is the
    process's)."""
    assert cfg.procs is not None  # LoadConfig resolved it
    n = min(cfg.procs, len(devices))
    # the models by spec, defaults resolved here: a device process cannot receive an
    # object (LoadConfig keeps a run whose draft is one in-process)
    job_models = (draft_spec(cfg), target_spec(cfg))
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
            pids.append((p.pid, p.pid))
            await send(p, (cfg.to_dict(), endpoint, part, *job_models))
        for p in procs:
            msg = await recv(p)
            if msg[0] != "ready":
                raise RuntimeError(f"a device process failed to start: {msg[1]}")
        sched = schedule()
        for p in procs:
            await send(p, ("go", sched.go, sched.end))
        gathered = asyncio.ensure_future(asyncio.gather(*(recv(p) for p in procs)))
        await _watch(gathered, cfg, bar, go_at, counts)
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
    """:func:`run_load` in a fresh event loop (the CLI's entry). Inside a running
    loop it refuses, pointing at ``await run_load(...)``: a nested loop cannot run
    there, and blocking that loop for the whole run would stall its other tasks."""
    no_running_loop("run_load_sync", "await run_load(cfg)")
    return asyncio.run(run_load(cfg, progress=progress))


def no_running_loop(name: str, instead: str) -> None:
    """Raise RuntimeError if called inside a running event loop (for the ``*_sync``
    wrappers, whose ``asyncio.run`` would fail there with a less useful message)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() was called inside a running event loop; use {instead}")


def run_scaling(base: LoadConfig, devices: Sequence[int] = (1, 4, 16, 64, 256),
                modes: Sequence[str] = BATCHING_MODES, *,
                progress: bool | None = None) -> dict[str, Any]:
    """One run per (devices, batching mode: :data:`BATCHING_MODES`); each report
    keeps its summary only (no per-device list, no raw samples)."""
    unknown = set(modes) - set(BATCHING_MODES)
    if unknown:
        raise ValueError(f"unknown batching modes {sorted(unknown)}; known: {BATCHING_MODES}")
    points = []
    for mode in modes:
        for n in devices:
            cfg = dataclasses.replace(base, devices=n, batching=mode != "off",
                                      merge_batches=mode == "on")
            rep = run_load_sync(cfg, progress=progress)
            rep.pop("per_device", None)
            rep.pop("samples", None)
            points.append(rep)
            log.info("%d devices, batching %s: %.0f tokens/s", n, mode, rep["tokens_per_s"])
    return {"kind": "load-scaling", "base": base.to_dict(), "points": points,
            "machine": machine()}


__all__ = ["RecordingModel", "no_running_loop", "run_load", "run_load_sync", "run_scaling"]
