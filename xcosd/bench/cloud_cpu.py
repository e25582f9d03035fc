"""Cloud CPU per round: what serving one round costs the cloud's process, in units of
what a bare ZeroMQ echo server spends on one message on the same machine, same run.

    .venv/bin/python -m xcosd.bench.cloud_cpu [--src DIR] [--before PATH] [--profile]

Rounds/s on a shared 2-core machine depend on both sides at once (the devices'
process is often the limit), so this bench compares CPU, not rates: each row is one
``xcosd bench load`` run (its own process, the cloud inside it, the devices in a
device process) against the near-free target ``synthetic:V:0.01:0.001`` with a
fixed 4-token draft, and its figures are the load report's ``cpu`` field: each
whole process's CPU (all threads, ZeroMQ's I/O thread included) over the measured
window per round (docs/LOAD.md). The yardstick is a bare ``zmq.asyncio`` ROUTER
echo server in its own process, its DEALER client (this process) keeping 64
messages of 32 bytes in flight: the server's CPU over a window per message echoed,
run before and after the load runs; their mean is the denominator of the ratios.

``--src DIR`` runs the load processes on another checkout's code (``PYTHONPATH``
and working directory ``DIR``), e.g. the commit before a change; ``--before PATH``
puts a previous report's figures beside this run's (default
``docs/cloud_cpu_before.json`` when it exists). ``--profile`` adds one xcosd-e run
against a cloud in this process under cProfile and keeps its top entries.

With vocab 256 and T=1 in the matrix, each method's sans-I/O core is also measured
alone, on this checkout's code whatever ``--src`` says (each pass a process of its
own, :func:`one_pass`): the edge and cloud state machines wired together with no socket and no event loop
(:func:`core_row`), the floor under the load rows. A change to that core is weighed
against another checkout in one run by :mod:`xcosd.bench.core_ab`.

Prints a table and writes ``bench/out/cloud_cpu.json``; docs/RESULTS.md's section
comes from :func:`section_cloud_cpu`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xcosd.bench.load import cpu
from xcosd.bench.report import OUT_DIR, machine, table, write_json

HEADING = "## Cloud CPU per round"
OUT = OUT_DIR / "cloud_cpu.json"
BEFORE = Path("docs") / "cloud_cpu_before.json"

METHODS = ("ar", "xcosd", "xcosd-e")
DEVICES = (64, 256)
#: warper label -> the ``xcosd bench load`` options it adds (T=1 is its default)
WARPERS: dict[str, list[str]] = {"T=1": [], "top-p 0.95": ["--top-p", "0.95"]}
VOCABS = (256, 131072, 262144)
VOCAB_LABELS = {131072: "128k", 262144: "262k"}
#: the target's cost: 10 us a call + 1 us a row, so what is measured is the framework
COSTS = "0.01:0.001"
DRAFT_LEN = 4
#: the echo's messages in flight and their size
ECHO_WINDOW = 64
ECHO_BYTES = 32

#: the goals the section checks: a ratio to the echo, or microseconds
GOAL_E = 2.0  # xcosd-e cloud us/round over echo us/message
GOAL_AR = 1.2  # ar cloud us/round over echo us/message
GOAL_DEVICE_US = 100.0  # the devices' CPU per xcosd-e round
GOAL_FLAT = 1.25  # cloud us/round at 256 devices over that at 64
#: a row with fewer rounds in its window is flagged in the section
FEW_ROUNDS = 200

ECHO_SERVER = """
import asyncio, sys, zmq, zmq.asyncio

