"""Warpers and input validation: bad vectors fail loudly, never sample silently."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.errors import InvalidDistribution
from xcosd.methods import Space
from xcosd.sampling import SamplingParams, check_distribution, sample_index, sample_many, warp
from xcosd.simulate import simulate_round

from .helpers.stats import assert_exact

P = np.array([0.1, 0.4, 0.2, 0.3], dtype=np.float32)


def test_temperature_matches_softmax_of_scaled_logits():
    out = warp(P, SamplingParams(temperature=0.5))
    ref = np.exp(np.log(P.astype(np.float64)) / 0.5)
    assert np.allclose(out, ref / ref.sum(), atol=1e-7)


def test_top_k_top_p_greedy():
    assert np.allclose(warp(P, SamplingParams(top_k=2)), [0, 4 / 7, 0, 3 / 7])
    assert np.allclose(warp(P, SamplingParams(top_p=0.7)), [0, 4 / 7, 0, 3 / 7])
    assert np.allclose(warp(P, SamplingParams(top_p=0.75)), [0, 4 / 9, 2 / 9, 3 / 9])
    g = warp(np.array([0.3, 0.3, 0.4, 0.0]), SamplingParams(temperature=0))
    assert g.tolist() == [0, 0, 1, 0]
    tie = warp(np.array([0.4, 0.2, 0.4]), SamplingParams(temperature=0))
    assert tie.tolist() == [1, 0, 0]  # ties broken by lowest id


def test_warp_rows_independently():
    rows = np.stack([P, P[::-1]])
    out = warp(rows, SamplingParams(top_k=1))
    assert out[0].tolist() == [0, 1, 0, 0] and out[1].tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("bad", [
    np.array([0.5, np.nan, 0.5]), np.array([0.6, -0.1, 0.5]), np.array([0.2, 0.2, 0.2]),
    np.array([np.inf, 0, 0]), np.array([]),
])
def test_invalid_vectors_raise_value_errors(bad):
    with pytest.raises(ValueError):
        check_distribution(bad)
    with pytest.raises(InvalidDistribution):
        check_distribution(bad)


def test_simulate_round_rejects_bad_input():
    rng = np.random.default_rng(0)
    common = np.array([True, True, False])
    good_t = np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]], np.float32)
    good_d = np.array([[0.5, 0.5, 0.0]], np.float32)
    for method in ("xcosd", "xcosd-e", "straightforward", "sd-uplink", "ar"):
        with pytest.raises(ValueError, match="NaN"):
            simulate_round(method, np.where(good_t == 0.2, np.nan, good_t), good_d, common, rng)
        with pytest.raises(ValueError, match="negative"):
            simulate_round(method, good_t * [[1, -1, 1]], good_d, common, rng)
        with pytest.raises(ValueError, match="sums to"):
            simulate_round(method, good_t * 2, good_d, common, rng)
    with pytest.raises(ValueError, match="outside V_C"):
        simulate_round("xcosd", good_t, np.array([[0.5, 0.25, 0.25]], np.float32), common, rng)
    with pytest.raises(ValueError, match="shape"):
        simulate_round("xcosd", good_t[:1], good_d, common, rng)
    with pytest.raises(ValueError, match="unknown method"):
        simulate_round("nope", good_t, good_d, common, rng)
    with pytest.raises(ValueError):
        Space.from_mask(np.zeros(3, dtype=bool))  # empty V_C


def test_sample_index_and_many_follow_weights():
    rng = np.random.default_rng(3)
    w = np.array([0.0, 2.0, 0.0, 1.0, 1.0])
    assert_exact([sample_index(w, rng) for _ in range(20_000)], w / 4, "sample_index")
    assert_exact(sample_many(w, 50_000, rng), w / 4, "sample_many")
    with pytest.raises(InvalidDistribution):
        sample_index(np.zeros(3), rng)


def test_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert SamplingParams(temperature=0).label() == "greedy"


def _reference_top(p: np.ndarray, k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Full-sort reference: descending probability, ties by lowest id."""
    out = p.astype(np.float64).copy()
    for r in range(p.shape[0]):
        order = sorted(range(p.shape[1]), key=lambda i: (-p[r, i], i))
        keep = order[:k] if k else order
        if top_p < 1.0:
            total, acc, kept = p[r].sum(), 0.0, []
            for i in order:
                if acc >= top_p * total and kept:
                    break
                kept.append(i)
                acc += p[r, i]
            keep = kept
        mask = np.zeros(p.shape[1], dtype=bool)
        mask[keep] = True
        out[r, ~mask] = 0
    return (out / out.sum(axis=-1, keepdims=True)).astype(np.float32)


def test_top_k_top_p_match_a_full_sort_including_ties():
    rng = np.random.default_rng(0)
    for trial in range(60):
        size = int(rng.integers(2, 600))
        p = rng.dirichlet(np.ones(size) * rng.choice([0.05, 1.0]), size=2)
        if trial % 2:
            p = np.round(p, 3) + 1e-3  # many exact ties
        p = p / p.sum(axis=-1, keepdims=True)
        k = int(rng.integers(1, size + 1))
        assert np.allclose(warp(p, SamplingParams(top_k=k)), _reference_top(p, k=k), atol=1e-7)
        tp = float(rng.choice([0.3, 0.9, 0.95, 0.999]))
        assert np.allclose(warp(p, SamplingParams(top_p=tp)), _reference_top(p, top_p=tp),
                           atol=1e-7)
