"""The accelerator path's parts (xcosd/accel/): the counted uniforms, the fixed-order sums, draws,
the batched warpers, and verification that does not depend on the batch.

The laws through the whole protocol are in ``tests/test_law_accel.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats

from xcosd.accel import DeviceReject, Round, on_request, supported, verify_batch
from xcosd.accel.draw import draw
from xcosd.accel.sums import fixed_cumsum, fixed_sum
from xcosd.accel.warp import warp_rows
from xcosd.draws import uniforms
from xcosd.errors import InvalidDistribution, ProtocolError
from xcosd.methods import Space, get_method
from xcosd.methods.base import (
    Answer,
    CandidatesReply,
    Draft,
    FullVectorReply,
    HybridReply,
    RejectState,
    Request,
    RequestKind,
    TokenReply,
)
from xcosd.methods.hybrid_resampling import HybridResampling
from xcosd.methods.sr_dv import SrDv
from xcosd.sampling import SamplingParams, warp
from xcosd.vocab import VocabMap

from .helpers.torch_threads import one_torch_thread  # noqa: F401
from .session_pairs import pair


def test_uniforms_are_a_function_of_their_counter() -> None:
    """A uniform depends on (key, round, stream, index) alone: asked for in a batch
    of 1,000 or alone, the same bits; and they are uniform."""
    keys = np.arange(1000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    batch = uniforms(keys, 7, 3, np.arange(1000) % 5)
    alone = np.array([uniforms(int(k), 7, 3, i % 5) for i, k in enumerate(keys)])
    assert np.array_equal(batch, alone)
    assert uniforms(1, 7, 3, 0) != uniforms(1, 8, 3, 0) != uniforms(1, 7, 4, 0)
    # uniform along each axis of the name (4 checks, each failing by chance at 1e-4)
    for many in (uniforms(12345, np.arange(20_000), 0, 0),
                 uniforms(12345, 5, np.arange(20_000), 0),
                 uniforms(12345, 5, 0, np.arange(20_000)),
                 uniforms(np.arange(20_000), 5, 0, 0)):
        assert stats.kstest(many, "uniform").pvalue > 1e-4
        assert many.min() >= 0.0 and many.max() < 1.0


def test_fixed_sums_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand((64, 3001), generator=g) ** 8
    whole_sum, whole_cum = fixed_sum(x), fixed_cumsum(x)
    for i in (0, 17, 63):
        assert torch.equal(fixed_sum(x[i: i + 1])[0], whole_sum[i])
        assert torch.equal(fixed_cumsum(x[i: i + 1])[0], whole_cum[i])
    exact = x.to(torch.float64).sum(-1)
    assert torch.allclose(whole_sum, exact, rtol=1e-12, atol=0)
    assert torch.allclose(whole_cum[:, -1], whole_sum, rtol=1e-12, atol=0)


def test_draws_follow_their_row() -> None:
    """Chi-square and TV of 40,000 counted draws against a known row with zeros, the
    zeros never drawn; a row without mass is refused."""
    p = np.array([0.0, 0.1, 0.0, 0.25, 0.05, 0.0, 0.4, 0.2], dtype=np.float32)
    u = uniforms(99, 0, 1, np.arange(40_000))
    got = draw(torch.from_numpy(p)[None].expand(40_000, -1),
               torch.from_numpy(u)[:, None])[:, 0].numpy()
    counts = np.bincount(got, minlength=p.shape[0])
    assert counts[p == 0].sum() == 0
    pos = p > 0
    assert stats.chisquare(counts[pos], p[pos] / p.sum() * counts.sum()).pvalue > 1e-3
    assert 0.5 * np.abs(counts / counts.sum() - p / p.sum()).sum() < 0.01
    # a draw at the very top of the range stays on a weighted index
    top = draw(torch.from_numpy(p)[None], torch.tensor([[1.0 - 2**-53]], dtype=torch.float64))
    assert int(top) == 7
    with pytest.raises(InvalidDistribution):
        draw(torch.zeros((1, 4)), torch.zeros((1, 1), dtype=torch.float64))


WARPERS = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9),
           SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=1.3, top_k=20,
                                                                     top_p=0.8),
           SamplingParams(top_k=1), SamplingParams(temperature=0.5, top_p=0.5)]


@pytest.mark.parametrize("params", WARPERS, ids=lambda sp: sp.label())
def test_warpers_match_the_numpy_path(params: SamplingParams) -> None:
    """The same kept sets as :func:`xcosd.sampling.warp` (transformers' rules), values
    within float32 rounding, on peaked rows with exact ties."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(4096, 0.05), size=6).astype(np.float32)
    p[:, 10] = p[:, 11] = p[:, 12] = p.max(axis=1)  # ties at the top
    p /= p.sum(axis=1, keepdims=True)
    want = warp(p, params)
    got = warp_rows(torch.from_numpy(p), [params] * 6).numpy()
    assert np.array_equal(want > 0, got > 0)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-9)
    assert np.allclose(got.sum(axis=1, dtype=np.float64), 1.0, atol=1e-5)


