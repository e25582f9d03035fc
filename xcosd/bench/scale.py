"""``xcosd bench scale``: throughput against 1, 2, 4 ... target replicas behind one
broker, and a run in which a replica process is killed.

The cluster is what a user starts: ``xcosd serve --replicas N`` in a child process
(the broker in it, the N replicas in N processes of their own). The devices are
closed-loop :class:`~xcosd.nodes.EdgeNode` s in this process, each with its own
ZeroMQ connection to the broker: one generation at a time, the next as soon as one
ends.

The target sleeps (``synthetic:256:20:0.5``: 20 ms per call plus 0.5 ms per scored
row, the GIL released), as a model on an accelerator waits for it; the devices
decode greedily with a draft whose greedy choice always matches the target's, so a
round commits ``draft_len + 1`` tokens. For B sessions in one batch the cost model's
best is ``B (d + 1) / (a + b B (d + 1))`` tokens/s per replica; with D devices on
N replicas B = D / N, which is what the report's ``ideal`` column assumes (every
device in every batch of its replica). Replicas cannot beat it: splitting the
devices only saves the per-row cost, never the per-call cost ``a``.

Throughput counts the tokens of the rounds that end inside the measured window
(after a warm-up).

Two controls say where the rest of a ratio goes, for each N above 1: *alone*, one
replica serving its ``D / N`` devices with nothing else running (times N: what N
replicas that cost each other nothing would reach), and *no broker*, N plain
``xcosd serve`` clouds side by side with the devices spread over them (the N-replica
point without the broker: what the broker costs). Between them, what N replicas
cost each other by sharing the machine's cores and the devices' process.

The killed run gives every device a fixed number of generations, kills one replica
process (SIGKILL) mid-run, and compares every output with the target's own greedy
decode: a lost or repeated token would show there.
The broker process starts the killed replica again, as it would in service.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from ..config import GenerationConfig
from ..models.base import LanguageModel
from ..nodes import EdgeNode, RoundObserved
from ..nodes.edge import shared_process_draft_thread
from .load.config import PROMPTS
from .report import OUT_DIR, machine, table

SCHEMA_VERSION = 2
#: where ``xcosd bench scale`` writes by default (and the results generator reads)
OUT_FILE = OUT_DIR / "scale.json"
#: 20 ms per target call plus 0.5 ms per scored row, sleeping
DEFAULT_TARGET = "synthetic:256:20:0.5"
#: the throughput ratios over one replica the design aims at
GOALS = {2: 1.8, 4: 3.4}
#: seconds a cluster gets to start (processes, imports, the target) or to stop
START_TIMEOUT_S = 120.0


@dataclasses.dataclass
class ScaleConfig:
    """One scaling bench. ``max_batch`` and ``max_batch_tokens`` default to values
    that let one replica put every device in one batch, so one replica is measured
    at its best and the ratios are not flattered by its batches being split."""

    devices: int = 128
    replicas: tuple[int, ...] = (1, 2, 4)
    target: str = DEFAULT_TARGET
    method: str = "xcosd-e"
    draft_len: int = 4
    max_new_tokens: int = 64
    warmup_s: float = 3.0
    duration_s: float = 10.0
    max_batch: int = 256
    max_batch_tokens: int = 4096
    max_wait_ms: float = 2.0
    #: the killed-replica run: replicas, generations per device, when to kill
    kill: bool = True
    kill_replicas: int = 2
    kill_generations: int = 3
    kill_after_s: float = 3.0
    timeout_s: float = 120.0
    #: the controls (module docstring) for each replica count above 1
    controls: bool = True

    def __post_init__(self) -> None:
        if self.devices < 1 or not self.replicas or min(self.replicas) < 1:
            raise ValueError("need at least one device and replica counts >= 1")
        if self.kill and self.kill_replicas < 2:
            raise ValueError("the killed run needs at least 2 replicas (one survives)")

    def generation(self) -> GenerationConfig:
        # a fixed length: the cost model (ideal_tokens_per_s) counts draft_len + 1
        # rows; no speculation: the devices share one process, where drafting ahead
        # while a verdict is in flight is not idle time put to use but added work
        return GenerationConfig(method=self.method, draft_len=self.draft_len,
                                adaptive_draft=False, speculate=False, do_sample=False,
                                max_new_tokens=self.max_new_tokens)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["replicas"] = list(self.replicas)
        return d


def synthetic_costs(target: str) -> tuple[float, float] | None:
    """``(a, b)`` in seconds of a ``synthetic:VOCAB:A_MS:B_MS`` target (a call costs
    ``a + b * rows``); ``None`` for any other target."""
    parts = target.split(":")
    if parts[0] != "synthetic" or len(parts) < 4:
        return None
    return float(parts[2]) / 1e3, float(parts[3]) / 1e3


def ideal_tokens_per_s(cfg: ScaleConfig, replicas: int,
                       devices: int | None = None) -> float | None:
    """The cost model's best with ``replicas`` replicas (module docstring) serving
    ``devices`` (default: ``cfg.devices``), for a synthetic target; ``None`` for
    any other."""
    costs = synthetic_costs(cfg.target)
    if costs is None:
        return None
    a, b = costs
    per = (cfg.devices if devices is None else devices) / replicas
    rows = cfg.draft_len + 1
    return replicas * per * rows / (a + b * per * rows)


def greedy_reference(model: LanguageModel, prompt: str, n: int) -> list[int]:
    """The target's own greedy decode of ``prompt`` (``n`` tokens, or up to EOS)."""
    import numpy as np

    eos = model.vocab.roles.get("eos")
    sess = model.start(model.tokenize(prompt))
    out: list[int] = []
    try:
        while len(out) < n:
            t = int(np.argmax(model.score([(sess, [])])[0][-1]))
            out.append(t)
            if t == eos:
                break
            model.append(sess, [t])
    finally:
        model.end(sess)
    return out


