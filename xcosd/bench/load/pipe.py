"""The framing between ``xcosd bench load`` and its device processes, defined once
for both ends: the parent talks through asyncio streams (:func:`send`,
:func:`recv`), the device process through its blocking stdin / stdout
(:func:`write`, :func:`read`).

A frame is one pickled object after its length as 8 bytes big-endian. Pickle,
because both ends are this package run by the same interpreter (the parent starts
the child with :data:`sys.executable`) and the records are plain Python objects;
the pipe is private to the two processes, so nothing from outside is unpickled.

The conversation, in order:

* parent -> device: ``(config dict, cloud endpoint, device ids)``;
* device -> parent: ``("ready", n)`` once its edges are connected;
* parent -> device: ``("go", go_time, end_time_or_None)`` (monotonic clock);
* device -> parent: ``("done", records)``, or ``("failed", message)`` at any point.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import IO, Any

#: the length prefix of every frame
HEADER = struct.Struct(">Q")


def frame(obj: Any) -> bytes:
    """``obj`` as one frame: length prefix, then the pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _payload_size(head: bytes) -> int:
    size: int = HEADER.unpack(head)[0]
    return size


def write(stream: IO[bytes], obj: Any) -> None:
    """Write one frame to a blocking stream and flush it (the other side waits)."""
    stream.write(frame(obj))
    stream.flush()


def read(stream: IO[bytes]) -> Any:
    """Read one frame from a blocking stream; :class:`EOFError` if it closed."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        raise EOFError("the other side closed the pipe")
    size = _payload_size(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe mid-frame")
    return pickle.loads(data)


async def send(writer: asyncio.StreamWriter, obj: Any) -> None:
    """Write one frame to an asyncio stream and wait until it is handed on."""
    writer.write(frame(obj))
    await writer.drain()


async def recv(reader: asyncio.StreamReader) -> Any:
    """Read one frame from an asyncio stream; :class:`asyncio.IncompleteReadError`
    if it closed."""
    head = await reader.readexactly(HEADER.size)
    return pickle.loads(await reader.readexactly(_payload_size(head)))


__all__ = ["HEADER", "frame", "read", "recv", "send", "write"]
