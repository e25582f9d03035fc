"""Every size limit of the project at its boundary: a message exactly at a limit is
accepted, one unit past it is refused with its typed code.

A limit checked with ``>=`` instead of ``>`` refuses legal input, and a limit
checked on the wrong quantity (each frame instead of the message's running total)
lets a hostile peer make the receiver buffer far more than the limit; neither
shows up unless a test sits exactly on the boundary. Layers, bottom up: the frame
codec (``check_limits``/``decode_message`` and the TCP ``StreamDecoder``), the
transports on real loopback sockets, the message fields, the vocabulary transfer,
the cloud state machine (``ServerLimits``, method options) and the nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
import zstandard
from zmq.utils.monitor import parse_monitor_message

import xcosd
from xcosd.errors import ProtocolError
from xcosd.methods.base import CandidatesReply, Draft
from xcosd.nodes.pump import Pump
from xcosd.protocol import (
    MESSAGE_TYPES,
    Close,
    DraftMsg,
    Error,
    Hello,
    Open,
    Ping,
    Pong,
    ReplyMsg,
    RequestMsg,
    VerdictMsg,
    VocabMapAccepted,
    VocabMapUpload,
    pack,
    unpack,
)
from xcosd.protocol.cloud import MAX_MAPS_PER_PEER, CloudConfig, CloudConnection
from xcosd.protocol.messages import (
    MAX_BUFFERS,
    MAX_CANDIDATE_ROUNDS,
    MAX_CANDIDATES,
    MAX_DRAFT,
    MAX_HEADER_BYTES,
    MAX_IDS,
    MAX_MESSAGE,
    MAX_NAME,
    MAX_OPTIONS,
    MAX_RESUME,
    MAX_STOP,
    MAX_TEXT,
    bytes_to_ids,
    from_wire,
    ids_to_bytes,
    session_of,
)
from xcosd.protocol.vocab_transfer import (
    MAX_TABLE_BYTES,
    map_fingerprint,
    table_to_vocab,
    upload_for,
    vocab_to_table,
)
from xcosd.transport import connect, listen
from xcosd.vocab import Vocabulary
from xcosd.wire.frames import (
    DEFAULT_LIMITS,
    Limits,
    StreamDecoder,
    check_limits,
    decode_header,
    decode_message,
    encode_stream,
)

from .helpers.gated import GatedModel
from .helpers.raw import handshake, reply
from .helpers.waits import HANG_S, until
from .session_pairs import pair


def header_of(size: int, t: str = "x", **fields: Any) -> bytes:
    """A valid header (a msgpack map: ``t``, ``fields`` and a padding) of exactly
    ``size`` bytes."""
    for pad in range(max(0, size - 16), size + 1):
        h = msgpack.packb({"t": t, **fields, "p": b"\0" * pad}, use_bin_type=True)
        if len(h) == size:
            return h
    raise ValueError(f"no header of {size} bytes")


def refused(fn: Callable[[], object], code: str) -> None:
    with pytest.raises(ProtocolError) as e:
        fn()
    assert e.value.code == code, e.value


SMALL = Limits(max_bytes=1000, max_frames=5, max_header_bytes=100)


# ------------------------------------------------------------------ frame codec


@pytest.mark.parametrize("lim", [SMALL, DEFAULT_LIMITS], ids=["small", "default"])
def test_frame_limits_at_their_values(lim: Limits) -> None:
    h = header_of(16)
    # frames: exactly max_frames, header included
    ok = [h] + [b""] * (lim.max_frames - 1)
    check_limits(ok, lim)
    assert decode_message(ok, limits=lim)[0]["t"] == "x"
    refused(lambda: decode_message([*ok, b""], limits=lim), "too_large")
    # header bytes: exactly max_header_bytes
    big_head = header_of(lim.max_header_bytes)
    assert decode_message([big_head], limits=lim)[0]["t"] == "x"
    assert decode_header(big_head, lim)["t"] == "x"
    over = header_of(lim.max_header_bytes + 1)
    refused(lambda: decode_message([over], limits=lim), "too_large")
    refused(lambda: decode_header(over, lim), "too_large")
    # total bytes: exactly max_bytes over header and buffers
    body = bytes(lim.max_bytes - len(h))
    assert decode_message([h, body], limits=lim)[1][0] == body
    refused(lambda: decode_message([h, body + b"\0"], limits=lim), "too_large")
    # the per-call override is the same boundary
    assert decode_message([h, body], max_bytes=lim.max_bytes)[1][0] == body
    refused(lambda: decode_message([h, body + b"\0"], max_bytes=lim.max_bytes), "too_large")


# ------------------------------------------------------------------ TCP stream framing


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(bytes(c) for c in encode_stream(frames))


def _feed_until_refused(d: StreamDecoder, wire: bytes) -> int:
    """Feed ``wire`` one byte at a time; return how many bytes were fed when the
    decoder refused (the refusing byte included)."""
    for i in range(len(wire)):
        try:
            d.feed(wire[i:i + 1])
        except ProtocolError as e:
            assert e.code == "too_large", e
            return i + 1
    raise AssertionError("the decoder accepted the whole message")


@pytest.mark.parametrize("lim", [SMALL, DEFAULT_LIMITS], ids=["small", "default"])
def test_stream_limits_at_their_values(lim: Limits) -> None:
    h = header_of(16)
    # count: exactly max_frames decodes; one more is refused on the 4-byte count alone
    msg = [h] + [b"y"] * (lim.max_frames - 1)
    assert StreamDecoder(lim).feed(_wire(msg)) == [msg]
    refused(lambda: StreamDecoder(lim).feed(struct.pack(">I", lim.max_frames + 1)), "too_large")
    # header length: exactly max_header_bytes decodes; one more is refused on its prefix
    big_head = header_of(lim.max_header_bytes)
    assert StreamDecoder(lim).feed(_wire([big_head])) == [[big_head]]
    refused(lambda: StreamDecoder(lim).feed(struct.pack(">II", 1, lim.max_header_bytes + 1)),
            "too_large")
    # total: exactly max_bytes decodes; one more is refused on the last frame's prefix
    body = bytes(lim.max_bytes - len(h))
    assert StreamDecoder(lim).feed(_wire([h, body])) == [[h, body]]
    prefixes = struct.pack(">II", 2, len(h)) + h + struct.pack(">I", len(body) + 1)
    refused(lambda: StreamDecoder(lim).feed(prefixes), "too_large")


def test_stream_checks_the_running_total_at_the_prefix_that_crosses_it() -> None:
    """Each frame is under max_bytes; their sum is not. The decoder must refuse on
    the length prefix of the frame that takes the total past the limit, before any
    of that frame's body, not wait for a frame that is too large on its own."""
    lim = Limits(max_bytes=1000, max_frames=64, max_header_bytes=100)
    h = header_of(20)
    frames = [h] + [bytes(300)] * 63  # every frame fits; the message is 18,920 bytes
    wire = _wire(frames)
    d = StreamDecoder(lim)
    fed = _feed_until_refused(d, wire)
    # header 20 + 300 + 300 + 300 = 920 fit; the 4th buffer's length prefix crosses
    crossing = 4 + (4 + 20) + 3 * (4 + 300) + 4
    assert fed == crossing
    assert len(wire) > 18 * crossing  # far more was on offer than was ever read


