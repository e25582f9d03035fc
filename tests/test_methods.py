"""What each method puts on the wire, and the protocol rules of its follow-ups."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.errors import ProtocolError
from xcosd.methods import LOSSLESS, LOSSY, METHODS, Request, Space, get_method
from xcosd.methods.base import CandidatesReply, HybridReply, RejectState
from xcosd.simulate import simulate_resample, simulate_round

from .helpers.pairs import vo_heavy


def always_rejecting_pair(size=20, n_common=8):
    """The draft proposes only token c0, which the target never emits."""
    common = np.zeros(size, dtype=bool)
    common[np.arange(0, 2 * n_common, 2)] = True
    p = np.where(common, 0.05, 0.0) + np.where(~common, 1.0, 0.0)
    p[0] = 0.0
    p = (p / p.sum()).astype(np.float32)
    q = np.zeros(size, np.float32)
    q[0] = 1
    return np.stack([p, p]), q[None], common


def test_registry():
    assert set(LOSSLESS) == {"ar", "sd-uplink", "straightforward", "xcosd", "xcosd-e"}
    assert set(LOSSY) == {"target-resample", "greedy-resample", "uhlm"}
    assert set(METHODS) == set(LOSSLESS) | set(LOSSY)
    with pytest.raises(TypeError):
        get_method("xcosd", K=3)  # K is xcosd-e's option, not HR's


def test_bytes_per_rejection():
    target, draft, common = always_rejecting_pair()
    size, nc = common.size, int(common.sum())
    rng = np.random.default_rng(0)
    up_draft = 4 + 4  # one id, one q value
    cases = {
        "straightforward": 4 + 4 * size,
        "xcosd": 4 + 4 * nc + 4 + 4,  # verdict count, p over V_C, theta_o, presampled y
        "target-resample": 4 + 4,
        "greedy-resample": 4 + 4,
        "sd-uplink": 4 + 4,
    }
    for name, down in cases.items():
        r = simulate_round(name, target, draft, common, rng)
        assert r.accepted == 0 and r.round_trips == 1
        assert r.downlink_bytes == down, name
        extra_up = 4 * nc if name == "sd-uplink" else 0  # the full q vector goes up
        assert r.uplink_bytes == up_draft + extra_up, name
    r = simulate_round("xcosd-e", target, draft, common, rng, K=5, M=3)
    assert r.downlink_bytes % 8 == 4  # K candidates of (id, value) per round, + count
    assert r.round_trips == (r.downlink_bytes - 4) // 40  # one trip per candidate round


def test_hr_paper_variant_costs_a_round_trip_only_on_vo():
    target, draft, common = always_rejecting_pair()
    rng = np.random.default_rng(1)
    res = [simulate_round("xcosd", target, draft, common, rng, hr_presample=False)
           for _ in range(300)]
    vo = [r for r in res if not common[r.tokens[0]]]
    vc = [r for r in res if common[r.tokens[0]]]
    assert vo and vc
    assert all(r.round_trips == 2 for r in vo) and all(r.round_trips == 1 for r in vc)
    assert all(r.downlink_bytes == 4 + 4 * int(common.sum()) + 4 + 4 for r in vo)
    # the follow-up's request goes up too: one byte, counted beside the draft's
    assert all(r.uplink_bytes == 4 + 4 + 1 for r in vo) and all(r.uplink_bytes == 8 for r in vc)
    for r in res:
        assert r.uplink_bytes == sum(n for way, _, n in r.messages if way == "up")
        assert r.downlink_bytes == sum(n for way, _, n in r.messages if way == "down")


def test_full_acceptance_sends_a_bonus_token():
    p = np.array([0.5, 0.5, 0.0], np.float32)
    common = np.array([True, True, False])
    r = simulate_round("xcosd", np.stack([p, p, p]), np.stack([p, p]), common,
                       np.random.default_rng(0))
    assert r.accepted == 2 and len(r.tokens) == 3 and r.downlink_bytes == 8


def test_srdv_follow_up_rules():
    target, _draft, common = vo_heavy(d=1)
    space = Space.from_mask(common)
    m = get_method("xcosd-e", K=2, M=2)
    rng = np.random.default_rng(0)
    st = RejectState(p_raw=target[0], p_star=target[0], rejected=int(np.flatnonzero(common)[0]))
    first = m.on_reject(st, space, rng)
    assert isinstance(first, CandidatesReply) and first.ids.shape == (2,)
    assert st.rejected not in first.ids.tolist()  # candidates skip the rejected draft
    m.on_request(st, Request("more"), space, rng)
    with pytest.raises(ProtocolError):
        m.on_request(st, Request("more"), space, rng)  # beyond M rounds
    assert isinstance(m.on_request(st, Request("fallback"), space, rng), HybridReply)
    with pytest.raises(ProtocolError):
        m.on_request(st, Request("fallback"), space, rng)
    with pytest.raises(ProtocolError):
        Request("bogus")
    with pytest.raises(ProtocolError):
        get_method("xcosd").on_request(st, Request("more"), space, rng)


def test_srdv_counts_trials_and_fallbacks():
    target, draft, common = vo_heavy(d=1, seed=3)
    rng = np.random.default_rng(2)
    q = draft[0]
    rejected = int(np.argmax(np.where(common, q - target[0], -np.inf)))
    res = [simulate_resample("xcosd-e", target[0], q, rejected, common, rng, K=1, M=1)
           for _ in range(2000)]
    assert all(r.trials >= 1 for r in res)
    fb = [r for r in res if r.fallbacks]
    assert fb and all(r.round_trips >= 2 for r in fb)


@pytest.mark.parametrize("k", [1, 20, 64, 65, 300])
def test_srdv_candidates_are_tested_as_the_formula_says(k: int) -> None:
    """``first_accepted`` (one by one up to 64 candidates, one vectorised pass past
    that) accepts exactly the candidate the acceptance rule names: the first with
    ``u < max(p - q, 0) / p`` (1 on V_O, 0 where ``p`` is 0), in float64 from the
    float32 values; ties ``u == alpha`` and zero values included."""
    from xcosd.methods.sr_dv import first_accepted

    rng = np.random.default_rng(k)
    size = 400
    common = rng.random(size) < 0.7
    space = Space.from_mask(common)
    checked = hits = 0
    for t in range(300):
        q = rng.dirichlet(np.full(space.common_ids.shape[0], 0.3)).astype(np.float32)
        ids = rng.integers(0, size, k)
        if t % 3 == 0:  # V_C candidates the draft covers: none can be accepted
            ids = rng.choice(space.common_ids, k)
        values = rng.dirichlet(np.full(size, 0.3)).astype(np.float32)[ids]
        values[rng.random(k) < 0.1] = 0.0
        pos = space.to_common[ids]
        if t % 3 == 0:
            q[pos] = np.maximum(q[pos], values)
        q_at = np.where(pos >= 0, q[np.maximum(pos, 0)], 0.0).astype(np.float64)
        alpha = [1.0 if p < 0 else (max(float(v) - qa, 0.0) / float(v) if v > 0 else 0.0)
                 for p, v, qa in zip(pos.tolist(), values.tolist(), q_at.tolist(), strict=True)]
        u = rng.random(k)
        # some uniforms exactly at alpha: u < alpha is then false
        tie = rng.random(k) < 0.1
        u[tie] = np.asarray(alpha)[tie]
        want = next((i for i in range(k) if u[i] < alpha[i]), None)
        got = first_accepted(CandidatesReply(ids=ids, values=values), q, space, u)
        assert got == want
        checked += 1
        hits += got is not None
    assert checked == 300 and 0 < hits < 300


def test_uhlm_skips_confident_positions():
    size = 6
    common = np.array([True, True, True, False, False, False])
    p = np.full(size, 1 / size, np.float32)
    confident = np.array([0.96, 0.02, 0.02, 0, 0, 0], np.float32)
    unsure = np.array([0.4, 0.3, 0.3, 0, 0, 0], np.float32)
    rng = np.random.default_rng(0)
    r = simulate_round("uhlm", np.stack([p, p, p]), np.stack([confident, unsure]), common, rng,
                       threshold=0.3)
    # one q vector (3 floats) for the one uncertain position, plus a 1-byte mask
    assert r.uplink_bytes == 2 * 8 + 3 * 4 + 1


def test_a_draft_drawn_over_its_support_is_the_dense_draw() -> None:
    """After top-k the TLI row has a few dozen non-zeros among 100k+; the device draws
    over those only. Same inverse CDF, same single uniform: for every seed the same
    token as the draw over the whole row, so the same law; and a method that drafts
    from a committed row (sd-uplink) ignores the support."""
    from xcosd.methods.round import draft_token

    n = 120_000
    space = Space.from_mask(np.ones(n, dtype=bool))
    rng = np.random.default_rng(3)
    for trial in range(20):
        size = 1 if trial < 3 else int(rng.integers(2, 80))  # a point mass (greedy) too
        support = np.sort(rng.choice(n, size, replace=False))
        q = np.zeros(n, dtype=np.float32)
        q[support] = rng.dirichlet(np.full(support.shape[0], 0.3)).astype(np.float32)
        for m in (get_method("xcosd-e"), get_method("sd-uplink", codec="q8")):
            for seed in range(50):
                g_dense, g_sparse = np.random.default_rng(seed), np.random.default_rng(seed)
                dense, _ = draft_token(m, q, space, g_dense)
                sparse, _ = draft_token(m, q, space, g_sparse, support)
                assert dense == sparse, (trial, m.name, seed)
                assert q[space.to_common[sparse]] > 0
                # one uniform either way, a one-token support included
                assert g_dense.random() == g_sparse.random()
