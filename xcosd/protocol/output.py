"""What every protocol state machine returns from ``receive``.

All three machines (:class:`~xcosd.protocol.edge.EdgeHandshake`,
:class:`~xcosd.protocol.edge.EdgeSession`,
:class:`~xcosd.protocol.cloud.CloudConnection`) take one decoded message and answer
with an :class:`Output`: the messages to send back, in order, and the events the
node must act on (compute to run, tokens to hand out, counters to bump). One shape
means one driving loop, in the nodes and in the in-process pump alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .messages import Message

E = TypeVar("E")


@dataclass
class Output(Generic[E]):
    """Messages to send and events for the node, from one state-machine step."""

    send: list[Message] = field(default_factory=list)
    events: list[E] = field(default_factory=list)

    def extend(self, other: Output[E]) -> None:
        self.send.extend(other.send)
        self.events.extend(other.events)