def test_stream_refuses_the_total_one_past_the_limit_and_no_later() -> None:
    lim = Limits(max_bytes=1000, max_frames=8, max_header_bytes=100)
    h = header_of(40)
    split = [h, bytes(480), bytes(480)]  # exactly 1000 bytes over three frames
    assert StreamDecoder(lim).feed(_wire(split)) == [split]
    over = [h, bytes(480), bytes(481)]
    wire = _wire(over)
    fed = _feed_until_refused(StreamDecoder(lim), wire)
    assert fed == len(wire) - 481  # at the last prefix: its 481 bytes were never needed


def test_stream_running_total_restarts_with_each_message() -> None:
    lim = Limits(max_bytes=1000, max_frames=8, max_header_bytes=100)
    h = header_of(40)
    msg = [h, bytes(960)]  # exactly the limit, twice in a row in one read
    d = StreamDecoder(lim)
    assert d.feed(_wire(msg) + _wire(msg)) == [msg, msg]
    assert d.pending == 0


def test_stream_delivers_the_messages_before_a_refused_one() -> None:
    """A message exactly at the limit and, in the same read, the prefix of one past
    it: the first is delivered, then the error is raised (and stays raised)."""
    lim = Limits(max_bytes=1000, max_frames=8, max_header_bytes=100)
    h = header_of(40)
    exact = [h, bytes(960)]
    d = StreamDecoder(lim)
    assert d.feed(_wire(exact) + _wire([h, bytes(961)])[:-961]) == [exact]
    refused(d.check, "too_large")
    refused(lambda: d.feed(b""), "too_large")