# ------------------------------------------------------------------ the cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """``xcosd serve --replicas N`` in a child process, watched through the lines
    it prints: the replica pids, and how many replicas the broker has live.
    ``broker=False``: a plain ``xcosd serve`` (one cloud, no broker), live once it
    says it is serving."""

    def __init__(self, cfg: ScaleConfig, replicas: int, *, broker: bool = True) -> None:
        if not broker and replicas != 1:
            raise ValueError("a cloud without a broker is one replica")
        self.cfg = cfg
        self.replicas = replicas
        self.broker = broker
        self.endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.lines: list[str] = []
        self.live = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def pids(self) -> list[int]:
        """Every replica process started so far, in order."""
        return [int(m.group(1)) for ln in self.lines
                if (m := re.search(r"^replica \d+ started \(pid (\d+)\)", ln))]

    async def start(self) -> Cluster:
        c = self.cfg
        replicas = ["--replicas", str(self.replicas)] if self.broker else []
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "xcosd", "serve", *replicas, "--bind", self.endpoint,
            "--target", c.target, "--max-batch", str(c.max_batch),
            "--max-batch-tokens", str(c.max_batch_tokens), "--max-wait-ms", repr(c.max_wait_ms),
            "--max-sessions", str(max(1024, 4 * c.devices)),
            "--max-queue", str(max(4096, 8 * c.devices)),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        await self.wait_live(self.replicas)
        return self

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        async for raw in self._proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if m := re.match(r"replicas live: (\d+)", line):
                self.live = int(m.group(1))
            elif not self.broker and line.startswith("serving "):
                self.live = 1
            self._changed.set()

    async def wait_live(self, n: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.live != n:
            assert self._proc is not None
            if self._proc.returncode is not None or time.monotonic() > deadline:
                tail = "\n".join(self.lines[-15:])
                raise RuntimeError(f"the cluster did not reach {n} live replicas:\n{tail}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.5)

    def kill_replica(self, index: int = 0) -> int:
        """SIGKILL the replica process started ``index``-th; its pid."""
        pid = self.pids()[index]
        os.kill(pid, signal.SIGKILL)
        return pid

    async def close(self) -> None:
        p = self._proc
        if p is None:
            return
        if p.returncode is None:
            p.send_signal(signal.SIGINT)  # the broker stops its replicas, then itself
            try:
                await asyncio.wait_for(p.wait(), START_TIMEOUT_S)
            except TimeoutError:
                p.kill()
                await p.wait()
        if self._reader is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 10)

    async def __aenter__(self) -> Cluster:
        try:
            return await self.start()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ------------------------------------------------------------------ the machine


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot (Linux), else ``None``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


class _CpuWindow:
    """How busy the machine and this process (the devices) were between
    :meth:`begin` and :meth:`end`: a point where the machine is near 100 % busy
    measures the cores, not the replicas."""

    def begin(self) -> None:
        self._m0, self._p0, self._t0 = _cpu_ticks(), time.process_time(), time.monotonic()

    def end(self) -> dict[str, float | None]:
        m1, p1, t1 = _cpu_ticks(), time.process_time(), time.monotonic()
        busy = None
        if self._m0 is not None and m1 is not None and m1[1] > self._m0[1]:
            busy = (m1[0] - self._m0[0]) / (m1[1] - self._m0[1])
        wall = max(1e-9, t1 - self._t0)
        return {"machine_busy": busy, "devices_cores": (p1 - self._p0) / wall,
                "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


# ------------------------------------------------------------------ the devices


class _WindowEnded(Exception):
    """Raised from a device's round hook once the measured window is over."""