def test_a_batch_mixes_warpers_row_by_row() -> None:
    rng = np.random.default_rng(2)
    p = torch.from_numpy(rng.dirichlet(np.full(500, 0.1), size=len(WARPERS)).astype(np.float32))
    mixed = warp_rows(p, WARPERS)
    for i, sp in enumerate(WARPERS):
        assert torch.equal(mixed[i], warp_rows(p[i: i + 1], [sp])[0])


def test_top_p_keeps_the_lowest_ids_of_a_tie_at_the_cut() -> None:
    """Stable ascending sort: at a tie straddling the cut the lowest ids go first."""
    p = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2]])
    got = warp_rows(p, [SamplingParams(top_p=0.5)])[0]
    assert (got > 0).tolist() == [False, False, True, True, True]


# -- verification that does not depend on the batch --------------------------------

METHODS = ["ar", "sd-uplink", "straightforward", "xcosd", "xcosd-e", "target-resample",
           "greedy-resample", "uhlm"]


def _rounds(n: int, seed: int) -> tuple[list[Round], list[torch.Tensor], Space]:
    """``n`` rounds of mixed methods and warpers on the cross-vocabulary pair's space:
    random target rows, drafts drawn from random q over V_C."""
    target, draft = pair()
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    rng = np.random.default_rng(seed)
    rounds, rows = [], []
    for i in range(n):
        m = get_method(METHODS[i % len(METHODS)])
        d = 0 if not m.drafts else int(rng.integers(1, 5))
        q = rng.dirichlet(np.full(space.n_common, 0.3), size=max(d, 1)).astype(np.float32)
        pos = np.array([rng.choice(space.n_common, p=q[j] / q[j].sum()) for j in range(d)],
                       dtype=np.int64)
        ids = space.common_ids[pos]
        qv = q[np.arange(d), pos].astype(np.float32)
        vecs = None
        mask = None
        if m.name in ("sd-uplink", "uhlm"):
            mask = np.ones(d, dtype=bool) if m.name == "uhlm" else None
            vecs = tuple(m.codec.encode(q[j]) for j in range(d))
        dr = Draft(ids=ids, q_values=qv, q_vectors=vecs, verify_mask=mask)
        params = WARPERS[i % 5] if i % 3 else SamplingParams()
        rounds.append(Round(m, space, params, dr, key=1_000 + i, round=int(rng.integers(0, 50))))
        rows.append(torch.from_numpy(
            rng.dirichlet(np.full(space.target_size, 0.4), size=d + 1).astype(np.float32)))
    return rounds, rows, space


def _same(a: object, b: object, exact: bool = True) -> bool:
    """The same reply, bit for bit; or (``exact=False``) the same draws: the same
    tokens, candidates and V_O sample, the values beside them those of the warped row,
    which numpy and torch may round an ulp apart."""
    if type(a) is not type(b):
        return False
    if isinstance(a, TokenReply):
        return a.token == b.token  # type: ignore[attr-defined]
    if isinstance(a, CandidatesReply):
        values = np.array_equal if exact else lambda x, y: np.allclose(x, y, rtol=1e-5)
        return (np.array_equal(a.ids, b.ids)  # type: ignore[attr-defined]
                and values(a.values, b.values))  # type: ignore[attr-defined]
    if isinstance(a, HybridReply):
        if not exact:
            return (a.other_token == b.other_token  # type: ignore[attr-defined]
                    and abs(a.theta_o - b.theta_o) <= 1e-6)  # type: ignore[attr-defined]
        return (a.data, a.theta_o, a.other_token) == (  # type: ignore[attr-defined]
            b.data, b.theta_o, b.other_token)  # type: ignore[attr-defined]
    if isinstance(a, FullVectorReply):
        return not exact or a.data == b.data  # type: ignore[attr-defined]
    raise AssertionError(type(a))


