"""``xcosd bench scale``'s comparison of the ways to run N clouds, same run: behind
xcosd's broker (``xcosd serve --replicas N``), behind HAProxy (N plain ``xcosd
serve`` processes, xcosd/bench/haproxy_fleet.py), and N independent clouds with the
devices spread over them by their own address lists (the no-balancer control).

For each way and each N: tokens/s and time to first token (p50, p99) of
closed-loop devices over a measured window. Then, at each N, the faults:

* a **kill**, for each way: one cloud process is killed (SIGKILL) at the window's
  start and started again, timing, for every device whose connection it held, the
  span from the kill to that device's next token (its next round that commits one,
  after it reconnected). The bound it is held to is twice the edges' heartbeat
  timeout (``timeout_s``: the silence after which an edge gives up on its cloud).
* a **drain**, through HAProxy and for the no-balancer control (the broker's
  replicas do not drain: a replica leaves at once with ``BYE``): one ``xcosd
  serve`` is sent SIGTERM at the window's start with a drain deadline of
  :data:`DRAIN_DEADLINE_S`, so that some of its running generations finish on it
  and the rest are handed off (exact resume elsewhere); it exits and is not started
  again (N - 1 clouds for the rest of the window). Every generation a device
  starts before the window ends runs to its end and is compared with the target's
  greedy decode (tokens expected vs exact); the drained cloud's own ``drained:
  {...}`` counts must add up (``sessions_at_start == finished + handed_off +
  ended_otherwise``), no device may see an error, and its exit is timed against
  its deadline. Tokens/s in the window is set against the same way's undisturbed
  run.

Speed is reported, never asserted here; :func:`goals` says, from the numbers,
whether each of issue 37's goals is met.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from ..nodes import EdgeNode, RoundObserved
from ..transport.addresses import Addresses
from .haproxy_fleet import Balanced
from .load.config import PROMPTS
from .report import OUT_DIR

#: the ways, in the report's order
KINDS = ("broker", "haproxy", "no-balancer")
#: the ways a drain is run for (a broker's replica does not drain)
DRAIN_KINDS = ("haproxy", "no-balancer")
#: the goal: tokens/s through HAProxy at least this share of the no-balancer control's
HAPROXY_GOAL = 0.95
#: seconds after the kill at which the killed cloud is started again
RESTART_AFTER_S = 1.0
#: the drained cloud's ``--drain-timeout``: shorter than a generation here, so the
#: drain both lets generations finish and hands the rest off
DRAIN_DEADLINE_S = 1.0
#: how long past its deadline the drained process may take to hand off and exit
#: (the hand-off's flush, then the process's own teardown)
DRAIN_EXIT_GRACE_S = 3.0


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
    """One way of running ``n`` clouds: its endpoint, and how to kill or drain one."""

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
                                haproxy=self.kind == "haproxy",
                                drain_timeout_s=DRAIN_DEADLINE_S) as b:
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

    async def drain(self) -> dict[str, Any]:
        """SIGTERM one plain cloud and wait for it to exit: its exit code, the
        seconds from the signal to its exit, and its ``drained: {...}`` counts."""
        assert self.balanced is not None, "only plain clouds drain"
        victim = self.balanced.clouds[0]
        t0 = time.monotonic()
        victim.process.send(signal.SIGTERM)
        rc = await victim.process.wait(DRAIN_DEADLINE_S + 60.0)
        exit_s = time.monotonic() - t0
        line = next((ln for ln in victim.process.lines if ln.startswith("drained: ")), None)
        counts = None if line is None else json.loads(line[len("drained: "):])
        return {"rc": rc, "exit_s": exit_s, "drained": counts}


async def _run(cfg: Any, kind: str, n: int, *, fault: str | None = None) -> dict[str, Any]:
    """One closed-loop run of ``cfg.devices`` devices on ``n`` clouds the ``kind``
    way; ``fault`` ``"kill"`` or ``"drain"``: a cloud is killed or drained at the
    window's start (module docstring)."""
    from ..models import load_model
    from .scale import _devices, greedy_reference

    kill, drain = fault == "kill", fault == "drain"
    want: dict[str, list[int]] = {}
    if drain:  # every generation is checked against the target's greedy decode
        reference = load_model(cfg.target, a=0.0, b=0.0)
        want = {p: greedy_reference(reference, p, cfg.max_new_tokens) for p in PROMPTS}
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
            fault_at: list[float] = []
            #: the drain run's generations: (prompt, token ids or None, resumes, error)
            records: list[tuple[str, list[int] | None, int, str | None]] = []
            drained: dict[str, Any] = {}

            def hook(i: int) -> Any:
                def on_round(r: RoundObserved) -> None:
                    nonlocal tokens
                    if w0 <= r.end <= w1:
                        tokens += r.tokens
                    if r.tokens and not got_first[i]:
                        got_first[i] = True
                        if w0 <= started[i] <= w1:
                            ttft.append(r.end - started[i])
                    if fault_at and r.tokens and r.end > fault_at[0]:
                        rounds_after[i].append(r.end)
                    if r.end > w1 and not drain:  # a drain run finishes what it started
                        raise _Ended()
                return on_round

            async def device(i: int, e: EdgeNode) -> None:
                nonlocal errors
                e.on_round = hook(i)
                await asyncio.sleep(max(0.0, go - time.monotonic()))
                k = 0
                while time.monotonic() < w1:
                    prompt = PROMPTS[(i + k) % len(PROMPTS)]
                    started[i], got_first[i] = time.monotonic(), False
                    try:
                        res = await asyncio.wait_for(e.generate(prompt), cfg.timeout_s)
                        records.append((prompt, res.token_ids, res.stats.resumes, None))
                    except _Ended:
                        break
                    except Exception as err:
                        errors += 1
                        records.append((prompt, None, 0, f"{type(err).__name__}: {err}"))
                        await asyncio.sleep(0.05)
                    k += 1

            async def fault_job() -> None:
                await asyncio.sleep(max(0.0, w0 - time.monotonic()))
                before = [e.resumes for e in edges]
                fault_at.append(time.monotonic())
                job = asyncio.ensure_future(ways.drain() if drain else ways.kill_and_restart())
                while time.monotonic() < w1:  # when each device reconnects (10 ms grain)
                    for j, e in enumerate(edges):
                        if reconnected_at[j] is None and e.resumes > before[j]:
                            reconnected_at[j] = time.monotonic()
                    await asyncio.sleep(0.01)
                out = await job
                if isinstance(out, dict):  # the drain's
                    drained.update(out)

            jobs = [device(i, e) for i, e in enumerate(edges)]
            if fault is not None:
                jobs.append(fault_job())
            await asyncio.gather(*jobs)
            bound = 2 * edges[0].timeout_s  # the heartbeat timeout the devices use
    out: dict[str, Any] = {
        "kind": kind, "replicas": n, "devices": cfg.devices, "tokens": tokens,
        "tokens_per_s": tokens / cfg.duration_s, "errors": errors,
        "ttft_ms_p50": None if not ttft else 1e3 * (_pct(ttft, 50) or 0.0),
        "ttft_ms_p99": None if not ttft else 1e3 * (_pct(ttft, 99) or 0.0)}
    if fault is not None:
        out["fault"] = fault
        out["devices_moved"] = sum(1 for at in reconnected_at if at is not None)
    if kill:
        t_k = fault_at[0]
        spans = []
        for j in range(len(edges)):
            at = reconnected_at[j]
            if at is None:
                continue
            nxt = next((t for t in rounds_after[j] if t >= at), None)
            spans.append(None if nxt is None else nxt - t_k)
        done = [s for s in spans if s is not None]
        out.update(affected=len(spans), recovered=len(done),
                   recovery_s_max=max(done) if done else None,
                   recovery_s_p50=_pct(done, 50), bound_s=bound,
                   within_bound=bool(spans) and len(done) == len(spans)
                   and max(done) <= bound)
    if drain:
        out.update(_drain_counts(records, want, drained))
    return out