@contextlib.asynccontextmanager
async def _devices(cfg: ScaleConfig, endpoints: list[str],
                   devices: int | None = None,
                   prepare: Any = None) -> AsyncIterator[list[EdgeNode]]:
    """``devices`` (default ``cfg.devices``) connected edges, device ``i`` to
    ``endpoints[i % len(endpoints)]``; the first builds the V_C map, the rest reuse
    it (every endpoint serves the same target). ``prepare(i, edge)`` is called on
    each before it connects."""
    from ..models import SyntheticModel, load_model

    target = load_model(cfg.target, a=0.0, b=0.0)
    draft = SyntheticModel(target.vocab, skew=0.9, name="synthetic-draft")
    gen = cfg.generation()
    edges: list[EdgeNode] = []
    n = cfg.devices if devices is None else devices

    def make(i: int, vmap: Any = None) -> EdgeNode:
        e = EdgeNode(draft, endpoints[i % len(endpoints)], config=gen,
                     target_vocab=target.vocab, vocab_map=vmap, busy_retry_s=0.01,
                     draft_thread=shared_process_draft_thread(draft), name="bench-scale")
        if prepare is not None:
            prepare(i, e)
        return e

    try:
        first = make(0)
        await first.start()
        edges.append(first)
        for i in range(1, n, 32):
            batch = [make(k, first.vocab_map) for k in range(i, min(n, i + 32))]
            edges.extend(batch)
            await asyncio.gather(*(e.start() for e in batch))
        yield edges
    finally:
        await asyncio.gather(*(e.close() for e in edges), return_exceptions=True)


