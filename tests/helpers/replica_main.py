"""A replica process serving the test pair's target behind a broker, for tests that
kill one with SIGKILL: ``python -m tests.helpers.replica_main BACK_ENDPOINT``
(from the repository root). It leaves as a killed process does, with no goodbye."""

from __future__ import annotations

import asyncio
import sys

import xcosd

from ..session_pairs import pair


async def main(back: str) -> None:
    target, _ = pair()
    async with xcosd.CloudNode(target=target, bind=back, transport="replica", max_batch=64,
                               max_sessions=8192, silence_timeout_s=30.0,
                               transport_options={"goodbye": False}):
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
