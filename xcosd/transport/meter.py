"""Byte metering: what crossed the wire, per direction and per message type.

The numbers the project reports about "bytes on the link" come from here, so a
meter counts what the transport really writes: every frame of the message
(header included) plus the transport's own framing (the TCP count and length
prefixes, the ZeroMQ ZMTP frame headers, CURVE's per-frame box). ``up`` is edge →
cloud, ``down`` is cloud → edge, whichever side holds the meter. A message's type
is its header's ``"t"`` key.

Transport-level keep-alives (ZeroMQ heartbeats, TCP ACKs) belong to no message and
are not counted.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..wire.frames import Buffer, message_bytes, message_type

Direction = Literal["up", "down"]


@dataclass
class Tally:
    """Counts for one (direction, message type)."""

    messages: int = 0
    frames: int = 0
    #: bytes of the frames themselves (header frame + buffers)
    payload: int = 0
    #: payload plus the transport's framing: what went on the wire
    wire: int = 0

    def add(self, other: Tally) -> None:
        self.messages += other.messages
        self.frames += other.frames
        self.payload += other.payload
        self.wire += other.wire

    def minus(self, other: Tally) -> Tally:
        return Tally(self.messages - other.messages, self.frames - other.frames,
                     self.payload - other.payload, self.wire - other.wire)


@dataclass
class Meter:
    """Counters by direction and message type; cheap to update, safe to snapshot."""

    up: dict[str, Tally] = field(default_factory=dict)
    down: dict[str, Tally] = field(default_factory=dict)

    def record(self, direction: Direction, frames: Sequence[Buffer], overhead: int,
               mtype: str | None = None) -> None:
        """Count one message; ``overhead`` is the transport's framing bytes. (Every
        message passes here, so nothing is built that the counts do not need.)"""
        payload = message_bytes(frames)
        t = mtype if mtype is not None else message_type(frames)
        side = self.up if direction == "up" else self.down
        tally = side.get(t)
        if tally is None:
            tally = side[t] = Tally()
        tally.messages += 1
        tally.frames += len(frames)
        tally.payload += payload
        tally.wire += payload + overhead

    def total(self, direction: Direction) -> Tally:
        out = Tally()
        for t in (self.up if direction == "up" else self.down).values():
            out.add(t)
        return out

    @property
    def up_bytes(self) -> int:
        """Wire bytes edge → cloud."""
        return self.total("up").wire

    @property
    def down_bytes(self) -> int:
        """Wire bytes cloud → edge."""
        return self.total("down").wire

    @property
    def up_messages(self) -> int:
        return self.total("up").messages

    @property
    def down_messages(self) -> int:
        return self.total("down").messages

    def snapshot(self) -> Meter:
        """An independent copy (subtract two snapshots for the cost of a span)."""
        return copy.deepcopy(self)

    def __sub__(self, other: Meter) -> Meter:
        out = Meter()
        for name in ("up", "down"):
            mine, theirs = getattr(self, name), getattr(other, name)
            getattr(out, name).update(
                {t: v.minus(theirs.get(t, Tally())) for t, v in mine.items()})
        return out

    def merge(self, other: Meter) -> None:
        """Add ``other``'s counts into this meter (e.g. per-peer into a total)."""
        for name in ("up", "down"):
            mine = getattr(self, name)
            for t, v in getattr(other, name).items():
                mine.setdefault(t, Tally()).add(v)

    def reset(self) -> None:
        self.up.clear()
        self.down.clear()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"up": {type: tally}, "down": {...}, "total": {"up": .., "down": ..}}``."""
        return {
            "up": {t: asdict(v) for t, v in sorted(self.up.items())},
            "down": {t: asdict(v) for t, v in sorted(self.down.items())},
            "total": {"up": asdict(self.total("up")), "down": asdict(self.total("down"))},
        }

