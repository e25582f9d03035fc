"""``target-resample`` (lossy): on a rejection, send one token drawn from ``p_j``.

Cheap on the link and wrong: the correct law after a rejection is the residual
``max(0, p_j − q_j)``, not ``p_j``, so tokens the draft over-proposes come out
too often. Kept to measure what losslessness costs.
"""

from __future__ import annotations

import numpy as np

from ..sampling import sample_index
from .base import Method, RejectState, Reply, Space, TokenReply


class TargetResample(Method):
    name = "target-resample"
    lossless = False

    def on_reject(self, state: RejectState, space: Space, rng: np.random.Generator) -> Reply:
        return TokenReply(sample_index(state.p_star, rng))
