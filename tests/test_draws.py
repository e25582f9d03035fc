"""A round's random numbers are counted (xcosd/draws.py): the host's streams give
a keyed hash's bits, a round's verification is a pure function of its plain data, and a
follow-up asked again gets the same answer."""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from xcosd.draws import (
    ACCEPT,
    CANDIDATES,
    OTHER,
    TOKEN,
    RoundDraws,
    draw_at,
    uniforms,
)
from xcosd.methods import Space, get_method
from xcosd.methods.base import Answer, Draft, RejectState, Request, RequestKind, answer_stream
from xcosd.methods.round import Round, verify_round
from xcosd.sampling import SamplingParams
from xcosd.vocab import VocabMap

from .session_pairs import pair


def _at(key: int, rnd: int, st: int, i: int) -> float:
    """Uniform ``i`` of a stream as the docstring of xcosd/draws.py defines it."""
    digest = hashlib.blake2b(struct.pack("<QQQ", rnd, st, i // 8),
                             key=key.to_bytes(8, "little"), digest_size=64).digest()
    word = struct.unpack("<8Q", digest)[i % 8]
    return (word >> 11) / float(1 << 53)


def test_a_stream_gives_its_counters_bits_one_at_a_time_or_many() -> None:
    for key, rnd, st in [(0, 0, 0), (2**64 - 1, 2**40 + 3, 7), (12345, 9, CANDIDATES + 2),
                         (5, 3, TOKEN), (7, 1, CANDIDATES)]:
        want = [_at(key, rnd, st, i) for i in range(40)]
        assert uniforms(key, rnd, st, np.arange(40)).tolist() == want
        one = RoundDraws(key, rnd).stream(st)
        assert [one.random() for _ in range(40)] == want
        many = RoundDraws(key, rnd).stream(st)
        got = np.concatenate([many.random(3), many.random(20), many.random(17)])
        assert got.tolist() == want and many.drawn == 40
        assert RoundDraws(key, rnd).stream(st).at(31) == want[31]
        assert RoundDraws(key, rnd).stream(st).first(11) == want[:11]
    assert draw_at(RoundDraws(1, 2).stream(3), 5) == float(uniforms(1, 2, 3, 5))
    assert draw_at(np.random.default_rng(0), 5) == np.random.default_rng(0).random()
    # the accelerator's batched form: one number per element, whatever the grouping
    keys = np.array([4, 4, 9, 4]), np.array([1, 1, 1, 2])
    got = uniforms(keys[0], keys[1], TOKEN, np.array([0, 9, 0, 0]))
    assert got.tolist() == [_at(4, 1, TOKEN, 0), _at(4, 1, TOKEN, 9), _at(9, 1, TOKEN, 0),
                            _at(4, 2, TOKEN, 0)]


def test_streams_and_rounds_are_apart() -> None:
    """Different rounds, streams and keys give different numbers; the same give the
    same (a verification run again draws what it drew)."""
    seen = {RoundDraws(k, r).stream(s).random() for k in (1, 2) for r in (0, 1) for s in
            (ACCEPT, TOKEN, OTHER, CANDIDATES)}
    assert len(seen) == 16
    assert RoundDraws(5, 3).stream(TOKEN).random() == RoundDraws(5, 3).stream(TOKEN).random()


def test_every_answer_kind_has_its_stream() -> None:
    st = RejectState(np.ones(4, np.float32), np.ones(4, np.float32), 0, candidate_rounds=2)
    assert answer_stream(Answer.CANDIDATES, st) == CANDIDATES + 2
    assert answer_stream(Answer.OTHER, st) == answer_stream(Answer.HYBRID, st) == OTHER
    for k in (Answer.TOKEN, Answer.RESIDUAL, Answer.ARGMAX, Answer.FULL):
        assert answer_stream(k, st) == TOKEN


def _round(method: str, seed: int, r: int) -> tuple[Round, np.ndarray]:
    target, draft = pair()
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    rng = np.random.default_rng(seed)
    d = 4
    q = rng.dirichlet(np.full(space.n_common, 0.3), size=d).astype(np.float32)
    pos = np.array([rng.choice(space.n_common, p=q[j] / q[j].sum()) for j in range(d)])
    dr = Draft(ids=space.common_ids[pos], q_values=q[np.arange(d), pos].astype(np.float32))
    rows = rng.dirichlet(np.full(space.target_size, 0.4), size=d + 1).astype(np.float32)
    return Round(get_method(method), space, SamplingParams(top_p=0.9), dr, seed, r), rows


def _key(o: object) -> str:
    return repr((o.accepted, o.reply))  # type: ignore[attr-defined]


def test_a_round_s_server_half_is_a_pure_function_of_its_data() -> None:
    """The same round verified twice, or after other rounds of its session, gives
    the same outcome; another round number or seed gives other draws."""
    outcomes = {}
    for seed in range(30):
        rd, rows = _round("xcosd-e", seed, 4)
        first = _key(verify_round(rd, rows))
        for other_seed in (seed + 100, seed + 200):  # other sessions verified between
            verify_round(*_round("xcosd", other_seed, 4))
        assert _key(verify_round(rd, rows)) == first
        outcomes[seed] = first
        again, _ = _round("xcosd-e", seed, 5)
        outcomes[-seed - 1] = _key(verify_round(again, rows))
    assert len(set(outcomes.values())) > 40


def test_a_follow_up_asked_again_gets_the_same_answer() -> None:
    """A peer cannot fish for fresh draws by asking a follow-up again: the answer is
    the round's, drawn from its counters."""
    for seed in range(40):
        rd, rows = _round("xcosd-e", seed, 2)
        o = verify_round(rd, rows)
        if o.reject is None:
            continue
        assert isinstance(o.reject, RejectState)
        st = o.reject
        a = rd.method.on_request(st, Request(RequestKind.FALLBACK), rd.space, rd.draws())
        st.fallback_sent = False  # as if the answer were lost and asked for again
        b = rd.method.on_request(st, Request(RequestKind.FALLBACK), rd.space, rd.draws())
        assert repr(a) == repr(b)
        return
    raise AssertionError("no rejection in 40 rounds")
