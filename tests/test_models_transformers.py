"""The transformers backend on tiny local Llamas: cache, rollback and batching agree
with a no-cache reference forward pass."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models_helpers.tiny import (  # noqa: E402
    byte_level_tokenizer,
    save_tiny_llama,
    sentencepiece_tokenizer,
)
from xcosd.errors import ModelError  # noqa: E402
from xcosd.models import LanguageModel, TransformersModel, load_model  # noqa: E402

TOL = 1e-4
TEXT = ("Return a new list containing all items from the iterable in ascending order. "
        "A custom key function can be supplied to customize the sort order.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-bl"), byte_level_tokenizer())


@pytest.fixture(scope="module")
def model(model_dir) -> TransformersModel:
    return TransformersModel.from_pretrained(model_dir)


def reference(m: TransformersModel, ids: list[int]) -> np.ndarray:
    """Rows after each prefix of ``ids`` from one full forward pass, no cache."""
    full = ([m._start] if m._add_bos or not ids else []) + ids
    with torch.inference_mode():
        logits = m.model(input_ids=torch.tensor([full])).logits[0].float()
    return torch.softmax(logits, -1).numpy()


def test_import_does_not_pull_torch() -> None:
    import subprocess

    code = "import sys, xcosd.models; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_is_a_language_model(model: TransformersModel) -> None:
    assert isinstance(model, LanguageModel)
    assert model.vocab.size == len(model.tokenizer)
    assert model.vocab.roles["eos"] == model.tokenizer.eos_token_id


def test_incremental_scoring_matches_no_cache_reference(model: TransformersModel) -> None:
    ids = model.tokenize(TEXT)[:24]
    s = model.start(ids[:5])
    got = [model.score([(s, ids[5:9])])[0]]  # p after 5..9 tokens
    model.append(s, ids[9:12])  # appended, not scored
    got.append(model.score([(s, ids[12:13])])[0])  # after 12, 13
    got.append(model.score([(s, [])])[0])  # after 13 again
    ref = reference(model, ids[:13])
    off = len(ref) - 13  # BOS prefix or not
    np.testing.assert_allclose(got[0], ref[off + 4: off + 9], atol=TOL)
    np.testing.assert_allclose(got[1], ref[off + 11: off + 13], atol=TOL)
    np.testing.assert_allclose(got[2][0], ref[off + 12], atol=TOL)
    for rows in got:
        assert rows.dtype == np.float32
        np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)


def test_rollback_crops_the_cache(model: TransformersModel) -> None:
    ids = model.tokenize(TEXT)[:20]
    s = model.start(ids[:6])
    model.score([(s, ids[6:10])])
    model.rollback(s, 7)  # 1 of 4 drafts accepted
    assert s.ids == ids[:7]
    assert s.cached <= 6
    alt = [ids[15], ids[3]]
    rows = model.score([(s, alt)])[0]
    ref = reference(model, ids[:7] + alt)
    np.testing.assert_allclose(rows, ref[-3:], atol=TOL)
    model.rollback(s, 0)
    assert s.ids == [] and s.cached == 0
    np.testing.assert_allclose(model.score([(s, [])])[0][0], reference(model, [])[0], atol=TOL)


def test_empty_prompt_starts_from_bos(model: TransformersModel) -> None:
    s = model.start([])
    row = model.score([(s, [])])[0][0]
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([[model.vocab.roles["bos"]]])).logits[0, -1]
    np.testing.assert_allclose(row, torch.softmax(logits.float(), -1).numpy(), atol=TOL)
    assert s.ids == []


def test_batched_equals_one_by_one(model: TransformersModel) -> None:
    ids = model.tokenize(TEXT)
    specs = [(ids[:3], ids[3:7]), (ids[:11], ids[11:12]), ([], []), (ids[:7], [])]
    batched = [model.start(p) for p, _ in specs]
    single = [model.start(p) for p, _ in specs]
    for step in range(2):  # second round runs on caches of different lengths
        news = [n if step == 0 else ids[20: 20 + k] for (_, n), k in zip(specs, (2, 0, 3, 1),
                                                                      strict=True)]
        got = model.score(list(zip(batched, news, strict=True)))
        for s, n, g in zip(single, news, got, strict=True):
            np.testing.assert_allclose(g, model.score([(s, n)])[0], atol=TOL)
        # a rejection in one session only
        model.rollback(batched[0], len(batched[0].ids) - 1)
        model.rollback(single[0], len(single[0].ids) - 1)
    for s in batched:
        model.end(s)


def test_sentencepiece_model_and_unused_ids(tmp_path) -> None:
    tok = sentencepiece_tokenizer()
    save_tiny_llama(tmp_path, tok, layers=2)
    # a padded embedding matrix: ids past the tokenizer have no bytes and get 0
    import transformers

    m0 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    m0.resize_token_embeddings(len(tok) + 8)
    m0.save_pretrained(tmp_path)
    m = load_model(str(tmp_path))
    assert isinstance(m, TransformersModel)
    assert m.vocab.size == len(tok) + 8
    rows = m.score([(m.start(m.tokenize("a test, é")), [])])[0]
    assert np.all(rows[:, len(tok):] == 0)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)


def test_bad_ids_and_paths(model: TransformersModel, tmp_path) -> None:
    with pytest.raises(ModelError):
        model.score([(model.start([]), [model.vocab.size])])
    with pytest.raises(ModelError):
        TransformersModel.from_pretrained(tmp_path)
    with pytest.raises(ModelError):
        TransformersModel.from_gguf(tmp_path / "missing.gguf")