def test_a_session_verified_alone_or_in_a_batch_gets_the_same_bits() -> None:
    """200 sessions of every method and warper, verified in one batch, alone, and in
    another order: the same verdicts, payloads and follow-ups, bit for bit."""
    rounds, rows, space = _rounds(200, seed=3)
    batch = verify_batch(rounds, rows)
    order = np.random.default_rng(4).permutation(len(rounds))
    shuffled = verify_batch([rounds[i] for i in order], [rows[i] for i in order])
    back = {int(i): o for i, o in zip(order, shuffled, strict=True)}
    kinds = set()
    for i, (rd, rw) in enumerate(zip(rounds, rows, strict=True)):
        [alone] = verify_batch([rd], [rw])
        for other in (batch[i], back[i]):
            assert other.error is None and alone.error is None
            assert other.accepted == alone.accepted
            assert _same(other.reply, alone.reply), (rd.method.name, other.reply, alone.reply)
        kinds.add(type(alone.reply).__name__)
        if rd.method.name == "xcosd-e" and alone.reject is not None:
            assert batch[i].reject is not None
            more = [on_request(rd.method, st, Request(RequestKind.MORE), space)
                    for st in (alone.reject, batch[i].reject)]
            assert _same(*more)
    assert kinds == {"TokenReply", "CandidatesReply", "HybridReply", "FullVectorReply"}


def test_the_host_and_the_device_draw_the_same_numbers() -> None:
    """One randomness model: the host's verification (:func:`verify_round`, numpy)
    and the device's (:func:`verify_batch`, torch) take every uniform from the same
    counters (xcosd/draws.py), so the same round gets the same verdict, payload and
    follow-ups on both paths: 400 rounds of every method and warper, on the
    cross-vocabulary pair's space (trees: ``tests/test_law_accel.py``). Only a draw whose uniform falls within
    rounding of a token's boundary could differ (the two paths sum a row in different
    orders); none does here. With the host's generator sequential, as it was, most
    verdicts differ (the control at the end)."""
    from xcosd.methods.round import verify_round

    rounds, rows, space = _rounds(400, seed=21)
    device = verify_batch(rounds, rows)
    same = rejected = 0
    for rd, rw, dev in zip(rounds, rows, device, strict=True):
        host = verify_round(rd, rw.numpy())
        assert host.error is None and dev.error is None
        assert host.accepted == dev.accepted, rd.method.name
        assert _same(host.reply, dev.reply, exact=False), (rd.method.name, host.reply, dev.reply)
        same += 1
        if rd.method.name == "xcosd-e" and host.reject is not None:
            assert isinstance(host.reject, RejectState) and dev.reject is not None
            rejected += 1
            for kind in (RequestKind.MORE, RequestKind.FALLBACK):
                a = rd.method.on_request(host.reject, Request(kind), space, rd.draws())
                b = on_request(rd.method, dev.reject, Request(kind), space)
                assert _same(a, b, exact=False), kind
    assert same == len(rounds) and rejected > 20
    # the control: the host's draws from a sequential generator seeded alike
    from xcosd.methods.round import verify_block
    differ = sum(verify_block(rd.method, rw.numpy(), rd.draft, space,
                              np.random.default_rng(rd.key)).accepted != dev.accepted
                 for rd, rw, dev in zip(rounds, rows, device, strict=True)
                 if rd.draft.length and rd.params.identity)
    assert differ > 20


def test_follow_ups_keep_the_numpy_paths_rules() -> None:
    rounds, rows, space = _rounds(40, seed=5)
    srdv = next(i for i, rd in enumerate(rounds) if rd.method.name == "xcosd-e"
                and verify_batch([rd], [rows[i]])[0].reject is not None)
    rd = rounds[srdv]
    out = verify_batch([rd], [rows[srdv]])[0]
    st = out.reject
    assert isinstance(st, DeviceReject) and isinstance(out.reply, CandidatesReply)
    assert st.rejected not in out.reply.ids.tolist()  # conditioned on y != x_j
    assert np.array_equal(out.reply.values, st.p_star[torch.from_numpy(out.reply.ids)].numpy())
    seen = {tuple(out.reply.ids.tolist())}
    m = rd.method
    for _ in range(m.M - 1):  # type: ignore[attr-defined]
        r = on_request(m, st, Request(RequestKind.MORE), space)
        assert isinstance(r, CandidatesReply)
        seen.add(tuple(r.ids.tolist()))
    assert len(seen) == m.M  # type: ignore[attr-defined]  # a fresh stream each round
    with pytest.raises(ProtocolError):
        on_request(m, st, Request(RequestKind.MORE), space)
    fb = on_request(m, st, Request(RequestKind.FALLBACK), space)
    assert isinstance(fb, HybridReply)
    with pytest.raises(ProtocolError):
        on_request(m, st, Request(RequestKind.FALLBACK), space)
    with pytest.raises(ProtocolError):
        on_request(get_method("sd-uplink"), st, Request(RequestKind.OTHER), space)


