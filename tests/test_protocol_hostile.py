"""Hostile and broken input against the cloud state machine and the frame layer:
every defect gets its typed error, and the other sessions carry on untouched."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from xcosd.errors import ProtocolError
from xcosd.methods.base import Draft
from xcosd.nodes.pump import Pump
from xcosd.protocol import (
    Close,
    DraftMsg,
    Error,
    Hello,
    Open,
    Ping,
    RequestMsg,
    VerdictMsg,
    pack,
    unpack,
)
from xcosd.protocol.messages import ids_to_bytes
from xcosd.wire.frames import Limits

from .session_pairs import pair


@pytest.fixture
def link() -> Pump:
    return Pump(*pair())


def _open(link: Pump, s: int) -> None:
    es = link.session("xcosd-e", prompt="ab")
    msg = es.open()
    m = Open(s, 0, msg.map_fp, msg.method, msg.codec, msg.options, 1.0, 0, 1.0, 1, "ab", 16)
    out = link.to_cloud(m)
    assert out[0].TYPE == "opened"


def _code(replies: list) -> str:
    errs = [m for m in replies if isinstance(m, Error)]
    assert len(errs) == 1, replies
    return errs[0].code


def _frames_code(frames: list, limits: Limits | None = None) -> str:
    with pytest.raises(ProtocolError) as ei:
        unpack(frames, limits)
    return ei.value.code


def test_frame_defects_have_codes() -> None:
    good = pack(Ping(1))
    assert _frames_code([b"\xc1not msgpack"]) == "bad_frame"
    assert _frames_code([good[0][:-1]]) == "bad_frame"  # truncated
    assert _frames_code([msgpack.packb([1, 2])]) == "bad_frame"  # not a map
    assert _frames_code([msgpack.packb({"t": "nope"})]) == "unknown_type"
    assert _frames_code([msgpack.packb({"x": 1})]) == "bad_frame"
    big = [good[0], b"\0" * 2000]
    assert _frames_code(big, Limits(max_bytes=1000)) == "too_large"
    assert _frames_code([msgpack.packb({"t": "ping", "n": "one"})]) == "bad_field"
    assert _frames_code([msgpack.packb({"t": "ping", "n": True})]) == "bad_field"
    assert _frames_code([msgpack.packb({"t": "ping", "n": 1}), b"extra"]) == "bad_field"


def _draft_frames(s: int, seq: int, r: int, ids: list[int], q: list[float]) -> list:
    h = {"t": "draft", "s": s, "seq": seq, "r": r, "tok": None}
    return [msgpack.packb(h), ids_to_bytes(ids), np.array(q, dtype="<f4").tobytes()]


def test_vector_defects() -> None:
    assert _frames_code(_draft_frames(1, 1, 0, [1, 2], [0.5, float("nan")])) == "bad_vector"
    assert _frames_code(_draft_frames(1, 1, 0, [1, 2], [0.5, -0.1])) == "bad_vector"
    assert _frames_code(_draft_frames(1, 1, 0, [1, 2], [0.5])) == "bad_field"  # wrong length
    assert _frames_code(_draft_frames(1, 1, 0, [1, 2], [0.5, 0.0])) == "bad_vector"
    frames = _draft_frames(1, 1, 0, [1], [0.5])
    frames[1] = b"\1\2\3"  # not whole int32s
    assert _frames_code(frames) == "bad_field"


def test_session_defects_are_refused_and_others_carry_on(link: Pump) -> None:
    _open(link, 100)
    _open(link, 200)
    sp = link.cloud.sessions[100].space
    c0 = int(sp.common_ids[0])
    good = Draft(ids=np.array([c0]), q_values=np.array([0.5], dtype=np.float32))
    # a message for a session that does not exist
    assert _code(link.to_cloud(DraftMsg(999, 1, 0, None, good))) == "no_session"
    # an id outside the vocabulary, and one in V_O (not draftable)
    bad = Draft(ids=np.array([10_000]), q_values=np.array([0.5], dtype=np.float32))
    assert _code(link.to_cloud(DraftMsg(100, 1, 0, None, bad))) == "bad_token"
    vo = Draft(ids=np.array([int(sp.other_ids[0])]), q_values=np.array([0.5], dtype=np.float32))
    assert _code(link.to_cloud(DraftMsg(100, 2, 0, None, vo))) == "bad_token"
    # a resolved token where no rejection happened
    assert _code(link.to_cloud(DraftMsg(100, 3, 0, 1, good))) == "bad_token"
    # a round from the future, a follow-up with nothing to follow
    assert _code(link.to_cloud(DraftMsg(100, 4, 5, None, good))) == "state"
    assert _code(link.to_cloud(RequestMsg(100, 5, 0, "more"))) == "state"
    # the refused messages did not disturb the session: a good draft is verified
    replies = link.to_cloud(DraftMsg(100, 6, 0, None, good))
    assert isinstance(replies[0], VerdictMsg) and replies[0].r == 0
    # replay: the same sequence number again, and an old round
    assert _code(link.to_cloud(DraftMsg(100, 6, 1, None, good))) == "replay"
    assert _code(link.to_cloud(DraftMsg(100, 7, 0, None, good))) in ("replay", "bad_field")
    # session 200 never noticed any of it
    replies = link.to_cloud(DraftMsg(200, 1, 0, None, good))
    assert isinstance(replies[0], VerdictMsg)
    link.to_cloud(Close(100, 50))
    assert _code(link.to_cloud(Close(100, 51))) == "no_session"
    assert 200 in link.cloud.sessions


def test_connection_defects(link: Pump) -> None:
    assert _code(link.to_cloud(Hello(version=99))) == "version"
    _open(link, 1)
    assert _code(link.to_cloud(Open(1, 0, "x", "xcosd", "f32", {}, 1.0, 0, 1.0, 1, "", 4))) \
        == "session_exists"
    es = link.session()
    fp = es.open().map_fp
    assert _code(link.to_cloud(Open(2, 0, "0" * 16, "xcosd", "f32", {}, 1.0, 0, 1.0, 1, "", 4))) \
        == "vocab"
    assert _code(link.to_cloud(Open(3, 0, fp, "nope", "f32", {}, 1.0, 0, 1.0, 1, "", 4))) \
        == "method"
    assert _code(link.to_cloud(Open(4, 0, fp, "xcosd", "zz", {}, 1.0, 0, 1.0, 1, "", 4))) \
        == "method"
    assert _code(link.to_cloud(Open(5, 0, fp, "xcosd", "f32", {"K": 3}, 1.0, 0, 1.0, 1, "", 4))) \
        == "method"


def test_session_limit_is_busy() -> None:
    lk = Pump(*pair(), max_sessions=2)
    lk.config.max_sessions_per_peer = 2  # the total cap, from one peer
    _open(lk, 1)
    _open(lk, 2)
    es = lk.session()
    m = es.open()
    assert _code(lk.to_cloud(Open(3, 0, m.map_fp, "xcosd", "f32", {}, 1.0, 0, 1.0, 1, "", 4))) \
        == "busy"


def test_before_hello_is_a_handshake_error() -> None:
    from xcosd.protocol import CloudConnection

    lk = Pump(*pair())
    fresh = CloudConnection(lk.config, b"other")
    out = fresh.receive(Ping(1))
    assert isinstance(out.send[0], Error) and out.send[0].code == "handshake"


# -- round 0's block riding on the open ------------------------------------------


def _open_with(link: Pump, s: int, draft: Draft, **kw: object) -> list:
    m = link.session("xcosd-e", prompt="ab").open()
    args: dict = {"seq": 1, "map_fp": m.map_fp, "method": "xcosd-e", "codec": "f32",
                  "options": {}, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 1,
                  "prompt": "ab", "max_new_tokens": 16, **kw}
    return link.to_cloud(Open(s, draft=draft, **args))


def test_a_draft_on_the_open_is_answered_by_its_verdict_alone(link: Pump) -> None:
    _open(link, 1)  # the map is known to the cloud from here on
    c0 = int(link.cloud.sessions[1].space.common_ids[0])
    good = Draft(ids=np.array([c0]), q_values=np.array([0.5], dtype=np.float32))
    replies = _open_with(link, 7, good)
    assert [type(m) for m in replies] == [VerdictMsg], replies  # no "opened" first
    v = replies[0]
    assert (v.s, v.r, v.ack) == (7, 0, 1)
    sess = link.cloud.sessions[7]
    assert (sess.rounds, sess.next_round, sess.last_answer is not None) == (1, 1, True)
    # a duplicate of the open is answered from the record, never verified again
    again = _open_with(link, 7, good)
    assert [pack(m) for m in again] == [pack(v)] and sess.rounds == 1


def test_a_refused_draft_on_the_open_refuses_the_open_and_leaves_nothing(link: Pump) -> None:
    _open(link, 1)
    sp = link.cloud.sessions[1].space
    c0 = int(sp.common_ids[0])
    before = link.config.sessions
    cases = {
        "bad_token": Draft(ids=np.array([int(sp.other_ids[0])]),
                           q_values=np.array([0.5], dtype=np.float32)),
        "bad_field": Draft(ids=np.array([c0] * 16), q_values=np.full(16, 0.5, np.float32)),
    }
    for code, draft in cases.items():
        assert _code(_open_with(link, 9, draft)) == code
        assert 9 not in link.cloud.sessions and link.config.sessions == before
    good = Draft(ids=np.array([c0]), q_values=np.array([0.5], dtype=np.float32))
    # only a new session's first open carries a block: not a resume, not a re-open
    assert _code(_open_with(link, 9, good, resume=np.array([c0]))) == "bad_field"
    assert _code(_open_with(link, 9, good, r=2)) == "bad_field"
    assert _code(_open_with(link, 1, good, seq=5)) == "bad_field"
    assert 9 not in link.cloud.sessions and link.config.sessions == before
    # the same open, now good, is served
    assert isinstance(_open_with(link, 9, good)[0], VerdictMsg)
    assert link.config.sessions == before + 1


def test_a_busy_open_with_a_draft_is_served_when_sent_again() -> None:
    lk = Pump(*pair(), max_sessions=1)
    _open(lk, 1)
    c0 = int(lk.cloud.sessions[1].space.common_ids[0])
    good = Draft(ids=np.array([c0]), q_values=np.array([0.5], dtype=np.float32))
    assert _code(_open_with(lk, 2, good)) == "busy"
    assert 2 not in lk.cloud.sessions
    lk.to_cloud(Close(1, 9))
    assert isinstance(_open_with(lk, 2, good)[0], VerdictMsg)


def test_draft_keys_without_a_draft_on_an_open_are_refused() -> None:
    h = {"t": "open", "s": 1, "seq": 1, "fp": "f", "m": "ar", "c": "f32", "o": {}, "T": 1.0,
         "k": 0, "p": 1.0, "seed": None, "prompt": "", "max": 4}
    empty = ids_to_bytes([])
    assert _frames_code([msgpack.packb({**h, "mk": True}), empty]) == "bad_field"
    assert _frames_code([msgpack.packb({**h, "dr": 1}), empty]) == "bad_field"
    # "dr" announces the block's two buffers: one missing is a defect
    assert _frames_code([msgpack.packb({**h, "dr": True}), empty, empty]) == "bad_field"
    ok = unpack([msgpack.packb({**h, "dr": True}), empty, empty, empty])
    assert isinstance(ok, Open) and ok.draft is not None and ok.draft.length == 0