def _drain_counts(records: list[tuple[str, list[int] | None, int, str | None]],
                  want: dict[str, list[int]], drained: dict[str, Any]) -> dict[str, Any]:
    """A drain run's counts: generations and tokens expected against exact, and the
    drained cloud's own counts, exit and deadline (module docstring)."""
    exact = [ids is not None and ids == want[p] for p, ids, _, _ in records]
    expected = sum(len(want[p]) for p, _, _, _ in records)
    got = sum(len(want[p]) for (p, _, _, _), ok in zip(records, exact, strict=True) if ok)
    counts = drained.get("drained") or {}
    parts = [counts.get(k) for k in ("sessions_at_start", "finished", "handed_off",
                                     "ended_otherwise")]
    balanced = False
    if all(isinstance(v, int) for v in parts):
        at_start, finished, handed_off, otherwise = (int(v or 0) for v in parts)
        balanced = at_start == finished + handed_off + otherwise
    exit_s = drained.get("exit_s")
    return {
        "generations": len(records), "generations_exact": sum(exact),
        "mismatched": sum(1 for (_, ids, _, err), ok in zip(records, exact, strict=True)
                          if not ok and err is None),
        "failed": sum(1 for r in records if r[3] is not None),
        "failures": sorted({r[3] for r in records if r[3]})[:5],
        "generations_resumed": sum(1 for r in records if r[2]),
        "tokens_expected": expected, "tokens_exact": got, "tokens_lost": expected - got,
        "drained": counts or None, "drain_rc": drained.get("rc"),
        "drain_exit_s": exit_s, "drain_deadline_s": DRAIN_DEADLINE_S,
        "drain_exit_grace_s": DRAIN_EXIT_GRACE_S,
        "exited_in_time": exit_s is not None and exit_s <= DRAIN_DEADLINE_S + DRAIN_EXIT_GRACE_S,
        "sessions_counted": balanced,
        "lossless": bool(records) and expected == got and balanced
        and not any(r[3] for r in records) and drained.get("rc") == 0}


