"""A llama.cpp vocabulary as a table of byte strings, for :class:`~xcosd.vocab.Vocabulary`.

llama.cpp keeps, per id, the token's text as the GGUF file stores it and a set of
attribute flags (normal, control, user-defined, byte, unused). The text is spelled
as in the tokenizer the file was converted from, so the conversion to bytes is the
one :mod:`xcosd.vocab.hf` applies: GPT-2's byte alphabet for byte-level BPE
(llama.cpp's ``BPE`` type), ``▁`` and ``<0xNN>`` for SentencePiece (``SPM``).

The result must be the very vocabulary the Hugging Face path builds from the same
GGUF file (the same bytes per id, the same special ids, the same roles): a draft on
llama.cpp and a target on transformers, or the other way round, are then one pair,
and a test compares the two tables on every id. The rules that make it so:

* control tokens are special and keep their text (``<|im_start|>``, ``<bos>``);
* user-defined tokens (Gemma's runs of spaces and newlines, ``[multimodal]``) are
  ordinary tokens whose text is their bytes, as transformers' added tokens are;
* byte tokens are their byte; normal tokens go through the family's spelling;
* ``bos``, ``eos`` and ``pad`` are llama.cpp's own ids (and special); ``eot`` is
  the first end-of-turn text of :data:`xcosd.vocab.hf.EOT_TEXTS` the vocabulary
  holds, unless that is the ``eos`` id, as in the Hugging Face conversion (llama.cpp's
  own ``eot`` guess differs: it names SmolLM2's ``<|endoftext|>``).

Pure: the caller reads the texts and flags out of llama.cpp
(:class:`~xcosd.models.llama_cpp_model.LlamaCppModel`) and hands them here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import VocabError
from .hf import EOT_TEXTS, HfTable, token_to_bytes

#: llama.cpp's ``llama_vocab_type`` values this conversion knows
VOCAB_FAMILIES = {1: "sentencepiece", 2: "byte_level"}

#: ``llama_token_attr`` flags
ATTR_UNUSED = 1 << 1
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5


def llama_table(name: str, vocab_type: int, texts: Sequence[bytes], attrs: Sequence[int],
                roles: dict[str, int], encoder: Callable[[str], list[int]]) -> HfTable:
    """The table of a llama.cpp vocabulary: ``texts[i]`` and ``attrs[i]`` are id
    ``i``'s stored text and flags, ``roles`` llama.cpp's ``bos`` / ``eos`` / ``pad``
    ids (a negative id: none)."""
    family = VOCAB_FAMILIES.get(vocab_type)
    if family is None:
        raise VocabError(f"{name}: llama.cpp vocabulary type {vocab_type} is not supported "
                         f"(only SentencePiece and byte-level BPE)")
    if len(texts) != len(attrs):
        raise VocabError(f"{name}: {len(texts)} token texts but {len(attrs)} attribute sets")
    size = len(texts)
    tokens: list[bytes | None] = [None] * size
    special: set[int] = set()
    for i, (raw, attr) in enumerate(zip(texts, attrs, strict=True)):
        if attr & ATTR_CONTROL:
            special.add(i)
            tokens[i] = raw
        elif attr & ATTR_USER_DEFINED:
            tokens[i] = raw
        else:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise VocabError(f"{name}: token {i} is not UTF-8 text: {raw!r}") from e
            tokens[i] = token_to_bytes(text, family)
    out_roles: dict[str, int] = {}
    for role in ("bos", "eos", "pad"):
        tid = roles.get(role, -1)
        if 0 <= tid < size:
            out_roles[role] = tid
            special.add(tid)
    index = {raw: i for i, raw in enumerate(texts)}
    for text in EOT_TEXTS:
        eot = index.get(text.encode())
        if eot is not None and eot != out_roles.get("eos"):
            out_roles["eot"] = eot
            special.add(eot)
            break
    return HfTable(name, tokens, special, out_roles, encoder)