def test_the_device_reads_a_method_s_answers_not_its_name() -> None:
    """A method the device path has never heard of, a subclass under a new name
    with the same answers (and one answering with another kind), is verified by what
    it declares: the same bits as the method it copies, and the other kind's reply."""
    class Renamed(SrDv):
        name = "renamed-sr-dv"

    class TokenInstead(HybridResampling):
        name = "hr-answering-tokens"
        rejection = Answer.TOKEN

    rounds, rows, _ = _rounds(60, seed=11)
    done = 0
    for rd, rw in zip(rounds, rows, strict=True):
        if rd.method.name not in ("xcosd-e", "xcosd"):
            continue
        twin = Renamed() if rd.method.name == "xcosd-e" else TokenInstead()
        [a] = verify_batch([rd], [rw])
        [b] = verify_batch([dataclasses.replace(rd, method=twin)], [rw])
        assert a.error is None and b.error is None and a.accepted == b.accepted
        if rd.method.name == "xcosd-e" or a.reject is None:
            assert _same(a.reply, b.reply)
        else:  # a token from p*_j where HR sends its payload
            assert isinstance(a.reply, HybridReply) and isinstance(b.reply, TokenReply)
            done += 1
    assert done > 0


def test_bad_drafts_fail_their_session_alone() -> None:
    rounds, rows, _ = _rounds(16, seed=6)
    bad = next(i for i, rd in enumerate(rounds) if rd.draft.length and rd.method.name == "xcosd")
    rd = rounds[bad]
    q = rd.draft.q_values.copy()
    q[0] = 0.0
    rounds[bad] = Round(rd.method, rd.space, rd.params,
                        Draft(ids=rd.draft.ids, q_values=q), rd.key, rd.round)
    short = (bad + 1) % 16
    rows[short] = rows[short][:-1] if rows[short].shape[0] > 1 else rows[short][:0]
    got = verify_batch(rounds, rows)
    assert got[bad].error is not None and isinstance(got[bad].error, InvalidDistribution)
    assert got[short].error is not None
    ok = [i for i in range(16) if i not in (bad, short)]
    assert all(got[i].error is None for i in ok)
    alone = [verify_batch([rounds[i]], [rows[i]])[0] for i in ok]
    assert all(a.accepted == got[i].accepted and _same(a.reply, got[i].reply)
               for a, i in zip(alone, ok, strict=True))


def test_which_codecs_commit_on_the_device() -> None:
    assert supported(get_method("xcosd-e", codec="f32"))
    assert supported(get_method("xcosd", codec="sparse"))
    assert supported(get_method("sd-uplink", codec="q8"))  # its codec is on q
    assert supported(get_method("straightforward", codec="f16"))
    assert supported(get_method("xcosd-e", codec="bf16+zstd"))
    assert not supported(get_method("xcosd-e", codec="q8"))
    assert not supported(get_method("xcosd", codec="topk:3"))


@pytest.mark.parametrize("codec", ["f16", "bf16", "f16+zstd"])
def test_the_device_commits_what_the_host_decodes(codec: str) -> None:
    """Bit for bit: the committed rows made in torch equal the numpy commit rule's,
    which is what the device computes from the bytes (straightforward's whole row,
    and the hybrid row of xcosd / xcosd-e with its V_O part), on rows with a long tail
    that reaches f16's subnormals and flushes to zero."""
    from xcosd.accel.commit import committed_full, committed_hybrid, device_commit, theta_other
    from xcosd.codecs import get_codec
    from xcosd.methods import commit as host

    target, draft = pair()
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    rng = np.random.default_rng(9)
    c = get_codec(codec)
    fn = device_commit(c)
    assert fn is not None
    for size, sp in ((space.target_size, space),
                     (50_000, Space(50_000, np.sort(rng.choice(50_000, 30_000, replace=False))))):
        logits = rng.standard_normal((4, size)) * 6.0
        rows = np.exp(logits - logits.max(axis=1, keepdims=True)).astype(np.float32)
        rows /= rows.sum(axis=1, keepdims=True)
        t = torch.from_numpy(rows)
        full = committed_full(fn, t).numpy()
        common = torch.from_numpy(sp.common_ids)
        other = torch.from_numpy(sp.other_mask)
        hyb = committed_hybrid(fn, t, common, other).numpy()
        sent = theta_other(t, other).tolist()  # the theta_o the device path sends
        for r in range(4):
            assert np.array_equal(full[r], host.committed_full(c, rows[r]))
            # what the device makes of the bytes and the theta_o on the wire
            dec = c.decode(c.encode(rows[r][sp.common_ids]), sp.n_common)
            p_c, _ = host.hybrid_view(c, dec, float(sent[r]))
            assert np.array_equal(hyb[r][sp.common_ids], p_c)
            assert hyb[r][sp.other_ids].sum(dtype=np.float64) > 0


