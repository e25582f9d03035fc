"""V_C pairs by each tokenizer's own spelling, on the shipped vocabularies.

The quicktok vocabularies (every ordered pair of them) here; the GGUF vocabularies
of SmolLM2 and Gemma-3 on both backends in ``tests/test_models_llama_cpp.py`` and
``tests/test_models_real.py``, through :mod:`tests.helpers.spelling`. And the
spelling as a peer sends it: a table that marks ids no tokenizer could have written
is refused.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from xcosd.errors import ProtocolError, VocabError
from xcosd.protocol.vocab_transfer import KIND_SPELLED, table_to_vocab, vocab_to_table
from xcosd.vocab import VocabMap, Vocabulary
from xcosd.vocab.spelling import duplicated_strings, own_spelling

from .helpers.spelling import check_pairs, written_ids

QUICKTOK = ["llama3", "qwen", "cl100k", "o200k"]


@pytest.fixture(scope="module")
def quicktok() -> dict[str, tuple[Vocabulary, dict[int, int]]]:
    out = {}
    for name in QUICKTOK:
        v = Vocabulary.load(name)
        out[name] = (v, written_ids(v))
    return out


@pytest.mark.parametrize(("draft", "target"), list(itertools.permutations(QUICKTOK, 2)))
def test_every_quicktok_pair_is_paired_by_the_written_ids(quicktok, draft: str,
                                                          target: str) -> None:
    (dv, dw), (tv, tw) = quicktok[draft], quicktok[target]
    vmap = VocabMap(dv, tv)
    assert check_pairs(vmap, dw, tw) > 0.9 * vmap.n_common


def test_qwen_normalises_and_is_not_misread(quicktok) -> None:
    """Qwen's tokenizer writes some strings as a token of other bytes (NFC): such a
    string has no written id of its own, and its id keeps its pair."""
    v, w = quicktok["qwen"]
    dec = b"\xc3\xaa\xcc\x81"  # e-circumflex + combining acute, written as one NFC token
    i = v.byte_index[dec]
    assert i not in w and v.encode(dec.decode()) != [i]


def test_own_spelling_asks_the_tokenizer() -> None:
    tokens = [b"a", b",", b"b", b","]
    dup = duplicated_strings(tokens, set())
    assert dup == {b",": (1, 3)}
    assert own_spelling(dup, lambda text: [3] if text == "," else [0]) == {3}
    # a tokenizer that writes the string otherwise decides nothing
    assert own_spelling(dup, lambda text: [1, 1]) == frozenset()
    assert own_spelling(dup, lambda text: [0]) == frozenset()
    v = Vocabulary("t", tokens, encoder=lambda text: [3] if text == "," else [0])
    assert v.byte_index[b","] == 3 and v.encode_bytes(b"a,") == [0, 3]


def test_a_table_marking_what_no_tokenizer_writes_is_refused() -> None:
    v = Vocabulary("t", [b"a", b",", b"b", b","], spelled=[3])
    good = vocab_to_table(v)
    assert table_to_vocab(good).byte_index[b","] == 3
    for ids in ([0], [1, 3]):  # a unique string; two ids for one string
        kinds = np.frombuffer(good.kinds, np.uint8).copy()
        kinds[kinds == KIND_SPELLED] = 1
        kinds[ids] = KIND_SPELLED
        bad = type(good)(good.name, good.fingerprint, good.roles, kinds.tobytes(),
                         good.lengths, good.blob, good.compressed)
        with pytest.raises(ProtocolError) as e:
            table_to_vocab(bad)
        assert e.value.code == "bad_field"
    kinds = np.frombuffer(good.kinds, np.uint8).copy()
    kinds[0] = 7
    with pytest.raises(ProtocolError, match="unknown token kind"):
        table_to_vocab(type(good)(good.name, good.fingerprint, good.roles, kinds.tobytes(),
                                  good.lengths, good.blob, good.compressed))
    with pytest.raises(VocabError):
        Vocabulary("t", [b"a", b",", b"b", b","], spelled=[2])
