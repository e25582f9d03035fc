"""The frame codec: headers + raw buffers, limits checked before decoding, typed
errors on malformed input, and the TCP stream framing cut at every byte."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xcosd.errors import ProtocolError
from xcosd.wire.frames import (
    Limits,
    StreamDecoder,
    decode_message,
    encode_message,
    encode_stream,
    message_bytes,
    message_type,
    stream_overhead,
)

headers = st.dictionaries(st.text(max_size=8), st.one_of(
    st.integers(-2**63, 2**64 - 1), st.text(max_size=20), st.binary(max_size=20),
    st.booleans(), st.none(), st.lists(st.integers(0, 9), max_size=5)), max_size=6)
buffers = st.lists(st.binary(max_size=300), max_size=5)


@settings(max_examples=200, deadline=None)
@given(header=headers, bufs=buffers)
def test_round_trip(header: dict, bufs: list[bytes]) -> None:
    frames = encode_message(header, bufs)
    h, b = decode_message(frames)
    assert h == header and [bytes(x) for x in b] == bufs


def test_arrays_go_out_as_raw_bytes_without_copy() -> None:
    a = np.arange(1000, dtype=np.float32)
    frames = encode_message({"t": "x", "n": 1000}, [a, a[::2]])
    assert isinstance(frames[1], memoryview) and np.shares_memory(np.asarray(frames[1]), a)
    assert bytes(frames[1]) == a.tobytes() and bytes(frames[2]) == a[::2].tobytes()
    assert len(frames[0]) < 20  # the array is not in the header
    assert message_bytes(frames) == len(frames[0]) + 4000 + 2000
    assert message_type(frames) == "x"


def test_limits_are_checked_before_decoding() -> None:
    lim = Limits(max_bytes=100, max_frames=3, max_header_bytes=10)
    garbage = b"\xc1" * 11  # not msgpack, but too long first: too_large wins
    for frames, code in (
        ([], "bad_frame"),
        ([b"\x80"] * 4, "too_large"),
        ([garbage], "too_large"),
        ([b"\x80", b"x" * 100], "too_large"),
        ([b"\xc1"], "bad_frame"),  # reserved msgpack byte
        ([b"\x93\x01\x02\x03"], "bad_frame"),  # an array, not a map
        ([b"\x81\x01\x02"], "bad_frame"),  # int key
        ([msgpack.packb({"a": 1}) + b"\x00"], "bad_frame"),  # trailing bytes
        ([msgpack.packb(msgpack.ExtType(5, b"x"))], "bad_frame"),
        ([b"\x82\xa1t"], "bad_frame"),  # truncated
    ):
        with pytest.raises(ProtocolError) as e:
            decode_message(frames, limits=lim)
        assert e.value.code == code, frames
    with pytest.raises(ProtocolError) as e:
        decode_message([b"\x80", b"x" * 50], max_bytes=10)
    assert e.value.code == "too_large"
    with pytest.raises(ProtocolError):
        decode_message(b"\x80")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        decode_message(["\x80"])  # type: ignore[list-item]


def test_deep_nesting_is_a_typed_error() -> None:
    deep = b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0"
    with pytest.raises(ProtocolError) as e:
        decode_message([deep])
    assert e.value.code == "bad_frame"


@settings(max_examples=300, deadline=None)
@given(junk=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_bytes_never_escape_as_other_errors(junk: list[bytes]) -> None:
    try:
        h, _ = decode_message(junk)
        assert isinstance(h, dict)
    except ProtocolError as e:
        assert e.code in {"bad_frame", "too_large"}


# ---------------------------------------------------------------- stream framing


@settings(max_examples=100, deadline=None)
@given(msgs=st.lists(st.tuples(headers, buffers), min_size=1, max_size=4),
       cut=st.integers(1, 17))
def test_stream_cut_anywhere(msgs: list[tuple[dict, list[bytes]]], cut: int) -> None:
    wire = b"".join(bytes(c) for h, b in msgs for c in encode_stream(encode_message(h, b)))
    d = StreamDecoder()
    out = []
    for i in range(0, len(wire), cut):
        out += d.feed(wire[i:i + cut])
    assert [decode_message(m) for m in out] == [(h, b) for h, b in msgs]
    assert d.pending == 0
    assert len(wire) == sum(message_bytes(encode_message(h, b)) + stream_overhead(len(b) + 1)
                            for h, b in msgs)


def test_stream_refuses_oversized_prefixes_before_the_body() -> None:
    lim = Limits(max_bytes=1000, max_frames=4, max_header_bytes=100)
    with pytest.raises(ProtocolError) as e:
        StreamDecoder(lim).feed(struct.pack(">I", 5))
    assert e.value.code == "too_large"
    with pytest.raises(ProtocolError) as e:  # header length alone
        StreamDecoder(lim).feed(struct.pack(">II", 2, 101))
    assert e.value.code == "too_large"
    with pytest.raises(ProtocolError) as e:  # a 4 GB buffer announced, never sent
        StreamDecoder(lim).feed(struct.pack(">II", 2, 1) + b"\x80" + struct.pack(">I", 2**32 - 1))
    assert e.value.code == "too_large"
    with pytest.raises(ProtocolError) as e:
        StreamDecoder(lim).feed(struct.pack(">I", 0))
    assert e.value.code == "bad_frame"


def test_message_type_is_read_in_place_for_every_message() -> None:
    """Metering reads ``"t"`` at its fixed offset, never decoding the header: it
    agrees with the decoded header for every message type, and a header that does
    not put ``"t"`` first meters as ``"?"`` (it is still decoded and checked on
    receipt)."""
    from xcosd.protocol import MESSAGE_TYPES, pack
    from xcosd.protocol.messages import Close, Ping
    from xcosd.wire.frames import decode_header

    for msg in (Ping(1), Close(3, 4)):
        frames = pack(msg)
        assert message_type(frames) == decode_header(frames[0])["t"] == msg.TYPE
    assert all(len(t) < 32 for t in MESSAGE_TYPES)  # every type fits a fixstr
    assert message_type([msgpack.packb({"x": 1, "t": "ping"})]) == "?"
    assert message_type([b"\x81\xa1t\xa4pi"]) == "?"  # truncated
    assert message_type([b""]) == "?" and message_type([]) == "?"


def test_stream_decoder_accounts_for_a_partial_message_and_compacts() -> None:
    """``pending`` counts every message byte not yet part of a complete message (its
    finished frames and the bytes after them), and the decoder keeps no consumed
    bytes, so
    a long-lived TCP connection's buffer stays bounded by one message."""
    frames = encode_message({"t": "x"}, [b"a" * 100, b"b" * 50])
    wire = b"".join(bytes(c) for c in encode_stream(frames))
    d = StreamDecoder()
    cut = len(wire) - 20  # inside the last frame: two frames done, one partial
    assert d.feed(wire[:cut]) == []
    assert d.pending == cut - stream_overhead(3)  # message bytes; its prefixes are read
    assert d.feed(wire[cut:]) == [[bytes(f) for f in frames]]
    assert d.pending == 0
    for _ in range(200):
        assert len(d.feed(wire + wire)) == 2
    assert len(d._buf) == 0  # consumed bytes were dropped, not kept


def test_limits_must_be_positive() -> None:
    for field in ("max_bytes", "max_frames", "max_header_bytes"):
        with pytest.raises(ValueError):
            Limits(**{field: 0})
        assert getattr(Limits(**{field: 1}), field) == 1