async def _throughput(cfg: ScaleConfig, replicas: int, *, kind: str = "broker",
                      devices: int | None = None) -> dict[str, Any]:
    """One point, closed loop, tokens in the window: ``replicas`` replicas behind
    the broker (``kind`` ``broker``), one replica behind the broker serving
    ``devices`` (``alone``), or ``replicas`` clouds without a broker (``no-broker``)."""
    n = cfg.devices if devices is None else devices
    serving = 1 if kind == "alone" else replicas  # the replicas the devices spread over
    async with contextlib.AsyncExitStack() as stack:
        if kind == "no-broker":
            clusters = [await stack.enter_async_context(Cluster(cfg, 1, broker=False))
                        for _ in range(replicas)]
        else:
            clusters = [await stack.enter_async_context(Cluster(cfg, serving))]
        edges = await stack.enter_async_context(
            _devices(cfg, [c.endpoint for c in clusters], n))
        go = time.monotonic() + 0.05
        w0, w1 = go + cfg.warmup_s, go + cfg.warmup_s + cfg.duration_s
        tokens = rounds = errors = resumes = 0
        round_s: list[float] = []

        def on_round(r: RoundObserved) -> None:
            nonlocal tokens, rounds
            if w0 <= r.end <= w1:
                tokens += r.tokens
                rounds += 1
                round_s.append(r.end - r.start)
            if r.end > w1:
                raise _WindowEnded()

        async def device(i: int, e: EdgeNode) -> None:
            nonlocal errors, resumes
            e.on_round = on_round
            await asyncio.sleep(max(0.0, go - time.monotonic()))
            k = 0
            while time.monotonic() < w1:
                try:
                    res = await asyncio.wait_for(e.generate(PROMPTS[(i + k) % len(PROMPTS)]),
                                                 cfg.timeout_s)
                    resumes += res.stats.resumes
                except _WindowEnded:
                    break
                except Exception:
                    errors += 1
                    await asyncio.sleep(0.05)
                k += 1

        cpu = _CpuWindow()
        usage: dict[str, float | None] = {}

        async def watch_cpu() -> None:
            await asyncio.sleep(max(0.0, w0 - time.monotonic()))
            cpu.begin()
            await asyncio.sleep(max(0.0, w1 - time.monotonic()))
            usage.update(cpu.end())

        watcher = asyncio.ensure_future(watch_cpu())
        await asyncio.gather(*(device(i, e) for i, e in enumerate(edges)))
        await watcher
        round_s.sort()
    ideal = ideal_tokens_per_s(cfg, serving, n)
    tps = tokens / cfg.duration_s
    return {"replicas": replicas, "kind": kind, "devices": n, "tokens": tokens,
            "rounds": rounds,
            "tokens_per_s": tps, "ideal_tokens_per_s": ideal,
            "efficiency": tps / ideal if ideal else None,
            "round_ms_p50": 1e3 * round_s[len(round_s) // 2] if round_s else None,
            "errors": errors, "resumes": resumes, **usage}


async def _killed(cfg: ScaleConfig) -> dict[str, Any]:
    """Fixed work on ``kill_replicas`` replicas; one replica process is killed after
    ``kill_after_s``; every output checked against the target's greedy decode."""
    from ..models import load_model

    reference = load_model(cfg.target, a=0.0, b=0.0)
    want = {p: greedy_reference(reference, p, cfg.max_new_tokens) for p in PROMPTS}
    async with Cluster(cfg, cfg.kill_replicas) as cluster, \
            _devices(cfg, [cluster.endpoint]) as edges:
        records: list[dict[str, Any]] = []

        async def device(i: int, e: EdgeNode) -> None:
            for k in range(cfg.kill_generations):
                prompt = PROMPTS[(i + k) % len(PROMPTS)]
                rec: dict[str, Any] = {"device": i, "k": k, "prompt": prompt}
                try:
                    res = await asyncio.wait_for(e.generate(prompt), cfg.timeout_s)
                    rec.update(tokens=len(res.token_ids), exact=res.token_ids == want[prompt],
                               resumes=res.stats.resumes, error=None)
                except Exception as err:
                    rec.update(tokens=0, exact=False, resumes=0,
                               error=f"{type(err).__name__}: {err}")
                records.append(rec)

        t0 = time.monotonic()
        task = asyncio.ensure_future(asyncio.gather(*(device(i, e) for i, e in enumerate(edges))))
        done, _ = await asyncio.wait([task], timeout=cfg.kill_after_s)
        killed_at = time.monotonic() - t0
        pid = cluster.kill_replica(0)
        await task
        wall = time.monotonic() - t0
        restarted = len(cluster.pids()) > cfg.kill_replicas
        reconnects = sum(e.resumes for e in edges)
        edges_moved = sum(1 for e in edges if e.resumes)
    expected = sum(len(want[r["prompt"]]) for r in records)
    got = sum(r["tokens"] for r in records if r["exact"])
    return {
        "replicas": cfg.kill_replicas, "devices": cfg.devices,
        "generations": len(records), "killed_pid": pid, "killed_at_s": killed_at,
        "finished_before_kill": bool(done), "wall_s": wall,
        "exact": sum(r["exact"] for r in records),
        "mismatched": sum(1 for r in records if not r["exact"] and r["error"] is None),
        "failed": sum(1 for r in records if r["error"] is not None),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "tokens_expected": expected, "tokens_exact": got, "tokens_lost": expected - got,
        "sessions_resumed": sum(1 for r in records if r["resumes"]),
        "resumes": sum(r["resumes"] for r in records),
        "edges_reconnected": edges_moved, "reconnects": reconnects,
        "replica_restarted": restarted,
        "tokens_per_s": sum(r["tokens"] for r in records) / wall if wall else 0.0,
    }


# ------------------------------------------------------------------ the report


async def run_scale(cfg: ScaleConfig, *, log: Any = None) -> dict[str, Any]:
    """Every point, then the killed run; the report (see :func:`format_report`)."""
    points = []
    for n in cfg.replicas:
        p = await _throughput(cfg, n)
        points.append(p)
        if log is not None:
            log(f"{n} replicas: {p['tokens_per_s']:,.0f} tokens/s")
    base = next((p["tokens_per_s"] for p in points if p["replicas"] == 1), None)
    for p in points:
        p["ratio"] = p["tokens_per_s"] / base if base else None
        ideal1 = ideal_tokens_per_s(cfg, 1)
        p["ideal_ratio"] = (p["ideal_tokens_per_s"] / ideal1
                            if ideal1 and p["ideal_tokens_per_s"] else None)
        goal = GOALS.get(p["replicas"])
        p["goal_ratio"] = goal
        p["meets_goal"] = None if goal is None or p["ratio"] is None else p["ratio"] >= goal
    controls = []
    for n in (cfg.replicas if cfg.controls else ()):
        if n < 2 or cfg.devices % n:
            continue
        alone = await _throughput(cfg, n, kind="alone", devices=cfg.devices // n)
        free = await _throughput(cfg, n, kind="no-broker")
        measured = next(p for p in points if p["replicas"] == n)
        for c in (alone, free):
            total = c["tokens_per_s"] * (n if c is alone else 1)
            c["ratio"] = total / base if base else None
        # the shares of the way from N x alone down to the measured point
        alone_n = n * alone["tokens_per_s"]
        free["sharing_cost"] = 1 - free["tokens_per_s"] / alone_n if alone_n else None
        free["broker_cost"] = (1 - measured["tokens_per_s"] / free["tokens_per_s"]
                               if free["tokens_per_s"] else None)
        controls += [alone, free]
        if log is not None:
            log(f"controls for {n}: one replica with {cfg.devices // n} devices alone "
                f"{alone['tokens_per_s']:,.0f} tokens/s, {n} clouds without a broker "
                f"{free['tokens_per_s']:,.0f} tokens/s")
    killed = await _killed(cfg) if cfg.kill else None
    if killed is not None and log is not None:
        log(f"killed run: {killed['exact']}/{killed['generations']} exact, "
            f"{killed['sessions_resumed']} sessions resumed")
    return {"schema_version": SCHEMA_VERSION, "kind": "scale", "config": cfg.to_dict(),
            "points": points, "controls": controls, "killed": killed, "machine": machine()}


def run_scale_sync(cfg: ScaleConfig, *, log: Any = None) -> dict[str, Any]:
    """:func:`run_scale` in a fresh event loop (the CLI's entry)."""
    return asyncio.run(run_scale(cfg, log=log))


SCALE_HEADER = ["replicas", "tokens/s", "ratio", "goal", "ideal tok/s", "ideal ratio",
                "efficiency", "round p50 ms", "machine busy", "devices cores", "errors",
                "resumes"]


def _f(v: float | None, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _busy(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _pct(v: float | None) -> str:
    """A share lost, as a percentage; one within rounding of none (or a gain, which
    on a shared machine is noise) says so."""
    if v is None:
        return "n/a"
    return "nothing measurable" if v < 0.005 else f"{100 * v:.0f} %"


def scale_rows(rep: dict[str, Any]) -> list[list[Any]]:
    """The table of :func:`format_report` (and of docs/RESULTS.md), one row a point."""
    return [[p["replicas"], _f(p["tokens_per_s"], ",.0f"), _f(p["ratio"], ".2f"),
             _f(p["goal_ratio"], ".1f"), _f(p["ideal_tokens_per_s"], ",.0f"),
             _f(p["ideal_ratio"], ".2f"), _f(p["efficiency"], ".2f"), _f(p["round_ms_p50"], ".1f"),
             _busy(p.get("machine_busy")),
             _f(p.get("devices_cores"), ".2f"), p["errors"], p["resumes"]]
            for p in rep["points"]]


CONTROL_HEADER = ["replicas", "control", "devices", "tokens/s", "as N replicas", "ratio",
                  "ideal tok/s", "efficiency", "round p50 ms", "machine busy"]


def control_rows(rep: dict[str, Any]) -> list[list[Any]]:
    """The controls' table: one row a control (empty for a report without them)."""
    rows = []
    for c in rep.get("controls") or []:
        n, alone = c["replicas"], c["kind"] == "alone"
        rows.append([n, "one replica alone" if alone else f"{n} clouds, no broker",
                     c["devices"], _f(c["tokens_per_s"], ",.0f"),
                     _f(c["tokens_per_s"] * (n if alone else 1), ",.0f"), _f(c["ratio"], ".2f"),
                     _f(c["ideal_tokens_per_s"], ",.0f"), _f(c["efficiency"], ".2f"),
                     _f(c["round_ms_p50"], ".1f"), _busy(c.get("machine_busy"))])
    return rows


def controls_sentence(rep: dict[str, Any]) -> str | None:
    """Where each ratio goes, from the controls: N x alone, then sharing the
    machine (no broker), then the broker (the measured point)."""
    controls = rep.get("controls") or []
    points = {p["replicas"]: p for p in rep["points"]}
    one = points.get(1)
    parts = []
    for n in sorted({c["replicas"] for c in controls}):
        alone = next((c for c in controls if c["replicas"] == n and c["kind"] == "alone"), None)
        free = next((c for c in controls if c["replicas"] == n and c["kind"] == "no-broker"),
                    None)
        measured = points.get(n)
        if alone is None or free is None or measured is None:
            continue
        text = (f"{n} replicas: with nothing shared they would reach {n} x "
                f"{alone['tokens_per_s']:,.0f} = {n * alone['tokens_per_s']:,.0f} tokens/s "
                f"({_f(alone['ratio'], '.2f')}x)")
        if alone.get("efficiency") is not None and one and one.get("efficiency") is not None:
            text += (f", since one replica serving {alone['devices']} devices alone delivers "
                     f"{alone['efficiency']:.2f} of the cost model's best where the one serving "
                     f"all {one.get('devices', rep['config']['devices'])} delivers "
                     f"{one['efficiency']:.2f}")
        text += (f"; sharing the machine's cores and the devices' process costs "
                 f"{_pct(free.get('sharing_cost'))} ({n} clouds without a broker: "
                 f"{free['tokens_per_s']:,.0f} tokens/s, {_f(free['ratio'], '.2f')}x), the "
                 f"broker {_pct(free.get('broker_cost'))} ({measured['tokens_per_s']:,.0f} "
                 "behind it)")
        parts.append(text)
    if not parts:
        return None
    return "The controls (same run): " + "; ".join(parts) + "."


def killed_sentence(k: dict[str, Any] | None) -> str:
    if k is None:
        return "No replica was killed in this run."
    verdict = ("no token was lost or repeated" if k["tokens_lost"] == 0 and not k["failed"]
               else f"{k['tokens_lost']} tokens were lost or wrong, {k['failed']} generations "
                    "failed")
    again = ("started the killed replica again" if k["replica_restarted"]
             else "had not yet restarted the killed replica")
    return (f"Killed run: {k['devices']} devices x {k['generations'] // max(1, k['devices'])} "
            f"greedy generations on {k['replicas']} replicas; one replica process was killed "
            f"(SIGKILL) {k['killed_at_s']:.1f} s in. {k['exact']} of {k['generations']} outputs "
            f"equal the target's greedy decode ({k['tokens_exact']:,} of "
            f"{k['tokens_expected']:,} tokens): {verdict}. {k['sessions_resumed']} sessions "
            f"were resumed on another replica ({k['edges_reconnected']} edges reconnected); "
            f"the broker process {again}.")


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """A docs/RESULTS.md section from a report (``None``: the file is missing)."""
    if rep is None:
        return ["## Replicas", "", f"{OUT_FILE} is missing.", ""]
    c = rep["config"]
    goals = [p for p in rep["points"] if p["goal_ratio"] is not None]
    met = [p for p in goals if p["meets_goal"]]
    m = rep.get("machine") or {}
    lines = ["## Replicas", "",
             f"Command: `{rep.get('command', 'xcosd bench scale')}`. {c['devices']} closed-loop "
             f"devices (greedy, {c['method']}, draft length {c['draft_len']}, "
             f"{c['max_new_tokens']} tokens per generation) against `xcosd serve --replicas N` "
             f"with target `{c['target']}`; {c['duration_s']:g} s measured after "
             f"{c['warmup_s']:g} s warm-up, on {m.get('nproc', '?')} cores"
             + (f" ({m['cpu_model']})" if m.get("cpu_model") else "") + ".", "",
             table(scale_rows(rep), SCALE_HEADER, markdown=True), ""]
    lines.append("*machine busy*: the share of all cores busy during the window (every "
                 "process on the machine); *devices cores*: the cores the devices' process used. "
                 "A point with the machine near 100 % busy is bound by the cores, not by the "
                 "replicas or the broker.")
    if goals:
        lines.append(f"{len(met)} of {len(goals)} ratio goals met ("
                     + ", ".join(f"{p['replicas']} replicas: {p['ratio']:.2f}x vs "
                                 f"{p['goal_ratio']:.1f}x" for p in goals) + ").")
    outside = _outside_call(rep)
    if outside:
        lines.append(
            "The ideal ratio is the cost model's with every device in every batch and nothing "
            "but the target call in a round; a goal equal to it asks N replicas to be as "
            "efficient as one. A round's median time outside the call it waits for (the "
            "devices' drafting and sampling, the broker's two hops, verification and the "
            "state machines, and a half batch's wait when a replica's devices split into two "
            "alternating batches) was "
            + ", ".join(f"{ms:.0f} ms with {n} replica{'s' if n > 1 else ''} "
                        f"({100 * ms / r:.0f} % of its round)" for n, ms, r in outside)
            + (": it shrinks more slowly than the call as the devices spread over more "
               "replicas, so its share of a round grows"
               if all(x[1] / x[2] < y[1] / y[2] for x, y in itertools.pairwise(outside))
               and len(outside) > 1 else "")
            + ".")
    bound = _turns_bound(rep)
    if bound:
        lines.append(bound)
    crow = control_rows(rep)
    if crow:
        lines += ["", table(crow, CONTROL_HEADER, markdown=True), ""]
        lines.append("*one replica alone*: one replica behind the broker serving its share "
                     "of the devices, nothing else running (*as N replicas*: times N); "
                     "*N clouds, no broker*: N plain `xcosd serve` processes at once, the "
                     "devices spread over them. *ratio*: to the 1-replica point above.")
        sentence = controls_sentence(rep)
        if sentence:
            lines.append(sentence)
    lines += [killed_sentence(rep.get("killed")), ""]
    return lines


def _outside_call(rep: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(replicas, ms, round ms) of each point: its median round, and that minus the
    call a full batch of its devices costs, for a synthetic target; empty for any
    other."""
    c = rep["config"]
    costs = synthetic_costs(str(c["target"]))
    if costs is None:
        return []
    a, b = 1e3 * costs[0], 1e3 * costs[1]  # ms
    rows = c["draft_len"] + 1
    return [(p["replicas"], p["round_ms_p50"] - (a + b * c["devices"] / p["replicas"] * rows),
             p["round_ms_p50"]) for p in rep["points"] if p.get("round_ms_p50") is not None]


def _turns_bound(rep: dict[str, Any]) -> str | None:
    """What the cost model allows once a replica's devices cannot all be back
    within a call's fixed cost ``a`` (``xcosd/nodes/merging.py``): its batches take
    turns in two groups, each paying ``a``; for a synthetic target only."""
    c = rep["config"]
    costs = synthetic_costs(str(c["target"]))
    goals = [(n, g) for n, g in GOALS.items() if n in c["replicas"]]
    if costs is None or not goals or 1 not in c["replicas"]:
        return None
    a, b = 1e3 * costs[0], 1e3 * costs[1]  # ms
    m = c["devices"] * (c["draft_len"] + 1)  # rows of every device's round
    turns_1 = 2 * a + b * m
    parts = []
    for n, goal in goals:
        turns_n = 2 * a + b * m / n
        need = turns_1 / goal - (a + b * m / n)
        parts.append(f"{n} replicas: turns cap the ratio at {turns_1 / turns_n:.2f}x, and "
                     f"whole batches reach {goal:.1f}x only if the devices are back within "
                     f"{need:.1f} ms of their verdicts")
    return ("Where a replica's devices take longer than the fixed cost a to come back, its "
            "batches take turns in two groups, each paying a: a cycle costs 2a + b·m "
            f"({turns_1:.0f} ms for the {c['devices']} devices of one replica) where the "
            f"ideal counts a + b·m. With one replica taking turns, "
            + "; ".join(parts) + ".")


def format_report(rep: dict[str, Any]) -> str:
    """The report as text (what ``xcosd bench scale`` prints)."""
    out = [table(scale_rows(rep), SCALE_HEADER), ""]
    crow = control_rows(rep)
    if crow:
        out += [table(crow, CONTROL_HEADER), ""]
    return "\n".join([*out, killed_sentence(rep.get("killed"))])


__all__ = ["CONTROL_HEADER", "DEFAULT_TARGET", "GOALS", "OUT_FILE", "SCALE_HEADER",
           "SCHEMA_VERSION", "Cluster", "ScaleConfig", "control_rows", "controls_sentence",
           "format_report", "greedy_reference", "ideal_tokens_per_s",
           "killed_sentence", "run_scale", "run_scale_sync", "scale_rows", "section_lines",
           "synthetic_costs"]
