"""One round of speculative decoding, written once.

A round is: the device samples each draft from its TLI row (:func:`draft_token`);
the server commits the target's warped rows, verifies the block and answers with a
bonus token or the method's rejection payload (:func:`verify_block`); on a
rejection the device resolves the payload, asking follow-ups until it has a token.

The state machines run exactly these functions, with the messages in between
crossing the wire (``xcosd/protocol/``); :func:`resolve_locally` runs the
rejection exchange in one process, for ``xcosd/simulate.py`` and the measured-TV
benchmark, which must compose the round the way the protocol does and not in a
copy of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..sampling import Rows, sample_index
from .base import ID_BYTES, DeviceState, Draft, Method, RejectState, Reply, Request, Space


def draft_token(method: Method, q: np.ndarray, space: Space, rng: np.random.Generator,
                support: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """Sample one draft from the TLI row ``q`` (V_C order): ``(target id, the row it
    was sampled from)`` (``method.draft_row(q)``: sd-uplink commits it).

    ``support``: ascending V_C positions outside which ``q`` is zero (after top-k or
    a peaked top-p, a few dozen of 100k+). The draw is then made over those entries
    only, by the same inverse CDF with the same one uniform: the same law, without a
    pass over the whole row. Used only when the method drafts from ``q`` itself."""
    qr = method.draft_row(q)
    if support is not None and qr is q:
        if support.shape[0] == 1:  # a point mass: the draw is that entry
            rng.random()  # still one uniform per draft, as sample_index takes
            j = int(support[0])
        else:
            j = int(support[sample_index(q[support], rng)])
    else:
        j = sample_index(qr, rng)
    return int(space.common_ids[j]), qr


@dataclass
class Verified:
    """The server's half of a round: ``accepted`` drafts, the ``reply`` to send (the
    bonus token, or the rejection payload) and, on a rejection, the state the
    follow-ups are answered from."""

    accepted: int
    reply: Reply
    reject: RejectState | None


def verify_block(method: Method, p: Rows, draft: Draft, space: Space,
                 rng: np.random.Generator) -> Verified:
    """Commit the ``d + 1`` warped target rows ``p``, verify ``draft`` against them
    and answer: a bonus token when every draft is accepted, else the method's
    rejection payload for the first rejected position. ``p`` may be a
    :class:`~xcosd.sampling.WarpedRows`: the rows after the first rejection are then
    never warped."""
    p_star = method.commit_rows(p, space)
    d = draft.length
    n = method.verify(p_star, draft, space, rng) if d else 0
    if n == d:
        return Verified(n, method.bonus(p_star[d], rng), None)
    state = _reject_state(method, p, p_star, draft, n, space)
    return Verified(n, method.on_reject(state, space, rng), state)


def _reject_state(method: Method, p: Rows, p_star: Rows, draft: Draft, n: int,
                  space: Space) -> RejectState:
    # copies: views would keep the whole (d+1) x |V_T| block alive until the
    # device's next draft
    p_n = np.array(p[n], dtype=np.float32)
    return RejectState(p_raw=p_n, p_star=p_n if p_star is p else p_star[n].copy(),
                       rejected=int(draft.ids[n]), q_common=method.server_q(draft, n, space))


def rebuild_reject(method: Method, p: Rows, draft: Draft, accepted: int, space: Space,
                   *, candidate_rounds: int = 0, fallback_sent: bool = False) -> RejectState:
    """The server's state after a rejection at ``accepted``, rebuilt from the rows
    alone, for a round whose verdict is known but whose state was lost (a cloud
    restart; ``xcosd/protocol/messages.py``, ``Redo``).

    Exact because the state is a function of the committed row, the rejected draft
    and the device's committed ``q`` (not of the verification's random numbers),
    and every follow-up is a fresh draw given it: the counts say how many
    follow-ups the device already received, so the limits (``M``, one fallback)
    hold across the restart.
    """
    if not 0 <= accepted < draft.length:
        raise ValueError(f"a rejection at {accepted} of a {draft.length}-token draft")
    state = _reject_state(method, p, method.commit_rows(p, space), draft, accepted, space)
    state.candidate_rounds = int(candidate_rounds)
    state.fallback_sent = bool(fallback_sent)
    return state


@dataclass
class Resolution:
    """How a rejection was resolved in process: the token, the exchanges it took
    and the bytes each crossing would carry."""

    token: int
    round_trips: int = 1
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    #: (direction, kind, bytes) of every crossing after the verdict's payload
    messages: list[tuple[str, str, int]] = field(default_factory=list)


def resolve_locally(method: Method, state: RejectState, dev: DeviceState, space: Space,
                    rng: np.random.Generator, reply: Reply | None = None) -> Resolution:
    """The rejection exchange with both halves in one process: the server's payload
    (``reply``, or ``method.on_reject``), then the device's resolution, answering
    each follow-up :class:`~xcosd.methods.base.Request` with ``method.on_request``."""
    if reply is None:
        reply = method.on_reject(state, space, rng)
    res = Resolution(0, downlink_bytes=ID_BYTES + reply.nbytes())
    res.messages.append(("down", "verdict", res.downlink_bytes))
    out = method.resolve(reply, dev, space, rng)
    while isinstance(out, Request):
        res.uplink_bytes += out.nbytes()
        res.messages.append(("up", f"request:{out.kind}", out.nbytes()))
        reply = method.on_request(state, out, space, rng)
        res.downlink_bytes += reply.nbytes()
        res.messages.append(("down", type(reply).__name__, reply.nbytes()))
        res.round_trips += 1
        out = method.resolve(reply, dev, space, rng)
    res.token = int(out)
    return res


__all__ = ["Resolution", "Verified", "draft_token", "rebuild_reject", "resolve_locally",
           "verify_block"]
