"""Transport overhead: xcosd's framing and rounds against bare pyzmq, in one run.

    .venv/bin/python -m xcosd.bench.transport [--quick] [--uvloop] [--repeat N]
    .venv/bin/python -m xcosd.bench.transport --rounds [--quick] [--repeat N] [--profile]

**Transport** (the default): for each payload (a small draft-sized message and a
100 KB HR-sized one) and each transport (``zmq``, ``tcp``, ``memory``), one edge
connection and the listener in the same event loop:

* ping-pong round trips (encode_message -> send -> listener recv ->
  decode_message -> reply -> recv -> decode): p50 / p99 microseconds;
* pipelined echo with 64 messages in flight: messages per second;

and the same for a bare ``zmq.asyncio`` DEALER/ROUTER echo of the same bytes
(one frame, no header codec), reported as ratios (xcosd / bare). The machine this
runs on is shared and a single pass swings by several times, so ``--repeat``
passes alternate the stacks and every number is the median over the passes (each
ratio the median of the per-pass ratios: numerator and denominator from the same
minute). Prints and writes ``bench/out/transport.json``.

**Rounds** (``--rounds``): what a whole round costs against what the socket
library costs. In the same process and run, the bare pyzmq echo pipelines 32-byte
messages with 64 in flight (messages/s), and ``xcosd bench load`` runs 64
closed-loop devices (one device process, the cloud in this process) against a
near-free target (:data:`NULL_TARGET`: 10 us + 1 us per row, sleeping) for each
method and transport, drafting a fixed 4 tokens a round (the adaptive length would
draft up to 16 against a free target: fewer, longer rounds, which is right for
tokens/s but hides the cost of a round) and not speculating (drafting on while a
verdict is in flight is a device's idle time put to use, but 64 devices share this
process, where it would be drafting work added to every round). Each load run is
bracketed by two echo runs, and its ratio is its rounds/s over their mean: the bare
echo is the yardstick of what this machine gives a Python process that minute.
A second yardstick, run beside it, echoes the load test's own socket layout (as
many DEALERs as devices, one message in flight each: :func:`bench_bare_zmq_layout`);
the ``layout_ratio`` over it says what xcosd costs on top of the sockets a load
test of that many devices needs, where the first ratio also counts what that
layout costs against one socket with a window.
One more point runs xcosd-e over ZeroMQ with :data:`MANY_DEVICES` devices from the
one device process (``--many``): what a load test of thousands of devices costs a
round. Medians over ``--repeat`` passes; writes ``bench/out/rounds.json``.
``--profile`` also profiles the cloud's process (cProfile) during the xcosd-e / zmq
runs and prints where its time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import platform
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from xcosd.bench.report import OUT_DIR, machine
from xcosd.gc_tuning import many_sessions_gc
from xcosd.transport import connect, listen
from xcosd.wire.frames import decode_message, encode_message

OUT = OUT_DIR / "transport.json"
ROUNDS_OUT = OUT_DIR / "rounds.json"
PAYLOADS = {"draft 32 B": 32, "hr 100 KB": 100_000}
WINDOW = 64
#: the near-free target of the rounds benchmark: a 256-id synthetic model costing
#: 0.01 ms per call and 0.001 ms per row, so what is measured is the framework
NULL_TARGET = "synthetic:256:0.01:0.001"
#: the devices of the rounds benchmark
DEVICES = 64
#: and of its one many-device point (xcosd-e over ZeroMQ): a load test of thousands
#: of devices from one device process
MANY_DEVICES = 2000
#: the most devices whose socket layout the second yardstick echoes
#: (:func:`bench_bare_zmq_layout`; the many-device point has none)
MAX_LAYOUT_SOCKETS = 256
#: warm-up of the many-device point: its devices' handshakes take a few seconds
MANY_WARMUP_S = 4.0
METHODS = ("xcosd-e", "ar")
TRANSPORTS = ("zmq", "tcp")
STACKS = ("zmq", "tcp", "memory")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q)) if xs else 0.0


async def bench_xcosd(kind: str, size: int, n_rtt: int, n_pipe: int) -> dict[str, float]:
    ep = "mem://" if kind == "memory" else "tcp://127.0.0.1:0"
    lst = await listen(ep, transport=kind)
    conn = await connect(lst.endpoint, transport=kind)
    buf = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    async def server() -> None:
        while True:
            peer, frames = await lst.recv()
            if frames is None:
                continue
            header, bufs = decode_message(frames)
            await lst.send(peer, encode_message({"t": "echo", "i": header["i"]}, bufs))

    task = asyncio.ensure_future(server())
    rtts = []
    for i in range(n_rtt):
        t0 = time.perf_counter()
        await conn.send(encode_message({"t": "ping", "i": i}, [buf]))
        decode_message(await conn.recv())
        rtts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sent = got = 0
    while got < n_pipe:
        while sent < n_pipe and sent - got < WINDOW:
            await conn.send(encode_message({"t": "ping", "i": sent}, [buf]))
            sent += 1
        decode_message(await conn.recv())
        got += 1
    rate = n_pipe / (time.perf_counter() - t0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await conn.close()
    await lst.close()
    return {"p50_us": _pct(rtts, 50), "p99_us": _pct(rtts, 99), "msgs_per_s": rate}


async def bench_bare_zmq(size: int, n_rtt: int, n_pipe: int) -> dict[str, float]:
    """The yardstick: a ``zmq.asyncio`` ROUTER echoing what one DEALER sends, one
    awaited call per message, both in this event loop."""
    ctx = zmq.asyncio.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("tcp://127.0.0.1:0")
    dealer.connect(str(router.getsockopt_string(zmq.LAST_ENDPOINT)))
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()

    async def server() -> None:
        while True:
            ident, msg = await router.recv_multipart()
            await router.send_multipart([ident, msg])

    task = asyncio.ensure_future(server())
    rtts = []
    for _ in range(n_rtt):
        t0 = time.perf_counter()
        await dealer.send(payload)
        await dealer.recv()
        rtts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sent = got = 0
    while got < n_pipe:
        while sent < n_pipe and sent - got < WINDOW:
            await dealer.send(payload)
            sent += 1
        await dealer.recv()
        got += 1
    rate = n_pipe / (time.perf_counter() - t0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()
    return {"p50_us": _pct(rtts, 50), "p99_us": _pct(rtts, 99), "msgs_per_s": rate}


async def bench_bare_zmq_layout(n_sockets: int, n_msgs: int, size: int = 32) -> float:
    """The rounds' second yardstick: the same sockets as the load test's devices, a
    ``zmq.asyncio`` ROUTER echoing ``n_sockets`` DEALERs that each keep one 32-byte
    message in flight (as a closed-loop device keeps one round), all in this event
    loop; messages per second over ``n_msgs``. Against :func:`bench_bare_zmq`'s one
    DEALER with a window of them, it is what the layout itself costs: every message
    wakes its own socket, and nothing batches in one pipe."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    endpoint = str(router.getsockopt_string(zmq.LAST_ENDPOINT))
    dealers = [ctx.socket(zmq.DEALER) for _ in range(n_sockets)]
    for d in dealers:
        d.connect(endpoint)
    payload = bytes(size)
    got = 0
    done = asyncio.get_running_loop().create_future()

    async def server() -> None:
        while True:
            await router.send_multipart(await router.recv_multipart())

    async def client(d: zmq.asyncio.Socket) -> None:
        nonlocal got
        await d.send(payload)
        while True:
            await d.recv()
            got += 1
            if got == n_msgs and not done.done():
                done.set_result(time.perf_counter())
            await d.send(payload)

    tasks = [asyncio.ensure_future(server()), *(asyncio.ensure_future(client(d)) for d in dealers)]
    while got < min(n_sockets, n_msgs // 10):  # every connection up and echoing
        await asyncio.sleep(0.001)
    got, t0 = 0, time.perf_counter()
    t1 = await done
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for sock in (router, *dealers):
        sock.close(linger=0)
    ctx.term()
    return n_msgs / (t1 - t0)


def _median_row(passes: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: float(statistics.median(p[k] for p in passes)) for k in passes[0]}


async def run_all(quick: bool, repeat: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, size in PAYLOADS.items():
        n_rtt = (300 if quick else 2000) if size < 1000 else (50 if quick else 300)
        n_pipe = n_rtt * 2
        passes: dict[str, list[dict[str, float]]] = {"bare pyzmq": []}
        passes.update({f"xcosd {k}": [] for k in STACKS})
        for _ in range(max(1, repeat)):
            bare = await bench_bare_zmq(size, n_rtt, n_pipe)
            passes["bare pyzmq"].append(bare)
            for kind in STACKS:
                r = await bench_xcosd(kind, size, n_rtt, n_pipe)
                r["p50_vs_bare"] = r["p50_us"] / bare["p50_us"]
                r["p99_vs_bare"] = r["p99_us"] / bare["p99_us"]
                r["msgs_per_s_vs_bare"] = r["msgs_per_s"] / bare["msgs_per_s"]
                passes[f"xcosd {kind}"].append(r)
        rows = {name: _median_row(ps) for name, ps in passes.items()}
        out[label] = {"round_trips": n_rtt, "pipelined": n_pipe, "repeats": max(1, repeat),
                      "results": rows}
    return out


def format_tables(res: dict[str, Any]) -> str:
    lines = []
    for label, block in res["payloads"].items():
        reps = block.get("repeats", 1)
        lines.append(f"\n{label}  ({block['round_trips']} round trips, {block['pipelined']} "
                     f"pipelined with {WINDOW} in flight; loop {res['loop']}; median of "
                     f"{reps} pass{'es' if reps != 1 else ''})")
        lines.append(f"{'transport':<14}{'p50 us':>9}{'p99 us':>9}{'msgs/s':>10}"
                     f"{'p50 x':>8}{'p99 x':>8}{'rate x':>8}")
        for name, r in block["results"].items():
            ratios = (f"{r['p50_vs_bare']:>8.2f}{r['p99_vs_bare']:>8.2f}"
                      f"{r['msgs_per_s_vs_bare']:>8.2f}" if "p50_vs_bare" in r else "")
            lines.append(f"{name:<14}{r['p50_us']:>9.0f}{r['p99_us']:>9.0f}"
                         f"{r['msgs_per_s']:>10,.0f}{ratios}")
    return "\n".join(lines)


# ------------------------------------------------------------------ rounds


async def bare_echo_rate(n: int, size: int = 32) -> float:
    """Messages/s of the bare pyzmq echo with :data:`WINDOW` in flight."""
    return (await bench_bare_zmq(size, 0, n))["msgs_per_s"]


async def load_rounds(method: str, transport: str, duration_s: float, warmup_s: float,
                      profile: cProfile.Profile | None = None,
                      devices: int = DEVICES) -> dict[str, Any]:
    """One ``xcosd bench load`` run of ``devices`` closed-loop devices against
    :data:`NULL_TARGET`; its rounds/s and what the cloud saw."""
    from xcosd.bench.load import LoadConfig, run_load
    from xcosd.config import GenerationConfig

    cfg = LoadConfig(devices=devices, target=NULL_TARGET,
                     generation=GenerationConfig(method=method, adaptive_draft=False,
                                                 speculate=False),
                     duration_s=duration_s,
                     warmup_s=warmup_s, transport=transport)
    if profile is not None:
        profile.enable()
    try:
        rep = await run_load(cfg, progress=False)
    finally:
        if profile is not None:
            profile.disable()
    cpu = rep.get("cpu") or {}
    dev, cloud = cpu.get("devices") or {}, cpu.get("cloud") or {}
    return {"rounds_per_s": float(rep["rounds_per_s"]), "tokens_per_s": float(rep["tokens_per_s"]),
            "round_p50_ms": float(rep["round_latency_ms"]["p50"]),
            "mean_batch_size": rep.get("mean_batch_size"), "errors": int(rep["errors_total"]),
            # where a round's CPU goes (xcosd/bench/load/cpu.py); None where not measured
            "devices_us_per_round": dev.get("us_per_round"),
            "devices_loop_busy": dev.get("loop_busy"),
            "cloud_us_per_round": cloud.get("us_per_round"),
            "cloud_loop_busy": cloud.get("loop_busy")}


async def run_rounds(quick: bool, repeat: int, methods: Sequence[str] = METHODS,
                     transports: Sequence[str] = TRANSPORTS,
                     profile: cProfile.Profile | None = None, *, devices: int = DEVICES,
                     many: int = MANY_DEVICES, duration_s: float | None = None,
                     warmup_s: float | None = None,
                     n_echo: int | None = None) -> dict[str, Any]:
    """The rounds benchmark (see the module docstring); ``profile`` records the
    cloud's process during the xcosd-e / zmq runs at ``devices``. ``many``: the
    devices of the xcosd-e / zmq point named ``"xcosd-e zmq, {many} devices"`` (0:
    none). The other keywords shrink it (a test)."""
    n_echo = n_echo or (4000 if quick else 10000)
    duration, warmup = (2.0, 1.0) if quick else (4.0, 1.5)
    duration = duration if duration_s is None else duration_s
    warmup = warmup if warmup_s is None else warmup_s
    await bare_echo_rate(n_echo // 4)  # warm the context and the loop
    configs = [(f"{m} {t}", m, t, devices, warmup) for t in transports for m in methods]
    if many:
        configs.append((f"xcosd-e zmq, {many} devices", "xcosd-e", "zmq", many,
                        max(warmup, MANY_WARMUP_S) if warmup_s is None else warmup))
    passes: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for _ in range(max(1, repeat)):
        for name, m, t, n, warm in configs:
            layout = n <= MAX_LAYOUT_SOCKETS
            before = await bare_echo_rate(n_echo)
            lay0 = await bench_bare_zmq_layout(n, n_echo) if layout else None
            prof = profile if (m, t, n) == ("xcosd-e", "zmq", devices) else None
            r = await load_rounds(m, t, duration, warm, prof, n)
            lay1 = await bench_bare_zmq_layout(n, n_echo) if layout else None
            after = await bare_echo_rate(n_echo)
            r["echo_msgs_per_s"] = (before + after) / 2
            r["ratio"] = r["rounds_per_s"] / r["echo_msgs_per_s"]
            r["layout_echo_msgs_per_s"] = (lay0 + lay1) / 2 if lay0 and lay1 else None
            r["layout_ratio"] = (r["rounds_per_s"] / r["layout_echo_msgs_per_s"]
                                 if r["layout_echo_msgs_per_s"] else None)
            r["devices"] = n
            passes[name].append(r)
    results = {}
    for name, ps in passes.items():
        results[name] = {
            "devices": ps[0]["devices"],
            "rounds_per_s": statistics.median(p["rounds_per_s"] for p in ps),
            "echo_msgs_per_s": statistics.median(p["echo_msgs_per_s"] for p in ps),
            "ratio": statistics.median(p["ratio"] for p in ps),
            "layout_ratio": (statistics.median(p["layout_ratio"] for p in ps)
                             if all(p["layout_ratio"] for p in ps) else None),
            "passes": ps}
    return {"kind": "rounds", "devices": devices, "many_devices": many,
            "target": NULL_TARGET, "window": WINDOW,
            "duration_s": duration, "warmup_s": warmup, "repeats": max(1, repeat),
            "results": results}


def format_rounds(res: dict[str, Any]) -> str:
    lines = [f"\n{res['devices']} closed-loop devices, target {res['target']}, against the bare "
             f"pyzmq echo ({res['window']} in flight); median of {res['repeats']} pass(es)",
             f"{'method / transport':<32}{'rounds/s':>10}{'echo msgs/s':>13}{'ratio':>8}"
             f"{'layout ratio':>14}{'  per pass'}"]
    for name, r in res["results"].items():
        per = " ".join(f"{p['ratio']:.2f}" for p in r["passes"])
        lay = "-" if r.get("layout_ratio") is None else f"{r['layout_ratio']:.2f}"
        lines.append(f"{name:<32}{r['rounds_per_s']:>10,.0f}{r['echo_msgs_per_s']:>13,.0f}"
                     f"{r['ratio']:>8.2f}{lay:>14}  {per}")
    return "\n".join(lines)


def profile_text(prof: cProfile.Profile, top: int = 30) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages, shorter runs")
    ap.add_argument("--uvloop", action="store_true", help="run under uvloop")
    ap.add_argument("--repeat", type=int, default=None,
                    help="passes, medians reported (default: 3, 1 with --quick)")
    ap.add_argument("--rounds", action="store_true",
                    help="rounds/s of 64 devices against the bare echo, not the transport")
    ap.add_argument("--profile", action="store_true",
                    help="with --rounds: profile the cloud during the xcosd-e / zmq runs")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"with --rounds: methods (default {','.join(METHODS)})")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help=f"with --rounds: transports (default {','.join(TRANSPORTS)})")
    ap.add_argument("--many", type=int, default=MANY_DEVICES,
                    help=f"with --rounds: the devices of the xcosd-e / zmq point run from "
                         f"one device process besides the {DEVICES} (default {MANY_DEVICES}; "
                         f"0: none)")
    args = ap.parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    runner: Any = asyncio.run
    if args.uvloop:
        import uvloop

        runner = uvloop.run
    loop_name = "uvloop" if args.uvloop else "asyncio"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if args.rounds:
        prof = cProfile.Profile() if args.profile else None
        with many_sessions_gc():  # its cloud and devices, as `xcosd serve` runs them
            res = runner(run_rounds(args.quick, repeat, args.methods.split(","),
                                    args.transports.split(","), profile=prof,
                                    many=args.many))
        res.update(loop=loop_name, machine=machine())
        print(format_rounds(res))
        out = ROUNDS_OUT.with_name("rounds_uvloop.json") if args.uvloop else ROUNDS_OUT
        if prof is not None:
            text = profile_text(prof)
            print("\nthe cloud's process during the xcosd-e / zmq runs (cProfile, tottime):\n")
            print(text)
            res["profile"] = text
        out.write_text(json.dumps(res, indent=2))
        print(f"\nwrote {out}")
        return 0
    payloads = runner(run_all(args.quick, repeat))
    res = {"loop": loop_name, "machine": platform.platform(), "payloads": payloads}
    print(format_tables(res))
    out = OUT.with_name("transport_uvloop.json") if args.uvloop else OUT
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
