"""A device that speaks the protocol by hand over a real connection, so a test can
send exactly the messages it wants (and misbehave) where an EdgeNode would not."""

from __future__ import annotations

import asyncio
from typing import Any

from xcosd.protocol import EdgeHandshake, Message, pack, unpack
from xcosd.transport.base import Connection
from xcosd.vocab import VocabMap

from .waits import HANG_S


async def handshake(conn: Connection, draft: Any) -> VocabMap:
    """Greet the cloud, fetch its vocabulary, upload the V_C map; return the map."""
    hs = EdgeHandshake(lambda tv: VocabMap(draft.vocab, tv))
    pending: list[Message] = [hs.hello()]
    while not hs.ready:
        for m in pending:
            await conn.send(pack(m))
        pending = hs.receive(unpack(await asyncio.wait_for(conn.recv(), HANG_S))).send
    assert hs.vmap is not None
    return hs.vmap


async def reply(conn: Connection) -> Message:
    """The cloud's next message (a hang bound, not a timing assumption)."""
    return unpack(await asyncio.wait_for(conn.recv(), HANG_S))
