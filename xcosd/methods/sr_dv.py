"""``xcosd-e``: server resampling with device verification (SR-DV), X-CoSD-E.

Rejection sampling of the residual with proposal ``p_j``: the server draws ``K``
candidates ``y ~ p_j`` and sends them with their values ``p_j(y)``; the device
accepts the first with ``v < alpha(y) = max(0, p_j(y) − q_j(y)) / p_j(y)``
(``alpha = 1`` on V_O). Each trial succeeds with probability ``Z`` and a success is
distributed as ``r``. After ``M`` rounds of ``K`` failures the device falls back to
hybrid resampling, which is exact conditioned on any number of failed trials.

The server draws candidates from ``p_j`` conditioned on ``y != x_j`` (the rejected
draft has ``alpha = 0``, so sending it would waste a slot); ``alpha`` keeps using the
unconditioned values, and the accepted law is unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..codecs import Codec
from ..draws import Uniforms
from ..errors import InvalidDistribution, ProtocolError
from ..sampling import sample_many
from .base import (
    Answer,
    CandidatesReply,
    CommitRule,
    DeviceState,
    HybridReply,
    Method,
    RejectState,
    Reply,
    Request,
    RequestKind,
    Space,
)
from .commit import committed_hybrid
from .hybrid_resampling import hr_answer, hybrid_resolve

#: replies of at most this many candidates are tested one by one, stopping at the
#: first accepted (most rejections are settled by their first candidate or two, and
#: a dozen numpy calls on a few values cost more than that); longer ones in one
#: vectorised pass
SCALAR_CANDIDATES = 64


def first_accepted(reply: CandidatesReply, q_common: np.ndarray, space: Space,
                   u: np.ndarray) -> int | None:
    """The index of the first candidate accepted (``u[i] < alpha(y_i)``), ``None``
    when none is. ``u``: one uniform per candidate, drawn whether or not it is
    looked at, so the device's random stream never depends on where the first
    acceptance falls. Both paths compute ``alpha`` in float64 from the same float32
    values, so they accept the same candidate."""
    k = int(reply.ids.shape[0])
    pos = space.to_common[reply.ids]
    if k <= SCALAR_CANDIDATES:
        vals, us = reply.values.tolist(), u.tolist()
        for i, p in enumerate(pos.tolist()):
            if p < 0:  # V_O: q = 0
                a = 1.0
            else:
                v = vals[i]
                a = max(v - q_common.item(p), 0.0) / v if v > 0 else 0.0
            if us[i] < a:
                return i
        return None
    v = reply.values.astype(np.float64)
    q = np.where(pos >= 0, q_common[np.maximum(pos, 0)], 0.0)
    # max(v - q, 0) / v where v > 0, else 0 (divided only where it is
    # defined: no floating-point state to switch around every reply)
    alpha = np.divide(np.maximum(v - q, 0.0), v, out=np.zeros_like(v), where=v > 0)
    alpha[pos < 0] = 1.0  # V_O: q = 0
    hits = np.flatnonzero(u < alpha)
    return int(hits[0]) if hits.size else None


class SrDv(Method):
    name = "xcosd-e"
    lossless = True
    codec_applies_to: ClassVar[str | None] = "p"
    commit_rule: ClassVar[CommitRule] = CommitRule.HYBRID
    rejection: ClassVar[Answer | None] = Answer.CANDIDATES

    def __init__(self, codec: Codec | str | None = None, *, K: int = 20, M: int = 10,
                 hr_presample: bool = True, **options: Any) -> None:
        super().__init__(codec, **options)
        if K < 1 or M < 1:
            raise ValueError(f"xcosd-e needs K >= 1 and M >= 1, got K={K}, M={M}")
        self.K, self.M, self.hr_presample = int(K), int(M), bool(hr_presample)

    def options(self) -> dict[str, Any]:
        return {"K": self.K, "M": self.M, "hr_presample": self.hr_presample}

    def commit_row(self, p: np.ndarray, space: Space) -> np.ndarray:
        return committed_hybrid(self.codec, p, space)

    def _candidates(self, state: RejectState, rng: Uniforms) -> CandidatesReply:
        w = state.p_star.copy()  # float32: the sampler sums in float64 itself
        w[state.rejected] = 0.0
        try:
            ids = sample_many(w, self.K, rng)
        except InvalidDistribution:
            # all mass on x_j cannot be rejected, save by rounding: the sampler found
            # no mass before it drew anything, so the draws come from p* instead
            ids = sample_many(state.p_star, self.K, rng)
        state.candidate_rounds += 1
        return CandidatesReply(ids=ids, values=state.p_star[ids].astype(np.float32, copy=False))

    def follow_up(self, state: RejectState | Any, request: Request) -> Answer:
        """``more`` candidates up to ``M`` rounds, then the HR ``fallback`` once, then
        HR's ``other``."""
        if request.kind == RequestKind.MORE:
            if state.candidate_rounds >= self.M or state.fallback_sent:
                raise ProtocolError(f"more than M={self.M} candidate rounds requested",
                                    code="bad_request")
            return Answer.CANDIDATES
        if request.kind == RequestKind.FALLBACK:
            if state.fallback_sent:
                raise ProtocolError("HR fallback requested twice", code="bad_request")
            state.fallback_sent = True
            return Answer.HYBRID
        if request.kind == RequestKind.OTHER and state.fallback_sent:
            return Answer.OTHER
        return super().follow_up(state, request)

    def answer(self, kind: Answer, state: RejectState, space: Space,
               rng: Uniforms) -> Reply:
        if kind is Answer.CANDIDATES:
            return self._candidates(state, rng)
        hr = hr_answer(self.codec, self.hr_presample, kind, state, space, rng)
        return hr if hr is not None else super().answer(kind, state, space, rng)

    def resolve(self, reply: Reply, state: DeviceState, space: Space,
                rng: Uniforms) -> int | Request:
        if isinstance(reply, CandidatesReply):
            state.candidate_rounds += 1
            k = int(reply.ids.shape[0])
            hit = first_accepted(reply, state.q_common, space, rng.random(k))
            if hit is not None:
                state.trials += hit + 1
                return int(reply.ids[hit])
            state.trials += k
            if state.candidate_rounds < self.M:
                return Request(RequestKind.MORE)
            state.fallbacks += 1
            return Request(RequestKind.FALLBACK)
        if isinstance(reply, HybridReply):
            return hybrid_resolve(self.codec, reply, state, space, rng)
        return super().resolve(reply, state, space, rng)
