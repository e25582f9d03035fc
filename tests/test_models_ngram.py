"""The n-gram model: full-vocabulary distributions, smoothing, caching, the session
interface, and the default pair over two real vocabularies."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.errors import ModelError
from xcosd.models import LanguageModel, NgramModel, default_corpus, default_pair, load_model
from xcosd.models.corpus import corpus_from_files, text_hash
from xcosd.vocab import VocabMap, Vocabulary


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return default_corpus()[:400]


@pytest.fixture(scope="module")
def cl100k() -> Vocabulary:
    return Vocabulary.load("cl100k")


@pytest.fixture(scope="module")
def model(cl100k: Vocabulary, docs: list[str]) -> NgramModel:
    return NgramModel.train(cl100k, docs, 4)


def test_default_corpus_is_large_and_stable() -> None:
    a = default_corpus()
    assert sum(map(len, a)) > 1_500_000
    assert text_hash(a) == text_hash(default_corpus())


def _check_row(row: np.ndarray, vocab: Vocabulary) -> None:
    assert row.dtype == np.float32 and row.shape == (vocab.size,)
    assert abs(float(row.sum(dtype=np.float64)) - 1.0) < 1e-5
    allowed = vocab.regular_mask.copy()
    allowed[vocab.roles["eos"]] = True
    assert np.all(row[allowed] > 0), "every regular token and eos must be possible"
    assert np.all(row[~allowed] == 0), "unused ids and other special tokens get 0"


def test_rows_are_distributions_over_the_whole_vocabulary(model: NgramModel, cl100k: Vocabulary,
                                                          docs: list[str]) -> None:
    assert isinstance(model, LanguageModel)
    prompts = ["", "Return the", docs[3][:200], "zzqx unseen ⊗ context", docs[10][:40]]
    for text in prompts:
        s = model.start(model.tokenize(text))
        rows = model.score([(s, cl100k.encode(" the value of"))])[0]
        assert rows.shape == (4, cl100k.size)
        for r in rows:
            _check_row(r, cl100k)


def test_seen_continuations_get_most_mass(model: NgramModel, cl100k: Vocabulary,
                                          docs: list[str]) -> None:
    ids = cl100k.encode(docs[5])
    ctx, nxt = ids[:20], ids[20]
    p = model.next_probs(ctx)
    assert p[nxt] > 1e-3
    assert p[nxt] > np.median(p) * 100


def test_smoothing_matches_kneser_ney_by_hand(cl100k: Vocabulary) -> None:
    """Order 2 on a tiny corpus: P(w|h) = max(c(hw)-D,0)/c(h) + D*N1+(h.)/c(h) * P_1(w)."""
    m = NgramModel.train(cl100k, [" a b a c a b"], 2, alpha=0.01)
    a, b, c = (cl100k.encode(x)[0] for x in (" a", " b", " c"))
    eos = cl100k.roles["eos"]
    lv = m.levels[0]
    d = lv.discount
    p = m.next_probs([a])
    # after "a": " b" twice, " c" once
    gamma = d * 2 / 3
    assert p[b] == pytest.approx((2 - d) / 3 + gamma * m.base[b], rel=1e-5)
    assert p[c] == pytest.approx((1 - d) / 3 + gamma * m.base[c], rel=1e-5)
    assert p[eos] == pytest.approx(gamma * m.base[eos], rel=1e-5)
    assert m.base[b] > m.base[cl100k.encode("zebra")[0]]


def test_session_interface_score_append_rollback(model: NgramModel, cl100k: Vocabulary) -> None:
    ids = cl100k.encode("The function returns a list of strings")
    s = model.start(ids[:3])
    rows = model.score([(s, ids[3:6])])[0]
    assert s.ids == ids[:6]
    for k in range(4):
        np.testing.assert_array_equal(rows[k], model.next_probs(ids[: 3 + k]))
    model.rollback(s, 4)
    assert s.ids == ids[:4]
    model.append(s, ids[4:7])
    np.testing.assert_array_equal(model.score([(s, [])])[0][0], model.next_probs(ids[:7]))
    # batched across sessions = one by one
    s1, s2 = model.start(ids[:2]), model.start([])
    batch = model.score([(s1, ids[2:4]), (s2, ids[:1])])
    np.testing.assert_array_equal(batch[0][2], model.next_probs(ids[:4]))
    np.testing.assert_array_equal(batch[1][1], model.next_probs(ids[:1]))
    model.end(s1)
    with pytest.raises(ModelError):
        model.score([(s2, [cl100k.size + 5])])


def test_empty_prompt_starts_after_eos(model: NgramModel, cl100k: Vocabulary) -> None:
    eos = cl100k.roles["eos"]
    np.testing.assert_array_equal(model.next_probs([]), model.next_probs([eos]))


def test_disk_cache_round_trip(tmp_path, cl100k: Vocabulary, docs: list[str]) -> None:
    m1 = NgramModel.load_or_train(cl100k, 3, docs[:50], cache=tmp_path)
    files = list(tmp_path.glob("ngram-cl100k-*.npz"))
    assert len(files) == 1
    m2 = NgramModel.load_or_train(cl100k, 3, docs[:50], cache=tmp_path)
    ctx = cl100k.encode(docs[7][:80])
    np.testing.assert_array_equal(m1.next_probs(ctx), m2.next_probs(ctx))
    # a different corpus is a different cache entry
    NgramModel.load_or_train(cl100k, 3, docs[:51], cache=tmp_path)
    assert len(list(tmp_path.glob("ngram-cl100k-*.npz"))) == 2
    # another vocabulary cannot load this file
    with pytest.raises(ModelError):
        NgramModel.load(files[0], Vocabulary.load("o200k"))


def test_train_on_own_text_files(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("hello world. hello there. hello world again.\n" * 20)
    m = load_model("ngram:qwen:3", corpus=[str(tmp_path)], cache=tmp_path / "cache")
    assert isinstance(m, NgramModel) and m.vocab.name == "qwen"
    v = m.vocab
    p = m.next_probs(v.encode("hello"))
    assert v.decode([int(np.argmax(p))]) == b" world"
    assert corpus_from_files([tmp_path / "a.txt"])[0].startswith("hello")
    with pytest.raises(ModelError):
        corpus_from_files([tmp_path / "missing"])


@pytest.fixture(scope="session")
def default_models(tmp_path_factory) -> tuple[NgramModel, NgramModel]:
    """The default pair trained once per test session (seconds) in a fresh cache."""
    return default_pair(cache=tmp_path_factory.mktemp("xcosd-cache"))


def test_default_pair_uses_two_real_vocabularies(default_models) -> None:
    draft, target = default_models
    assert draft.vocab.name != target.vocab.name
    assert draft.order < target.order
    vmap = VocabMap(draft.vocab, target.vocab)
    assert vmap.n_common > 50_000 and vmap.n_other > 10_000
    for m in (draft, target):
        s = m.start([])
        _check_row(m.score([(s, [])])[0][0], m.vocab)


def test_default_pair_v_o_tokens_occur_in_text(default_models) -> None:
    """Target-only tokens must be frequent enough in ordinary text that the V_O branch
    of hybrid resampling really runs."""
    draft, target = default_models
    vmap = VocabMap(draft.vocab, target.vocab)
    ids = np.array(target.tokenize("".join(default_corpus()[:300])))
    share = float(vmap.other_mask[ids].mean())
    assert 0.002 < share < 0.05
    # and the target gives them real mass in context
    i = int(np.flatnonzero(vmap.other_mask[ids[8:]])[0]) + 8
    assert target.next_probs(ids[:i].tolist())[ids[i]] > 1e-3


def test_load_model_names(default_models) -> None:
    draft = load_model("default-draft")
    assert draft.name == default_models[0].name
    with pytest.raises(ModelError):
        load_model("ngram:qwen")
    with pytest.raises(ModelError, match="unknown model"):
        load_model("no-such-model")
