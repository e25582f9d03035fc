"""Warpers and input validation: bad vectors fail loudly, never sample silently."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.errors import InvalidDistribution
from xcosd.methods import Space
from xcosd.sampling import (
    SamplingParams,
    WarpedRows,
    check_distribution,
    sample_index,
    sample_many,
    warp,
    warp_kept,
)
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


def test_sampling_a_long_row_goes_through_block_sums_and_stays_exact():
    """Rows over 4096 ids are sampled via per-block running sums: mass at block edges,
    zeros between, float32 and float64 weights all keep the law."""
    rng = np.random.default_rng(4)
    w = np.zeros(50_003, dtype=np.float32)
    hot = [0, 5, 1023, 1024, 2047, 30_000, 50_002]
    w[hot] = [0.5, 1, 2, 3, 0.25, 4, 0.5]
    expected = w[hot] / w.sum()
    where = {t: i for i, t in enumerate(hot)}
    for weights in (w, w.astype(np.float64)):
        one = [where[sample_index(weights, rng)] for _ in range(8_000)]
        assert_exact(one, expected, "sample_index (blocks)")
        many = [where[int(t)] for t in sample_many(weights, 30_000, rng)]
        assert_exact(many, expected, "sample_many (one cumsum)")
        few = [where[int(t)] for _ in range(2_000) for t in sample_many(weights, 6, rng)]
        assert_exact(few, expected, "sample_many (blocks)")
    with pytest.raises(InvalidDistribution):
        sample_many(np.zeros(10_000), 3, rng)


class _Uniforms:
    """A generator whose draws are given: the ends of [0, 1) a real one reaches
    only through rounding."""

    def __init__(self, u: list[float]) -> None:
        self.u = np.array(u)

    def random(self, n: int) -> np.ndarray:
        return self.u[:n].copy()


def test_many_draws_from_a_short_row_are_the_clamped_search_stepped_back():
    """sample_many's one-cumsum path gives, for every uniform, the first index whose
    running mass exceeds it, clamped to the row and stepped back over zero weights:
    zeros inside the row, a row ending in zeros, a one-entry row, draws at 0 and at
    the very end."""
    from xcosd.sampling import _step_back

    def reference(w: np.ndarray, u: np.ndarray) -> list[int]:
        c = np.cumsum(w, dtype=np.float64)
        idx = np.minimum(c.searchsorted(u * float(c[-1]), side="right"), c.shape[0] - 1)
        return _step_back(w, idx).tolist()

    g = np.random.default_rng(6)
    for trial in range(400):
        size = int(g.integers(1, 700))
        w = g.random(size).astype(np.float32 if trial % 2 else np.float64)
        w[g.random(size) < 0.4] = 0.0
        if trial % 3 == 0:
            w[-int(g.integers(1, 6)):] = 0.0
        if not w.sum() > 0:
            w[0] = 1.0
        u = [0.0, 1.0, float(np.nextafter(1.0, 0.0)), *g.random(29).tolist()]
        got = sample_many(w, len(u), _Uniforms(u))  # type: ignore[arg-type]
        assert got.dtype == np.int64
        assert got.tolist() == reference(w, np.array(u)), (trial, size)
        assert all(w[i] > 0 for i in got.tolist())


def test_few_draws_from_a_long_row_are_the_single_draws_path_vectorised():
    """sample_many's block path gives, for every uniform, the index sample_index's path
    gives for it: same block sums, same running sums inside the block, a draw kept in
    its block, zero weights stepped back over; the short last block included."""
    from xcosd.sampling import _draw, _draw_blocks, _prepare

    rng = np.random.default_rng(5)
    for size in (4_097 * 3, 50_003, 262_144):
        w = rng.random(size).astype(np.float32)
        w[rng.integers(0, size, size // 3)] = 0.0
        w[-7:] = 0.0  # the row ends in zeros: draws at the very end step back
        w, blocks, _, total = _prepare(w)
        assert blocks is not None
        u = np.concatenate((rng.random(300) * total,
                            [0.0, total, blocks[0], blocks[1], blocks[-2], blocks[-1]]))
        want = [_draw(w, blocks, None, float(x)) for x in u]
        assert _draw_blocks(w, blocks, u).tolist() == want


def _short_rows(g: np.random.Generator, kind: int, n: int, size: int) -> np.ndarray:
    """float32 rows of a kind that stresses top-p: peaked, flat, integer ties, ties
    quantised so the cut lands in them, all equal, mostly zeros."""
    if kind == 0:
        b = g.dirichlet(np.ones(size) * 0.3, size=n)
    elif kind == 1:
        b = g.random((n, size))
    elif kind == 2:
        b = g.integers(0, 4, (n, size)).astype(np.float64)
        b[:, 0] += 1
    elif kind == 3:
        b = np.round(g.random((n, size)) * 8) / 8
        b[:, 0] = 1
    elif kind == 4:
        b = np.ones((n, size))
    else:
        b = g.random((n, size)) ** 8
        b[g.random((n, size)) < 0.5] = 0.0
        b[:, -1] += 1e-3
    return b.astype(np.float32)


def test_top_p_of_short_rows_together_is_each_row_alone_bit_for_bit():
    """A block of short float32 rows is cut by top-p all at once (one sort of the
    block); each of its rows is the bits the band search gives that row alone: ties at
    the cut (dropped lowest id first), masses on the float32 threshold, one-entry
    rows, the longest short row."""
    from xcosd.sampling import WHOLE_ROW_MAX, _top_p_band, _top_p_short

    g = np.random.default_rng(7)
    sizes = [1, 2, 3, 255, 256, 820, WHOLE_ROW_MAX]
    for trial in range(240):
        size = sizes[trial % len(sizes)] if trial < 70 else int(g.integers(1, WHOLE_ROW_MAX + 1))
        rows = _short_rows(g, trial % 6, int(g.integers(1, 7)), size)
        for top_p in (0.9, 0.95, 0.5, 0.999, float(g.uniform(0.01, 0.99))):
            got = _top_p_short(rows, top_p)
            assert got.dtype == np.float32
            for i, row in enumerate(rows):
                want = _top_p_band(row, top_p)
                assert isinstance(want, np.ndarray)
                assert np.array_equal(got[i].view(np.uint32), want.view(np.uint32)), \
                    (trial, size, top_p, i)
    with pytest.raises(InvalidDistribution):
        _top_p_short(np.array([[0.5, 0.5], [0.0, 0.0]], dtype=np.float32), 0.9)


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(0.7, 0, 0.95),
                                    SamplingParams(top_k=5), SamplingParams(1.3, 7, 0.8),
                                    SamplingParams(0.5)], ids=lambda p: p.label())
def test_a_block_of_short_rows_warps_each_row_as_alone(params: SamplingParams):
    """warp is a pure function of each row: a block (what a batch warps together)
    gives every row the bits it gets warped by itself."""
    g = np.random.default_rng(8)
    for trial in range(30):
        rows = _short_rows(g, trial % 6, int(g.integers(2, 9)), int(g.integers(1, 600)))
        block = warp(rows, params)
        for i, row in enumerate(rows):
            assert np.array_equal(block[i].view(np.uint32), warp(row, params).view(np.uint32))


def test_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert SamplingParams(temperature=0).label() == "greedy"


def _reference_top(p: np.ndarray, k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Full-sort reference of transformers' rules: top-k keeps every token tied with the
    k-th; top-p drops, in stable ascending order, each token whose cumulative mass is
    <= 1 - top_p (compared in float32, as transformers does), keeping the top one."""
    out = p.astype(np.float64).copy()
    for r in range(p.shape[0]):
        row = out[r]
        if k:
            row[row < np.sort(row)[-k]] = 0
        if top_p < 1.0:
            order = np.argsort(row, kind="stable")
            cum = np.cumsum(row[order]) / row.sum()
            drop = cum.astype(np.float32) <= np.float32(1 - top_p)
            drop[-1] = False
            row[order[drop]] = 0
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


