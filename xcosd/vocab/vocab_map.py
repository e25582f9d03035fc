"""The map between a draft and a target vocabulary: V_C, V_O and id translation.

V_C (tokens both sides spell with the same bytes) is where the edge's draft
distribution and the cloud's target distribution can be compared; V_O (target-only
tokens) is what the lossless methods must still be able to emit. Both sides build
the same map and check its fingerprint before a session opens.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import VocabError
from .vocabulary import MATCHED_ROLES, Vocabulary

#: at most this many ascending runs of V_C draft ids are read as slices
#: (:attr:`VocabMap.common_draft_index`); more are gathered id by id
MAX_RUNS = 8


class VocabMap:
    """V_C, V_O and the id translation between a draft and a target vocabulary.

    V_C holds every regular (non-special) token both vocabularies spell with the
    same bytes, plus the generated special tokens whose role both vocabularies
    define (an EOS is an EOS whatever its text), paired one to one. Its fixed
    order, "V_C order", is ascending target id.
    V_O is every other used target id.
    """

    def __init__(self, draft: Vocabulary, target: Vocabulary) -> None:
        self.draft = draft
        self.target = target
        d_index, t_index = draft.byte_index, target.byte_index
        # the edge re-tokenises each target-only token it emits with the draft
        # vocabulary (encode_bytes): its look-ahead is computed here, with the
        # index, not on the event loop in the first round that emits one
        _ = draft.max_token_len
        if len(d_index) > len(t_index):
            pairs = [(d, t_index[b]) for b, d in d_index.items() if b in t_index]
        else:
            pairs = [(d_index[b], t) for b, t in t_index.items() if b in d_index]
        # Generated special tokens are matched by role, one to one: a tokenizer that
        # uses one token for two roles (SmolLM2's <|im_end|> is eos and pad) pairs it
        # once, with the first role both sides define.
        used_d = {d for d, _ in pairs}
        used_t = {t for _, t in pairs}
        for role in MATCHED_ROLES:
            if role in draft.roles and role in target.roles:
                d_id, t_id = draft.roles[role], target.roles[role]
                if d_id not in used_d and t_id not in used_t:
                    pairs.append((d_id, t_id))
                    used_d.add(d_id)
                    used_t.add(t_id)
        arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        order = np.argsort(arr[:, 1], kind="stable")
        self.common_draft_ids: np.ndarray = np.ascontiguousarray(arr[order, 0])
        self.common_target_ids: np.ndarray = np.ascontiguousarray(arr[order, 1])
        self.draft_to_target = np.full(draft.size, -1, dtype=np.int64)
        self.draft_to_target[self.common_draft_ids] = self.common_target_ids
        self.target_to_draft = np.full(target.size, -1, dtype=np.int64)
        self.target_to_draft[self.common_target_ids] = self.common_draft_ids
        self.common_mask = np.zeros(target.size, dtype=bool)
        self.common_mask[self.common_target_ids] = True
        self.other_mask = target.used_mask & ~self.common_mask

    @property
    def n_common(self) -> int:
        return int(self.common_target_ids.shape[0])

    @cached_property
    def common_draft_index(self) -> np.ndarray | tuple[slice, ...]:
        """:attr:`common_draft_ids` as the cheapest index that reads them out of a
        draft row: the ascending runs they form, as slices, when there are at most
        :data:`MAX_RUNS` (a draft that shares the target's vocabulary: its regular
        ids in one run, the matched specials in a few more), else the ids. Copying
        runs of a row costs a fraction of gathering it id by id (128k ids: about 75
        against 170 µs), and :func:`~xcosd.methods.tli.restrict_to_common` does it for
        every drafted token."""
        ids = self.common_draft_ids
        if not ids.shape[0]:
            return ids
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        if cuts.shape[0] >= MAX_RUNS:
            return ids
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), ids.shape[0]]
        return tuple(slice(int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts, ends, strict=True))

    @cached_property
    def draft_to_common(self) -> np.ndarray:
        """Position of each draft id in V_C order (-1 outside V_C): the edge maps a
        warped draft row's few kept ids straight into its V_C vector with it."""
        out = np.full(self.draft.size, -1, dtype=np.int64)
        out[self.common_draft_ids] = np.arange(self.n_common)
        return out

    @property
    def n_other(self) -> int:
        return int(self.other_mask.sum())

    @property
    def identical(self) -> bool:
        """True when V_O is empty: every method reduces to standard speculative decoding."""
        return self.n_other == 0

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the V_C target-id list and its draft ids: both sides of a session
        must agree on it, or the session is refused."""
        h = hashlib.sha256()
        h.update(self.target.size.to_bytes(8, "little") + self.draft.size.to_bytes(8, "little"))
        h.update(self.common_target_ids.astype("<i8").tobytes())
        h.update(self.common_draft_ids.astype("<i8").tobytes())
        return h.hexdigest()[:16]

    def draft_spelling(self, target_id: int) -> list[int]:
        """The draft ids a target token stands for in the draft's context: its pair
        in V_C, else its bytes re-tokenised by the draft vocabulary (any split only
        affects draft quality; none where the draft cannot spell them)."""
        d = int(self.target_to_draft[target_id])
        if d >= 0:
            return [d]
        data = self.target.piece(int(target_id))
        if not data:
            return []
        try:
            return self.draft.encode_bytes(data)
        except VocabError:
            return []

    def draft_to_target_probs(self, q_draft: np.ndarray) -> np.ndarray:
        """Token-level intersection (TLI): a draft distribution over V_D (rows) becomes
        a distribution over target ids, zero outside V_C and renormalised on V_C.

        Raises :class:`VocabError` if a row has no mass on V_C at all.
        """
        q = np.asarray(q_draft)
        lead = q.shape[:-1]
        out = np.zeros((*lead, self.target.size), dtype=np.float32)
        sub = q[..., self.common_draft_ids].astype(np.float64)
        z = sub.sum(axis=-1, keepdims=True)
        if np.any(z <= 0):
            raise VocabError("draft distribution has no mass on the common vocabulary V_C")
        out[..., self.common_target_ids] = (sub / z).astype(np.float32)
        return out

    def summary(self) -> dict[str, Any]:
        """Facts for ``xcosd vocab``: sizes, |V_C|, shares and the fingerprint."""
        nc_regular = int(
            np.count_nonzero(self.target.regular_mask[self.common_target_ids])
        )
        return {
            "draft": {
                "name": self.draft.name,
                "size": self.draft.size,
                "regular": self.draft.n_regular,
                "common_share": nc_regular / max(1, self.draft.n_regular),
            },
            "target": {
                "name": self.target.name,
                "size": self.target.size,
                "regular": self.target.n_regular,
                "common_share": nc_regular / max(1, self.target.n_regular),
            },
            "common": nc_regular,
            "common_with_special_roles": self.n_common,
            "other": self.n_other,
            "fingerprint": self.fingerprint,
        }
