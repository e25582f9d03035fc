"""``xcosd bench scale``'s comparison of the ways to run N clouds, same run: behind
xcosd's broker (``xcosd serve --replicas N``), behind HAProxy (N plain ``xcosd
serve`` processes, xcosd/bench/balancer.py), and N independent clouds with the
devices spread over them by their own address lists (the no-balancer control).

For each way and each N: tokens/s and time to first token (p50, p99) of
closed-loop devices over a measured window; then, for each way, a run in which
one cloud process is killed (SIGKILL) and started again, timing, for every device
whose connection it held, the span from the kill to that device's next token
(its next round that commits one, after it reconnected). The bound it is held to
is twice the edges' heartbeat timeout (``timeout_s``: the silence after which an
edge gives up on its cloud). Speed is reported, never asserted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from ..nodes import EdgeNode, RoundObserved
from ..transport.addresses import Addresses
from .balancer import Balanced
from .load.config import PROMPTS
from .report import OUT_DIR

#: the ways, in the report's order
KINDS = ("broker", "haproxy", "no-balancer")
#: the goal: tokens/s through HAProxy at least this share of the no-balancer control's
HAPROXY_GOAL = 0.95
#: seconds after the kill at which the killed cloud is started again
RESTART_AFTER_S = 1.0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def _serve_args(cfg: Any) -> list[str]:
    return ["--max-batch", str(cfg.max_batch), "--max-batch-tokens", str(cfg.max_batch_tokens),
            "--max-wait-ms", repr(cfg.max_wait_ms),
            "--max-sessions", str(max(1024, 4 * cfg.devices)),
            "--max-queue", str(max(4096, 8 * cfg.devices))]


class _Ways:
    """One way of running ``n`` clouds: its endpoint, and how to kill one."""

    def __init__(self, cfg: Any, kind: str, n: int) -> None:
        self.cfg, self.kind, self.n = cfg, kind, n
        self.cluster: Any = None
        self.balanced: Balanced | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        from .scale import Cluster

        if self.kind == "broker":
            async with Cluster(self.cfg, self.n) as c:
                self.cluster = c
                yield c.endpoint
        else:
            async with Balanced(self.n, self.cfg.target, serve_args=_serve_args(self.cfg),
                                haproxy=self.kind == "haproxy") as b:
                self.balanced = b
                yield b.endpoint

    async def kill_and_restart(self) -> None:
        """SIGKILL one cloud; start it again :data:`RESTART_AFTER_S` later (the
        broker process restarts its replica by itself)."""
        if self.kind == "broker":
            self.cluster.kill_replica(0)
            return
        assert self.balanced is not None
        victim = self.balanced.clouds[0]
        victim.process.send(signal.SIGKILL)
        await victim.process.wait()
        await asyncio.sleep(RESTART_AFTER_S)
        await victim.start()


async def _run(cfg: Any, kind: str, n: int, *, kill: bool) -> dict[str, Any]:
    """One closed-loop run of ``cfg.devices`` devices on ``n`` clouds the ``kind``
    way; with ``kill``, a cloud is killed at the window's start."""
    from .scale import _devices

    ways = _Ways(cfg, kind, n)
    async with ways.running() as endpoint:
        prepare = None
        if kind == "no-balancer":  # spread evenly: device i starts on cloud i % n

            def prepare(i: int, e: EdgeNode) -> None:
                e._addresses = Addresses(endpoint.split(","), start=i)

        async with _devices(cfg, [endpoint], prepare=prepare) as edges:
            go = time.monotonic() + 0.05
            w0, w1 = go + cfg.warmup_s, go + cfg.warmup_s + cfg.duration_s
            tokens = 0
            ttft: list[float] = []
            errors = 0
            #: per device: when its current generation started, whether it has a token
            started = [0.0] * len(edges)
            got_first = [True] * len(edges)
            rounds_after: list[list[float]] = [[] for _ in edges]
            reconnected_at: list[float | None] = [None] * len(edges)
            killed_at: list[float] = []

            def hook(i: int) -> Any:
                def on_round(r: RoundObserved) -> None:
                    nonlocal tokens
                    if w0 <= r.end <= w1:
                        tokens += r.tokens
                    if r.tokens and not got_first[i]:
                        got_first[i] = True
                        if w0 <= started[i] <= w1:
                            ttft.append(r.end - started[i])
                    if killed_at and r.tokens and r.end > killed_at[0]:
                        rounds_after[i].append(r.end)
                    if r.end > w1:
                        raise _Ended()
                return on_round

            async def device(i: int, e: EdgeNode) -> None:
                nonlocal errors
                e.on_round = hook(i)
                await asyncio.sleep(max(0.0, go - time.monotonic()))
                k = 0
                while time.monotonic() < w1:
                    started[i], got_first[i] = time.monotonic(), False
                    try:
                        await asyncio.wait_for(e.generate(PROMPTS[(i + k) % len(PROMPTS)]),
                                               cfg.timeout_s)
                    except _Ended:
                        break
                    except Exception:
                        errors += 1
                        await asyncio.sleep(0.05)
                    k += 1

            async def fault() -> None:
                await asyncio.sleep(max(0.0, w0 - time.monotonic()))
                before = [e.resumes for e in edges]
                killed_at.append(time.monotonic())
                restart = asyncio.ensure_future(ways.kill_and_restart())
                while time.monotonic() < w1:  # when each device reconnects (10 ms grain)
                    for j, e in enumerate(edges):
                        if reconnected_at[j] is None and e.resumes > before[j]:
                            reconnected_at[j] = time.monotonic()
                    await asyncio.sleep(0.01)
                await restart

            jobs = [device(i, e) for i, e in enumerate(edges)]
            if kill:
                jobs.append(fault())
            await asyncio.gather(*jobs)
    out: dict[str, Any] = {
        "kind": kind, "replicas": n, "devices": cfg.devices, "tokens": tokens,
        "tokens_per_s": tokens / cfg.duration_s, "errors": errors,
        "ttft_ms_p50": None if not ttft else 1e3 * (_pct(ttft, 50) or 0.0),
        "ttft_ms_p99": None if not ttft else 1e3 * (_pct(ttft, 99) or 0.0)}
    if kill:
        t_k = killed_at[0]
        spans = []
        for j in range(len(edges)):
            at = reconnected_at[j]
            if at is None:
                continue
            nxt = next((t for t in rounds_after[j] if t >= at), None)
            spans.append(None if nxt is None else nxt - t_k)
        done = [s for s in spans if s is not None]
        bound = 2 * 15.0  # EdgeNode's default timeout_s, what the devices use
        out.update(affected=len(spans), recovered=len(done),
                   recovery_s_max=max(done) if done else None,
                   recovery_s_p50=_pct(done, 50), bound_s=bound,
                   within_bound=bool(spans) and len(done) == len(spans)
                   and max(done) <= bound)
    return out


