"""Moving vocabulary facts across the link, once per connection.

Cross-vocabulary decoding needs V_C on both sides, and V_C is a function of both
tokenizers: the device holds the draft one, the cloud the target one. The edge
gets the target's id -> bytes table (:func:`vocab_to_table` /
:func:`table_to_vocab`, unless it was given the target vocabulary), with the ids the
target's tokenizer writes where two ids share their bytes (the edge has no tokenizer
to ask, and V_C pairs by them), builds the
:class:`~xcosd.vocab.VocabMap` itself and uploads the two V_C id arrays; the cloud
checks them against its own vocabulary and the claimed fingerprint
(:func:`space_from_upload`) and keeps the resulting :class:`~xcosd.methods.Space`
per fingerprint, so later edges with the same pair upload nothing. The table is
also how the edge spells every target-only token the cloud names: no reply carries
spellings.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import ProtocolError, VocabError
from ..methods.base import Space
from ..vocab import VocabMap, Vocabulary
from .messages import VocabMapUpload, VocabTable

#: a table's ``kinds``: an unused id, a regular token, a special token, and a regular
#: token that is the tokenizer's own spelling of bytes other ids spell too
#: (:mod:`xcosd.vocab.spelling`)
KIND_UNUSED, KIND_REGULAR, KIND_SPECIAL, KIND_SPELLED = 0, 1, 2, 3

#: a VocabTable's token bytes (its decompressed blob) may not exceed this, so a hostile
#: table cannot blow memory
MAX_TABLE_BYTES = 64 << 20


def map_fingerprint(target_size: int, draft_size: int, common_target_ids: np.ndarray,
                    common_draft_ids: np.ndarray) -> str:
    """The fingerprint :attr:`xcosd.vocab.VocabMap.fingerprint` computes, from the arrays
    alone, so the cloud can recompute it without the draft vocabulary."""
    h = hashlib.sha256()
    h.update(int(target_size).to_bytes(8, "little") + int(draft_size).to_bytes(8, "little"))
    h.update(np.asarray(common_target_ids).astype("<i8").tobytes())
    h.update(np.asarray(common_draft_ids).astype("<i8").tobytes())
    return h.hexdigest()[:16]


def vocab_to_table(vocab: Vocabulary, compress: bool = True) -> VocabTable:
    """The :class:`VocabTable` message for ``vocab`` (zstd on the token bytes)."""
    kinds = np.zeros(vocab.size, dtype=np.uint8)
    lengths = np.zeros(vocab.size, dtype="<i4")
    parts: list[bytes] = []
    spelled = vocab.spelled
    for i, b in enumerate(vocab.tokens):
        if b is None:
            continue
        kinds[i] = KIND_SPECIAL if i in vocab.special_ids else (
            KIND_SPELLED if i in spelled else KIND_REGULAR)
        lengths[i] = len(b)
        parts.append(b)
    blob = b"".join(parts)
    if compress:
        import zstandard

        blob = zstandard.ZstdCompressor(level=3).compress(blob)
    return VocabTable(vocab.name, vocab.fingerprint, dict(vocab.roles), kinds.tobytes(),
                      lengths.tobytes(), blob, compress)


def table_to_vocab(msg: VocabTable) -> Vocabulary:
    """Rebuild the target :class:`Vocabulary` from a :class:`VocabTable` and check its
    fingerprint (``vocab`` error on any inconsistency)."""
    kinds = np.frombuffer(msg.kinds, dtype=np.uint8)
    if len(msg.lengths) != 4 * kinds.shape[0]:
        raise ProtocolError("vocab: lengths do not match kinds", code="bad_field")
    lengths = np.frombuffer(msg.lengths, dtype="<i4").astype(np.int64)
    if np.any(lengths < 0):
        raise ProtocolError("vocab: negative token lengths", code="bad_field")
    total = int(lengths.sum())
    if total > MAX_TABLE_BYTES:
        raise ProtocolError(f"vocab: {total} bytes of tokens exceed the limit of "
                            f"{MAX_TABLE_BYTES}", code="too_large")
    blob = msg.blob
    if msg.compressed:
        import zstandard

        try:
            # zstd ignores max_output_size when the frame states its size: check the
            # stated size first, or a few kilobytes could claim (and get) gigabytes
            declared = zstandard.frame_content_size(blob)
            if declared != -1 and declared != total:
                raise ProtocolError(f"vocab: the compressed table holds {declared} bytes, "
                                    f"its lengths say {total}",
                                    code="too_large" if declared > total else "bad_field")
            blob = zstandard.ZstdDecompressor().decompress(
                blob, max_output_size=max(total, 1))
        except zstandard.ZstdError as e:
            raise ProtocolError(f"vocab: bad compressed table ({e})", code="bad_field") from e
    if len(blob) != total:
        raise ProtocolError("vocab: token bytes do not match lengths", code="bad_field")
    if int(kinds.max(initial=0)) > KIND_SPELLED:
        raise ProtocolError("vocab: unknown token kind", code="bad_field")
    tokens: list[bytes | None] = []
    special: list[int] = []
    spelled: list[int] = []
    pos = 0
    for i, (k, n) in enumerate(zip(kinds.tolist(), lengths.tolist(), strict=True)):
        if k == KIND_UNUSED:
            tokens.append(None)
            continue
        tokens.append(bytes(blob[pos:pos + n]))
        pos += n
        if k == KIND_SPECIAL:
            special.append(i)
        elif k == KIND_SPELLED:
            spelled.append(i)
    try:
        vocab = Vocabulary(msg.name, tokens, special=special, roles=msg.roles, spelled=spelled)
    except VocabError as e:
        raise ProtocolError(f"vocab: {e}", code="bad_field") from e
    if vocab.fingerprint != msg.fingerprint:
        raise ProtocolError("vocab: the table does not match its fingerprint", code="vocab")
    return vocab


def upload_for(vmap: VocabMap) -> VocabMapUpload:
    """The :class:`VocabMapUpload` for a :class:`~xcosd.vocab.VocabMap`."""
    return VocabMapUpload(vmap.fingerprint, vmap.draft.size, vmap.common_target_ids,
                          vmap.common_draft_ids)


def space_from_upload(msg: VocabMapUpload, target: Vocabulary) -> Space:
    """The cloud's :class:`Space` for an uploaded V_C map, after checking it.

    V_C target ids must be strictly ascending used ids of ``target``; draft ids must
    be distinct and inside the draft vocabulary; the fingerprint must be the one the
    arrays give. Anything else is refused with a typed error.
    """
    ct, cd = msg.common_target_ids, msg.common_draft_ids
    if ct.shape[0] == 0:
        raise ProtocolError("vmap: V_C is empty", code="vocab")
    if int(ct.max()) >= target.size:
        raise ProtocolError("vmap: a V_C id is outside the target vocabulary", code="bad_token")
    if np.any(np.diff(ct) <= 0):
        raise ProtocolError("vmap: V_C target ids must be strictly ascending", code="bad_field")
    # one to one: a draft id drafts exactly one target token (VocabMap pairs roles so)
    if int(cd.max()) >= msg.draft_size or np.unique(cd).shape[0] != cd.shape[0]:
        raise ProtocolError("vmap: draft ids must be distinct ids of the draft vocabulary",
                            code="bad_token")
    used = target.used_mask
    if not np.all(used[ct]):
        raise ProtocolError("vmap: V_C names an unused target id", code="bad_token")
    fp = map_fingerprint(target.size, msg.draft_size, ct, cd)
    if fp != msg.fingerprint:
        raise ProtocolError(f"vmap: fingerprint {msg.fingerprint!r} does not match the "
                            f"arrays ({fp!r})", code="vocab")
    common = np.zeros(target.size, dtype=bool)
    common[ct] = True
    return Space(target.size, ct, used & ~common)
