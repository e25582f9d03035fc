"""The CPU the load test's own processes used in the window: is the load generator
(or the cloud it started) the bottleneck?

A load tester measures the cloud only while it is not itself the limit. Each device
process runs its devices on one event-loop thread: when that thread is busy nearly
all the window, rounds wait for the load generator, not for the cloud, and the
report's rates measure the tester. So the report carries, for the window, each
process's CPU seconds (all its threads, ZeroMQ's I/O thread included) and its loop
thread's, read from Linux's ``/proc`` at the window's two ends, as CPU seconds per
round (what a round costs each side) and as the share of the window the busiest loop
thread was running (near 1: saturated). Elsewhere than Linux, ``null``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

#: a loop thread busy this share of the window or more is taken as saturated
SATURATED = 0.9

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _stat_cpu_s(path: str) -> float | None:
    """utime + stime of a ``/proc/.../stat`` file, in seconds."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: count from the closing parenthesis
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def sample(pid: int, loop_tid: int) -> tuple[float, float] | None:
    """(CPU seconds of process ``pid``, of its thread ``loop_tid``) so far, or
    ``None`` when they cannot be read (not Linux, the process is gone)."""
    total = _stat_cpu_s(f"/proc/{pid}/stat")
    loop = _stat_cpu_s(f"/proc/{pid}/task/{loop_tid}/stat")
    return None if total is None or loop is None else (total, loop)


def side(before: Sequence[tuple[float, float] | None],
         after: Sequence[tuple[float, float] | None], window_s: float,
         rounds: int) -> dict[str, Any] | None:
    """One side's report from the samples of its processes at the window's ends:
    ``processes``, ``cores`` (CPU seconds over the window), ``us_per_round``, and
    ``loop_busy`` (the busiest loop thread's share of the window)."""
    pairs = [(b, a) for b, a in zip(before, after, strict=True)
             if b is not None and a is not None]
    if not pairs or len(pairs) != len(before) or window_s <= 0:
        return None  # a process could not be read at one end: no half answer
    cpu = sum(a[0] - b[0] for b, a in pairs)
    busy = max((a[1] - b[1]) / window_s for b, a in pairs)
    return {"processes": len(pairs), "cores": cpu / window_s,
            "us_per_round": 1e6 * cpu / rounds if rounds else None, "loop_busy": busy}


def describe(cpu: dict[str, Any]) -> str:
    """The report's text line for :func:`side` of the devices and of the cloud."""
    def one(name: str, s: dict[str, Any]) -> str:
        per = f", {s['us_per_round']:.0f} us a round" if s["us_per_round"] is not None else ""
        return (f"{name} {s['cores']:.2f} cores in {s['processes']} process(es), loop thread "
                f"busy {s['loop_busy']:.2f}{per}")

    parts = [one("devices", cpu["devices"])]
    if cpu.get("cloud") is not None:
        parts.append(one("cloud", cpu["cloud"]))
    elif cpu.get("shared"):
        parts.append("the cloud runs in the devices' process")
    line = "  cpu: " + "; ".join(parts)
    if cpu["devices"]["loop_busy"] >= SATURATED:
        line += ("\n  ! the load generator was saturated (a device loop busy "
                 f"{cpu['devices']['loop_busy']:.0%} of the window): these rates measure it, "
                 "not the cloud; spread the devices over more --procs or hosts")
    return line


__all__ = ["SATURATED", "describe", "sample", "side"]