class _Ended(Exception):
    """Raised from a device's round hook once the window is over."""


async def compare(cfg: Any, counts: tuple[int, ...], *, log: Any = None) -> dict[str, Any]:
    """Every way at every count in ``counts``, then at each count a kill for each
    way and a drain for each of :data:`DRAIN_KINDS`; the report's ``balancers``
    section."""
    points = []
    for n in counts:
        for kind in KINDS:
            p = await _run(cfg, kind, n)
            points.append(p)
            if log is not None:
                log(f"{kind} x {n}: {p['tokens_per_s']:,.0f} tokens/s, TTFT p50 "
                    f"{p['ttft_ms_p50'] or 0:.0f} ms")
        control = next(p for p in points if p["replicas"] == n and p["kind"] == "no-balancer")
        for p in points:
            if p["replicas"] == n:
                p["vs_control"] = (p["tokens_per_s"] / control["tokens_per_s"]
                                   if control["tokens_per_s"] else None)
    kills, drains = [], []
    for n in counts:
        for kind in KINDS:
            k = await _run(cfg, kind, n, fault="kill")
            kills.append(k)
            if log is not None:
                log(f"{kind} x {n}, a cloud killed: {k['recovered']}/{k['affected']} "
                    f"affected devices had their next token within "
                    f"{k['recovery_s_max'] or 0:.1f} s")
        for kind in DRAIN_KINDS:
            d = await _run(cfg, kind, n, fault="drain")
            calm = next(p for p in points if p["replicas"] == n and p["kind"] == kind)
            d["vs_undisturbed"] = (d["tokens_per_s"] / calm["tokens_per_s"]
                                   if calm["tokens_per_s"] else None)
            drains.append(d)
            if log is not None:
                log(f"{kind} x {n}, a cloud drained: {d['tokens_exact']:,} of "
                    f"{d['tokens_expected']:,} tokens exact, drained {d['drained']}, exit "
                    f"{d['drain_exit_s'] or 0:.2f} s (deadline {DRAIN_DEADLINE_S:g} s)")
    haproxy = [p for p in points if p["kind"] == "haproxy"]
    return {"counts": list(counts), "points": points, "kills": kills, "drains": drains,
            "goal": HAPROXY_GOAL,
            "meets_goal": all((p.get("vs_control") or 0) >= HAPROXY_GOAL for p in haproxy)}


def failed(rep: dict[str, Any]) -> bool:
    """Whether the run saw an error or a drain lost something (speed never fails it)."""
    return (any(p["errors"] for p in rep["points"])
            or any(not d.get("lossless") for d in rep.get("drains", [])))


__all__ = ["DRAIN_DEADLINE_S", "DRAIN_KINDS", "HAPROXY_GOAL", "KINDS", "compare", "failed"]


# ------------------------------------------------------------------ the report

#: where ``xcosd bench scale`` writes this comparison (and the results generator reads)
OUT_FILE = OUT_DIR / "balancers.json"
HEADING = "## Behind a balancer"
POINT_HEADER = ["clouds", "way", "tokens/s", "vs no balancer", "TTFT p50 ms", "TTFT p99 ms",
                "errors"]
KILL_HEADER = ["way", "clouds", "affected devices", "next token within (max) s",
               "median s", "bound s", "errors"]
