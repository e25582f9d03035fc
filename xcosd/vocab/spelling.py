"""A tokenizer's own spelling of a byte string that several of its ids spell.

SentencePiece vocabularies with byte fallback (Gemma, Llama 2, Mistral) hold some
byte strings twice: a piece (Gemma-3's ``,`` is 236764) and a byte-fallback token
(``<0x2C>``, 282). Only the piece is what the tokenizer writes, so only the piece
is what the model was trained to emit: a V_C that pairs the draft's ``,`` with the
byte token leaves the target's mass on ``,`` out of the draft's reach (on the
SmolLM2 -> Gemma-3 pair, 31 % of the target's mass on its own text).

The side that holds the tokenizer decides: :func:`own_spelling` asks it, once per
duplicated string, which id it writes for those bytes. The answer travels with the
vocabulary (a table's ``kinds`` mark it, :mod:`xcosd.protocol.vocab_transfer`) and
is part of its fingerprint, so both sides of a session pair a string alike.
A string the tokenizer does not write as one of its ids (a lone byte that is not
UTF-8, or one a tokenizer prefixes with a space) keeps the lowest id.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..errors import VocabError


def duplicated_strings(tokens: Sequence[bytes | None],
                       special: Collection[int]) -> dict[bytes, tuple[int, ...]]:
    """Byte strings that two or more regular ids spell, with those ids ascending."""
    seen: dict[bytes, int] = {}
    dup: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if b is None or i in special:
            continue
        first = seen.setdefault(b, i)
        if first != i:
            dup.setdefault(b, [first]).append(i)
    return {b: tuple(ids) for b, ids in dup.items()}


def own_spelling(duplicates: Mapping[bytes, Sequence[int]],
                 encode: Callable[[str], list[int]]) -> frozenset[int]:
    """Of each duplicated string's ids, the one ``encode`` (the tokenizer) writes
    for its text, where it writes the string as one of those ids."""
    out: set[int] = set()
    for b, ids in duplicates.items():
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        got = encode(text)
        if len(got) == 1 and int(got[0]) in ids:
            out.add(int(got[0]))
    return frozenset(out)


def own_spelling_check(vocab: Any, spelled: frozenset[int]) -> frozenset[int]:
    """``spelled`` after checking it against ``vocab`` (a table from a peer): each
    id is a regular id of a duplicated string, at most one per string."""
    dup = vocab.duplicates
    strings: set[bytes] = set()
    for i in spelled:
        if not 0 <= i < vocab.size or i in vocab.special_ids or vocab.tokens[i] is None:
            raise VocabError(f"{vocab.name}: spelled id {i} is not a regular token")
        b = vocab.tokens[i]
        if b not in dup:
            raise VocabError(f"{vocab.name}: spelled id {i} spells a string no other id spells")
        if b in strings:
            raise VocabError(f"{vocab.name}: two spelled ids for {b!r}")
        strings.add(b)
    return spelled