async def main():
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    print(router.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        ident, msg = await router.recv_multipart()
        await router.send_multipart([ident, msg])

asyncio.run(main())
"""


def vocab_label(v: int) -> str:
    return VOCAB_LABELS.get(v, str(v))


def row_key(r: dict[str, Any]) -> tuple[str, int, str, int]:
    return (str(r["method"]), int(r["devices"]), str(r["warper"]), int(r["vocab"]))


def _shown(cmd: Sequence[str], tmp: str | None = None) -> str:
    text = " ".join(shlex.quote(c) for c in cmd).replace(sys.executable, "python")
    return text.replace(tmp, "$TMP") if tmp else text


# ------------------------------------------------------------------ the echo


async def _echo_client(endpoint: str, pid: int, warmup_s: float, window_s: float) -> dict[str, Any]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    payload = bytes(ECHO_BYTES)
    for _ in range(ECHO_WINDOW):
        await dealer.send(payload)
    t_start = time.monotonic() + warmup_s
    got = n0 = n1 = 0
    t0 = t1 = 0.0
    s0: tuple[float, float] | None = None
    s1: tuple[float, float] | None = None
    started = False
    while True:
        # a ready socket completes these awaits without yielding: the clock is read
        # here, not from a sleeping task
        await dealer.recv()
        got += 1
        await dealer.send(payload)
        if got % 64:
            continue
        now = time.monotonic()
        if not started and now >= t_start:
            started, s0, n0, t0 = True, cpu.sample(pid, pid), got, now
        elif started and now >= t0 + window_s:
            s1, n1, t1 = cpu.sample(pid, pid), got, now
            break
    dealer.close(linger=0)
    ctx.term()
    if s0 is None or s1 is None:
        raise RuntimeError("the echo server's CPU could not be read from /proc")
    msgs, window, cpu_s = n1 - n0, t1 - t0, s1[0] - s0[0]
    return {"messages": msgs, "window_s": window, "msgs_per_s": msgs / window,
            "server_cpu_s": cpu_s, "server_cores": cpu_s / window,
            "server_loop_busy": (s1[1] - s0[1]) / window, "us_per_msg": 1e6 * cpu_s / msgs}


def echo(warmup_s: float, window_s: float) -> dict[str, Any]:
    """The bare echo server's CPU per message: the server in its own process, the
    client in this one, ``window_s`` measured after ``warmup_s``."""
    server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        if not endpoint:
            raise RuntimeError(f"the echo server exited ({server.wait()}) before binding")
        return asyncio.run(_echo_client(endpoint, server.pid, warmup_s, window_s))
    finally:
        server.terminate()
        server.wait(10)


# ------------------------------------------------------------------ the load runs


def load_command(method: str, devices: int, warper: str, vocab: int, duration_s: float,
                 warmup_s: float, json_path: str, procs: int = 1) -> list[str]:
    return [sys.executable, "-m", "xcosd", "bench", "load", "-n", str(devices),
            "--target", f"synthetic:{vocab}:{COSTS}", "--method", method,
            "--duration", f"{duration_s:g}", "--warmup", f"{warmup_s:g}", "--json", json_path,
            "--no-progress", "--fixed-draft-len", "--draft-len", str(DRAFT_LEN),
            "--no-speculate", "--procs", str(procs), *WARPERS[warper]]


def _run_env(src: Path | None) -> tuple[dict[str, str], str | None]:
    """The load processes' environment and working directory: with ``src``, its
    code first on the path (as the working directory too, since ``python -m`` puts
    that ahead of ``PYTHONPATH``)."""
    env = dict(os.environ)
    if src is None:
        return env, None
    env["PYTHONPATH"] = str(src)
    return env, str(src)


def code_info(src: Path | None) -> dict[str, Any]:
    """Which xcosd the load processes import, and its git commit (and whether its
    ``xcosd/`` has uncommitted changes)."""
    env, cwd = _run_env(src)
    path = subprocess.run([sys.executable, "-c", "import os, xcosd; "
                           "print(os.path.dirname(os.path.dirname(xcosd.__file__)))"],
                          env=env, cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()
    out: dict[str, Any] = {"path": path, "commit": None, "dirty": None}
    try:
        out["commit"] = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"],
                                       capture_output=True, text=True,
                                       check=True).stdout.strip()
        out["dirty"] = bool(subprocess.run(
            ["git", "-C", path, "status", "--porcelain", "--untracked-files=no", "--", "xcosd"],
            capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def load_row(method: str, devices: int, warper: str, vocab: int, duration_s: float,
             warmup_s: float, src: Path | None, procs: int = 1) -> dict[str, Any]:
    """One ``xcosd bench load`` run in its own process and its row."""
    env, cwd = _run_env(src)
    with tempfile.TemporaryDirectory(prefix="cloud_cpu_") as tmp:
        path = os.path.join(tmp, "load.json")
        cmd = load_command(method, devices, warper, vocab, duration_s, warmup_s, path, procs)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=warmup_s + duration_s + 300)
            rc, tail = proc.returncode, (proc.stderr or proc.stdout or "")[-2000:]
        except subprocess.TimeoutExpired:
            rc, tail = None, "timed out"
        wall = time.perf_counter() - t0
        shown = _shown(cmd, tmp)
        if src is not None:
            shown = f"PYTHONPATH={shlex.quote(str(src))} {shown}  # in {src}"
        row: dict[str, Any] = {"method": method, "devices": devices, "warper": warper,
                               "vocab": vocab, "warmup_s": warmup_s, "duration_s": duration_s,
                               "rc": rc, "wall_s": wall, "command": shown}
        if rc is None or not os.path.exists(path):
            return {**row, "rounds": None, "rounds_per_s": None, "cloud_us_per_round": None,
                    "devices_us_per_round": None, "cloud_loop_busy": None,
                    "devices_loop_busy": None, "errors": None, "failed": tail}
        rep = json.loads(Path(path).read_text())
    c = rep.get("cpu") or {}
    cloud, dev = c.get("cloud") or {}, c.get("devices") or {}
    return {**row, "rounds": rep.get("rounds"), "rounds_per_s": rep.get("rounds_per_s"),
            "cloud_us_per_round": cloud.get("us_per_round"),
            "devices_us_per_round": dev.get("us_per_round"),
            "cloud_loop_busy": cloud.get("loop_busy"),
            "devices_loop_busy": dev.get("loop_busy"),
            "errors": rep.get("errors_total")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ------------------------------------------------------------------ the core alone

#: one pass, run by ``python -c`` on whichever ``xcosd`` is first on the path: it uses
#: only what every checkout's pump has (``Pump.generate`` and its stats)
CORE_PASS = """
import json, os, sys, time, types
import xcosd
import xcosd.nodes.pump as pump_module
from xcosd.models import SyntheticModel
from xcosd.nodes.pump import Pump
method, generations, draft_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pump_module.time = types.SimpleNamespace(perf_counter=time.thread_time)
target = SyntheticModel(256, name="synthetic")
draft = SyntheticModel(target.vocab, skew=0.9, name="synthetic-draft")
model_s = 0.0
score = target.score
def timed(batch):
    global model_s
    t0 = time.thread_time()
    try:
        return score(batch)
    finally:
        model_s += time.thread_time() - t0
target.score = timed
pump = Pump(target, draft)
pump.generate(method, prompt="ab", max_new_tokens=64, seed=10**6, draft_len=draft_len,
              adaptive_draft=False)
model_s = 0.0
cloud_s = edge_s = 0.0
rounds = 0
for i in range(generations):
    g = pump.generate(method, prompt="ab", max_new_tokens=64, seed=i, draft_len=draft_len,
                      adaptive_draft=False)
    cloud_s += g.stats.cloud_compute_s
    edge_s += g.stats.draft_compute_s
    rounds += g.stats.rounds
    pump.events.clear()
print(json.dumps({"path": os.path.dirname(os.path.dirname(os.path.abspath(xcosd.__file__))),
                  "rounds": rounds, "cloud_us_per_round": 1e6 * (cloud_s - model_s) / rounds,
                  "model_us_per_round": 1e6 * model_s / rounds,
                  "edge_us_per_round": 1e6 * edge_s / rounds}))
"""


def one_pass(method: str, src: Path | None, generations: int) -> dict[str, Any]:
    """One pass of :data:`CORE_PASS` in a fresh process on ``src``'s code (``None``:
    this checkout's), after one generation of warm-up; a :class:`RuntimeError` when
    the process imported ``xcosd`` from anywhere else."""
    root = Path(__file__).resolve().parents[2] if src is None else src
    out = subprocess.run([sys.executable, "-c", CORE_PASS, method, str(generations),
                          str(DRAFT_LEN)], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True)
    got = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if Path(got.pop("path")).resolve() != root.resolve():
        # (an installed xcosd found instead, the checkout having none)
        raise RuntimeError(f"the pass on {root} imported another checkout's xcosd")
    return got


#: generations of the core's measurement, and its passes (the fastest is kept)
CORE_GENERATIONS = 120
CORE_PASSES = 3


def core_row(method: str, generations: int = CORE_GENERATIONS,
             passes: int = CORE_PASSES) -> dict[str, Any]:
    """What the sans-I/O core alone costs a round, with no socket and no event
    loop: the real edge and cloud state machines wired together in one thread by
    :class:`~xcosd.nodes.pump.Pump` (:data:`CORE_PASS`, each pass a process of its
    own on this checkout, timed by the thread's CPU clock), every message packed and unpacked, the cloud's
    rows scored and verified by the scheduler's own ``score_batch`` (a batch of
    one), over the load runs' vocabulary-256 synthetic target and draft at no
    modeled cost, T=1, the same fixed 4-token draft. The cloud's figure leaves out
    the target's own call (timed apart, ``model_us_per_round``): in a load run that
    call is shared by a whole batch. The floor under the load rows' T=1 figures:
    transport, event loop, metering, queues and fairness come on top of it. (Only
    T=1: under top-p a batch of one warps its rows alone, where a load run's batch
    warps them together, so a batch of one would overstate a session's share.)"""
    best: dict[str, Any] | None = None
    for _ in range(passes):
        row = {"method": method, "warper": "T=1", "vocab": 256, "generations": generations,
               **one_pass(method, None, generations)}
        if best is None or row["cloud_us_per_round"] < best["cloud_us_per_round"]:
            best = row
    assert best is not None
    return best


# ------------------------------------------------------------------ the profile


def _strip_paths(text: str) -> str:
    # the checkout's root: this file is xcosd/bench/cloud_cpu.py in it
    roots = {str(Path(__file__).resolve().parents[2]), sysconfig.get_paths()["purelib"],
             sysconfig.get_paths()["stdlib"]}
    for r in sorted(roots, key=len, reverse=True):
        text = text.replace(r + "/", "")
    return text


async def _profiled_cloud(duration_s: float, warmup_s: float, top: int) -> dict[str, Any]:
    from xcosd.models import load_model
    from xcosd.nodes import CloudNode

    spec = f"synthetic:256:{COSTS}"
    # the event loop thread's CPU clock: a wait (``poll``, ``sched_yield``) costs no
    # CPU and counts nothing, where the default wall clock would count it whole
    prof = cProfile.Profile(time.thread_time)
    async with CloudNode(load_model(spec), "tcp://127.0.0.1:0", max_batch=256) as cloud:
        # the devices run a second longer than the profiled window, which starts
        # warmup_s after the first rounds
        cmd = [sys.executable, "-m", "xcosd", "bench", "load", "--connect", cloud.endpoint,
               "-n", "64", "--target", spec, "--method", "xcosd-e",
               "--duration", f"{duration_s + 1:g}", "--warmup", f"{warmup_s:g}",
               "--no-progress", "--fixed-draft-len", "--draft-len", str(DRAFT_LEN),
               "--no-speculate"]
        devices = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while not cloud.counters["rounds"] and devices.returncode is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the profiled cloud saw no round in 120 s")
                await asyncio.sleep(0.05)
            await asyncio.sleep(warmup_s)
            r0, c0 = cloud.counters["rounds"], time.process_time()
            prof.enable()
            await asyncio.sleep(duration_s)
            prof.disable()
            r1, c1 = cloud.counters["rounds"], time.process_time()
            _, err = await asyncio.wait_for(devices.communicate(), warmup_s + duration_s + 120)
        finally:
            if devices.returncode is None:
                devices.kill()
                await devices.wait()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    rounds = r1 - r0
    return {"method": "xcosd-e", "devices": 64, "warper": "T=1", "vocab": 256,
            "duration_s": duration_s, "rounds": rounds, "devices_rc": devices.returncode,
            "us_per_round_profiled": 1e6 * (c1 - c0) / rounds if rounds else None,
            "command": _shown(cmd).replace(cloud.endpoint, "ENDPOINT"),
            "devices_stderr": (err or b"").decode(errors="replace")[-1000:] or None,
            "top": top, "text": _strip_paths(buf.getvalue()).strip("\n")}


def profile(duration_s: float, warmup_s: float, top: int = 25) -> dict[str, Any]:
    """One xcosd-e / 64 devices / T=1 / vocab 256 load against a cloud in this
    process (under :func:`xcosd.gc_tuning.many_sessions_gc`, as ``xcosd serve``),
    profiled for ``duration_s``: its top entries by own time."""
    from xcosd.gc_tuning import many_sessions_gc

    with many_sessions_gc():
        return asyncio.run(_profiled_cloud(duration_s, warmup_s, top))


# ------------------------------------------------------------------ the report


def _before_block(path: Path) -> dict[str, Any]:
    rep = json.loads(path.read_text())
    keep = ("method", "devices", "warper", "vocab", "rounds", "cloud_us_per_round",
            "devices_us_per_round", "cloud_per_echo", "devices_per_echo", "errors")
    return {"path": str(path), "code": rep.get("code"),
            "echo_us_per_msg": (rep.get("echo") or {}).get("us_per_msg"),
            "rows": [{k: r.get(k) for k in keep} for r in rep.get("rows", [])]}


def run(methods: Sequence[str], devices: Sequence[int], warpers: Sequence[str],
        vocabs: Sequence[int], duration_s: float, warmup_s: float, warmup_large_s: float,
        echo_warmup_s: float, echo_window_s: float, src: Path | None, procs: int = 1,
        do_profile: bool = False, log: bool = True, repeat: int = 1) -> dict[str, Any]:
    """The echo, the matrix of load runs, the echo again (and the profile)."""
    t_all = time.perf_counter()
    code = code_info(src)
    if src is not None and Path(code["path"]).resolve() != src.resolve():
        raise RuntimeError(f"--src {src}: the load processes import xcosd from {code['path']}")
    say = print if log else (lambda *a, **k: None)
    e0 = echo(echo_warmup_s, echo_window_s)
    say(f"echo before: {e0['us_per_msg']:.1f} us/message ({e0['msgs_per_s']:,.0f} msgs/s)",
        flush=True)
    rows = []
    for vocab in vocabs:
        # the goals' rows (vocab 256) run `repeat` passes, each pass over every row
        # in turn, and keep each figure's median: one run on a shared machine swings
        # by several per cent
        passes = repeat if vocab <= 256 else 1
        runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        for _ in range(passes):
            for warper in warpers:
                for n in devices:
                    for method in methods:
                        w = warmup_s if vocab <= 256 else max(warmup_s, warmup_large_s)
                        r = load_row(method, n, warper, vocab, duration_s, w, src, procs)
                        runs.setdefault((warper, n, method), []).append(r)
                        say(f"{method:8} {n:4} {warper:11} {vocab_label(vocab):>4}: "
                            f"{r['rounds']} rounds, cloud {_fmt(r['cloud_us_per_round'])} "
                            f"us, devices {_fmt(r['devices_us_per_round'])} us, errors "
                            f"{r['errors']} ({r['wall_s']:.1f} s)", flush=True)
        rows += [_median_row(got) for got in runs.values()]
    core = []
    if 256 in vocabs and "T=1" in warpers:
        for method in methods:
            core.append(core_row(method))
            c = core[-1]
            say(f"core {method:8}: cloud {c['cloud_us_per_round']:.1f} us (+ target "
                f"{c['model_us_per_round']:.1f} us), edge {c['edge_us_per_round']:.1f} us a "
                "round", flush=True)
    e1 = echo(echo_warmup_s, echo_window_s)
    say(f"echo after: {e1['us_per_msg']:.1f} us/message", flush=True)
    us = (e0["us_per_msg"] + e1["us_per_msg"]) / 2
    for r in rows:
        r["cloud_per_echo"] = _ratio(r["cloud_us_per_round"], us)
        r["devices_per_echo"] = _ratio(r["devices_us_per_round"], us)
    for c in core:
        c["cloud_per_echo"] = _ratio(c["cloud_us_per_round"], us)
    rep: dict[str, Any] = {
        "bench": "cloud_cpu", "code": code, "src": str(src) if src else None,
        "target": f"synthetic:V:{COSTS}", "draft_len": DRAFT_LEN, "procs": procs,
        "duration_s": duration_s, "warmup_s": warmup_s, "warmup_large_s": warmup_large_s,
        "repeat": repeat, "echo": {"window": ECHO_WINDOW, "bytes": ECHO_BYTES, "warmup_s": echo_warmup_s,
                 "window_s": echo_window_s, "before": e0, "after": e1, "us_per_msg": us},
        "rows": rows, "core": core, "profile": None}
    if do_profile:
        rep["profile"] = profile(duration_s, warmup_s)
        say(f"profile: {rep['profile']['rounds']} rounds profiled", flush=True)
    rep["wall_s"] = time.perf_counter() - t_all
    return rep


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from its passes: each figure's median (the first pass's command and
    settings), every pass's figures kept under ``passes``; errors summed."""
    def med(key: str) -> float | None:
        vals = sorted(v for r in runs if (v := r.get(key)) is not None)
        return statistics.median(vals) if vals else None

    row = dict(runs[0])
    if len(runs) == 1:
        return row
    for key in ("rounds", "rounds_per_s", "cloud_us_per_round", "devices_us_per_round",
                "cloud_loop_busy", "devices_loop_busy", "wall_s"):
        row[key] = med(key)
    if row["rounds"] is not None:
        row["rounds"] = int(row["rounds"])
    errs = [r.get("errors") for r in runs]
    row["errors"] = None if any(e is None for e in errs) else sum(errs)
    row["passes"] = [{k: r.get(k) for k in ("rounds", "cloud_us_per_round",
                                            "devices_us_per_round", "errors")} for r in runs]
    return row


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def _before_rows(rep: dict[str, Any]) -> dict[tuple[str, int, str, int], dict[str, Any]]:
    b = rep.get("before") or {}
    return {row_key(r): r for r in b.get("rows", [])}


def format_report(rep: dict[str, Any]) -> str:
    before = _before_rows(rep)
    rows = []
    for r in rep["rows"]:
        b = before.get(row_key(r), {})
        rows.append([r["method"], r["devices"], r["warper"], vocab_label(r["vocab"]),
                     _fmt(r["rounds"], "d"), _fmt(b.get("cloud_us_per_round")),
                     _fmt(r["cloud_us_per_round"]), _fmt(b.get("cloud_per_echo"), ".2f"),
                     _fmt(r["cloud_per_echo"], ".2f"), _fmt(r["devices_us_per_round"]),
                     _fmt(r["devices_per_echo"], ".2f"), _fmt(r["cloud_loop_busy"], ".2f"),
                     _fmt(r["errors"], "d")])
    e = rep["echo"]
    lines = [f"echo: {e['before']['us_per_msg']:.1f} us/message before, "
             f"{e['after']['us_per_msg']:.1f} after, mean {e['us_per_msg']:.1f}", "",
             table(rows, ["method", "devices", "warper", "vocab", "rounds", "cloud us before",
                          "cloud us", "/echo before", "/echo", "devices us", "/echo",
                          "cloud busy", "errors"]), ""]
    lines += [f"goal: {g}: {got} ({_verdict(ok)})" for g, got, ok in goals(rep)]
    if rep.get("core"):
        lines += ["", "the sans-I/O core alone (T=1, vocab 256):", "",
                  table([[c["method"], _fmt(c["cloud_us_per_round"], ".1f"),
                          _fmt(c["cloud_per_echo"], ".2f"), _fmt(c["model_us_per_round"], ".1f"),
                          _fmt(c["edge_us_per_round"], ".1f")] for c in rep["core"]],
                        ["method", "cloud us", "/echo", "target us", "edge us"])]
    if rep.get("profile"):
        lines += ["", rep["profile"]["text"]]
    return "\n".join(lines)


# ------------------------------------------------------------------ RESULTS.md


def _find(rep: dict[str, Any], method: str, devices: int, warper: str,
          vocab: int) -> dict[str, Any] | None:
    return next((r for r in rep["rows"] if row_key(r) == (method, devices, warper, vocab)), None)


def _within(vals: Sequence[float | None], limit: float) -> bool | None:
    """All of ``vals`` at most ``limit``; ``None`` when there is none or one is missing."""
    got = [v for v in vals if v is not None]
    return None if not vals or len(got) < len(vals) else all(v <= limit for v in got)


def goals(rep: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """Issue 34's goals, each ``(goal, what this run measured, met)`` (``None``: a
    row it needs was not measured), from the numbers."""
    warpers = [w for w in WARPERS if any(r["warper"] == w for r in rep["rows"])] or list(WARPERS)

    def bound(method: str, key: str, limit: float, fmt: str) -> tuple[str, bool | None]:
        got, vals = [], []
        for n in DEVICES:
            for w in warpers:
                r = _find(rep, method, n, w, 256)
                v = None if r is None else r.get(key)
                got.append(f"{n} devices {w} {_fmt(v, fmt)}")
                vals.append(v)
        return ", ".join(got), _within(vals, limit)

    out: list[tuple[str, str, bool | None]] = []
    got, ok = bound("xcosd-e", "cloud_per_echo", GOAL_E, ".2f")
    out.append((f"xcosd-e cloud / echo <= {GOAL_E:g} at 64 and 256 devices, vocab 256", got, ok))
    got, ok = bound("ar", "cloud_per_echo", GOAL_AR, ".2f")
    out.append((f"ar cloud / echo <= {GOAL_AR:g} at 64 and 256 devices, vocab 256", got, ok))
    got, ok = bound("xcosd-e", "devices_us_per_round", GOAL_DEVICE_US, ".0f")
    out.append((f"devices' CPU per xcosd-e round <= {GOAL_DEVICE_US:g} us, vocab 256", got + " us",
                ok))
    flat, vals = [], []
    for m in METHODS:
        for w in warpers:
            lo, hi = _find(rep, m, 64, w, 256), _find(rep, m, 256, w, 256)
            if lo is None and hi is None:
                continue
            v = _ratio((hi or {}).get("cloud_us_per_round"), (lo or {}).get("cloud_us_per_round"))
            flat.append(f"{m} {w} {_fmt(v, '.2f')}x")
            vals.append(v)
    out.append((f"flat in batch size: cloud us/round at 256 devices <= {GOAL_FLAT:g}x that at "
                "64, vocab 256", ", ".join(flat) or "no such rows", _within(vals, GOAL_FLAT)))
    return out


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "met" if ok else "not met"


def _code_text(code: dict[str, Any] | None) -> str:
    if not code or not code.get("commit"):
        return "code not recorded"
    return f"commit {code['commit'][:10]}" + (" with uncommitted changes" if code.get("dirty")
                                               else "")


def _procs(n: int) -> str:
    return "one device process" if n == 1 else f"{n} device processes"


def _core_lines(rep: dict[str, Any]) -> list[str]:
    """The section's paragraph on the sans-I/O core alone (:func:`core_row`)."""
    core = rep.get("core") or []
    if not core:
        return []
    rows = [[c["method"], _fmt(c["cloud_us_per_round"], ".1f"), _fmt(c["cloud_per_echo"], ".2f"),
             _fmt(c["model_us_per_round"], ".1f"), _fmt(c["edge_us_per_round"], ".1f")]
            for c in core]
    by = {c["method"]: c for c in core}
    lines = ["The floor under these figures: the sans-I/O core alone, the real edge and cloud "
             "state machines wired together in one thread with no socket and no event loop "
             "(`xcosd.nodes.pump.Pump`), every message packed and unpacked, the cloud's rows "
             "scored and verified by the scheduler's own `score_batch` (a batch of one), the "
             "same vocabulary-256 synthetic pair, T=1, fixed 4-token drafts; the fastest of "
             f"{CORE_PASSES} passes of {core[0].get('generations', CORE_GENERATIONS)} "
             "generations of 64 tokens. The cloud's figure leaves out the target's own call "
             "(shared by a whole batch in a load run; its own column); the edge's includes "
             "its draft model's steps.", "",
             table(rows, ["method", "cloud core µs/round", "/ echo", "target call µs/round",
                          "edge core µs/round"], markdown=True), ""]
    e, a = by.get("xcosd-e"), by.get("ar")
    if e is not None and a is not None:
        us = rep["echo"]["us_per_msg"]
        lines += [f"Against the goals: xcosd-e's cloud core alone is "
                  f"{_fmt(e['cloud_per_echo'], '.2f')}x the echo (goal {GOAL_E:g}x, "
                  f"{GOAL_E * us:.0f} µs), ar's {_fmt(a['cloud_per_echo'], '.2f')}x (goal "
                  f"{GOAL_AR:g}x, {GOAL_AR * us:.0f} µs), and the edge's core "
                  f"{_fmt(e['edge_us_per_round'])} µs an xcosd-e round (goal "
                  f"{GOAL_DEVICE_US:g} µs for the whole device process). What the goals leave "
                  "above the core for receiving, sending, the event loop, metering and the "
                  f"fair queues, {GOAL_E * us - e['cloud_us_per_round']:.0f} µs (xcosd-e) and "
                  f"{GOAL_AR * us - a['cloud_us_per_round']:.0f} µs (ar) a round, is "
                  + ("less than" if max(GOAL_E * us - e["cloud_us_per_round"],
                                        GOAL_AR * us - a["cloud_us_per_round"]) < us
                     else "to be set against")
                  + f" what the bare echo spends on one message ({us:.1f} µs).", ""]
    return lines


def section_cloud_cpu(rep: dict[str, Any] | None) -> list[str]:
    """docs/RESULTS.md's section from a report (``None``: the file is missing)."""
    if rep is None:
        return [HEADING, "", f"{OUT} is missing.", ""]
    m = rep.get("machine") or {}
    e = rep["echo"]
    b = rep.get("before")
    before = _before_rows(rep)
    vocabs = sorted({r["vocab"] for r in rep["rows"]})
    large = [vocab_label(v) for v in vocabs if v > 256]
    warm = (f"{rep['warmup_s']:g} s" + (f" ({rep['warmup_large_s']:g} s at vocab "
                                         f"{', '.join(large)})" if large else ""))
    text = ("From `python -m xcosd.bench.cloud_cpu` (bench/out/cloud_cpu.json). Each row is one "
            "`xcosd bench load` run in its own process: the cloud it starts in that process, "
            f"the closed-loop devices in {_procs(rep.get('procs', 1))}, target "
            f"`{rep['target']}` (10 us a call + 1 us a row, so what is measured is the "
            f"framework), a fixed {rep['draft_len']}-token draft, no speculation, "
            f"{rep['duration_s']:g} s measured after {warm} of warm-up"
            + (f" (the vocab-256 rows: the median of {rep['repeat']} passes, each pass over "
               "every row in turn)" if rep.get("repeat", 1) > 1 else "") + ", on "
            f"{m.get('nproc', '?')} cores ({m.get('cpu_model', 'CPU not recorded')}). The "
            "figures are the CPU of each whole process (every thread, its ZeroMQ I/O thread "
            "included) over the window per round, from the load report's `cpu` field "
            "(docs/LOAD.md). The yardstick is a bare `zmq.asyncio` ROUTER echo server in its "
            f"own process, a DEALER in another keeping {e['window']} messages of {e['bytes']} "
            f"bytes in flight: the server's CPU per message echoed over {e['window_s']:g} s, "
            f"{e['before']['us_per_msg']:.1f} us before the load runs and "
            f"{e['after']['us_per_msg']:.1f} us after; their mean, {e['us_per_msg']:.1f} us, "
            "divides the rows' figures (*/ echo*). *After* is this run "
            f"({_code_text(rep.get('code'))})")
    if b:
        text += (f"; *before* is the same bench on {_code_text(b.get('code'))} "
                 f"({b['path']}), its ratios against its own run's echo "
                 f"({_fmt(b.get('echo_us_per_msg'), '.1f')} us).")
    else:
        text += "; no earlier report was given, so the *before* columns are empty."
    rows = []
    for r in rep["rows"]:
        o = before.get(row_key(r), {})
        rows.append([r["method"], f"{r['devices']:,}", r["warper"], vocab_label(r["vocab"]),
                     _fmt(o.get("cloud_us_per_round")), _fmt(r["cloud_us_per_round"]),
                     _fmt(o.get("cloud_per_echo"), ".2f"), _fmt(r["cloud_per_echo"], ".2f"),
                     _fmt(o.get("devices_us_per_round")), _fmt(r["devices_us_per_round"]),
                     _fmt(r["devices_per_echo"], ".2f")])
    lines = [HEADING, "", text, "",
             table(rows, ["method", "devices", "warper", "vocab", "cloud µs/round before",
                          "after", "cloud / echo before", "after", "devices µs/round before",
                          "after", "devices / echo after"], markdown=True), ""]
    single = [vocab_label(v) for v in vocabs if v > 256 or rep.get("repeat", 1) == 1]
    if single:
        lines += [f"The rows at vocab {', '.join(single)} are single runs of "
                  f"{rep['duration_s']:g} s, of a few hundred to a few thousand rounds each: "
                  "a record of what those vocabularies cost, too noisy on this shared machine "
                  "to compare before with after row by row.", ""]
    few = [r for r in rep["rows"] if r["rounds"] is not None and r["rounds"] < FEW_ROUNDS]
    if few:
        lines += ["Rows with under {:,} rounds in the window (their per-round figures rest on "
                  "few rounds): {}.".format(FEW_ROUNDS, "; ".join(
                      f"{r['method']} {r['devices']} {r['warper']} {vocab_label(r['vocab'])}: "
                      f"{r['rounds']}" for r in few)), ""]
    bad = [r for r in rep["rows"] if r["errors"] is None or r["errors"]]
    if bad:
        lines += ["Rows with errors or no report: " + "; ".join(
            f"{r['method']} {r['devices']} {r['warper']} {vocab_label(r['vocab'])}: "
            f"{'no report' if r['errors'] is None else r['errors']}" for r in bad) + ".", ""]
    lines += ["Goals, this run:", ""]
    lines += [f"* {g}: {got} (**{_verdict(ok)}**)." for g, got, ok in goals(rep)]
    lines.append("")
    lines += _core_lines(rep)
    p = rep.get("profile")
    if p:
        lines += [f"A profile's top entries after: the cloud of one {p['method']} run "
                  f"({p['devices']} devices, {p['warper']}, vocab {p['vocab']}) in the bench's "
                  f"own process under cProfile, {p['duration_s']:g} s, {p['rounds']:,} rounds, "
                  f"the top {p['top']} by own time on the event loop thread's CPU clock "
                  "(a call that waits, such as `poll` or `sched_yield`, counts only the CPU "
                  "it spends; the worker thread that runs the target is not profiled; the "
                  f"profiler slows every call: {_fmt(p['us_per_round_profiled'])} µs of CPU a "
                  "round under it).", "",
                  "```", p["text"], "```", ""]
    return lines


# ------------------------------------------------------------------ main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="xcosd.bench.cloud_cpu",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--devices", default=",".join(map(str, DEVICES)))
    ap.add_argument("--warpers", default=",".join(WARPERS), help=f"of {', '.join(WARPERS)}")
    ap.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds a run")
    ap.add_argument("--warmup", type=float, default=1.5, help="warm-up seconds a run")
    ap.add_argument("--warmup-large", type=float, default=3.0,
                    help="warm-up seconds at a vocabulary over 256 (the devices' first "
                         "rounds at 262k take seconds)")
    ap.add_argument("--echo-warmup", type=float, default=1.0)
    ap.add_argument("--echo-window", type=float, default=3.0)
    ap.add_argument("--procs", type=int, default=1, help="device processes a run")
    ap.add_argument("--src", type=Path, default=None,
                    help="run the load processes on this checkout's code")
    ap.add_argument("--before", default=None,
                    help=f"an earlier report beside this one (default {BEFORE} when it "
                         "exists; none: no before)")
    ap.add_argument("--profile", action="store_true",
                    help="profile a cloud in this process during one more xcosd-e run "
                         "(this process's code, whatever --src says)")
    ap.add_argument("--quick", action="store_true",
                    help="xcosd-e and ar at 8 devices, vocab 256, T=1, 1 s runs, one short echo")
    ap.add_argument("--repeat", type=int, default=3,
                    help="passes of the vocab-256 rows (the goals'), medians kept")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.quick:
        args.methods, args.devices, args.warpers, args.vocabs = "xcosd-e,ar", "8", "T=1", "256"
        args.repeat = 1
        args.duration, args.warmup, args.echo_warmup, args.echo_window = 1.0, 0.5, 0.3, 0.7
    warpers = [w for w in args.warpers.split(",") if w]
    unknown = [w for w in warpers if w not in WARPERS]
    if unknown:
        ap.error(f"unknown warper(s) {unknown}: use {', '.join(WARPERS)}")
    before: Path | None = None
    if args.before is None:
        before = BEFORE if BEFORE.exists() else None
    elif args.before != "none":
        before = Path(args.before)
    if before is not None and before.resolve() == args.out.resolve():
        before = None
    rep = run(args.methods.split(","), _ints(args.devices), warpers, _ints(args.vocabs),
              args.duration, args.warmup, args.warmup_large, args.echo_warmup,
              args.echo_window, args.src, args.procs, args.profile, repeat=args.repeat)
    rep["machine"] = machine()
    rep["command"] = _shown([sys.executable, "-m", "xcosd.bench.cloud_cpu",
                             *(sys.argv[1:] if argv is None else argv)])
    rep["before"] = _before_block(before) if before is not None else None
    print()
    print(format_report(rep))
    write_json(args.out, rep)
    print(f"\nwrote {args.out} in {rep['wall_s']:.0f} s")
    return 1 if any(r["errors"] is None for r in rep["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