def test_stream_header_limit_applies_to_the_header_only() -> None:
    lim = Limits(max_bytes=1000, max_frames=8, max_header_bytes=100)
    h = header_of(100)
    msg = [h, bytes(900)]  # a buffer nine times max_header_bytes is fine
    assert StreamDecoder(lim).feed(_wire(msg)) == [msg]


async def test_tcp_listener_limits_over_a_real_socket() -> None:
    lim = Limits(max_bytes=1000, max_frames=4, max_header_bytes=100)
    async with await listen("tcp://127.0.0.1:0", transport="tcp", limits=lim) as lst:
        host, port = lst.endpoint.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        h = header_of(40)
        exact = [h, bytes(480), bytes(480)]
        # the message at the limit, then one byte over, announced by the last prefix
        # and never sent: the first is delivered, then the peer is dropped
        writer.write(_wire(exact) + _wire([h, bytes(480), bytes(481)])[:-481])
        await writer.drain()
        peer, frames = await asyncio.wait_for(lst.recv(), HANG_S)
        assert frames == exact
        assert await asyncio.wait_for(lst.recv(), HANG_S) == (peer, None)
        assert await asyncio.wait_for(reader.read(), HANG_S) == b""  # closed by the listener
        writer.close()


async def test_tcp_connection_limits_over_a_real_socket() -> None:
    lim = Limits(max_bytes=1000, max_frames=4, max_header_bytes=100)
    h = header_of(40)
    exact, over = [h, bytes(960)], [h, bytes(961)]

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_wire(exact) + _wire(over)[:-961])
        await w.drain()
        await r.read()  # until the client hangs up
        w.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = await connect(f"tcp://127.0.0.1:{port}", transport="tcp", limits=lim)
    assert await asyncio.wait_for(c.recv(), HANG_S) == exact
    with pytest.raises(ProtocolError) as e:
        await asyncio.wait_for(c.recv(), HANG_S)
    assert e.value.code == "too_large"
    await c.close()
    server.close()
    await server.wait_closed()


async def test_zmq_maxmsgsize_is_max_bytes_per_frame() -> None:
    """ZeroMQ's MAXMSGSIZE is max_bytes, and libzmq applies it to each frame: a frame
    of exactly max_bytes passes, one byte more gets the sender disconnected before
    Python sees it. (A message's total is the node's check, see below.)"""
    lim = Limits(max_bytes=4096)
    async with await listen("tcp://127.0.0.1:0", transport="zmq", limits=lim) as lst:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.linger = 0
            sock.connect(lst.endpoint)
            await sock.send_multipart([header_of(4096)])
            _, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None and len(frames[0]) == 4096
            await sock.send_multipart([header_of(4097)])
            event = await asyncio.wait_for(mon.recv_multipart(), HANG_S)
            assert parse_monitor_message(event)["event"] == zmq.EVENT_DISCONNECTED
            # the socket reconnects; the next message arrives, the oversized one never did
            await sock.send_multipart([header_of(50, "after")])
            _, frames = await asyncio.wait_for(lst.recv(), HANG_S)
            assert frames is not None and decode_message(frames)[0]["t"] == "after"
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)
            ctx.term()


# ------------------------------------------------------------------ message fields


def test_id_buffers_at_their_caps() -> None:
    for cap in (1, 7, MAX_DRAFT):
        assert bytes_to_ids(bytes(4 * cap), "t", max_n=cap).shape == (cap,)
        refused(lambda cap=cap: bytes_to_ids(bytes(4 * (cap + 1)), "t", max_n=cap), "bad_field")
    # a resume's own cap, MAX_RESUME
    h, _ = Open(1, 0, "f" * 16, "xcosd", "f32", {}, 1.0, 0, 1.0, None, "ab", 4).to_wire()
    opened = from_wire(h, [bytes(4 * MAX_RESUME)])
    assert isinstance(opened, Open) and opened.resume.shape == (MAX_RESUME,)
    refused(lambda: from_wire(h, [bytes(4 * (MAX_RESUME + 1))]), "bad_field")
    # the default cap, MAX_IDS, through the messages that use it
    vh = {"t": "vmap", "fp": "f" * 16, "dsize": 8}
    ids = ids_to_bytes(np.arange(MAX_IDS))
    assert from_wire(vh, [ids, ids]).TYPE == "vmap"
    more = ids_to_bytes(np.arange(MAX_IDS + 1))
    refused(lambda: from_wire(vh, [more, more]), "bad_field")


