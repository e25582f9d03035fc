"""``uhlm`` (lossy): uncertainty-aware skipping, after U-HLM.

The device measures its own uncertainty on each drafted position, ``1 − max q_i``,
and only positions above ``threshold`` are verified (their ``q_i`` vectors go up
the link so the server can resample the residual); confident drafts are taken
as they are. That saves uplink and rejections, and it is lossy exactly where the
draft is confident and wrong.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..codecs import Codec
from ..draws import ACCEPT, Draws, stream_of
from ..sampling import Rows
from .base import Answer, Draft, Method, Space, verify
from .commit import committed_full, decoded_full


class Uhlm(Method):
    name = "uhlm"
    lossless = False
    codec_applies_to: ClassVar[str | None] = "q"
    rejection: ClassVar[Answer | None] = Answer.RESIDUAL

    def __init__(self, codec: Codec | str | None = None, *, threshold: float = 0.3,
                 **options: Any) -> None:
        super().__init__(codec, **options)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"uhlm threshold must be in [0, 1], got {threshold}")
        self.threshold = float(threshold)

    def options(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def draft_row(self, q_common: np.ndarray) -> np.ndarray:
        return committed_full(self.codec, q_common)

    def draft_message(self, ids: np.ndarray, q_rows: list[np.ndarray], space: Space) -> Draft:
        committed = [self.draft_row(q) for q in q_rows]
        base = super().draft_message(ids, committed, space)
        mask = np.array([1.0 - float(q.max()) > self.threshold for q in committed], dtype=bool)
        vectors = tuple(self.codec.encode(np.asarray(q, dtype=np.float32))
                        for q, m in zip(q_rows, mask, strict=True) if m)
        return Draft(ids=base.ids, q_values=base.q_values, q_vectors=vectors, verify_mask=mask)

    def verify(self, p_star: Rows, draft: Draft, space: Space, rng: Draws) -> int:
        return verify(p_star, draft.ids, draft.q_values, stream_of(rng, ACCEPT),
                      mask=draft.verify_mask)

    def server_q(self, draft: Draft, j: int, space: Space) -> np.ndarray | None:
        assert draft.q_vectors is not None and draft.verify_mask is not None
        k = int(np.count_nonzero(draft.verify_mask[:j]))
        return decoded_full(self.codec, draft.q_vectors[k], space.n_common)

