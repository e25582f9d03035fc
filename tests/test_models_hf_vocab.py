"""Hugging Face tokenizers converted to byte vocabularies: both families round-trip
real text, ids map to their own bytes (not to a sorted position), roles are found."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from xcosd.models import default_corpus, vocabulary_from_hf
from xcosd.models.tiny import byte_level_tokenizer, sentencepiece_tokenizer
from xcosd.vocab import VocabMap, Vocabulary
from xcosd.vocab.hf import gpt2_byte_decoder, token_to_bytes, tokenizer_family

TEXTS = [
    "Return a new sorted list from the items in *iterable*.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Unicode: café, naïve, 中文字符, emoji 🙂🚀, math ∑ x² ≤ ∞",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment",
]


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece():
    return sentencepiece_tokenizer()


def test_gpt2_byte_map_is_a_bijection() -> None:
    table = gpt2_byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["a"] == ord("a")


def test_sentencepiece_spelling() -> None:
    assert token_to_bytes("\u2581the", "sentencepiece") == b" the"
    assert token_to_bytes("<0xE4>", "sentencepiece") == b"\xe4"
    assert token_to_bytes("\u2581\u2581", "sentencepiece") == b"  "
    assert token_to_bytes("ĠtheĊ", "byte_level") == b" the\n"


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_real_text_round_trips_through_bytes(family: str, byte_level, sentencepiece) -> None:
    tok = byte_level if family == "byte_level" else sentencepiece
    assert tokenizer_family(tok) == family
    v = vocabulary_from_hf(tok, name=family)
    for text in [*TEXTS, default_corpus()[700][:2000]]:
        ids = v.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert v.decode(ids) == text.encode("utf-8")


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_each_id_maps_to_its_own_bytes(family: str, byte_level, sentencepiece) -> None:
    """The id -> bytes table must follow the tokenizer's ids, whatever order its
    listing comes in: every valid-UTF-8 token decodes (alone) to its own bytes."""
    tok = byte_level if family == "byte_level" else sentencepiece
    v = vocabulary_from_hf(tok)
    checked = 0
    for i in range(v.size):
        b = v.tokens[i]
        if b is None or i in v.special_ids:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert tok.decode([i], clean_up_tokenization_spaces=False) == text, i
        checked += 1
    assert checked > 300


def test_byte_fallback_tokens_are_single_bytes(sentencepiece) -> None:
    v = vocabulary_from_hf(sentencepiece)
    ids = v.encode("中")
    assert [v.token_bytes(i) for i in ids] == [b"\xe4", b"\xb8", b"\xad"]


def test_special_tokens_by_role(byte_level, sentencepiece) -> None:
    bl = vocabulary_from_hf(byte_level)
    assert bl.token_bytes(bl.roles["eos"]) == b"<|endoftext|>"
    assert bl.token_bytes(bl.roles["bos"]) == b"<|startoftext|>"
    sp = vocabulary_from_hf(sentencepiece)
    assert sp.token_bytes(sp.roles["eos"]) == b"</s>" and sp.token_bytes(sp.roles["bos"]) == b"<s>"
    for v in (bl, sp):
        assert all(v.is_special(i) for i in v.roles.values())
        assert v.decode([v.roles["eos"]]) == b""


def test_two_tokenizer_families_share_a_common_vocabulary(byte_level, sentencepiece) -> None:
    bl, sp = vocabulary_from_hf(byte_level), vocabulary_from_hf(sentencepiece)
    vmap = VocabMap(bl, sp)
    assert 200 < vmap.n_common < min(bl.size, sp.size)
    # the eos/bos roles are matched though their texts differ
    assert vmap.target_to_draft[sp.roles["eos"]] == bl.roles["eos"]
    # a common token means the same bytes on both sides
    for t in vmap.common_target_ids[:300]:
        d = vmap.target_to_draft[t]
        if not sp.is_special(int(t)):
            assert sp.token_bytes(int(t)) == bl.token_bytes(int(d))


def test_from_hf_tokenizer_delegates(byte_level) -> None:
    v = Vocabulary.from_hf_tokenizer(byte_level, name="bl")
    assert v.name == "bl" and v.size == len(byte_level)
