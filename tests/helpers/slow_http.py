"""A slow HTTP client, for the tests of the servers' head deadline."""

from __future__ import annotations

import asyncio
import contextlib


async def trickle_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       request_line: bytes) -> None:
    """Send ``request_line``, then a header line every 20 ms, until the server closes:
    each line well inside a read deadline, the head never finished. The deadline is
    for the whole head, so a server drops this client all the same."""
    writer.write(request_line)
    with contextlib.suppress(ConnectionError):
        while not reader.at_eof():
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
