"""Transport overhead: xcosd's framing over each transport against bare pyzmq.

    .venv/bin/python -m xcosd.bench.transport [--quick] [--uvloop]

For each payload (a small draft-sized message and a 100 KB HR-sized one) and each
transport (``zmq``, ``tcp``, ``memory``), one edge connection and the listener in
the same event loop:

* ping-pong round trips (encode_message -> send -> listener recv ->
  decode_message -> reply -> recv -> decode): p50 / p99 microseconds;
* pipelined echo with 64 messages in flight: messages per second;

and the same for a bare ``zmq.asyncio`` DEALER/ROUTER echo of the same bytes
(one frame, no header codec), reported as ratios (xcosd / bare). Prints and
writes ``bench/out/transport.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from xcosd.bench.report import OUT_DIR
from xcosd.transport import connect, listen
from xcosd.wire.frames import decode_message, encode_message

OUT = OUT_DIR / "transport.json"
PAYLOADS = {"draft 32 B": 32, "hr 100 KB": 100_000}
WINDOW = 64


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e6, q))


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


async def run_all(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, size in PAYLOADS.items():
        n_rtt = (300 if quick else 2000) if size < 1000 else (50 if quick else 300)
        n_pipe = n_rtt * 2
        bare = await bench_bare_zmq(size, n_rtt, n_pipe)
        rows: dict[str, Any] = {"bare pyzmq": bare}
        for kind in ("zmq", "tcp", "memory"):
            r = await bench_xcosd(kind, size, n_rtt, n_pipe)
            r["p50_vs_bare"] = r["p50_us"] / bare["p50_us"]
            r["p99_vs_bare"] = r["p99_us"] / bare["p99_us"]
            r["msgs_per_s_vs_bare"] = r["msgs_per_s"] / bare["msgs_per_s"]
            rows[f"xcosd {kind}"] = r
        out[label] = {"round_trips": n_rtt, "pipelined": n_pipe, "results": rows}
    return out


def format_tables(res: dict[str, Any]) -> str:
    lines = []
    for label, block in res["payloads"].items():
        lines.append(f"\n{label}  ({block['round_trips']} round trips, {block['pipelined']} "
                     f"pipelined with {WINDOW} in flight; loop {res['loop']})")
        lines.append(f"{'transport':<14}{'p50 us':>9}{'p99 us':>9}{'msgs/s':>10}"
                     f"{'p50 x':>8}{'p99 x':>8}{'rate x':>8}")
        for name, r in block["results"].items():
            ratios = (f"{r['p50_vs_bare']:>8.2f}{r['p99_vs_bare']:>8.2f}"
                      f"{r['msgs_per_s_vs_bare']:>8.2f}" if "p50_vs_bare" in r else "")
            lines.append(f"{name:<14}{r['p50_us']:>9.0f}{r['p99_us']:>9.0f}"
                         f"{r['msgs_per_s']:>10,.0f}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer round trips")
    ap.add_argument("--uvloop", action="store_true", help="run under uvloop")
    args = ap.parse_args(argv)
    if args.uvloop:
        import uvloop

        payloads = uvloop.run(run_all(args.quick))
    else:
        payloads = asyncio.run(run_all(args.quick))
    res = {"loop": "uvloop" if args.uvloop else "asyncio", "machine": platform.platform(),
           "payloads": payloads}
    print(format_tables(res))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    out = OUT.with_name("transport_uvloop.json") if args.uvloop else OUT
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