def _draft_wire(d: int) -> tuple[dict[str, Any], list[bytes]]:
    h = {"t": "draft", "s": 1, "seq": 1, "r": 0, "tok": None}
    return h, [ids_to_bytes(np.zeros(d, dtype=np.int64)), np.full(d, 0.5, "<f4").tobytes()]


def _cand_wire(k: int) -> tuple[dict[str, Any], list[bytes]]:
    h = {"t": "verdict", "s": 1, "r": 0, "n": 0, "k": "cand"}
    return h, [ids_to_bytes(np.zeros(k, dtype=np.int64)), np.full(k, 0.5, "<f4").tobytes()]


def test_draft_ids_and_candidates_at_their_caps() -> None:
    msg = from_wire(*_draft_wire(MAX_DRAFT))
    assert isinstance(msg, DraftMsg) and msg.draft.length == MAX_DRAFT
    refused(lambda: from_wire(*_draft_wire(MAX_DRAFT + 1)), "bad_field")
    v = from_wire(*_cand_wire(MAX_CANDIDATES))
    assert isinstance(v, VerdictMsg) and isinstance(v.reply, CandidatesReply)
    assert v.reply.ids.shape == (MAX_CANDIDATES,)
    refused(lambda: from_wire(*_cand_wire(MAX_CANDIDATES + 1)), "bad_field")


def _open_h(**over: Any) -> dict[str, Any]:
    h, _ = Open(1, 0, "f" * 16, "xcosd", "f32", {}, 1.0, 0, 1.0, None, "ab", 4).to_wire()
    return {**h, **over}


def _welcome_h(**over: Any) -> dict[str, Any]:
    lim = {"msg": 1 << 20, "sess": 8, "draft": 32, "hb": 1.0, "to": 15.0}
    h = {"t": "welcome", "v": 1, "sid": "s", "tname": "t", "tfp": "f", "tsize": 9, "stop": [1],
         "lim": lim, "map": False}
    for k, v in over.items():
        if k.startswith("lim_"):
            lim[k[4:]] = v
        else:
            h[k] = v
    return h


def _verdict_h(**over: Any) -> dict[str, Any]:
    return {"t": "verdict", "s": 1, "r": 0, "n": 0, "k": "tok", "tok": 1, **over}


def _names(n: int) -> dict[str, int]:
    return {f"o{i}": i for i in range(n)}


