"""Vocabularies as byte strings: :class:`Vocabulary` and its loaders.

Cross-vocabulary speculative decoding compares tokens by their **bytes**, never by
id or by decoded text: two tokenizers agree on a token exactly when they spell it
with the same bytes. :class:`Vocabulary` is id <-> bytes plus special tokens by
role, loaded from quicktok's shipped encodings, a tiktoken file or a Hugging Face
tokenizer (:mod:`.hf` does that conversion); :class:`~xcosd.vocab.VocabMap` pairs
two of them.

Ids that a vocabulary leaves unused (cl100k and o200k have holes) have no bytes:
they are never in V_C and no model should give them probability.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import VocabError
from .hf import hf_table
from .spelling import duplicated_strings, own_spelling, own_spelling_check

#: Short names accepted everywhere, mapped to quicktok's encoding names.
QUICKTOK_ALIASES: dict[str, str] = {
    "llama3": "llama3",
    "qwen": "qwen3",
    "qwen3": "qwen3",
    "qwen2.5": "qwen3",
    "cl100k": "cl100k_base",
    "cl100k_base": "cl100k_base",
    "o200k": "o200k_base",
    "o200k_base": "o200k_base",
}

#: Special-token text -> role, for the vocabularies quicktok ships.
_QUICKTOK_ROLES: dict[str, dict[str, str]] = {
    "llama3": {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "eot": "<|eot_id|>"},
    "qwen3": {"eos": "<|endoftext|>", "eot": "<|im_end|>"},
    "cl100k_base": {"eos": "<|endoftext|>"},
    "o200k_base": {"eos": "<|endoftext|>"},
}

#: Roles a Vocabulary may name.
SPECIAL_ROLES = ("bos", "eos", "pad", "eot")
#: Roles that put a special token in V_C (matched by role, not bytes), in priority
#: order. Only tokens a model *generates* belong there: bos and pad never are.
MATCHED_ROLES = ("eos", "eot")


class Vocabulary:
    """Token ids <-> token bytes for one tokenizer.

    ``tokens[i]`` is the byte string of id ``i``; ``None`` marks an unused id.
    ``special`` holds the ids of special tokens (their ``tokens`` entry is their
    text, e.g. ``b"<|endoftext|>"``); ``roles`` names some of them (``bos``,
    ``eos``, ``pad``, ``eot``) so that two vocabularies can match them by role.
    """

    def __init__(
        self,
        name: str,
        tokens: Sequence[bytes | None],
        *,
        special: Iterable[int] = (),
        roles: Mapping[str, int] | None = None,
        encoder: Any = None,
        spelled: Iterable[int] | None = None,
    ) -> None:
        self.name = name
        self.tokens: list[bytes | None] = list(tokens)
        self.size = len(self.tokens)
        self.special_ids: frozenset[int] = frozenset(int(i) for i in special)
        self.roles: dict[str, int] = dict(roles or {})
        for role, i in self.roles.items():
            if not 0 <= i < self.size:
                raise VocabError(f"{name}: role {role!r} points at id {i}, outside 0..{self.size - 1}")
        self._encoder = encoder
        if self.size == 0:
            raise VocabError(f"{name}: empty vocabulary")
        if spelled is not None:
            # given (a table that came over the wire, a cache): the side that held the
            # tokenizer decided; anything else is computed from the encoder on first use
            self.__dict__["spelled"] = own_spelling_check(self, frozenset(int(i) for i in spelled))

    def __repr__(self) -> str:
        return f"Vocabulary({self.name!r}, size={self.size}, regular={self.n_regular})"

    def __len__(self) -> int:
        return self.size

    # -- lookups -------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` (a special token's text for special ids)."""
        if not 0 <= token_id < self.size:
            raise VocabError(f"{self.name}: token id {token_id} outside 0..{self.size - 1}")
        b = self.tokens[token_id]
        if b is None:
            raise VocabError(f"{self.name}: token id {token_id} is unused")
        return b

    def piece(self, token_id: int) -> bytes:
        """The bytes ``token_id`` contributes to output text (b"" for special tokens)."""
        if token_id in self.special_ids:
            return b""
        return self.token_bytes(token_id)

    def decode(self, ids: Iterable[int]) -> bytes:
        """Concatenated output bytes of ``ids``."""
        return b"".join(self.piece(int(i)) for i in ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    @cached_property
    def used_mask(self) -> np.ndarray:
        """Bool mask over ids: True for every id that has a token (special or not)."""
        return np.array([b is not None for b in self.tokens], dtype=bool)

    @cached_property
    def regular_mask(self) -> np.ndarray:
        """Bool mask over ids: True for used, non-special ids."""
        m = self.used_mask.copy()
        if self.special_ids:
            m[np.fromiter(self.special_ids, dtype=np.int64)] = False
        return m

    @cached_property
    def n_regular(self) -> int:
        return int(self.regular_mask.sum())

    @cached_property
    def duplicates(self) -> dict[bytes, tuple[int, ...]]:
        """Byte strings that two or more regular ids spell, with those ids ascending
        (Gemma-3 spells ``,`` ``.`` the digits and a lone space twice: a piece and a
        byte-fallback token)."""
        return duplicated_strings(self.tokens, self.special_ids)

    @cached_property
    def spelled(self) -> frozenset[int]:
        """Of each duplicated string's ids, the one this vocabulary's own tokenizer
        writes for those bytes (:mod:`.spelling`); empty without an encoder."""
        if self._encoder is None:
            return frozenset()
        return own_spelling(self.duplicates, self.encode)

    @cached_property
    def byte_index(self) -> dict[bytes, int]:
        """bytes -> id over regular tokens. Where ids share their bytes the one the
        tokenizer writes wins (:attr:`spelled`), else the lowest: V_C pairs by this
        index, and pairing a draft token with an id the model never emits puts the
        model's mass out of the draft's reach."""
        index: dict[bytes, int] = {}
        special = self.special_ids
        for i, b in enumerate(self.tokens):
            if b is not None and i not in special and b not in index:
                index[b] = i
        for i in self.spelled:
            b = self.tokens[i]
            assert b is not None
            index[b] = i
        return index

    @cached_property
    def max_token_len(self) -> int:
        """Bytes in the longest regular token: how far :meth:`encode_bytes` looks
        ahead. A pass over every token (about 5 ms at 200k ids), so a
        :class:`~xcosd.vocab.VocabMap` computes it up front for its draft."""
        return max(map(len, self.byte_index), default=1)

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of the id -> bytes table, the role map and which duplicate
        the tokenizer writes (two sides that pair a string differently disagree on V_C)."""
        h = hashlib.sha256()
        spelled = self.spelled
        for i, b in enumerate(self.tokens):
            tag = b"S" if i in self.special_ids else (
                b"N" if b is None else (b"P" if i in spelled else b"R"))
            h.update(tag + len(b or b"").to_bytes(4, "little") + (b or b""))
        for role in sorted(self.roles):
            h.update(role.encode() + self.roles[role].to_bytes(8, "little"))
        return h.hexdigest()[:16]

    # -- tokenisation ----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Tokenise ``text`` with the vocabulary's own tokenizer when it has one,
        else by greedy longest match over bytes (see :meth:`encode_bytes`)."""
        if self._encoder is not None:
            return [int(i) for i in self._encoder(text)]
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Split arbitrary bytes into regular tokens by greedy longest match.

        Used to re-tokenise a target-only token (which arrives as bytes) into draft
        tokens: any valid split is fine there, it only affects draft quality. Raises
        :class:`VocabError` when some byte has no token at all.
        """
        index = self.byte_index
        out: list[int] = []
        i, n, longest = 0, len(data), self.max_token_len
        while i < n:
            for j in range(min(n, i + longest), i, -1):
                tid = index.get(data[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                raise VocabError(f"{self.name}: no token covers byte {data[i]:#04x}")
        return out

    # -- loaders ---------------------------------------------------------------

    @classmethod
    def load(cls, spec: str) -> Vocabulary:
        """Load by short name (``llama3``, ``qwen``, ``cl100k``, ``o200k``) or by path
        to a tiktoken-format file."""
        if spec in QUICKTOK_ALIASES:
            return cls.from_quicktok(spec)
        p = Path(spec)
        if p.exists():
            return cls.from_tiktoken_file(p)
        raise VocabError(
            f"unknown vocabulary {spec!r}: use one of {sorted(set(QUICKTOK_ALIASES))} "
            "or a path to a tiktoken-format file"
        )

    @classmethod
    def from_quicktok(cls, name: str) -> Vocabulary:
        """A vocabulary that the ``quicktok-v1`` package ships.

        quicktok's ``token_byte_values()`` is sorted by bytes, not by id, so the
        table is read id by id with ``decode_single_token_bytes``.
        """
        import quicktok

        enc_name = QUICKTOK_ALIASES.get(name, name)
        try:
            enc = quicktok.get_encoding(enc_name)
        except Exception as e:  # quicktok raises RuntimeError/KeyError variants
            raise VocabError(f"quicktok has no encoding {enc_name!r}: {e}") from e
        tokens: list[bytes | None] = []
        special: list[int] = []
        by_text: dict[str, int] = {}
        for i in range(enc.n_vocab):
            try:
                b = enc.decode_single_token_bytes(i)
            except KeyError:
                tokens.append(None)
                continue
            tokens.append(b)
            if enc.is_special_token(i):
                special.append(i)
                by_text[b.decode("utf-8", "replace")] = i
        roles = {
            role: by_text[text]
            for role, text in _QUICKTOK_ROLES.get(enc_name, {}).items()
            if text in by_text
        }
        short = next((k for k, v in QUICKTOK_ALIASES.items() if v == enc_name), enc_name)
        return cls(short, tokens, special=special, roles=roles, encoder=enc.encode_ordinary)

    @classmethod
    def from_tiktoken_file(
        cls,
        path: str | Path,
        *,
        special_tokens: Mapping[str, int] | None = None,
        roles: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> Vocabulary:
        """A tiktoken ``.tiktoken`` file: one ``base64(bytes) rank`` pair per line.

        ``special_tokens`` maps special-token text to id; ``roles`` maps a role to
        one of those texts.
        """
        p = Path(path)
        ranks: dict[int, bytes] = {}
        try:
            for _lineno, line in enumerate(p.read_bytes().splitlines(), 1):
                if not line.strip():
                    continue
                tok, rank = line.split()
                ranks[int(rank)] = base64.b64decode(tok)
        except (ValueError, OSError) as e:
            raise VocabError(f"{p}: not a tiktoken file ({e})") from e
        special_tokens = dict(special_tokens or {})
        size = max([*ranks, *special_tokens.values(), -1]) + 1
        tokens: list[bytes | None] = [None] * size
        for r, b in ranks.items():
            tokens[r] = b
        for text, i in special_tokens.items():
            tokens[i] = text.encode()
        role_ids = {role: special_tokens[text] for role, text in (roles or {}).items()}
        return cls(name or p.stem, tokens, special=special_tokens.values(), roles=role_ids)

    @classmethod
    def from_hf_tokenizer(cls, tokenizer: Any, name: str | None = None) -> Vocabulary:
        """A Hugging Face tokenizer (byte-level BPE or SentencePiece), converted to bytes.

        ``encode`` then tokenises with the tokenizer itself (no special tokens
        added), so prompts get exactly the ids the model was trained on.
        """
        t = hf_table(tokenizer, name)
        return cls(t.name, t.tokens, special=t.special, roles=t.roles, encoder=t.encoder)

    def with_size(self, size: int) -> Vocabulary:
        """This vocabulary padded with unused ids up to ``size`` (a model's embedding
        rows beyond its tokenizer), the tokenizer's spelling choices kept."""
        if size < self.size:
            raise VocabError(f"{self.name}: cannot shrink {self.size} ids to {size}")
        return Vocabulary(self.name, [*self.tokens, *([None] * (size - self.size))],
                          special=self.special_ids, roles=self.roles, encoder=self._encoder,
                          spelled=self.spelled)

