"""A hostile HTTP client in a process of its own: ``python -m tests.helpers.stall_heads
PORT N SOURCE`` opens N connections to 127.0.0.1:PORT from the address SOURCE, sends
each the first line of a request head and nothing more, prints ``stalled N`` once
every connection is open (those the server refused included) and holds them all
until its stdin closes."""

from __future__ import annotations

import asyncio
import sys

HEAD_START = b"POST /v1/completions HTTP/1.1\r\n"


async def main(port: int, n: int, source: str) -> None:
    held: list[asyncio.StreamWriter] = []
    sem = asyncio.Semaphore(200)  # connects in flight: within the listen backlog

    async def one() -> None:
        async with sem:
            _, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        w.write(HEAD_START)
        held.append(w)

    await asyncio.gather(*[one() for _ in range(n)])
    print("stalled", len(held), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    for w in held:
        w.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