#: (what, header at the cap, header one past it, buffers); one past is bad_field
FIELD_CAPS: list[tuple[str, dict[str, Any], dict[str, Any], list[bytes]]] = [
    ("prompt: MAX_TEXT bytes", _open_h(prompt="a" * MAX_TEXT),
     _open_h(prompt="a" * (MAX_TEXT + 1)), [b""]),
    ("prompt: counted in UTF-8 bytes, not characters", _open_h(prompt="é" * (MAX_TEXT // 2)),
     _open_h(prompt="é" * (MAX_TEXT // 2) + "a"), [b""]),
    ("method name: MAX_NAME", _open_h(m="m" * MAX_NAME), _open_h(m="m" * (MAX_NAME + 1)),
     [b""]),
    ("options: MAX_OPTIONS", _open_h(o=_names(MAX_OPTIONS)), _open_h(o=_names(MAX_OPTIONS + 1)),
     [b""]),
    ("option name: MAX_NAME", _open_h(o={"o" * MAX_NAME: 1}), _open_h(o={"o" * (MAX_NAME + 1): 1}),
     [b""]),
    ("max new tokens: 2^31", _open_h(max=1 << 31), _open_h(max=(1 << 31) + 1), [b""]),
    ("top-k: 2^31", _open_h(k=1 << 31), _open_h(k=(1 << 31) + 1), [b""]),
    ("seed: 2^64 - 1", _open_h(seed=(1 << 64) - 1), _open_h(seed=1 << 64), [b""]),
    ("hello node name: MAX_NAME", {"t": "hello", "v": 1, "node": "n" * MAX_NAME},
     {"t": "hello", "v": 1, "node": "n" * (MAX_NAME + 1)}, []),
    ("error text: MAX_MESSAGE", {"t": "error", "code": "x", "msg": "e" * MAX_MESSAGE},
     {"t": "error", "code": "x", "msg": "e" * (MAX_MESSAGE + 1)}, []),
    ("stop ids: MAX_STOP", _welcome_h(stop=list(range(MAX_STOP))),
     _welcome_h(stop=list(range(MAX_STOP + 1))), []),
    ("target size: 2^31", _welcome_h(tsize=1 << 31), _welcome_h(tsize=(1 << 31) + 1), []),
    ("server draft limit: MAX_DRAFT", _welcome_h(lim_draft=MAX_DRAFT),
     _welcome_h(lim_draft=MAX_DRAFT + 1), []),
    ("accepted drafts: MAX_DRAFT", _verdict_h(n=MAX_DRAFT), _verdict_h(n=MAX_DRAFT + 1), []),
    ("resolved token: 2^31 - 1", _verdict_h(tok=(1 << 31) - 1), _verdict_h(tok=1 << 31), []),
    ("vmap draft size: 2^31", {"t": "vmap", "fp": "f", "dsize": 1 << 31},
     {"t": "vmap", "fp": "f", "dsize": (1 << 31) + 1}, [b"", b""]),
]


@pytest.mark.parametrize(("what", "at", "past", "bufs"), FIELD_CAPS,
                         ids=[c[0] for c in FIELD_CAPS])
def test_header_fields_at_their_caps(what: str, at: dict[str, Any], past: dict[str, Any],
                                     bufs: list[bytes]) -> None:
    assert isinstance(from_wire(at, bufs), MESSAGE_TYPES[at["t"]])
    refused(lambda: from_wire(past, bufs), "bad_field")


def test_buffer_count_at_max_buffers() -> None:
    h, bufs = _draft_wire(0)
    nv = MAX_BUFFERS - len(bufs)  # draft vectors fill the message to MAX_BUFFERS buffers
    msg = from_wire({**h, "nv": nv}, [*bufs, *[b""] * nv])
    assert isinstance(msg, DraftMsg) and len(msg.draft.q_vectors or ()) == nv
    refused(lambda: from_wire({**h, "nv": nv + 1}, [*bufs, *[b""] * (nv + 1)]), "bad_field")


def test_the_largest_legal_header_passes_the_clouds_frame_limits() -> None:
    """A prompt of MAX_TEXT bytes with every other field at its cap fits the header
    bound the cloud uses, and one byte more is refused as ``bad_field`` *on its
    session*: if the frame layer refused it first (``too_large``, no session), the
    edge that sent it would wait for an answer forever."""
    target, _ = pair()
    cloud = xcosd.CloudNode(target=target, bind="mem://")  # its limits; never started
    opts = {f"{i:0{MAX_NAME}d}": 1.5 for i in range(MAX_OPTIONS)}
    name = "n" * MAX_NAME
    big = Open(2**40, 2**40, name, name, name, opts, 1e6, 1 << 31, 1.0, (1 << 64) - 1,
               "é" * (MAX_TEXT // 2), 1 << 31)
    frames = pack(big)
    assert len(frames[0]) <= MAX_HEADER_BYTES <= cloud.frame_limits.max_header_bytes
    assert unpack(frames, cloud.frame_limits).TYPE == "open"
    over = pack(Open(7, 0, name, name, name, opts, 1.0, 0, 1.0, None, "é" * (MAX_TEXT // 2) + "a",
                     4))
    header, _ = decode_message(over, limits=cloud.frame_limits)
    assert session_of(header) == 7
    refused(lambda: unpack(over, cloud.frame_limits), "bad_field")


# ------------------------------------------------------------------ vocabulary transfer


def test_vocab_table_at_max_table_bytes() -> None:
    half = MAX_TABLE_BYTES // 2
    v = Vocabulary("big", [b"a" * half, b"b" * (MAX_TABLE_BYTES - half)])
    table = vocab_to_table(v)
    assert table_to_vocab(table).fingerprint == v.fingerprint
    lengths = np.array([half, MAX_TABLE_BYTES - half + 1], dtype="<i4").tobytes()
    over = type(table)(table.name, table.fingerprint, {}, table.kinds, lengths, b"", True)
    refused(lambda: table_to_vocab(over), "too_large")


def test_vocab_table_blob_claiming_more_than_its_lengths_is_refused_unread() -> None:
    """zstd ignores ``max_output_size`` when a frame states its size, so a blob of a
    few kilobytes could make the edge allocate whatever it claims. The stated size is
    checked against the lengths first; nothing near it is ever allocated."""
    blob = zstandard.ZstdCompressor().compress(bytes(MAX_TABLE_BYTES + 1))
    assert len(blob) < 1 << 16
    v = Vocabulary("small", [b"a", b"b"])
    t = vocab_to_table(v)
    hostile = type(t)(t.name, t.fingerprint, {}, t.kinds, t.lengths, blob, True)
    tracemalloc.start()
    try:
        refused(lambda: table_to_vocab(hostile), "too_large")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    # a stated size that matches the lengths is decompressed as before
    assert table_to_vocab(t).fingerprint == v.fingerprint


# ------------------------------------------------------------------ the cloud state machine


def _open(link: Pump, s: int, method: str = "xcosd", options: dict[str, Any] | None = None,
          seed: int | None = 1) -> list[Any]:
    fp = link.handshake.vmap.fingerprint  # type: ignore[union-attr]
    return link.to_cloud(Open(s, 0, fp, method, "f32", options or {}, 1.0, 0, 1.0, seed, "ab", 16))


def _code(replies: list[Any]) -> str:
    assert len(replies) == 1 and isinstance(replies[0], Error), replies
    return str(replies[0].code)


def _drafts(link: Pump, s: int, d: int, q: float = 0.5) -> Draft:
    c = int(link.cloud.sessions[s].space.common_ids[0])
    return Draft(ids=np.full(d, c, dtype=np.int64), q_values=np.full(d, q, dtype=np.float32))


def test_max_draft_at_its_value() -> None:
    link = Pump(*pair(), max_draft=3)
    for s in (1, 2):
        assert _open(link, s)[0].TYPE == "opened"
    assert link.to_cloud(DraftMsg(1, 1, 0, None, _drafts(link, 1, 3)))[0].TYPE == "verdict"
    assert _code(link.to_cloud(DraftMsg(2, 1, 0, None, _drafts(link, 2, 4)))) == "bad_field"


def test_max_sessions_at_its_value() -> None:
    link = Pump(*pair(), max_sessions=3)
    link.config.max_sessions_per_peer = 3  # the total cap, from one peer
    for s in (1, 2, 3):
        assert _open(link, s)[0].TYPE == "opened"
    assert _code(_open(link, 4)) == "busy"
    link.to_cloud(Close(2, 1))  # a closed session frees its place
    assert _open(link, 4)[0].TYPE == "opened"
    assert _code(_open(link, 5)) == "busy"


def test_k_is_capped_by_what_one_reply_can_carry() -> None:
    """xcosd-e sends K candidates in one reply and the edge refuses a reply with more
    than MAX_CANDIDATES; a larger K (from a hostile edge: it would also make the
    cloud sample that many) is refused when the session opens."""
    link = Pump(*pair())
    assert _open(link, 1, "xcosd-e", {"K": MAX_CANDIDATES})[0].TYPE == "opened"
    assert _code(_open(link, 2, "xcosd-e", {"K": MAX_CANDIDATES + 1})) == "method"
    assert _code(_open(link, 3, "xcosd-e", {"K": (1 << 31) - 1})) == "method"


def test_m_candidate_rounds_then_no_more() -> None:
    """xcosd-e answers a rejection with candidates and at most M - 1 ``more``
    requests after it: M candidate rounds in all."""
    m = 3
    link = Pump(*pair())
    for seed in range(100):  # the first seed whose round rejects its one draft
        s = 10 + seed
        _open(link, s, "xcosd-e", {"K": 1, "M": m}, seed=seed)
        out = link.to_cloud(DraftMsg(s, 1, 0, None, _drafts(link, s, 1, q=1.0)))
        if isinstance(out[0], VerdictMsg) and out[0].accepted == 0:
            break
    else:
        raise AssertionError("no seed rejected a draft with q = 1")
    assert isinstance(out[0].reply, CandidatesReply)  # candidate round 1
    for k in range(2, m + 1):
        got = link.to_cloud(RequestMsg(s, k, 0, "more"))
        assert isinstance(got[0], ReplyMsg) and isinstance(got[0].reply, CandidatesReply), k
    assert _code(link.to_cloud(RequestMsg(s, m + 1, 0, "more"))) == "bad_request"


def test_known_maps_keep_the_newest_max_maps() -> None:
    link = Pump(*pair())
    _open(link, 1)
    space = link.cloud.sessions[1].space
    cfg = CloudConfig(link.target.vocab, link.target.tokenize, link.config.limits, "x",
                      max_maps=4)
    for i in range(4):
        cfg.remember(f"fp{i}", space)
    assert list(cfg.maps) == ["fp0", "fp1", "fp2", "fp3"]  # exactly max_maps: all kept
    assert cfg.space("fp0") is space  # used: now the newest
    cfg.remember("fp4", space)
    assert list(cfg.maps) == ["fp2", "fp3", "fp0", "fp4"]  # one more: the oldest goes


# ------------------------------------------------------------------ the nodes


async def test_cloud_max_message_bytes_at_its_value() -> None:
    """ServerLimits.max_message is the node's max_bytes: a message of exactly that
    many bytes is served; one byte more (in frames that each pass ZeroMQ's per-frame
    check) is answered ``too_large``."""
    target, draft = pair()
    limit = 4096
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0",
                               max_message_bytes=limit) as cloud:
        assert cloud.limits.max_message == cloud.frame_limits.max_bytes == limit
        conn = await connect(cloud.endpoint)
        try:
            await handshake(conn, draft)
            await conn.send([header_of(limit, "ping", n=5)])
            got = await reply(conn)
            assert isinstance(got, Pong) and got.n == 5
            await conn.send([header_of(limit - 100, "ping", n=6), bytes(101)])
            got = await reply(conn)
            assert isinstance(got, Error) and got.code == "too_large"
        finally:
            await conn.close()


async def test_cloud_max_frames_at_its_value() -> None:
    target, _ = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_draft=4,
                               max_tree=6) as cloud:
        # a block's frames: ids, q, and a tree's parents, row nodes and rows
        n = cloud.frame_limits.max_frames
        assert n == 64 + 6
        conn = await connect(cloud.endpoint)
        try:
            head = pack(Ping(1))[0]
            await conn.send([head] + [b""] * (n - 1))  # fits: refused for its fields only
            got = await reply(conn)
            assert isinstance(got, Error) and got.code == "bad_field"
            await conn.send([head] + [b""] * n)
            got = await reply(conn)
            assert isinstance(got, Error) and got.code == "too_large"
        finally:
            await conn.close()


async def test_cloud_max_queue_at_its_value() -> None:
    """``max_queue`` rounds may wait behind the running batch; the next is refused
    ``busy``, and batches never take more than ``max_batch``."""
    target, draft = pair()
    gated = GatedModel(target, hold_score=True)
    async with xcosd.CloudNode(target=gated, bind="tcp://127.0.0.1:0", max_queue=3,
                               max_batch=2) as cloud:
        conn = await connect(cloud.endpoint)
        try:
            vmap = await handshake(conn, draft)
            for s in range(1, 6):
                await conn.send(pack(Open(s, 0, vmap.fingerprint, "xcosd", "f32", {}, 1.0, 0,
                                          1.0, 1, "ab", 16)))
                assert (await reply(conn)).TYPE == "opened"
            c = int(vmap.common_target_ids[0])
            one = Draft(ids=np.array([c]), q_values=np.array([0.5], dtype=np.float32))
            try:
                await conn.send(pack(DraftMsg(1, 1, 0, None, one)))
                await until(gated.in_score.is_set, "session 1's batch to hold the worker")
                for s in (2, 3, 4, 5):  # handled in order: 3 wait, the 4th finds them
                    await conn.send(pack(DraftMsg(s, 1, 0, None, one)))
                got = await reply(conn)
                assert isinstance(got, Error) and got.code == "busy" and got.s == 5
                assert cloud.stats()["queued"] == 3
            finally:
                gated.gate.set()
            verdicts = [await reply(conn) for _ in range(4)]
            assert {v.s for v in verdicts if isinstance(v, VerdictMsg)} == {1, 2, 3, 4}
            hist = cloud.stats()["scheduler"]["batch_size_histogram"]
            assert hist == {1: 2, 2: 1}  # [1], then [2, 3] (max_batch), then [4]
        finally:
            await conn.close()


async def test_the_edge_keeps_to_the_clouds_message_limit() -> None:
    """The welcome tells the edge the cloud's max_message. An edge message of exactly
    that size is sent and served; one byte more fails the generation at once with
    ``too_large``. (Sent, the cloud would refuse it before it could tell whose it
    was, and the generation would wait for an answer forever.)"""
    target, draft = pair()
    limit = 2048
    async with (
        xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_message_bytes=limit) as cloud,
        xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge,
    ):
        # an open's size grows one byte per prompt byte (str16 from 256 bytes on)
        base = "ab" * 150
        await asyncio.wait_for(edge.generate(base, max_new_tokens=1), HANG_S)
        size = edge.meter.up["open"].payload
        exact = base + "a" * (limit - size)
        res = await asyncio.wait_for(edge.generate(exact, max_new_tokens=1), HANG_S)
        assert len(res.token_ids) == 1
        assert edge.meter.up["open"].payload == size + limit  # that open was `limit` bytes
        with pytest.raises(ProtocolError) as e:
            await asyncio.wait_for(edge.generate(exact + "a", max_new_tokens=1), HANG_S)
        assert e.value.code == "too_large"
        assert edge.meter.up["open"].messages == 2  # the oversized open was never sent
        assert "too_large" not in cloud.stats()["errors_by_code"]


async def test_prompt_of_max_text_bytes_end_to_end() -> None:
    """A prompt of MAX_TEXT bytes is served over real ZeroMQ; one byte more is
    refused ``bad_field`` on its own session, so the edge's generation fails with
    it instead of waiting forever (the cloud's header limit used to refuse any
    prompt over about 64 KiB as ``too_large``, with no session to answer on)."""
    target, draft = pair()
    async with (
        xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud,
        xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, target_vocab=target.vocab) as edge,
    ):
        prompt = "ab" * (MAX_TEXT // 2)
        res = await asyncio.wait_for(edge.generate(prompt, max_new_tokens=1), HANG_S)
        assert len(res.token_ids) == 1
        with pytest.raises(ProtocolError) as e:
            await asyncio.wait_for(edge.generate(prompt + "a", max_new_tokens=1), HANG_S)
        assert e.value.code == "bad_field"
        assert cloud.stats()["errors_by_code"] == {"bad_field": 1}


def test_a_peer_cannot_evict_another_peers_map() -> None:
    """Maps are pinned by the connections using them: uploads from another peer evict
    only unpinned ones, and with every map pinned an upload is refused ``busy``."""
    link = Pump(*pair())
    cfg = link.config
    cfg.max_maps = 3
    mine = link.handshake.vmap.fingerprint  # type: ignore[union-attr]
    upload = upload_for(link.vmap)
    size = link.target.vocab.size

    def distinct(i: int) -> VocabMapUpload:  # a valid map of its own (another draft size)
        ds = upload.draft_size + 1 + i
        return dataclasses.replace(upload, draft_size=ds, fingerprint=map_fingerprint(
            size, ds, upload.common_target_ids, upload.common_draft_ids))

    hostile = CloudConnection(cfg, b"hostile")
    hostile.receive(Hello())
    accepted = 0
    for i in range(40):  # many distinct maps, as 33 uploads once evicted a live edge's map
        out = hostile.receive(distinct(i))
        accepted += isinstance(out.send[0], VocabMapAccepted)
    assert accepted == 40 and len(hostile.pinned) == MAX_MAPS_PER_PEER
    assert mine in cfg.maps  # the edge's map survived
    assert _open(link, 1)[0].TYPE == "opened"
    # a third peer pins the last free slot; with all three pinned an upload is refused
    other = CloudConnection(cfg, b"other")
    other.receive(Hello())
    other.receive(distinct(100))
    assert len(cfg.maps) == 3 and all(cfg.pins.get(fp) for fp in cfg.maps)
    third = CloudConnection(cfg, b"third")
    third.receive(Hello())
    out = third.receive(distinct(200))
    assert isinstance(out.send[0], Error) and out.send[0].code == "busy"
    # a peer that leaves unpins: the slot frees
    hostile.drop()
    out = third.receive(distinct(200))
    assert isinstance(out.send[0], VocabMapAccepted) and mine in cfg.maps


def test_one_peer_cannot_take_every_session() -> None:
    link = Pump(*pair(), max_sessions=8)
    assert link.config.max_sessions_per_peer == 4
    for s in range(1, 5):
        assert _open(link, s)[0].TYPE == "opened"
    assert _code(_open(link, 5)) == "busy"
    other = CloudConnection(link.config, b"other")  # another peer still gets sessions
    other.receive(Hello())
    fp = link.handshake.vmap.fingerprint  # type: ignore[union-attr]
    out = other.receive(Open(1, 0, fp, "xcosd", "f32", {}, 1.0, 0, 1.0, 1, "ab", 16))
    assert out.send[0].TYPE == "opened"


def test_m_has_an_upper_bound() -> None:
    link = Pump(*pair())
    assert _open(link, 1, "xcosd-e", {"M": MAX_CANDIDATE_ROUNDS})[0].TYPE == "opened"
    assert _code(_open(link, 2, "xcosd-e", {"M": MAX_CANDIDATE_ROUNDS + 1})) == "method"
