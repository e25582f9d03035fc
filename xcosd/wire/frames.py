"""The frame codec: one message = a msgpack header frame + raw binary buffer frames.

Why this shape: probability vectors and id arrays are large and already binary, so
they travel as their own frames (zero-copy from a numpy array into ZeroMQ, one
``writelines`` on TCP); only the small header goes through msgpack, so an array
never crosses element by element. The header is a msgpack *map* with string keys;
its ``"t"`` key names the message type (metering counts bytes per type).

Everything that arrives from a peer is hostile until checked, so
:func:`decode_message` enforces the :class:`Limits` *before* decoding anything
(frame count, total bytes, header bytes) and raises :class:`ProtocolError` with a
stable code: ``too_large`` for a limit, ``bad_frame`` for malformed input.

For byte streams (raw TCP) the same message is cut into a frame count and
length-prefixed frames, all 4-byte big-endian unsigned::

    u32 n_frames | u32 len_0 | frame_0 | u32 len_1 | frame_1 | ...

:class:`StreamDecoder` is the sans-I/O parser for that stream; it refuses an
oversized count or length as soon as the prefix is read, before the body.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ..errors import ProtocolError

Buffer = bytes | bytearray | memoryview
FrameList = list[bytes | memoryview]

_U32 = struct.Struct(">I")
#: bytes the TCP stream adds to a message: the count, then one length per frame
STREAM_COUNT_BYTES = 4
STREAM_LENGTH_BYTES = 4


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts from one message before decoding it.

    The defaults fit a full float32 vector over a 256k vocabulary many times over
    while keeping a hostile peer from making the process allocate without bound.
    """

    #: total bytes of all frames of one message (header included)
    max_bytes: int = 16 * 1024 * 1024
    #: frames per message (header included)
    max_frames: int = 64
    #: bytes of the msgpack header frame
    max_header_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_frames < 1 or self.max_header_bytes < 1:
            raise ValueError(f"limits must be positive: {self}")


DEFAULT_LIMITS = Limits()


def _as_frame(buf: Buffer | np.ndarray) -> bytes | memoryview:
    """A frame for ``buf`` without copying when it is already contiguous."""
    if isinstance(buf, np.ndarray):
        arr = np.ascontiguousarray(buf).reshape(-1)  # a view when already contiguous
        return arr.data.cast("B")
    if isinstance(buf, bytes):
        return buf
    if isinstance(buf, bytearray):
        return bytes(buf)
    if isinstance(buf, memoryview):
        return buf if buf.contiguous and buf.format == "B" and buf.ndim == 1 else buf.cast("B")
    raise TypeError(f"a buffer must be bytes, memoryview or ndarray, not {type(buf).__name__}")


def encode_message(header: dict[str, Any],
                   buffers: Sequence[Buffer | np.ndarray] = ()) -> FrameList:
    """The frames of one message: the msgpack ``header``, then each buffer as is.

    numpy arrays go out as a byte view of their memory (no copy when contiguous);
    the receiver needs the dtype and length from the header, which the protocol
    puts there.
    """
    if not isinstance(header, dict):
        raise TypeError(f"a header must be a dict, not {type(header).__name__}")
    head = msgpack.packb(header, use_bin_type=True)
    return [head, *(_as_frame(b) for b in buffers)]


def frame_len(frame: Buffer) -> int:
    """Bytes in one frame (``len`` of a memoryview counts items, not bytes)."""
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def message_bytes(frames: Iterable[Buffer]) -> int:
    """Total bytes of a message's frames (what limits and meters count)."""
    n = 0
    for f in frames:  # a plain loop: this runs for every message, several times
        n += f.nbytes if type(f) is memoryview else len(f)
    return n


def check_limits(frames: Sequence[Buffer], limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ``too_large`` / ``bad_frame`` before anything is decoded."""
    n = len(frames)
    if n == 0:
        raise ProtocolError("empty message: no header frame", code="bad_frame")
    if n > limits.max_frames:
        raise ProtocolError(f"{n} frames exceed the limit of {limits.max_frames}",
                            code="too_large")
    head = frame_len(frames[0])
    if head > limits.max_header_bytes:
        raise ProtocolError(f"header of {head} bytes exceeds the limit of "
                            f"{limits.max_header_bytes}", code="too_large")
    total = message_bytes(frames)
    if total > limits.max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of "
                            f"{limits.max_bytes}", code="too_large")


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header",
                        code="bad_frame")


def decode_header(frame: Buffer, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The header map of a header frame; ``bad_frame`` unless it is exactly one
    msgpack map with string keys."""
    n = frame_len(frame)
    if n > limits.max_header_bytes:
        raise ProtocolError(f"header of {n} bytes exceeds the limit of "
                            f"{limits.max_header_bytes}", code="too_large")
    try:
        header = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, ext_hook=_no_ext, timestamp=0,
            max_str_len=n, max_bin_len=n,
            max_array_len=n, max_map_len=n, max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}",
                            code="bad_frame") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}",
                            code="bad_frame")
    return header


