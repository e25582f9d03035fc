"""``straightforward``: the naive exact cross-vocabulary method.

On a rejection the server sends ``p_j`` over the whole target vocabulary and the
device computes the residual itself. Exact, and the downlink baseline the other
methods are measured against (|V_T| values per rejection).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..draws import Uniforms
from .base import (
    Answer,
    CommitRule,
    DeviceState,
    FullVectorReply,
    Method,
    Reply,
    Request,
    Space,
    residual_sample,
)
from .commit import committed_full, decoded_full


class Straightforward(Method):
    name = "straightforward"
    lossless = True
    codec_applies_to: ClassVar[str | None] = "p"
    commit_rule: ClassVar[CommitRule] = CommitRule.FULL
    rejection: ClassVar[Answer | None] = Answer.FULL

    def commit_row(self, p: np.ndarray, space: Space) -> np.ndarray:
        return committed_full(self.codec, p)


    def resolve(self, reply: Reply, state: DeviceState, space: Space,
                rng: Uniforms) -> int | Request:
        if isinstance(reply, FullVectorReply):
            p_star = decoded_full(self.codec, reply.data, space.target_size)
            return residual_sample(p_star, space.expand(state.q_common), rng)
        return super().resolve(reply, state, space, rng)