def test_top_k_keeps_every_token_tied_with_the_kth():
    """transformers' rule, not "exactly k": the change from xcosd's first warper."""
    p = np.array([0.1, 0.3, 0.2, 0.2, 0.2], dtype=np.float32)
    out = warp(p, SamplingParams(top_k=2))
    assert (out > 0).tolist() == [False, True, True, True, True]
    assert np.allclose(out, [0, 1 / 3, 2 / 9, 2 / 9, 2 / 9])


def test_top_p_tie_at_the_cut_drops_lowest_ids_first():
    """A stable ascending sort puts the lowest ids of a tie first, so they go first."""
    p = np.full(8, 0.125, dtype=np.float32)
    out = warp(p, SamplingParams(top_p=0.5))  # cumulative 1/8 .. 4/8 <= 1/2: dropped
    assert (out > 0).tolist() == [False] * 4 + [True] * 4
    assert np.allclose(out[4:], 0.25)


# -------------------------------------------------- transformers' own processors


def _hf_warp(logits: np.ndarray, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
             ) -> np.ndarray:
    """The probabilities transformers' processors give (its generation order), with
    torch.sort made stable: its default CPU sort orders ties arbitrarily."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **kw: sort(*a, **kw, stable=True))
    x = torch.tensor(logits, dtype=torch.float32)
    if params.temperature != 1.0:
        x = lp.TemperatureLogitsWarper(params.temperature)(None, x)
    if params.top_k:
        x = lp.TopKLogitsWarper(params.top_k)(None, x)
    if params.top_p < 1.0:
        x = lp.TopPLogitsWarper(params.top_p)(None, x)
    monkeypatch.undo()
    return torch.softmax(x, dim=-1).numpy()


def _adversarial_logits(rng: np.random.Generator, size: int) -> list[tuple[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    rows = [
        ("float32 normal", rng.normal(0, 3, (2, size)).astype(np.float32)),
        ("bf16 normal", torch.tensor(rng.normal(0, 4, (2, size)), dtype=torch.bfloat16)
         .float().numpy()),
        ("many ties", rng.integers(0, 6, (2, size)).astype(np.float32)),
        ("heavy tail", (rng.standard_cauchy((2, size)) * 2).clip(-40, 40).astype(np.float32)),
        ("flat", rng.normal(0, 0.01, (2, size)).astype(np.float32)),
    ]
    # ties exactly at the 50th value: 10 tokens share it
    tied = rng.normal(0, 1, (1, size)).astype(np.float32)
    top = np.argsort(-tied[0])[:60]
    tied[0, top[:45]] += 10
    tied[0, top[45:55]] = tied[0, top[:45]].min() - 1
    rows.append(("ties at the k-th", tied))
    return rows


def _near_threshold_logits(size: int, top_p: float, gap: float) -> np.ndarray:
    """Logits whose ascending cumulative mass passes 1 - top_p by ``gap``: one token's
    inclusion hangs on a 1e-6 relative margin (in both directions)."""
    rng = np.random.default_rng(size)
    p = rng.random(size) + 0.5
    p /= p.sum()
    order = np.argsort(p)
    cum = np.cumsum(p[order])
    i = int(np.searchsorted(cum, 1 - top_p))
    # move mass so that the cumulative mass at position i is (1 - top_p) * (1 + gap)
    need = (1 - top_p) * (1 + gap) - cum[i]
    p[order[i]] += need
    p[order[-1]] -= need
    return np.log(p).astype(np.float32)[None]


def _ascending_cumulative(p: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Each token's float64 cumulative mass in stable ascending order, over what top-k
    and the temperature leave (the quantity top-p compares with 1 - top_p)."""
    w = p.astype(np.float64) ** (1 / params.temperature)
    if params.top_k:
        w[w < np.sort(w)[-params.top_k]] = 0
    order = np.argsort(w, kind="stable")
    cum = np.empty_like(w)
    cum[order] = np.cumsum(w[order]) / w.sum()
    return cum