def test_candidates_leave_out_the_rejected_draft() -> None:
    """SR-DV's candidates are drawn from ``p`` given ``y != x_j``, even where ``x_j``
    holds most of the mass (it has alpha = 0: sending it would waste a slot); when
    rounding left all of the mass on it, from ``p`` itself."""
    _, _, space = _rounds(1, seed=7)
    m = get_method("xcosd-e")
    row = torch.zeros(space.target_size)
    row[5], row[2], row[7] = 0.9, 0.06, 0.04
    st = DeviceReject(row, rejected=5, key=3, round=2)
    r = on_request(m, st, Request(RequestKind.MORE), space)
    assert isinstance(r, CandidatesReply) and r.ids.shape[0] == m.K  # type: ignore[attr-defined]
    assert 5 not in r.ids.tolist() and set(r.ids.tolist()) <= {2, 7}
    assert np.allclose(r.values, row[torch.from_numpy(r.ids)].numpy())
    alone = torch.zeros(space.target_size)
    alone[5] = 1.0
    r2 = on_request(m, DeviceReject(alone, rejected=5, key=3, round=2), Request(RequestKind.MORE),
                    space)
    assert set(r2.ids.tolist()) == {5}  # type: ignore[attr-defined]


def _inverse_cdf(row: np.ndarray, u: float) -> int:
    """The index ``sample_index`` draws from ``row`` for the uniform ``u``."""
    c = np.cumsum(row.astype(np.float64))
    return int(np.searchsorted(c, u * c[-1], side="right"))


def test_draws_use_the_documented_counters() -> None:
    """The streams docs/MODELS.md names: the accept test of draft ``i`` uses (round, 0,
    i), the terminal token (round, 1, 0), the V_O sample (round, 2, 0), SR-DV's c-th
    candidate round (round, 3 + c, k); a plugin or a second implementation can draw
    the same numbers."""
    target, draft = pair()
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    rng = np.random.default_rng(8)
    row = rng.dirichlet(np.full(space.target_size, 1.0)).astype(np.float32)
    key, rnd = 77, 12
    # ar: no drafts, the terminal token is (round, 1, 0)'s draw from row 0
    ar = Round(get_method("ar"), space, SamplingParams(), Draft(ids=np.zeros(0, dtype=np.int64),
               q_values=np.zeros(0, dtype=np.float32)), key, rnd)
    [out] = verify_batch([ar], [torch.from_numpy(row[None])])
    assert out.reply.token == _inverse_cdf(row, float(uniforms(key, rnd, 1, 0)))  # type: ignore[attr-defined]
    # xcosd-e: one draft with q = 1 on a token of p = 0 (rejected whatever u), then K
    # candidates from stream 3 (the first candidate round), index k
    x = int(space.common_ids[0])
    p = row.copy()
    p[x] = 0.0
    p /= p.sum()
    srdv = Round(get_method("xcosd-e"), space, SamplingParams(),
                 Draft(ids=np.array([x]), q_values=np.ones(1, dtype=np.float32)), key, rnd)
    [out] = verify_batch([srdv], [torch.from_numpy(np.stack([p, p]))])
    assert out.accepted == 0 and isinstance(out.reply, CandidatesReply)
    want = [_inverse_cdf(p, float(u)) for u in uniforms(key, rnd, 3, np.arange(20))]
    assert out.reply.ids.tolist() == want
    # hybrid resampling's presampled V_O token is (round, 2, 0)'s draw from p | V_O
    hr = Round(get_method("xcosd"), space, SamplingParams(), srdv.draft, key, rnd)
    [out] = verify_batch([hr], [torch.from_numpy(np.stack([p, p]))])
    assert isinstance(out.reply, HybridReply)
    vo = np.where(space.other_mask, p, 0.0)
    assert out.reply.other_token == _inverse_cdf(vo, float(uniforms(key, rnd, 2, 0)))
    # without presampling there is none: the device asks for it when its coin says so
    nopre = Round(get_method("xcosd", hr_presample=False), space, SamplingParams(), srdv.draft,
                  key, rnd)
    [out] = verify_batch([nopre], [torch.from_numpy(np.stack([p, p]))])
    assert isinstance(out.reply, HybridReply) and out.reply.other_token is None
    # the accept test of draft i: u(round, 0, i) * q < p(x_i)
    p2 = row.copy()
    p2[x] = 0.0
    p2 *= 0.5 / p2.sum()
    p2[x] = 0.5
    for r in range(8):
        rd = Round(get_method("xcosd-e"), space, SamplingParams(),
                   Draft(ids=np.array([x]), q_values=np.ones(1, dtype=np.float32)), key, r)
        [got] = verify_batch([rd], [torch.from_numpy(np.stack([p2, p2]))])
        assert got.accepted == int(uniforms(key, r, 0, 0) < float(p2[x]))


