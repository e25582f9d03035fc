"""What decides acceptance, checked against the tokenizers themselves: every V_C
pair is the id each side's own tokenizer writes for the pair's bytes.

A V_C that pairs a draft token with an id the target never emits is as exact as
any other (the law tests cannot see it) but puts the target's mass on those bytes
out of the draft's reach, so the pairing is checked here, id by id, on real
vocabularies.
"""

from __future__ import annotations

from typing import Any

from xcosd.vocab import VocabMap, Vocabulary


def written_ids(vocab: Vocabulary, encode: Any = None) -> dict[int, int]:
    """For every regular id whose bytes the tokenizer writes as one token of the
    same bytes: id -> the id it writes (itself, unless another id spells them too)."""
    encode = encode or vocab.encode
    out: dict[int, int] = {}
    for i, b in enumerate(vocab.tokens):
        if b is None or i in vocab.special_ids:
            continue
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        got = encode(text)
        if len(got) == 1 and vocab.tokens[int(got[0])] == b:
            out[i] = int(got[0])
    return out


def check_pairs(vmap: VocabMap, draft_written: dict[int, int],
                target_written: dict[int, int]) -> int:
    """Assert that each V_C pair is both sides' written id wherever the tokenizer
    writes its bytes as one token; return how many pairs that decided."""
    checked = 0
    for d, t in zip(vmap.common_draft_ids.tolist(), vmap.common_target_ids.tolist(), strict=True):
        if t in vmap.target.special_ids:
            continue  # matched by role
        want_t = target_written.get(t)
        if want_t is not None:
            assert want_t == t, (vmap.target.tokens[t], t, want_t)
            checked += 1
        want_d = draft_written.get(d)
        if want_d is not None:
            assert want_d == d, (vmap.draft.tokens[d], d, want_d)
    # and no written id of a string both spell is left out of V_C
    for t, w in target_written.items():
        if w == t and vmap.target.tokens[t] in vmap.draft.byte_index:
            assert vmap.common_mask[t], (vmap.target.tokens[t], t)
    return checked


def dup_written(vocab: Vocabulary) -> list[tuple[bytes, int]]:
    """(string, written id) for every duplicated string the tokenizer writes as one
    of its ids."""
    out = []
    for b, ids in vocab.duplicates.items():
        w = [i for i in ids if i in vocab.spelled]
        if w:
            out.append((b, w[0]))
    return out


__all__ = ["check_pairs", "dup_written", "written_ids"]
