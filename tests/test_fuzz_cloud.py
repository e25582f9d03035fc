"""Fuzzing a live CloudNode over real ZeroMQ: more than 10,000 mutated and random
frames, sent in bulk from several sockets, then a well-behaved session still
completes with the right output."""

from __future__ import annotations

import asyncio
import contextlib
import math

import msgpack
import numpy as np
import zmq
import zmq.asyncio

import xcosd
from xcosd.methods.base import Draft, TokenReply
from xcosd.protocol import (
    Close,
    DraftMsg,
    EdgeHandshake,
    Error,
    Hello,
    Open,
    Ping,
    ReplyMsg,
    RequestMsg,
    VerdictMsg,
    VocabRequest,
    pack,
    unpack,
)
from xcosd.protocol.messages import ids_to_bytes
from xcosd.vocab import VocabMap

from .helpers.waits import HANG_S, until
from .session_pairs import greedy_decode, pair

N_FRAMES = 10_500
LIMIT = 64 * 1024


def _valid_messages(vmap: VocabMap) -> list[list[bytes]]:
    c = vmap.common_target_ids
    draft = Draft(ids=np.array([c[0], c[1], c[2]]), q_values=np.array([.3, .2, .1], np.float32))
    msgs = [
        Hello(), VocabRequest(), Ping(3),
        Open(1, 0, vmap.fingerprint, "xcosd-e", "f32", {}, 1.0, 0, 1.0, 9, "abc", 20),
        Open(2, 0, vmap.fingerprint, "xcosd", "f32", {"hr_presample": False}, 0.5, 3, 0.9,
             None, "", 20, np.array([1, 2, 3])),
        DraftMsg(1, 1, 0, None, draft), DraftMsg(1, 2, 1, int(c[3]), draft),
        RequestMsg(1, 3, 0, "more"), RequestMsg(2, 3, 0, "other"), Close(1, 9),
        Error("busy", "x", 1, 0), VerdictMsg(1, 0, 1, TokenReply(2)), ReplyMsg(1, 0, TokenReply(3)),
    ]
    return [[bytes(f) for f in pack(m)] for m in msgs]


_WEIRD = [None, True, -1, 2**40, 2**64 - 1, -2**63, 1.5, math.nan, math.inf, "x" * 300, "",
          b"\xff" * 9, [1, "a"], {"k": 1}, [], {}]


def _mutate(frames: list[bytes], rng: np.random.Generator, valid: list[list[bytes]]) -> list[bytes]:
    kind = int(rng.integers(12))
    out = list(frames)
    if kind == 0:  # random frames
        return [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 4)))]
    if kind == 1:  # bit flips in the header
        h = bytearray(out[0])
        for _ in range(int(rng.integers(1, 4))):
            if h:
                i = int(rng.integers(len(h)))
                h[i] ^= 1 << int(rng.integers(8))
        out[0] = bytes(h)
        return out
    if kind == 2:  # truncation
        i = int(rng.integers(len(out)))
        out[i] = out[i][: int(rng.integers(0, max(1, len(out[i]))))]
        return out
    header = msgpack.unpackb(out[0], raw=False)
    keys = list(header)
    if kind in (3, 4):  # a field of the wrong type or range
        k = keys[int(rng.integers(len(keys)))]
        header[k] = _WEIRD[int(rng.integers(len(_WEIRD)))]
    elif kind == 5:  # a missing or an extra field
        if rng.random() < 0.5 and len(keys) > 1:
            del header[keys[1 + int(rng.integers(len(keys) - 1))]]
        else:
            header["zz"] = 1
    elif kind == 6:  # unknown type, wrong version
        header["t"] = ["hello!", "DRAFT", "", "verdict2"][int(rng.integers(4))]
        if "v" in header:
            header["v"] = 7
    elif kind == 7:  # NaN, negative, wrong-length vectors
        v = np.array([np.nan, -0.5, 2.0, 0.0, 0.3][: int(rng.integers(1, 6))], dtype="<f4")
        out = [out[0], *out[1:]]
        if len(out) >= 3:
            out[2] = v.tobytes()
        else:
            out.append(v.tobytes())
    elif kind == 8:  # ids outside the vocabulary
        bad = ids_to_bytes(rng.integers(0, 2**31 - 1, size=int(rng.integers(1, 5))))
        out = [out[0], bad, *out[2:]] if len(out) > 1 else [out[0], bad]
    elif kind == 9:  # replay another valid message as is
        return list(valid[int(rng.integers(len(valid)))])
    elif kind == 10:  # too many frames, or more bytes than the limit in total
        if rng.random() < 0.5:
            return [out[0]] + [b"x"] * 200
        return [out[0]] + [b"\0" * 40_000] * 2
    else:  # a header that is msgpack but not a map
        return [msgpack.packb([1, 2, 3]), *out[1:]]
    out[0] = msgpack.packb(header, use_bin_type=True)
    return out


async def _drain(sock: zmq.asyncio.Socket, got: list[int]) -> None:
    """Read the cloud's answers until cancelled."""
    while True:
        await sock.recv_multipart()
        got[0] += 1


async def test_fuzzing_a_live_cloud() -> None:
    target, draft = pair()
    rng = np.random.default_rng(1234)
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0",
                               max_message_bytes=LIMIT, max_sessions=64) as cloud:
        vmap = VocabMap(draft.vocab, target.vocab)
        valid = _valid_messages(vmap)
        ctx = zmq.asyncio.Context()
        socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
        got = [0]
        try:
            for s in socks:
                s.linger = 0
                s.sndhwm = s.rcvhwm = 100_000
                s.connect(cloud.endpoint)
            # half the fuzzers complete a real handshake first, so the session paths
            # (open, draft, request, close on live sessions) are fuzzed too
            for s in socks[:2]:
                hs = EdgeHandshake(lambda tv: VocabMap(draft.vocab, tv))
                pending = [hs.hello()]
                while not hs.ready:
                    for m in pending:
                        await s.send_multipart(pack(m))
                    pending = hs.receive(unpack(await asyncio.wait_for(s.recv_multipart(),
                                                                       HANG_S))).send
                for f in valid[3:5]:
                    await s.send_multipart(f)
            drains = [asyncio.ensure_future(_drain(s, got)) for s in socks]
            sent = 0
            for i in range(N_FRAMES):
                base = valid[int(rng.integers(len(valid)))]
                frames = _mutate(base, rng, valid)
                if not frames:
                    frames = [b""]
                await socks[i % 4].send_multipart(frames)
                sent += 1
            # wait until the cloud has counted the lot, however long that takes here
            await until(lambda: cloud.stats()["messages"] >= sent,
                        f"the cloud to take in all {sent} fuzzed messages")
        finally:
            for d in locals().get("drains", []):
                d.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await d
            for s in socks:
                s.close(0)
            ctx.term()
        st = cloud.stats()
        assert sent >= 10_000
        # most frames were received (ZeroMQ drops a peer only for a frame over its limit)
        assert st["messages"] > 0.9 * sent
        codes = st["errors_by_code"]
        for code in ("bad_frame", "bad_field", "unknown_type", "too_large", "bad_vector",
                     "bad_token", "handshake"):
            assert codes.get(code, 0) > 0, (code, codes)
        assert got[0] > 0  # errors went back to the senders
        assert st["internal_errors"] == 0 and codes.get("internal", 0) == 0, codes
        # and a well-behaved session still completes, exactly
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, temperature=0.0) as edge:
            res = await edge.generate("ab", max_new_tokens=30)
        assert res.token_ids == greedy_decode(target, "ab", 30)
