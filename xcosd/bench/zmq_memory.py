"""Process memory of bare pyzmq at a given number of connections and message rate.

    .venv/bin/python -m xcosd.bench.zmq_memory [--connections 256] [--rate 2.5]
                                               [--duration 240] [--json PATH]

The control for the soak's memory figure (``xcosd bench soak``): one ROUTER and
``--connections`` DEALERs in one process, no xcosd code, each DEALER sending a
small message and waiting for its echo ``--rate`` times a second on average. RSS is
sampled every 5 s.

Why it is needed: libzmq keeps each pipe's messages in a queue that grows in chunks
of 256 messages and keeps one freed chunk as a spare, so a connection's queue memory
is allocated only as its first few hundred messages pass, and then stays. A process
with many connections that each carry a few messages a second (a cloud with 256
devices, or the soak, where the devices live in the same process) grows for minutes
before it is flat; at a high message rate the same plateau is reached in seconds.
Run at the soak's per-connection rate, this control shows how much of the soak's
growth, and for how long, is libzmq's own.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from .report import OUT_DIR, rss_mb, write_json

OUT = OUT_DIR / "zmq_memory.json"
SAMPLE_S = 5.0


async def measure(connections: int, rate: float, duration_s: float, *, seed: int = 0,
                  sample_s: float = SAMPLE_S) -> dict[str, Any]:
    """Echo small messages over ``connections`` DEALERs for ``duration_s``; RSS every
    ``sample_s`` seconds."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for _ in range(connections):
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{port}")
        dealers.append(d)
    sent = 0

    async def serve() -> None:
        while True:
            frames = await router.recv_multipart()
            await router.send_multipart(frames)

    async def device(d: zmq.asyncio.Socket, rnd: random.Random) -> None:
        nonlocal sent
        while True:
            await d.send(b"x" * rnd.randint(20, 300))
            await d.recv()
            sent += 1
            await asyncio.sleep(rnd.expovariate(rate))

    tasks = [asyncio.create_task(serve())]
    tasks += [asyncio.create_task(device(d, random.Random(seed * 100_003 + i)))
              for i, d in enumerate(dealers)]
    series: list[list[float]] = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < duration_s:
            await asyncio.sleep(sample_s)
            series.append([round(time.monotonic() - t0, 1), round(rss_mb(), 1)])
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in [router, *dealers]:
            s.close(linger=0)
        ctx.term()
    elapsed = time.monotonic() - t0
    end = series[-1][1] if series else 0.0
    # when RSS came within 1 MiB of where it ended
    flat_from = next((t for t, mb in series if end - mb <= 1.0), None)
    return {"kind": "zmq_memory", "connections": connections, "rate_per_connection": rate,
            "duration_s": duration_s, "messages_per_connection_per_s": sent / elapsed
            / max(1, connections), "zmq": zmq.zmq_version(), "pyzmq": zmq.__version__,
            "series_mb": series, "first_mb": series[0][1] if series else 0.0,
            "end_mb": end, "flat_from_s": flat_from}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xcosd.bench.zmq_memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--rate", type=float, default=2.5,
                    help="messages per second per connection, on average")
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args(argv)
    rep = asyncio.run(measure(args.connections, args.rate, args.duration))
    print(f"bare pyzmq {rep['pyzmq']} (libzmq {rep['zmq']}): {args.connections} connections, "
          f"{rep['messages_per_connection_per_s']:.2f} messages/s each")
    print("RSS MiB every 5 s: " + ", ".join(f"{mb:g}" for _, mb in rep["series_mb"]))
    print(f"RSS {rep['first_mb']:g} -> {rep['end_mb']:g} MiB; within 1 MiB of the end "
          f"from {rep['flat_from_s']} s")
    write_json(args.json, rep)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
