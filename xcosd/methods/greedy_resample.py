"""``greedy-resample`` (lossy): on a rejection, send ``argmax p_j``.

One token id down per rejection and deterministic, but it collapses the residual
onto one token (and may even re-emit the rejected draft).
"""

from __future__ import annotations

import numpy as np

from .base import Method, RejectState, Reply, Space, TokenReply


class GreedyResample(Method):
    name = "greedy-resample"
    lossless = False

    def on_reject(self, state: RejectState, space: Space, rng: np.random.Generator) -> Reply:
        return TokenReply(int(np.argmax(state.p_star)))