WARPERS = [SamplingParams(top_k=50), SamplingParams(top_p=0.95), SamplingParams(top_p=0.5),
           SamplingParams(top_k=50, top_p=0.9), SamplingParams(temperature=0.7, top_k=40),
           SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(top_k=1)]


@pytest.mark.parametrize("size", [50, 4096, 262_144])
def test_warpers_match_transformers_processors(size, monkeypatch):
    """Kept sets identical to transformers' processors, warped probabilities within
    TV 1e-6 of its (renormalised) output, on float32 and bf16-derived logits and on
    adversarial rows. Rows are fed as a model gives them: the float32 softmax of the
    logits. On 262k-id rows transformers' float32 cumulative masses are themselves off
    by up to ~1e-5, so there a token may differ when its exact cumulative mass is that
    close to the cut (a tie group straddling it); never on smaller rows."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(size)
    cases = _adversarial_logits(rng, size)
    if size >= 4096:
        cases += [(f"near threshold {g:+g}", _near_threshold_logits(size, 0.95, g))
                  for g in (1e-5, -1e-5)]
    for name, logits in cases:
        probs = torch.softmax(torch.tensor(logits), dim=-1).numpy()
        for params in WARPERS:
            if size < 100 and params.top_k >= size:
                continue
            ref = _hf_warp(logits, params, monkeypatch)
            got = warp(probs, params)
            for r in range(probs.shape[0]):
                differ = np.flatnonzero((ref[r] > 0) != (got[r] > 0))
                if differ.size:
                    # only where transformers' own float32 rounding decides: its softmax
                    # of a 262k row is normalised to ~1e-5, so a cumulative mass that
                    # close to 1 - top_p can go either way there; ours is float64
                    cum = _ascending_cumulative(probs[r], params)
                    assert np.all(np.abs(cum[differ] - (1 - params.top_p)) < 2e-5), (
                        name, params.label(), r, differ)
                    assert size > 4096, (name, params.label(), r, differ)
                # transformers' float32 softmax of a 130k-token row sums to 1 +- 3e-6 by
                # itself: compare against it renormalised in float64
                ref64 = ref[r].astype(np.float64) / ref[r].sum(dtype=np.float64)
                tv = 0.5 * np.abs(ref64 - got[r]).sum()
                slack = float(np.maximum(ref64[differ], got[r][differ]).sum())
                assert tv <= 1e-6 + slack, (name, params.label(), tv)


def test_near_threshold_rows_fall_on_the_right_side():
    """The kept count differs by one token across a 1e-5 relative margin at the cut."""
    size, top_p = 4096, 0.95
    counts = []
    for gap in (1e-5, -1e-5):
        logits = _near_threshold_logits(size, top_p, gap)
        p = np.exp(logits.astype(np.float64))
        counts.append(np.count_nonzero(warp((p / p.sum()).astype(np.float32),
                                            SamplingParams(top_p=top_p))))
    assert counts[1] == counts[0] - 1


# ------------------------------------------------------- the same bits everywhere


def test_a_row_warps_to_the_same_bits_alone_in_a_block_on_demand_and_sparse():
    """The edge warps single rows, the cloud whole batches: for the same row every path
    must give bit-identical kept sets and values, whatever rows it is warped with."""
    rng = np.random.default_rng(5)
    size = 50_000
    rows = [rng.dirichlet(np.full(size, a)).astype(np.float32) for a in (0.01, 0.3, 5.0)]
    rows.append(np.round(rows[2], 6) + np.float32(1e-6))  # ties everywhere
    rows[3] /= rows[3].sum()
    block = np.stack(rows)
    for params in [*WARPERS, SamplingParams(temperature=0.5), SamplingParams(temperature=0)]:
        whole = warp(block, params)
        lazy = WarpedRows(block[::-1], params)
        for r, row in enumerate(rows):
            alone = warp(row, params)
            assert alone.dtype == np.float32
            assert np.array_equal(alone, whole[r]), params.label()
            assert np.array_equal(alone, warp(row.copy(), params))
            kept = warp_kept(row, params)
            dense = kept.probs if kept.ids is None else np.zeros(size, np.float32)
            if kept.ids is not None:
                dense[kept.ids] = kept.probs.astype(np.float32)
                assert np.all(np.diff(kept.ids) > 0)
            assert np.array_equal(alone, dense), params.label()
        # on demand, in any order, a row at a time or all at once
        assert np.array_equal(lazy[2], whole[1]) and lazy.warped_rows == 1
        assert lazy[0, 7] == whole[3, 7] and lazy.warped_rows == 2
        assert np.array_equal(np.asarray(lazy), whole[::-1]) and lazy.warped_rows == 4
        assert np.array_equal(lazy[-1], whole[0])
    with pytest.raises(IndexError):
        WarpedRows(block, WARPERS[0])[4]


def test_warp_refuses_a_row_without_mass():
    for params in (SamplingParams(top_k=3), SamplingParams(top_p=0.9)):
        with pytest.raises(InvalidDistribution):
            warp(np.zeros(10, np.float32), params)


def test_a_cut_inside_a_huge_tie_group_matches_a_full_sort():
    """A model's floor value shared by most of a 200k row (an n-gram backoff, a
    clipped softmax): the cut falls inside that group, which is resolved without
    sorting it. The kept set and values must be the full sort's, lowest ids of the
    group dropped first, for cuts at many places inside the group."""
    rng = np.random.default_rng(11)
    size = 200_000
    cut_inside = 0
    for trial in range(12):
        head = int(rng.integers(50, 3_000))
        logits = np.zeros(size, dtype=np.float64)
        at = rng.choice(size, head, replace=False)
        logits[at] = rng.uniform(2.0, 9.0, head)
        p = np.exp(logits)
        p /= p.sum()
        row = p.astype(np.float32)
        floor = row[logits == 0][0]
        top_p = float(rng.choice([0.5, 0.8, 0.9, 0.95, 0.99]))
        got = warp(row, SamplingParams(top_p=top_p))
        ref = _reference_top(row[None], top_p=top_p)[0]
        assert np.array_equal(got > 0, ref > 0), (trial, top_p)
        assert np.allclose(got, ref, atol=1e-9, rtol=1e-5), (trial, top_p)
        dropped = np.flatnonzero((row == floor) & (got == 0))
        if dropped.size and dropped.size < np.count_nonzero(row == floor):
            kept_ties = np.flatnonzero((row == floor) & (got > 0))
            assert dropped.max() < kept_ties.min()  # lowest ids of the group go first
            cut_inside += 1
    assert cut_inside >= 6  # the case this is about, not only cuts above the group


@pytest.mark.parametrize("size", [4_100, 128_256, 200_019])
def test_top_k_candidates_from_group_maxima_match_a_full_sort(size):
    """Top-k looks only inside the groups whose maximum reaches a bound, plus the ids
    past the last full stride (sizes that are no multiple of the group count): the
    kept set must still be the full sort's, ties with the k-th included, wherever the
    largest values sit (the tail among them)."""
    rng = np.random.default_rng(size)
    rows = rng.dirichlet(np.full(size, 0.05), size=3).astype(np.float32)
    rows[1, -5:] = rows[1].max() * 2  # the largest values in the tail
    rows[2] = np.round(rows[2], 5)  # many ties, at the k-th too
    rows /= rows.sum(axis=-1, keepdims=True)
    for k in (1, 50, 700):
        got = warp(rows, SamplingParams(top_k=k))
        ref = _reference_top(rows, k=k)
        assert np.array_equal(got > 0, ref > 0), k
        assert np.allclose(got, ref, atol=1e-7), k


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_greedy_row_alone_is_the_block_row(dtype: type) -> None:
    """One greedy row takes a short path (:func:`warp`): the first maximum, as the
    block path keeps it, whatever the dtype, ties or an all-zero row."""
    rng = np.random.default_rng(11)
    greedy = SamplingParams(temperature=0)
    rows = [rng.random(n).astype(dtype) for n in (1, 2, 300)]
    tied = rng.random(300).astype(dtype)
    tied[[17, 40, 299]] = tied.max() + 1
    rows += [tied, np.zeros(300, dtype=dtype)]
    for row in rows:
        assert np.array_equal(warp(row, greedy), warp(np.stack([row, row[::-1]]), greedy)[0])
    assert int(np.flatnonzero(warp(tied, greedy))[0]) == 17


@pytest.mark.parametrize("size", [50, 256, 4096])
def test_short_rows_sorted_whole_keep_what_the_band_search_keeps(size, monkeypatch):
    """Top-p sorts a row of at most ``WHOLE_ROW_MAX`` ids whole instead of searching a
    band around the cut: on adversarial rows (ties at the cut, masses a hair from
    the threshold) it keeps exactly the tokens the band search keeps, with values
    within float32 rounding of its."""
    import xcosd.sampling as sampling

    rng = np.random.default_rng(size + 1)
    cases = [logits for _, logits in _adversarial_logits(rng, size)]
    if size >= 4096:
        cases += [_near_threshold_logits(size, 0.95, g) for g in (1e-5, -1e-5)]
    for logits in cases:
        z = np.asarray(logits, dtype=np.float64)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        probs = (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)
        for params in [SamplingParams(top_p=t) for t in (0.5, 0.9, 0.95)] + [
                SamplingParams(temperature=1.3, top_p=0.9)]:
            whole = warp(probs, params)
            monkeypatch.setattr(sampling, "WHOLE_ROW_MAX", 0)
            band = warp(probs, params)
            monkeypatch.undo()
            assert np.array_equal(whole > 0, band > 0), params.label()
            assert np.allclose(whole, band, rtol=1e-6, atol=0), params.label()