DRAIN_HEADER = ["way", "clouds", "generations exact", "tokens exact", "tokens lost", "errors",
                "at start = finished + handed off + otherwise", "refused", "drain took s",
                "exit s", "deadline s", "tokens/s", "vs undisturbed"]
_NAMES = {"broker": "xcosd broker (--replicas N)", "haproxy": "HAProxy, N xcosd serve",
          "no-balancer": "N clouds, no balancer"}


def _f(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def point_rows(rep: dict[str, Any]) -> list[list[Any]]:
    return [[p["replicas"], _NAMES[p["kind"]], _f(p["tokens_per_s"], ",.0f"),
             _f(p.get("vs_control"), ".2f"), _f(p["ttft_ms_p50"], ".0f"),
             _f(p["ttft_ms_p99"], ".0f"), p["errors"]] for p in rep["points"]]


def kill_rows(rep: dict[str, Any]) -> list[list[Any]]:
    return [[_NAMES[k["kind"]], k["replicas"], f"{k['recovered']} of {k['affected']}",
             _f(k["recovery_s_max"], ".2f"), _f(k["recovery_s_p50"], ".2f"),
             _f(k["bound_s"], ".0f"), k["errors"]] for k in rep["kills"]]


def _drained_cell(c: dict[str, Any] | None) -> str:
    if not c:
        return "no drained: line"
    return (f"{c['sessions_at_start']} = {c['finished']} + {c['handed_off']} + "
            f"{c['ended_otherwise']}")


def drain_rows(rep: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for d in rep.get("drains", []):
        c = d.get("drained") or {}
        rows.append([_NAMES[d["kind"]], d["replicas"],
                     f"{d['generations_exact']:,} of {d['generations']:,}",
                     f"{d['tokens_exact']:,} of {d['tokens_expected']:,}",
                     f"{d['tokens_lost']:,}", d["errors"], _drained_cell(c),
                     c.get("refused", "n/a"), _f(c.get("took_s"), ".2f"),
                     _f(d["drain_exit_s"], ".2f"), _f(d["drain_deadline_s"], "g"),
                     _f(d["tokens_per_s"], ",.0f"), _f(d.get("vs_undisturbed"), ".2f")])
    return rows


def goals(rep: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """Issue 37's goals, each ``(goal, what the run measured, met)``, from the numbers."""
    out = []
    hap = [p for p in rep["points"] if p["kind"] == "haproxy"]
    counts = " and ".join(str(p["replicas"]) for p in hap)
    out.append((f"through HAProxy at {counts} replicas, tokens/s >= {rep['goal']:.2f}x the "
                "no-balancer control of the same run",
                ", ".join(f"{p['replicas']} clouds {_f(p.get('vs_control'), '.2f')}x"
                          for p in hap),
                bool(hap) and all((p.get("vs_control") or 0) >= rep["goal"] for p in hap)))
    kills = rep["kills"]
    bound = max((k["bound_s"] for k in kills), default=0.0)
    worst = max((k["recovery_s_max"] or 0.0 for k in kills), default=None)
    affected = sum(k["affected"] for k in kills)
    recovered = sum(k["recovered"] for k in kills)
    out.append(("resume after a kill: every affected session's next token within 2 x the "
                f"heartbeat timeout ({bound:g} s)",
                f"{recovered} of {affected} affected devices over {len(kills)} kills "
                f"(every way at {' and '.join(str(n) for n in rep['counts'])} clouds), "
                f"the slowest {_f(worst, '.2f')} s",
                bool(kills) and all(k["within_bound"] for k in kills)))
    drains = rep.get("drains", [])
    lost = sum(d["tokens_lost"] for d in drains)
    gens = sum(d["generations"] for d in drains)
    exact = sum(d["generations_exact"] for d in drains)
    errs = sum(d["errors"] for d in drains)
    counted = sum(1 for d in drains if d["sessions_counted"])
    at_start = sum((d.get("drained") or {}).get("sessions_at_start", 0) for d in drains)
    exits = [d["drain_exit_s"] for d in drains if d.get("drain_exit_s") is not None]
    gone = ("" if not exits else
            f"; the drained clouds exited {min(exits):.2f} to {max(exits):.2f} s after "
            f"SIGTERM ({sum(1 for d in drains if d.get('exited_in_time'))} of {len(drains)} "
            f"within the {drains[0]['drain_deadline_s']:g} s deadline + "
            f"{drains[0]['drain_exit_grace_s']:g} s)")
    out.append(("a drain loses no token and no session (counted)",
                f"{len(drains)} drains: {exact:,} of {gens:,} generations equal to the "
                f"target's greedy decode, {lost:,} tokens lost, {errs} device errors; the "
                f"drained clouds' counts add up in {counted} of {len(drains)} "
                f"({at_start} sessions at the drains' start){gone}",
                bool(drains) and all(d["lossless"] for d in drains)))
    return out


def format_report(rep: dict[str, Any]) -> str:
    from .report import table

    lines = [table(point_rows(rep), POINT_HEADER), "", table(kill_rows(rep), KILL_HEADER)]
    if rep.get("drains"):
        lines += ["", table(drain_rows(rep), DRAIN_HEADER)]
    lines += [""] + [f"goal: {g}: {got} ({_met(ok)})" for g, got, ok in goals(rep)]
    return "\n".join(lines)


def section_lines(rep: dict[str, Any] | None) -> list[str]:
    """docs/RESULTS.md's section from a report (``None``: the file is missing)."""
    from .report import table

    if rep is None:
        return [HEADING, "", f"{OUT_FILE} is missing.", ""]
    c = rep["config"]
    m = rep.get("machine") or {}
    counts = " and ".join(str(n) for n in rep["counts"])
    lines = [HEADING, "",
             f"Command: `{rep.get('command', 'xcosd bench scale')}`. The same run compares "
             f"three ways of running N clouds for {c['devices']} closed-loop devices (greedy, "
             f"{c['method']}, draft length {c['draft_len']}, {c['max_new_tokens']} tokens per "
             f"generation, target `{c['target']}`): behind xcosd's broker, behind HAProxy "
             "(TCP mode, HTTP checks of `/health`: docs/DEPLOY.md) in front of N plain "
             "`xcosd serve` processes, and N clouds with the devices spread over them evenly "
             f"by their own address lists (no balancer: the control); {c['duration_s']:g} s "
             f"measured after {c['warmup_s']:g} s warm-up, on {m.get('nproc', '?')} cores. "
             "Code: xcosd/bench/balancing_ways.py.", "",
             table(point_rows(rep), POINT_HEADER, markdown=True), "",
             f"Then, at {counts} clouds, for each way, a run in which one cloud process is "
             "killed (SIGKILL) at the window's start and started again "
             f"({RESTART_AFTER_S:g} s later for HAProxy and the control; the broker process "
             "restarts its replica itself): for every device whose connection the killed "
             "cloud held, the time from the kill to its next committed token (after it "
             "reconnected), against twice the edges' heartbeat timeout.", "",
             table(kill_rows(rep), KILL_HEADER, markdown=True), ""]
    drains = rep.get("drains") or []
    if drains:
        d0 = drains[0]
        lines += [
            f"And at {counts} clouds, through HAProxy and without a balancer, a drain: one "
            "`xcosd serve` is sent SIGTERM at the window's start with "
            f"`--drain-timeout {d0['drain_deadline_s']:g}`, shorter than a generation "
            "here: a generation that ends within it finishes on the drained cloud, one "
            "still running at the deadline is handed off and resumed exactly on another "
            "(the devices start together and their generations are of equal length, so "
            "they run nearly in step: which of the two happens to most of them depends on "
            "where their generations stand at the signal). The drained cloud exits and "
            "is not started again (N - 1 clouds for the rest of the window: a "
            "scale-down). Every generation a device starts in the run is let "
            "finish and compared with the target's greedy decode (generations and tokens "
            "exact of those started); *at start = finished + handed off + otherwise* and "
            "*refused* (opens it turned away while draining) are the drained cloud's own "
            "`drained: {...}` counts; *drain took* is its drain's own time, *exit* the time "
            "from SIGTERM to the process's exit, against its deadline (the hand-off and "
            f"teardown may add up to {d0['drain_exit_grace_s']:g} s); tokens/s is the "
            "window's, *vs undisturbed* against the same way's run above.", "",
            table(drain_rows(rep), DRAIN_HEADER, markdown=True), ""]
    lines += ["Goals (issue 37), from the numbers above:", ""]
    lines += [f"* {g[0].upper()}{g[1:]}: {got} (**{_met(ok)}**)." for g, got, ok in goals(rep)]
    lines.append("")
    return lines


__all__ += ["DRAIN_HEADER", "HEADING", "OUT_FILE", "format_report", "goals", "section_lines"]
