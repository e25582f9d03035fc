"""``sd-uplink``: standard distributed speculative decoding (SPADE's setting).

The device uplinks its full draft vectors ``q_i`` (over V_C, through the codec)
with the drafts, so the server can compute the residual itself and send back a
single token. Exact; the price is the uplink. With a lossy codec the device drafts
from the committed ``q*`` it sends, so the server's residual uses the very same
numbers.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import Answer, Draft, Method, Space
from .commit import committed_full, decoded_full


class SdUplink(Method):
    name = "sd-uplink"
    lossless = True
    codec_applies_to: ClassVar[str | None] = "q"
    rejection: ClassVar[Answer | None] = Answer.RESIDUAL

    def draft_row(self, q_common: np.ndarray) -> np.ndarray:
        return committed_full(self.codec, q_common)

    def draft_message(self, ids: np.ndarray, q_rows: list[np.ndarray], space: Space) -> Draft:
        base = super().draft_message(ids, [self.draft_row(q) for q in q_rows], space)
        vectors = tuple(self.codec.encode(np.asarray(q, dtype=np.float32)) for q in q_rows)
        return Draft(ids=base.ids, q_values=base.q_values, q_vectors=vectors)

    def server_q(self, draft: Draft, j: int, space: Space) -> np.ndarray | None:
        assert draft.q_vectors is not None
        return decoded_full(self.codec, draft.q_vectors[j], space.n_common)

