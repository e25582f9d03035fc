"""The xcosd session protocol: messages and the two sans-I/O state machines.

``messages`` defines every message and its wire form (msgpack header + raw
buffers); ``cloud`` and ``edge`` are the state machines, fed decoded messages and
answering with messages to send and events; ``errors`` maps wire error codes to
the :mod:`xcosd.errors` family. ``docs/PROTOCOL.md`` has the tables.
"""

from __future__ import annotations

from typing import Any

from ..wire.frames import Limits, decode_message, encode_message
from .cloud import (
    CloudConfig,
    CloudConnection,
    CloudSession,
    Output,
    Rejected,
    RenderNeeded,
    RoundOutcome,
    RoundVerified,
    ScoreNeeded,
    SessionClosed,
    SessionOpened,
)
from .edge import (
    DraftNeeded,
    EdgeHandshake,
    EdgeOutput,
    EdgeSession,
    Finished,
    HandshakeDone,
    Retry,
    RoundSettled,
    SessionReady,
    TokensEmitted,
)
from .errors import CODES, ErrorCode, error_code, exception_for
from .messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Close,
    DraftMsg,
    Error,
    Hello,
    Message,
    Open,
    Opened,
    Ping,
    Pong,
    Render,
    Rendered,
    ReplyMsg,
    RequestMsg,
    ServerLimits,
    VerdictMsg,
    VocabMapAccepted,
    VocabMapUpload,
    VocabRequest,
    VocabTable,
    Welcome,
    from_wire,
)
from .session_settings import SessionSettings


def pack(msg: Message) -> list[Any]:
    """The frames of ``msg`` (msgpack header, then its raw buffers)."""
    header, buffers = msg.to_wire()
    return encode_message(header, buffers)


def unpack(frames: Any, limits: Limits | None = None) -> Message:
    """The message ``frames`` carry: size limits first, then msgpack, then every field.

    Raises :class:`~xcosd.errors.ProtocolError` with a typed code on any defect.
    """
    header, buffers = (decode_message(frames) if limits is None
                       else decode_message(frames, limits=limits))
    return from_wire(header, [bytes(b) for b in buffers])


__all__ = [
    "CODES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "Close",
    "CloudConfig",
    "CloudConnection",
    "CloudSession",
    "DraftMsg",
    "DraftNeeded",
    "EdgeHandshake",
    "EdgeOutput",
    "EdgeSession",
    "Error",
    "ErrorCode",
    "Finished",
    "HandshakeDone",
    "Hello",
    "Message",
    "Open",
    "Opened",
    "Output",
    "Ping",
    "Pong",
    "Rejected",
    "Render",
    "RenderNeeded",
    "Rendered",
    "ReplyMsg",
    "RequestMsg",
    "Retry",
    "RoundOutcome",
    "RoundSettled",
    "RoundVerified",
    "ScoreNeeded",
    "ServerLimits",
    "SessionClosed",
    "SessionOpened",
    "SessionReady",
    "SessionSettings",
    "TokensEmitted",
    "VerdictMsg",
    "VocabMapAccepted",
    "VocabMapUpload",
    "VocabRequest",
    "VocabTable",
    "Welcome",
    "error_code",
    "exception_for",
    "from_wire",
    "pack",
    "unpack",
]