def test_a_draw_at_the_top_of_the_range_stays_on_a_weight() -> None:
    """Rows whose mass ends blocks before the row does: the largest uniform draws the
    last id with weight, never one of the empty ids after it."""
    from xcosd.accel.draw import BLOCK

    w = torch.zeros((2, 3 * BLOCK + 7))
    w[0, 5], w[0, 17] = 0.25, 0.75
    w[1, BLOCK + 3] = 1.0
    top = torch.full((2, 1), 1.0 - 2**-53, dtype=torch.float64)
    assert draw(w, top)[:, 0].tolist() == [17, BLOCK + 3]


def test_a_batch_mixing_peers_settings_answers_each_by_its_own(
        caplog: pytest.LogCaptureFixture) -> None:
    """One target, sessions from peers whose V_C maps, codecs and method options
    differ, in one batch: each payload is gathered over its own V_C, encoded with its
    own codec and sized by its own options, bit for bit what it gets verified alone."""
    target, draft = pair()
    own = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    other = Space(own.target_size, np.array([0, 2, 4, 6, 7]))
    rng = np.random.default_rng(10)
    kinds = [("xcosd", "f32", {}), ("xcosd", "f16", {"hr_presample": False}),
             ("xcosd-e", "f32", {"K": 3}), ("xcosd-e", "bf16", {}), ("straightforward", "f16", {}),
             ("straightforward", "sparse", {}), ("sd-uplink", "f32", {}), ("sd-uplink", "f16", {})]
    rounds, rows = [], []
    for i in range(64):
        name, codec, opts = kinds[i % len(kinds)]
        space = own if (i // len(kinds)) % 2 else other
        m = get_method(name, codec=codec, **opts)
        q = rng.dirichlet(np.full(space.n_common, 0.3)).astype(np.float32)
        q = m.draft_row(q)
        pos = int(rng.choice(space.n_common, p=q / q.sum()))
        vecs = (m.codec.encode(q),) if name == "sd-uplink" else None
        dr = Draft(ids=space.common_ids[[pos]], q_values=q[[pos]], q_vectors=vecs)
        rounds.append(Round(m, space, SamplingParams(), dr, key=500 + i, round=3))
        rows.append(torch.from_numpy(
            rng.dirichlet(np.full(space.target_size, 0.4), size=2).astype(np.float32)))
    with caplog.at_level("ERROR", logger="xcosd.accel.verify"):
        batch = verify_batch(rounds, rows)
    # verified as one batch, not rescued by the session-by-session retry
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    rejected = 0
    for rd, rw, got in zip(rounds, rows, batch, strict=True):
        [alone] = verify_batch([rd], [rw])
        assert got.error is None and alone.error is None, (got.error, alone.error)
        assert got.accepted == alone.accepted and _same(got.reply, alone.reply), rd.method
        rejected += got.reject is not None
        if isinstance(got.reply, HybridReply):
            # decodable with the session's own codec over its own V_C
            assert rd.method.codec.decode(got.reply.data, rd.space.n_common).shape == (
                rd.space.n_common,)
            assert (got.reply.other_token is None) == (not rd.method.hr_presample  # type: ignore[attr-defined]
                                                       or got.reply.theta_o == 0)
        if isinstance(got.reply, CandidatesReply):
            assert got.reply.ids.shape[0] == rd.method.K  # type: ignore[attr-defined]
    assert rejected > 20