def decode_message(frames: Sequence[Buffer], *, max_bytes: int | None = None,
                   limits: Limits = DEFAULT_LIMITS) -> tuple[dict[str, Any], list[Buffer]]:
    """``(header, buffers)`` of one received message.

    ``max_bytes`` overrides ``limits.max_bytes``. The limits are checked first, on
    lengths only; buffers come back as the received frames (no copy).
    """
    if max_bytes is not None:
        limits = Limits(max_bytes, limits.max_frames, limits.max_header_bytes)
    if type(frames) is not list and (not isinstance(frames, Sequence) or isinstance(
            frames, (bytes, bytearray, memoryview))):
        raise ProtocolError("a message must be a list of frames", code="bad_frame")
    for f in frames:
        if type(f) is not bytes and not isinstance(f, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"a frame must be bytes, not {type(f).__name__}",
                                code="bad_frame")
    check_limits(frames, limits)
    return decode_header(frames[0], limits), frames[1:] if type(frames) is list \
        else list(frames[1:])


def message_type(frames: Sequence[Buffer]) -> str:
    """The header's ``"t"``, read in place (for metering every message without
    decoding its header a second time).

    :func:`encode_message` writes ``"t"`` as the header's first key, so it sits at a
    fixed offset: the map marker, ``a1 74`` (the key), then a short string. Anything
    else (a foreign or malformed header) meters as ``"?"``; the receive path decodes
    and checks it fully anyway.
    """
    if not frames:
        return "?"
    head = frames[0]
    head = head[:48] if type(head) is bytes else bytes(memoryview(head).cast("B")[:48])
    if len(head) < 4:
        return "?"
    marker = head[0]
    i = 1 if 0x80 <= marker <= 0x8F else 3 if marker == 0xDE else 5 if marker == 0xDF else 0
    if not i or bytes(head[i : i + 2]) != b"\xa1t":
        return "?"
    tag = head[i + 2]
    if not 0xA0 <= tag <= 0xBF:
        return "?"
    n = tag & 0x1F
    raw = head[i + 3 : i + 3 + n]
    if len(raw) != n:
        return "?"
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return "?"


# ---------------------------------------------------------------- byte streams


def stream_overhead(n_frames: int) -> int:
    """Bytes the stream framing adds to a message of ``n_frames`` frames."""
    return STREAM_COUNT_BYTES + STREAM_LENGTH_BYTES * n_frames


def encode_stream(frames: Sequence[Buffer]) -> list[Buffer]:
    """The chunks to write for one message on a byte stream (for ``writelines``)."""
    out: list[Buffer] = [_U32.pack(len(frames))]
    for f in frames:
        out.append(_U32.pack(frame_len(f)))
        out.append(f)
    return out


class StreamDecoder:
    """Sans-I/O parser that cuts a byte stream back into messages.

    ``feed(data)`` returns the messages completed so far. A frame count over
    ``max_frames``, a header length over ``max_header_bytes`` or a running total
    over ``max_bytes`` raises ``too_large`` as soon as its prefix is read, so a
    hostile length never makes the receiver buffer the body. Messages completed
    before the error in the same data are still returned, and the error is held
    back until the next ``feed`` or :meth:`check`: a valid message is not lost
    because a bad one arrived in the same read. After an error the stream is out
    of sync and must be closed.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._buf = bytearray()
        self._pos = 0
        self._count: int | None = None  # frames of the message being read
        self._need: int | None = None  # length of the frame being read
        self._frames: list[bytes] = []
        self._total = 0
        self._error: ProtocolError | None = None

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a complete message."""
        return len(self._buf) - self._pos + self._total

    def check(self) -> None:
        """Raise the framing error held back behind messages already returned."""
        if self._error is not None:
            raise self._error

    def feed(self, data: Buffer) -> list[list[bytes]]:
        self.check()
        self._buf += data
        out: list[list[bytes]] = []
        try:
            self._parse(out)
        except ProtocolError as e:
            self._error = e
            if not out:
                raise
            return out
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        return out

    def _parse(self, out: list[list[bytes]]) -> None:
        lim = self.limits
        while True:
            avail = len(self._buf) - self._pos
            if self._count is None:
                if avail < 4:
                    return
                (count,) = _U32.unpack_from(self._buf, self._pos)
                self._pos += 4
                if count == 0:
                    raise ProtocolError("message with no frames", code="bad_frame")
                if count > lim.max_frames:
                    raise ProtocolError(f"{count} frames exceed the limit of "
                                        f"{lim.max_frames}", code="too_large")
                self._count, self._frames, self._total = count, [], 0
                continue
            if self._need is None:
                if avail < 4:
                    return
                (need,) = _U32.unpack_from(self._buf, self._pos)
                self._pos += 4
                if not self._frames and need > lim.max_header_bytes:
                    raise ProtocolError(f"header of {need} bytes exceeds the limit of "
                                        f"{lim.max_header_bytes}", code="too_large")
                if self._total + need > lim.max_bytes:
                    raise ProtocolError(f"message of at least {self._total + need} bytes "
                                        f"exceeds the limit of {lim.max_bytes}",
                                        code="too_large")
                self._need = need
                continue
            if avail < self._need:
                return
            end = self._pos + self._need
            self._frames.append(bytes(self._buf[self._pos:end]))
            self._total += self._need
            self._pos, self._need = end, None
            if len(self._frames) == self._count:
                out.append(self._frames)
                self._count, self._frames, self._total = None, [], 0
