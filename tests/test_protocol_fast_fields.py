"""The compiled field readers and the small-array checks accept and refuse exactly
what the full readers do, with the same error.

Every header field of every message table is read both ways from a set of values
around its bounds and of every wrong type (and from a header without it); the
probability and id checks are compared with their numpy forms on random arrays
with NaN, infinities, negatives and values just past 1 thrown in."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
import pytest

from xcosd.errors import ProtocolError
from xcosd.protocol import messages as M
from xcosd.protocol.fields import Field, _fast_reader, _read, bytes_to_ids, check_probs

VALUES: list[Any] = [
    0, 1, -1, 5, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), True, False, None, 0.0, 0.5,
    1.0, 1.0 + 1e-7, 2.0, -0.1, math.nan, math.inf, -math.inf, 1e6, 1e7, "", "x", "x" * 200,
    "x" * 5000, "more", "other", "fallback", "tok", "busy", "internal", "no_such", b"b", [1],
    {}, {"a": 1}]
_ABSENT = object()


def _tables() -> list[tuple[Field, ...]]:
    out = [c.FIELDS for c in vars(M).values() if isinstance(c, type) and hasattr(c, "FIELDS")]
    out += [fields for _, fields, _ in M.REPLY_SPECS.values()]
    return out


def _plain(v: Any) -> tuple[Any, ...]:
    return (float, "nan") if isinstance(v, float) and math.isnan(v) else (type(v), v)


def _outcome(fn: Any, describe: Any = _plain) -> tuple[Any, ...]:
    """What a read gave: ``describe`` of its value, or the typed refusal."""
    try:
        v = fn()
    except ProtocolError as e:
        return ("refused", e.code, str(e))
    return ("value", *describe(v))


@pytest.mark.parametrize("fields", _tables(), ids=lambda fs: ",".join(f.key for f in fs))
def test_compiled_readers_match_the_full_readers(fields: tuple[Field, ...]) -> None:
    for f in fields:
        fast = _fast_reader(f)
        for v in [*VALUES, _ABSENT]:
            h = {} if v is _ABSENT else {f.key: v}
            assert _outcome(partial(fast, h, "t")) == _outcome(partial(_read, h, f, "t")), \
                (f.attr, v)


def _numpy_probs_ok(v: np.ndarray) -> bool:
    return not v.size or bool(np.all(np.isfinite(v)) and float(v.min()) >= 0.0
                              and float(v.max()) <= 1.0 + 1e-6)


def test_small_checks_match_numpy() -> None:
    rng = np.random.default_rng(0)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, 1.0 + 1e-6, 1.0 + 2e-6, -1e-30,
                3.4e38, -3.4e38, 1e-45]
    for _ in range(3000):
        n = int(rng.integers(0, 80))
        v = rng.random(n).astype(np.float32)
        for _ in range(int(rng.integers(0, 3))):
            if n:
                v[rng.integers(0, n)] = rng.choice(specials)
        try:
            check_probs(v, "t", "q")
            ok = True
        except ProtocolError as e:
            assert e.code == "bad_vector"
            ok = False
        assert ok == _numpy_probs_ok(v), v
        a = rng.integers(-3, 2**31 - 1, n, dtype=np.int64).astype("<i4")
        if n and rng.random() < 0.5:
            a[rng.integers(0, n)] = rng.choice([-1, -(2**31), 2**31 - 1, 0])
        try:
            got = bytes_to_ids(a.tobytes(), "t")
            assert np.array_equal(got, a.astype(np.int64))
            ok = True
        except ProtocolError as e:
            assert e.code == "bad_token"
            ok = False
        assert ok == (not n or int(a.min()) >= 0), a


def _draft_fields(m: Any) -> tuple[Any, ...]:
    d = m.draft
    return (m.s, m.seq, m.r, m.token, m.redo, d.ids.dtype, d.ids.tolist(),
            d.q_values.dtype, d.q_values.tobytes(), d.q_vectors,
            None if d.verify_mask is None else d.verify_mask.tolist())


def test_the_draft_fast_path_matches_the_general_one() -> None:
    """``DraftMsg.from_wire`` reads the common draft inline: for headers with every
    field value above (and some keys missing or extra) and blocks with bad lengths,
    negative ids, NaN, zero or too large ``q``, it returns what the table-driven
    path returns, or refuses with the same error."""
    rng = np.random.default_rng(7)
    general = super(M.DraftMsg, M.DraftMsg).from_wire
    good = {"t": "draft", "s": 3, "seq": 17, "r": 9, "tok": 42}
    ids_ok = np.array([5, 7, 9, 11], dtype="<i4").tobytes()
    q_ok = np.array([0.1, 0.2, 0.3, 1.0], dtype="<f4").tobytes()
    blocks: list[list[bytes]] = [
        [ids_ok, q_ok], [ids_ok[:-1], q_ok], [ids_ok, q_ok[:-4]], [b"", b""],
        [np.array([5, -7], dtype="<i4").tobytes(), q_ok[:8]],
        [np.array([5, -1], dtype="<i4").tobytes(), q_ok[:8]], [b"", q_ok[:4]],
        [ids_ok, np.array([0.1, math.nan, 0.2, 0.3], dtype="<f4").tobytes()],
        [ids_ok, np.array([0.1, 0.0, 0.2, 0.3], dtype="<f4").tobytes()],
        [ids_ok, np.array([0.1, 1.01, 0.2, 0.3], dtype="<f4").tobytes()],
        [ids_ok, np.array([0.1, -0.5, 0.2, math.inf], dtype="<f4").tobytes()],
        [np.arange(70, dtype="<i4").tobytes(), np.full(70, 0.01, dtype="<f4").tobytes()],
        [ids_ok, q_ok, b"\x01\x01\x00\x01"], [ids_ok],
    ]
    for _ in range(40):
        d = int(rng.integers(1, 9))
        ids = rng.integers(-2, 1 << 20, d).astype("<i4")
        q = rng.choice([0.0, 0.3, 1.0, 1.0 + 1e-6, 1.0 + 1e-5, math.nan], d).astype("<f4")
        blocks.append([ids.tobytes(), q.tobytes()])
    headers: list[dict[str, Any]] = [good, {**good, "tok": None},
                                     {k: v for k, v in good.items() if k != "tok"},
                                     {**good, "mk": True}, {**good, "extra": 1}]
    for key in ("s", "seq", "r", "tok"):
        headers += [{**good, key: v} for v in VALUES]
    for h in headers:
        for bufs in blocks:
            fast = _outcome(partial(M.DraftMsg.from_wire, h, bufs), _draft_fields)
            full = _outcome(partial(general.__func__, M.DraftMsg, h, bufs), _draft_fields)
            assert fast == full, (h, bufs)


def test_the_verdict_fast_path_writes_the_tables_bytes() -> None:
    """``VerdictMsg.to_wire`` writes a bonus-token verdict inline: the same header,
    key order and bytes as the field tables, for every mix of the optional keys
    (and other replies still go through the tables)."""
    from xcosd.methods.base import CandidatesReply, TokenReply
    from xcosd.wire.frames import encode_message

    replies: list[Any] = [TokenReply(0), TokenReply(77), TokenReply(np.int64(2**31 - 1)),
                          CandidatesReply(ids=np.arange(3, dtype=np.int64),
                                          values=np.full(3, 0.25, dtype=np.float32))]
    for reply in replies:
        for us in (0, 1, 120, 2**40):
            for ack in (0, 1, 2**62):
                for n in (0, 4):
                    v = M.VerdictMsg(3, 9, n, reply, us, ack=ack)
                    fast, general = v.to_wire(), M.Message.to_wire(v)
                    assert list(fast[0].items()) == list(general[0].items())
                    assert encode_message(*fast) == encode_message(*general)


def _verdict_fields(m: Any) -> tuple[Any, ...]:
    rep = m.reply
    body = ((rep.token, type(rep.token)) if hasattr(rep, "token")
            else (rep.ids.dtype, rep.ids.tolist(), rep.values.dtype, rep.values.tobytes())
            if hasattr(rep, "ids") else (type(rep).__name__,))
    return (m.s, m.r, m.accepted, m.compute_us, m.ack,
            type(rep).__name__, body)


def test_the_verdict_decode_fast_path_matches_the_general_one() -> None:
    """``VerdictMsg.from_wire`` reads a bonus token or a few candidates inline: for
    every field value above in each key, keys missing or extra, and candidate
    blocks with bad lengths, negative ids, NaN or out-of-range values, it returns
    what the table-driven path returns, or refuses with the same error."""
    general = super(M.VerdictMsg, M.VerdictMsg).from_wire.__func__
    tok = {"t": "verdict", "s": 3, "r": 9, "n": 4, "us": 120, "a": 17, "k": "tok", "tok": 77}
    cand = {"t": "verdict", "s": 3, "r": 9, "n": 1, "a": 17, "k": "cand"}
    ids = np.array([5, 7, 9], dtype="<i4").tobytes()
    vals = np.array([0.5, 0.25, 0.0], dtype="<f4").tobytes()
    cand_blocks: list[list[bytes]] = [
        [ids, vals], [ids[:-1], vals], [ids, vals[:-4]], [b"", b""], [ids], [ids, vals, b""],
        [np.array([5, -1, 2], dtype="<i4").tobytes(), vals],
        [ids, np.array([0.5, math.nan, 0.1], dtype="<f4").tobytes()],
        [ids, np.array([0.5, -0.1, 0.1], dtype="<f4").tobytes()],
        [ids, np.array([0.5, 1.01, 0.1], dtype="<f4").tobytes()],
        [ids, np.array([0.5, 1.0 + 1e-6, math.inf], dtype="<f4").tobytes()],
        [np.arange(70, dtype="<i4").tobytes(), np.full(70, 0.01, dtype="<f4").tobytes()]]
    cases: list[tuple[dict[str, Any], list[list[bytes]]]] = []
    for base, blocks in ((tok, [[], [b"x"]]), (cand, cand_blocks)):
        headers = [base, {**base, "ob": [[9, b"x"]]}, {**base, "extra": 1},
                   {k: v for k, v in base.items() if k not in ("us", "a")},
                   {**base, "us": None, "a": None}, {**base, "k": "full"}, {**base, "k": 3}]
        for key in [k for k in base if k not in ("t", "k")] + ["us", "a"]:
            headers += [{**base, key: v} for v in VALUES]
            headers.append({k: v for k, v in base.items() if k != key})
        cases += [(h, blocks) for h in headers]
    for h, blocks in cases:
        for bufs in blocks:
            fast = _outcome(partial(M.VerdictMsg.from_wire, h, bufs), _verdict_fields)
            full = _outcome(partial(general, M.VerdictMsg, h, bufs), _verdict_fields)
            assert fast == full, (h, bufs)


def test_the_draft_encode_fast_path_writes_the_tables_bytes() -> None:
    """``DraftMsg.to_wire`` writes a plain block inline: the tables' header, key
    order and bytes, with and without a resolved token (a redo, a mask or vectors
    go through the tables)."""
    from xcosd.methods.base import Draft
    from xcosd.wire.frames import encode_message

    drafts = [Draft(ids=np.array([5, 7], dtype=np.int64),
                    q_values=np.array([0.5, 0.25], dtype=np.float32)),
              Draft(ids=np.empty(0, dtype=np.int64), q_values=np.empty(0, dtype=np.float32)),
              Draft(ids=np.array([5], dtype=np.int64), q_values=np.array([0.5], dtype=np.float32),
                    verify_mask=np.array([True]), q_vectors=(b"v",))]
    for d in drafts:
        for token in (None, 0, 42):
            for redo in (None, M.Redo(1, "more", 2, False)):
                m = M.DraftMsg(3, 17, 9, token, d, redo)
                fast, general = m.to_wire(), M.Message.to_wire(m)
                assert list(fast[0].items()) == list(general[0].items())
                assert encode_message(*fast) == encode_message(*general)
