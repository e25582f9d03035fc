"""TableModel (exactness tests) and SyntheticModel (load tests) behave as specified."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.errors import InvalidDistribution, ModelError
from xcosd.models import LanguageModel, SyntheticModel, TableModel, load_model
from xcosd.vocab import VocabMap

TARGET_TOKENS = [b"a", b"b", b"ab", b"ba", b"<eos>", b"c"]
DRAFT_TOKENS = [b"b", b"a", b"<e>", b"aa", b"ab"]


def target_probs(ctx: list[int]) -> np.ndarray:
    p = np.array([1, 2, 3, 1, 1, 2], dtype=np.float64) + len(ctx)
    p[len(ctx) % 6] += 5
    return p / p.sum()


def draft_probs(ctx: list[int]) -> np.ndarray:
    return np.full(5, 0.2)


def test_table_model_is_a_language_model() -> None:
    m = TableModel(TARGET_TOKENS, target_probs, eos_id=4)
    assert isinstance(m, LanguageModel)
    assert m.vocab.size == 6
    assert m.vocab.roles == {"eos": 4}
    assert m.vocab.token_bytes(2) == b"ab"


def test_table_model_rows_are_next_probs_of_the_context() -> None:
    m = TableModel(TARGET_TOKENS, target_probs, eos_id=4)
    s = m.start([0, 1])
    rows = m.score([(s, [2, 5])])[0]
    assert rows.shape == (3, 6) and rows.dtype == np.float32
    for k, ctx in enumerate(([0, 1], [0, 1, 2], [0, 1, 2, 5])):
        np.testing.assert_allclose(rows[k], target_probs(ctx), rtol=1e-6)
    m.rollback(s, 1)
    m.append(s, [3])
    np.testing.assert_allclose(m.score([(s, [])])[0][0], target_probs([0, 3]), rtol=1e-6)
    s0 = m.start([])
    np.testing.assert_allclose(m.score([(s0, [])])[0][0], target_probs([]), rtol=1e-6)


def test_table_model_tokenizes_by_greedy_longest_match() -> None:
    m = TableModel(TARGET_TOKENS, target_probs, eos_id=4)
    assert m.tokenize("abab") == [2, 2]
    assert m.tokenize("bac") == [3, 5]
    assert m.tokenize("aab") == [0, 2]
    d = TableModel(DRAFT_TOKENS, draft_probs, eos_id=2)
    assert d.tokenize("aab") == [3, 0]


def test_two_table_models_form_a_cross_vocabulary_pair() -> None:
    t = TableModel(TARGET_TOKENS, target_probs, eos_id=4)
    d = TableModel(DRAFT_TOKENS, draft_probs, eos_id=2)
    vmap = VocabMap(d.vocab, t.vocab)
    # common by bytes: a, b, ab; eos by role; target-only: ba, c
    assert vmap.common_target_ids.tolist() == [0, 1, 2, 4]
    assert vmap.common_draft_ids.tolist() == [1, 0, 4, 2]
    assert vmap.other_mask.tolist() == [False, False, False, True, False, True]
    assert not vmap.identical


def test_table_model_rejects_bad_rows() -> None:
    m = TableModel(TARGET_TOKENS, lambda ctx: np.ones(6), eos_id=4)
    with pytest.raises(InvalidDistribution):
        m.score([(m.start([]), [])])
    m2 = TableModel(TARGET_TOKENS, lambda ctx: np.ones(5) / 5)
    with pytest.raises(InvalidDistribution):
        m2.score([(m2.start([]), [])])
    with pytest.raises(ModelError):
        TableModel(TARGET_TOKENS, target_probs, eos_id=9)


def test_synthetic_model_rows_and_cost_accounting() -> None:
    m = SyntheticModel(300, a=0.0, b=0.0)
    s = m.start([5])
    rows = m.score([(s, [7, 8]), (m.start([]), [])])
    assert [r.shape for r in rows] == [(3, 300), (1, 300)]
    for r in rows:
        np.testing.assert_allclose(r.sum(axis=1), 1.0, rtol=1e-5)
    assert m.calls == 1 and m.rows == 4
    # deterministic: the same context gives the same row
    again = m.score([(m.start([5, 7]), [])])[0][0]
    np.testing.assert_array_equal(again, rows[0][1])
    assert not np.array_equal(rows[0][0], rows[0][1])


def test_a_synthetic_drafting_step_is_the_general_row() -> None:
    """One session and no new ids (every drafting step) takes a shortcut; it must
    give the bits, the counts and the cache state the general path gives."""
    m = SyntheticModel(300, skew=0.9)
    for ctx in ([], [0], [5, 7], [299, 3, 17]):
        s, s2 = m.start(ctx), m.start(ctx)
        calls, rows = m.calls, m.rows
        [fast] = m.score([(s, [])])
        assert (m.calls, m.rows) == (calls + 1, rows + 1)
        general = m.score([(s2, []), (m.start([1]), [])])[0]
        assert fast.shape == (1, 300) and fast.dtype == np.float32 and fast.flags.writeable
        np.testing.assert_array_equal(fast, general)
        assert s.cached == len(ctx) and s.ids == ctx
        fast[0, 0] = 7.0  # the caller's own copy: the model's next row is unchanged
        np.testing.assert_array_equal(m.score([(s, [])])[0], general)


def test_synthetic_over_a_real_vocabulary_by_spec() -> None:
    m = load_model("synthetic:qwen:1:0.5")
    assert isinstance(m, SyntheticModel)
    assert m.a == pytest.approx(0.001) and m.b == pytest.approx(0.0005)
    r = m.score([(m.start(m.tokenize("hello")), [])])[0][0]
    assert r.shape == (m.vocab.size,)
    assert np.all(r[~m.vocab.regular_mask & (np.arange(m.vocab.size) != m.vocab.roles["eos"])] == 0)
    with pytest.raises(ModelError):
        load_model("synthetic:qwen:x")
