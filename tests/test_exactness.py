"""Every lossless method reproduces the target's distribution; every lossy one does not.

The emitted tokens of many independent rounds (fixed seeds) are compared with the
analytically known law: ``target_probs[0]`` for the first token, ``target_probs[1]``
for the second when the first draft was accepted, and the residual
``max(0, p - q) / Z`` for the resampling step alone.

These run one round at a time through ``xcosd/simulate.py`` on raw rows, which
makes adversarial shapes cheap (85 % of the mass on V_O, ``Z`` close to 0, point
masses, ``|V_C| = 1``, 200k-entry real vocabularies). Whole multi-draft generations
through the real state machines are ``tests/test_law.py``'s job.

Built to catch (chi-square at p > 1e-4 plus TV < 3 / sqrt(N), ``helpers/stats.py``):
at N = 50,000 a first-token deviation of TV 0.02 over 16 cells; at N = 20,000-30,000
TV 0.04; on the real cl100k -> o200k map (N = 2,000, 20 cells) TV 0.1 and any id
mapping error (a token off the target's support gives p = 0).
"""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.methods import Space, get_method
from xcosd.simulate import simulate_resample, simulate_round

from .helpers.law import committed_row
from .helpers.pairs import random_pair, residual, scatter_mask, vo_heavy, z_small
from .helpers.stats import assert_exact, assert_not_exact

LOSSLESS = [
    ("ar", {}),
    ("sd-uplink", {}),
    ("straightforward", {}),
    ("xcosd", {}),
    ("xcosd", {"hr_presample": False}),
    ("xcosd-e", {}),
    ("xcosd-e", {"K": 1, "M": 1}),
]
RESAMPLING = [v for v in LOSSLESS if v[0] != "ar"]


def _id(v: tuple[str, dict]) -> str:
    name, opts = v
    return name + "".join(f"-{k}{v}" for k, v in opts.items())


def run_rounds(name, opts, target, draft, common, n, seed):
    m = get_method(name, **opts)
    space = Space.from_mask(common)
    rng = np.random.default_rng(seed)
    return [simulate_round(m, target, draft, space, rng, validate=False) for _ in range(n)]


@pytest.mark.parametrize("variant", LOSSLESS, ids=_id)
def test_first_token_vo_heavy(variant):
    name, opts = variant
    target, draft, common = vo_heavy(d=1)
    rounds = run_rounds(name, opts, target, draft, common, 50_000, seed=11)
    assert_exact([r.tokens[0] for r in rounds], target[0], _id(variant))
    if name != "ar":
        assert sum(r.rejected for r in rounds) > 25_000  # the residual really was exercised
    if name == "xcosd-e" and opts.get("K") == 1:
        assert sum(r.fallbacks for r in rounds) > 500  # HR fallback really ran


@pytest.mark.parametrize("variant", RESAMPLING, ids=_id)
def test_resampling_when_z_is_close_to_zero(variant):
    name, opts = variant
    p, q, common = z_small()
    r = residual(p, q)
    assert (np.maximum(p.astype(np.float64) - q, 0).sum()) < 0.02  # Z really is small
    space = Space.from_mask(common)
    rng = np.random.default_rng(5)
    m = get_method(name, **opts)
    # a token the target under-weights relative to the draft (so it can be rejected)
    rejected = int(np.argmax(np.where(common, q - p, -np.inf)))
    tokens = [simulate_resample(m, p, q, rejected, space, rng).tokens[0] for _ in range(12_000)]
    assert_exact(tokens, r, f"{_id(variant)} residual, Z small")


@pytest.mark.parametrize("variant", RESAMPLING, ids=_id)
def test_residual_mostly_in_vo(variant):
    name, opts = variant
    target, draft, common = vo_heavy(d=1, seed=3)
    p, q = target[0], draft[0]
    r = residual(p, q)
    assert r[~common].sum() > 0.8
    rng = np.random.default_rng(6)
    m = get_method(name, **opts)
    space = Space.from_mask(common)
    rejected = int(np.argmax(np.where(common, q - p, -np.inf)))
    res = [simulate_resample(m, p, q, rejected, space, rng) for _ in range(20_000)]
    assert_exact([x.tokens[0] for x in res], r, f"{_id(variant)} residual in V_O")
    if name == "xcosd" and not opts.get("hr_presample", True):
        assert sum(x.round_trips > 1 for x in res) > 12_000  # the paper's extra round trip
    if name == "xcosd" and opts.get("hr_presample", True):
        assert all(x.round_trips == 1 for x in res)