class _Ended(Exception):
    """Raised from a device's round hook once the window is over."""


async def compare(cfg: Any, counts: tuple[int, ...], *, log: Any = None) -> dict[str, Any]:
    """Every way at every count in ``counts``, then a kill for each way at the
    first count; the report's ``balancers`` section."""
    points = []
    for n in counts:
        for kind in KINDS:
            p = await _run(cfg, kind, n, kill=False)
            points.append(p)
            if log is not None:
                log(f"{kind} x {n}: {p['tokens_per_s']:,.0f} tokens/s, TTFT p50 "
                    f"{p['ttft_ms_p50'] or 0:.0f} ms")
        control = next(p for p in points if p["replicas"] == n and p["kind"] == "no-balancer")
        for p in points:
            if p["replicas"] == n:
                p["vs_control"] = (p["tokens_per_s"] / control["tokens_per_s"]
                                   if control["tokens_per_s"] else None)
    kills = []
    for kind in KINDS:
        k = await _run(cfg, kind, counts[0], kill=True)
        kills.append(k)
        if log is not None:
            log(f"{kind} x {counts[0]}, a cloud killed: {k['recovered']}/{k['affected']} "
                f"affected devices had their next token within "
                f"{k['recovery_s_max'] or 0:.1f} s")
    haproxy = [p for p in points if p["kind"] == "haproxy"]
    return {"counts": list(counts), "points": points, "kills": kills, "goal": HAPROXY_GOAL,
            "meets_goal": all((p.get("vs_control") or 0) >= HAPROXY_GOAL for p in haproxy)}


