"""``xcosd``: hybrid resampling (HR), X-CoSD's exact cross-vocabulary resampler.

The residual ``r ∝ max(0, p_j − q_j)`` splits into a V_C part (mass ``theta_c``,
which the device can compute from ``p_j`` over V_C and its own ``q_j``) and a V_O
part (mass ``theta_o = p_j(V_O)``, since ``q_j = 0`` there). The server sends
``p_j`` over V_C and ``theta_o``; the device flips a ``theta_c : theta_o`` coin and
samples the chosen branch. The V_O branch needs a draw from ``p_j | V_O``, which
only the server can make: the paper spends a round trip on it
(``hr_presample=False``); by default the server draws one ``y`` up front and ships
it with the payload, used only if the coin picks V_O. ``y`` is independent of the
coin, so the law is still exactly ``r``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..codecs import Codec
from ..draws import Uniforms
from ..sampling import sample_index
from .base import (
    Answer,
    CommitRule,
    DeviceState,
    HybridReply,
    Method,
    RejectState,
    Reply,
    Request,
    RequestKind,
    Space,
    TokenReply,
)
from .commit import committed_hybrid, hybrid_view, theta_other


def hybrid_payload(codec: Codec, state: RejectState, space: Space, presample: bool,
                   rng: Uniforms) -> HybridReply:
    """The server's HR payload for one rejection (shared with SR-DV's fallback)."""
    theta_o = theta_other(state.p_raw, space)
    other = None
    if presample and theta_o > 0:
        other = sample_other(state, space, rng)
    return HybridReply(codec.encode(state.p_raw[space.common_ids]), float(theta_o), other)


def sample_other(state: RejectState, space: Space, rng: Uniforms) -> int:
    """``y ~ p*_j | V_O`` (a target id)."""
    return int(space.other_ids[sample_index(state.p_star[space.other_ids], rng)])


def hr_answer(codec: Codec, presample: bool, kind: Answer, state: RejectState, space: Space,
              rng: Uniforms) -> Reply | None:
    """HR's answers drawn on the host (its payload, a V_O token), shared with SR-DV's
    fallback; ``None`` for any other kind."""
    if kind is Answer.HYBRID:
        return hybrid_payload(codec, state, space, presample, rng)
    if kind is Answer.OTHER:
        return TokenReply(sample_other(state, space, rng))
    return None


def hybrid_resolve(codec: Codec, reply: HybridReply, state: DeviceState, space: Space,
                   rng: Uniforms) -> int | Request:
    """The device's half of HR: coin between the V_C residual and the V_O branch."""
    dec = codec.decode(reply.data, space.n_common)
    p_c, theta_o = hybrid_view(codec, dec, reply.theta_o)
    resid = np.maximum(p_c.astype(np.float64) - state.q_common, 0.0)
    theta_c = float(resid.sum())
    if not theta_c + theta_o > 0:  # Z == 0 by rounding: sample p_j (here all on V_C)
        return int(space.common_ids[sample_index(p_c, rng)])
    if rng.random() * (theta_c + theta_o) < theta_c:
        return int(space.common_ids[sample_index(resid, rng)])
    if reply.other_token is not None:
        return int(reply.other_token)
    return Request(RequestKind.OTHER)


class HybridResampling(Method):
    name = "xcosd"
    lossless = True
    codec_applies_to: ClassVar[str | None] = "p"
    commit_rule: ClassVar[CommitRule] = CommitRule.HYBRID
    rejection: ClassVar[Answer | None] = Answer.HYBRID

    def __init__(self, codec: Codec | str | None = None, *, hr_presample: bool = True,
                 **options: Any) -> None:
        super().__init__(codec, **options)
        self.hr_presample = bool(hr_presample)

    def options(self) -> dict[str, Any]:
        return {"hr_presample": self.hr_presample}

    def commit_row(self, p: np.ndarray, space: Space) -> np.ndarray:
        return committed_hybrid(self.codec, p, space)

    def follow_up(self, state: RejectState | Any, request: Request) -> Answer:
        if request.kind == RequestKind.OTHER:
            return Answer.OTHER
        return super().follow_up(state, request)

    def answer(self, kind: Answer, state: RejectState, space: Space,
               rng: Uniforms) -> Reply:
        hr = hr_answer(self.codec, self.hr_presample, kind, state, space, rng)
        return hr if hr is not None else super().answer(kind, state, space, rng)

    def resolve(self, reply: Reply, state: DeviceState, space: Space,
                rng: Uniforms) -> int | Request:
        if isinstance(reply, HybridReply):
            return hybrid_resolve(self.codec, reply, state, space, rng)
        return super().resolve(reply, state, space, rng)