@pytest.mark.parametrize("codec", ["topk:3", "topk:5"])
@pytest.mark.parametrize("variant", [v for v in RESAMPLING if v[0] != "sd-uplink"], ids=_id)
def test_resampling_follows_the_committed_residual(variant, codec):
    """With a lossy codec on ``p`` the residual is that of the *committed* row ``p*``,
    computed here from the spec's commit rule (``helpers/law.committed_row``), not
    from the method code. The rows make ``p*`` differ from ``p`` a lot (top-k drops
    V_C's tail, so V_C's head and V_O's share both grow) where the draft overlaps
    the head: a method that decides with raw values, or leaves ``theta_o``
    unnormalised, moves the law far beyond what N = 30,000 catches."""
    name, opts = variant
    common = scatter_mask(16, 10, seed=4)
    p = np.zeros(16)
    p[common] = [0.2, 0.15, 0.12, *[0.05] * 7]  # V_C: a head and a tail of 7
    p[~common] = 0.18 / 6
    q = np.zeros(16)
    q[common] = [0.1, 0.3, 0.05, *[0.55 / 7] * 7]  # the draft overlaps the head
    p, q = (p / p.sum()).astype(np.float32), (q / q.sum()).astype(np.float32)
    m = get_method(name, codec=codec, **opts)
    space = Space.from_mask(common)
    p_star = committed_row(name, codec, p, space)
    r = residual(p_star, q)
    assert 0.5 * np.abs(r - residual(p, q)).sum() > 0.03  # the commit really matters
    rng = np.random.default_rng(16)
    rejected = int(np.argmax(np.where(common, q - p_star, -np.inf)))
    res = [simulate_resample(m, p, q, rejected, space, rng) for _ in range(30_000)]
    assert_exact([x.tokens[0] for x in res], r, f"{_id(variant)} {codec} committed residual")


@pytest.mark.parametrize("variant", LOSSLESS, ids=_id)
def test_point_masses(variant):
    name, opts = variant
    size = 10
    common = np.zeros(size, dtype=bool)
    common[[1, 4, 7, 8]] = True
    # target: all mass on a V_O token; draft: all mass on a V_C token
    p = np.zeros(size, np.float32)
    p[5] = 1
    q = np.zeros(size, np.float32)
    q[4] = 1
    rounds = run_rounds(name, opts, np.stack([p, p]), q[None], common, 500, seed=1)
    assert all(r.tokens[0] == 5 for r in rounds)
    # target and draft agree on one V_C token: always accepted, bonus from row 2
    p2 = np.zeros(size, np.float32)
    p2[7] = 1
    rounds = run_rounds(name, opts, np.stack([p2, p]), p2[None], common, 500, seed=2)
    assert all(r.tokens[:2] == [7, 5] or name == "ar" for r in rounds)
    # target a point mass in V_C, draft spread over V_C: output is always that token
    q3 = np.where(common, 0.25, 0).astype(np.float32)
    rounds = run_rounds(name, opts, np.stack([p2, p]), q3[None], common, 500, seed=3)
    assert all(r.tokens[0] == 7 for r in rounds)


@pytest.mark.parametrize("variant", LOSSLESS, ids=_id)
def test_empty_vo_is_standard_speculative_decoding(variant):
    name, opts = variant
    target, draft, _ = random_pair(2, size=12, n_common=12, seed=9)
    common = np.ones(12, dtype=bool)
    rounds = run_rounds(name, opts, target, draft, common, 20_000, seed=4)
    assert_exact([r.tokens[0] for r in rounds], target[0], f"{_id(variant)} V_O empty")
    if name == "xcosd":
        # no V_O: HR never needs the V_O branch, so never an extra round trip
        assert all(r.round_trips == 1 for r in rounds)