__all__ = ["HAPROXY_GOAL", "KINDS", "compare"]


# ------------------------------------------------------------------ the report

#: where ``xcosd bench scale`` writes this comparison (and the results generator reads)
OUT_FILE = OUT_DIR / "balancers.json"
HEADING = "## Behind a balancer"
POINT_HEADER = ["clouds", "way", "tokens/s", "vs no balancer", "TTFT p50 ms", "TTFT p99 ms",
                "errors"]
KILL_HEADER = ["way", "clouds", "affected devices", "next token within (max) s",
               "median s", "bound s", "errors"]
_NAMES = {"broker": "xcosd broker (--replicas N)", "haproxy": "HAProxy, N xcosd serve",
          "no-balancer": "N clouds, no balancer"}


def _f(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def point_rows(rep: dict[str, Any]) -> list[list[Any]]:
    return [[p["replicas"], _NAMES[p["kind"]], _f(p["tokens_per_s"], ",.0f"),
             _f(p.get("vs_control"), ".2f"), _f(p["ttft_ms_p50"], ".0f"),
             _f(p["ttft_ms_p99"], ".0f"), p["errors"]] for p in rep["points"]]


def kill_rows(rep: dict[str, Any]) -> list[list[Any]]:
    return [[_NAMES[k["kind"]], k["replicas"], f"{k['recovered']} of {k['affected']}",
             _f(k["recovery_s_max"], ".2f"), _f(k["recovery_s_p50"], ".2f"),
             _f(k["bound_s"], ".0f"), k["errors"]] for k in rep["kills"]]


def format_report(rep: dict[str, Any]) -> str:
    from .report import table

    return "\n".join([table(point_rows(rep), POINT_HEADER), "",
                      table(kill_rows(rep), KILL_HEADER)])


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """docs/RESULTS.md's section from a report (``None``: the file is missing)."""
    from .report import table

    if rep is None:
        return [HEADING, "", f"{OUT_FILE} is missing.", ""]
    c = rep["config"]
    m = rep.get("machine") or {}
    goal = rep["goal"]
    hap = [p for p in rep["points"] if p["kind"] == "haproxy"]
    lines = [HEADING, "",
             f"Command: `{rep.get('command', 'xcosd bench scale')}`. The same run compares "
             f"three ways of running N clouds for {c['devices']} closed-loop devices (greedy, "
             f"{c['method']}, draft length {c['draft_len']}, {c['max_new_tokens']} tokens per "
             f"generation, target `{c['target']}`): behind xcosd's broker, behind HAProxy "
             "(TCP mode, HTTP checks of `/health`: docs/DEPLOY.md) in front of N plain "
             "`xcosd serve` processes, and N clouds with the devices spread over them evenly "
             f"by their own address lists (no balancer: the control); {c['duration_s']:g} s "
             f"measured after {c['warmup_s']:g} s warm-up, on {m.get('nproc', '?')} cores. "
             "Code: xcosd/bench/balancers.py.", "",
             table(point_rows(rep), POINT_HEADER, markdown=True), "",
             f"Goal: through HAProxy, at least {goal:.2f}x the control's tokens/s: "
             + ", ".join(f"{p['replicas']} clouds {_f(p.get('vs_control'), '.2f')}x"
                         for p in hap)
             + (" (met)." if rep["meets_goal"] else " (not met)."), "",
             "Then, for each way, a run in which one cloud process is killed (SIGKILL) at "
             f"the window's start and started again ({RESTART_AFTER_S:g} s later for HAProxy "
             "and the control; the broker process restarts its replica itself): for every "
             "device whose connection the killed cloud held, the time from the kill to its "
             "next committed token (after it reconnected), against twice the edges' "
             "heartbeat timeout.", "",
             table(kill_rows(rep), KILL_HEADER, markdown=True), ""]
    return lines


__all__ += ["HEADING", "OUT_FILE", "format_report", "section_lines"]
