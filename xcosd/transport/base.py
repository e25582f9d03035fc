"""The async interface every transport implements.

A transport moves *messages*, each a list of frames (``bytes``-like): the first
frame is the msgpack header, the rest are raw binary buffers (see
``xcosd.codecs.frames``). ZeroMQ carries them as multipart messages, TCP as
length-prefixed frames, the in-memory pair as Python objects. The cloud side is a
:class:`Listener` that talks to many peers, each named by an opaque ``peer`` id;
the edge side is a :class:`Connection` to one cloud.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

Frames = Sequence[bytes | bytearray | memoryview]


class Connection(ABC):
    """Edge side: one connection to one cloud."""

    @abstractmethod
    async def send(self, frames: Frames) -> None: ...

    @abstractmethod
    async def recv(self) -> list[bytes]: ...

    @abstractmethod
    async def close(self) -> None: ...


class Listener(ABC):
    """Cloud side: one bound endpoint, many peers."""

    #: the bound endpoint, with the real port when bound to port 0
    endpoint: str

    @abstractmethod
    async def send(self, peer: bytes, frames: Frames) -> None: ...

    @abstractmethod
    async def recv(self) -> tuple[bytes, list[bytes]]: ...

    @abstractmethod
    async def close(self) -> None: ...