@pytest.mark.parametrize("variant", RESAMPLING, ids=_id)
def test_single_common_token(variant):
    name, opts = variant
    size = 8
    common = np.zeros(size, dtype=bool)
    common[3] = True
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(size)).astype(np.float32)
    q = np.where(common, 1.0, 0.0).astype(np.float32)
    rounds = run_rounds(name, opts, np.stack([p, p]), q[None], common, 20_000, seed=8)
    assert_exact([r.tokens[0] for r in rounds], p, f"{_id(variant)} |V_C| = 1")


# ---------------------------------------------------------------- lossy baselines


def test_target_resample_is_lossy():
    target, draft, common = vo_heavy(d=1)
    rounds = run_rounds("target-resample", {}, target, draft, common, 50_000, seed=11)
    assert_not_exact([r.tokens[0] for r in rounds], target[0], "target-resample")


def test_greedy_resample_is_lossy():
    target, draft, common = vo_heavy(d=1)
    rounds = run_rounds("greedy-resample", {}, target, draft, common, 30_000, seed=11)
    assert_not_exact([r.tokens[0] for r in rounds], target[0], "greedy-resample")


def test_uhlm_is_lossy_when_the_draft_is_confident_and_wrong():
    size = 12
    common = np.zeros(size, dtype=bool)
    common[[0, 2, 5, 6, 9]] = True
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(size)).astype(np.float32)
    q = np.zeros(size, np.float32)
    q[common] = [0.9, 0.025, 0.025, 0.025, 0.025]  # uncertainty 0.1 < threshold
    rounds = run_rounds("uhlm", {"threshold": 0.3}, np.stack([p, p]), q[None], common,
                        30_000, seed=11)
    assert_not_exact([r.tokens[0] for r in rounds], p, "uhlm")
    # and with a threshold below its uncertainty it verifies everything: exact again
    rounds = run_rounds("uhlm", {"threshold": 0.05}, np.stack([p, p]), q[None], common,
                        30_000, seed=12)
    assert_exact([r.tokens[0] for r in rounds], p, "uhlm verifying every draft")


# ---------------------------------------------------------- real vocabularies


@pytest.fixture(scope="module")
def real_space():
    from xcosd.vocab import VocabMap, Vocabulary

    vm = VocabMap(Vocabulary.load("cl100k"), Vocabulary.load("o200k"))
    return vm, Space.from_vocab_map(vm)


def _real_pair(vm, seed=0):
    """Target mass on real o200k tokens, half of them absent from cl100k (V_O);
    draft mass on real cl100k tokens mapped into o200k ids by bytes."""
    rng = np.random.default_rng(seed)
    vc = rng.choice(vm.common_target_ids, 10, replace=False)
    vo = rng.choice(np.flatnonzero(vm.other_mask), 10, replace=False)
    size = vm.target.size
    p = np.zeros(size)
    p[vc] = rng.dirichlet(np.ones(10)) * 0.4
    p[vo] = rng.dirichlet(np.ones(10)) * 0.6
    q = np.zeros(size)
    q[vc[:6]] = rng.dirichlet(0.5 * np.ones(6))
    p, q = p.astype(np.float32), q.astype(np.float32)
    return np.stack([p, p]), q[None]


@pytest.mark.parametrize("variant", [("xcosd", {}), ("xcosd-e", {}), ("straightforward", {})],
                         ids=_id)
def test_exact_on_real_vocabularies(real_space, variant):
    vm, space = real_space
    target, draft = _real_pair(vm)
    m = get_method(variant[0], **variant[1])
    rng = np.random.default_rng(21)
    toks = [simulate_round(m, target, draft, space, rng, validate=False).tokens[0]
            for _ in range(2_000)]
    assert_exact(toks, target[0], f"{_id(variant)} on cl100k -> o200k")


def test_lossy_fails_on_real_vocabularies(real_space):
    vm, space = real_space
    target, draft = _real_pair(vm)
    rng = np.random.default_rng(21)
    toks = [simulate_round("target-resample", target, draft, space, rng, validate=False).tokens[0]
            for _ in range(2_000)]
    assert_not_exact(toks, target[0], "target-resample on cl100k -> o200k")
