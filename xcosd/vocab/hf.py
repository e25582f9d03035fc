"""A Hugging Face tokenizer as a table of byte strings, for :class:`~xcosd.vocab.Vocabulary`.

Cross-vocabulary decoding compares tokens by their bytes, so each token's
*string* in the tokenizer's vocabulary must be turned back into the bytes it
stands for. The two families spell bytes differently:

* **byte-level BPE** (GPT-2, SmolLM2, Llama 3, Qwen): every byte is mapped to a
  printable character by GPT-2's ``bytes_to_unicode`` table (space -> ``Ġ``,
  newline -> ``Ċ``, ...); the inverse table gives the bytes back.
* **SentencePiece** (Gemma, Llama 2, Mistral): ``▁`` (U+2581) stands for a space and
  ``<0xNN>`` byte-fallback tokens for single raw bytes; every other character is its
  UTF-8.

Tokens added on top of the model (``added_tokens_decoder``) are stored as plain
text in both families. Special tokens keep their text as bytes, are flagged
special and mapped to roles (``bos``, ``eos``, ``pad``, ``eot``) so two vocabularies
match them by role. Ids the tokenizer does not define are unused (``None``).

The conversion walks ids ``0 .. size-1`` and reads each id's own string: building
the table from any sorted listing and assuming position = id is the classic
cross-tokenizer bug that mock vocabularies (already sorted) never reveal.

This module returns the table (:class:`HfTable`) and leaves building the
:class:`~xcosd.vocab.Vocabulary` to ``Vocabulary.from_hf_tokenizer``, so the
vocabulary module can offer that loader without the two importing each other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..errors import VocabError

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
#: special-token texts that end a turn in chat models, for the ``eot`` role
EOT_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


@cache
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` table, inverted: printable character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _backend_json(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = tokenizer if hasattr(tokenizer, "to_str") else None
    if backend is None:
        return {}
    try:
        return dict(json.loads(backend.to_str()))
    except (ValueError, TypeError, AttributeError):
        return {}


def _contains_type(node: Any, name: str) -> bool:
    if isinstance(node, dict):
        if node.get("type") == name:
            return True
        return any(_contains_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_contains_type(v, name) for v in node)
    return False


def tokenizer_family(tokenizer: Any, vocab: dict[str, int] | None = None) -> str:
    """``"byte_level"`` or ``"sentencepiece"``, from the tokenizer's decoder (or, for
    tokenizers without a backend description, from the characters of its tokens)."""
    j = _backend_json(tokenizer)
    if j:
        dec, pre = j.get("decoder"), j.get("pre_tokenizer")
        if _contains_type(dec, "ByteLevel") or _contains_type(pre, "ByteLevel"):
            return "byte_level"
        if (_contains_type(dec, "ByteFallback") or _contains_type(dec, "Metaspace")
                or _contains_type(pre, "Metaspace") or "\u2581" in json.dumps(dec)):
            return "sentencepiece"
    vocab = vocab if vocab is not None else dict(tokenizer.get_vocab())
    sample = list(vocab)[:5000]
    n_sp = sum("\u2581" in t for t in sample)
    n_bl = sum("Ġ" in t for t in sample)
    if n_sp == 0 and n_bl == 0:
        raise VocabError("cannot tell whether this tokenizer is byte-level BPE or SentencePiece")
    return "sentencepiece" if n_sp > n_bl else "byte_level"


def token_to_bytes(token: str, family: str) -> bytes:
    """The bytes one vocabulary string stands for, in ``family``'s spelling."""
    if family == "byte_level":
        table = gpt2_byte_decoder()
        try:
            return bytes(table[c] for c in token)
        except KeyError as e:
            raise VocabError(f"token {token!r} is not in GPT-2 byte spelling") from e
    m = _BYTE_TOKEN.match(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def hf_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Text -> ids with the tokenizer itself, no special tokens added: prompts get
    exactly the ids the model was trained on."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode


@dataclass(frozen=True)
class HfTable:
    """What a :class:`~xcosd.vocab.Vocabulary` is built from: bytes per id (``None``
    for an unused id), the special ids, the roles and the tokenizer's own encoder."""

    name: str
    tokens: list[bytes | None]
    special: set[int]
    roles: dict[str, int]
    encoder: Callable[[str], list[int]]


def hf_table(tokenizer: Any, name: str | None = None) -> HfTable:
    """Convert a Hugging Face tokenizer's vocabulary to bytes, id by id."""
    vocab: dict[str, int] = dict(tokenizer.get_vocab())
    if not vocab:
        raise VocabError("tokenizer has an empty vocabulary")
    family = tokenizer_family(tokenizer, vocab)
    size = max(max(vocab.values()) + 1, len(tokenizer))
    by_id: list[str | None] = [None] * size
    for text, i in vocab.items():
        by_id[i] = text
    added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    special: set[int] = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    special |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
    tokens: list[bytes | None] = [None] * size
    for i, piece in enumerate(by_id):
        if piece is None:
            continue
        if i in added or i in special:
            content = getattr(added.get(i), "content", piece)
            tokens[i] = str(content).encode("utf-8")
        else:
            tokens[i] = token_to_bytes(piece, family)
    roles: dict[str, int] = {}
    for role in ("bos", "eos", "pad"):
        tid = getattr(tokenizer, f"{role}_token_id", None)
        if tid is not None and 0 <= int(tid) < size:
            roles[role] = int(tid)
            special.add(int(tid))
    for text in EOT_TEXTS:
        tid = vocab.get(text)
        if tid is not None and tid != roles.get("eos"):
            roles["eot"] = tid
            special.add(tid)
            break
    if name is None:
        name = str(getattr(tokenizer, "name_or_path", "") or "hf").rstrip("/").split("/")[-1] or "hf"
    return HfTable(name, tokens, special, roles, hf_encoder(tokenizer))
