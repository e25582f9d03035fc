"""The wire layer: how one protocol message becomes frames and bytes.

A message is a msgpack header frame plus raw binary buffer frames
(:mod:`.frames`); a byte stream carries it as a frame count and length-prefixed
frames. Every receiver checks :class:`Limits` before decoding anything. This
layer knows nothing of message types beyond the header's ``"t"`` key: the
protocol above it defines the messages, the transports below move the frames.
"""

from __future__ import annotations

from .frames import (
    DEFAULT_LIMITS,
    STREAM_COUNT_BYTES,
    STREAM_LENGTH_BYTES,
    Buffer,
    FrameList,
    Limits,
    StreamDecoder,
    check_limits,
    decode_header,
    decode_message,
    encode_message,
    encode_stream,
    frame_len,
    message_bytes,
    message_type,
    stream_overhead,
)

__all__ = [
    "DEFAULT_LIMITS", "STREAM_COUNT_BYTES", "STREAM_LENGTH_BYTES", "Buffer", "FrameList",
    "Limits", "StreamDecoder", "check_limits", "decode_header", "decode_message",
    "encode_message", "encode_stream", "frame_len", "message_bytes", "message_type",
    "stream_overhead",
]
