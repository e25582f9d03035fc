"""One round of speculative decoding, written once.

A round is: the device samples each draft from its TLI row (:func:`draft_token`);
the server commits the target's warped rows, verifies the block and answers with a
bonus token or the method's rejection payload (:func:`verify_block`); on a
rejection the device resolves the payload, asking follow-ups until it has a token.

The server half of a round is :func:`verify_round`: a pure function of the round's
plain data (:class:`Round`: the block, the method, the sampling settings, the seed
and round number, a redo) and the target's rows, drawing from the round's counters
(:mod:`xcosd.draws`), so it may run on any thread, again after a restart, or on an
accelerator (``xcosd/accel/verify.py`` verifies the same :class:`Round`), and give the
same outcome.

The state machines run exactly these functions, with the messages in between
crossing the wire (``xcosd/protocol/``); :func:`resolve_locally` runs the
rejection exchange in one process, for ``xcosd/simulate.py`` and the measured-TV
benchmark, which must compose the round the way the protocol does and not in a
copy of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..draws import Draws, RoundDraws, Uniforms
from ..errors import InvalidDistribution, ProtocolError, XcosdError
from ..sampling import Rows, SamplingParams, WarpedRows, sample_index
from .base import (
    ID_BYTES,
    DeviceState,
    Draft,
    KeptReject,
    Method,
    RejectState,
    Reply,
    Request,
    RequestKind,
    Space,
    TokenReply,
)
from .tree import DraftTree, rebuild_tree_reject, verify_tree


def draft_token(method: Method, q: np.ndarray, space: Space, rng: Uniforms,
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


@dataclass(eq=False)
class RoundOutcome:
    """What verifying a :class:`Round` gives: ``accepted`` drafts (a tree's verdict
    ``n``: the index + 1 of the node the walk stopped at, whose path the block names,
    ``Draft.path``) and the ``reply``,
    the rejection's state its follow-ups are answered from, or the ``error`` that
    fails this session alone."""

    accepted: int
    reply: Reply
    #: on a rejection, what its follow-ups are answered from (on the host, or kept on
    #: the target's device: a :class:`~xcosd.methods.base.KeptReject`)
    reject: RejectState | KeptReject | None
    error: XcosdError | None = None
    #: compute time of the batch this round was verified in (reported to the edge)
    compute_s: float = 0.0
    #: a redone round: ``reply`` answers the device's pending follow-up, not the draft
    redo: bool = False


def failed(error: XcosdError) -> RoundOutcome:
    """The outcome of a round that fails its session with ``error``."""
    return RoundOutcome(0, TokenReply(0), None, error)


def verify_block(method: Method, p: Rows, draft: Draft, space: Space,
                 rng: Draws) -> RoundOutcome:
    """Commit the ``d + 1`` warped target rows ``p``, verify ``draft`` against them
    and answer: a bonus token when every draft is accepted, else the method's
    rejection payload for the first rejected position. ``p`` may be a
    :class:`~xcosd.sampling.WarpedRows`: the rows after the first rejection are then
    never warped."""
    p_star = method.commit_rows(p, space)
    d = draft.length
    n = method.verify(p_star, draft, space, rng) if d else 0
    if n == d:
        return RoundOutcome(n, method.bonus(p_star[d], rng), None)
    state = _reject_state(method, p, p_star, draft, n, space)
    return RoundOutcome(n, method.on_reject(state, space, rng), state)


def _reject_state(method: Method, p: Rows, p_star: Rows, draft: Draft, n: int,
                  space: Space) -> RejectState:
    # copies: views would keep the whole (d+1) x |V_T| block alive until the
    # device's next draft
    p_n = np.array(p[n], dtype=np.float32)
    return RejectState(p_raw=p_n, p_star=p_n if p_star is p else p_star[n].copy(),
                       rejected=int(draft.ids[n]), q_common=method.server_q(draft, n, space))


def rebuild_reject(method: Method, p: Rows, draft: Draft, accepted: int, space: Space,
                   *, candidate_rounds: int, fallback_sent: bool) -> RejectState:
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
                    rng: Uniforms, reply: Reply | None = None) -> Resolution:
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


__all__ = ["Resolution", "RoundOutcome", "draft_token", "rebuild_reject", "resolve_locally",
           "verify_block"]


# ------------------------------------------------------------- the server's half


@dataclass(frozen=True)
class RoundRedo:
    """A round whose verdict the device saw before the cloud lost it (a restart):
    ``accepted`` is taken as the verdict, the rejection's state is rebuilt with the
    follow-ups the device already received, and the one it waits for (``kind``) is
    answered."""

    accepted: int
    kind: RequestKind
    candidate_rounds: int = 0
    fallback: bool = False


@dataclass(eq=False, slots=True)
class Round:
    """One round's server half as plain data: the pending ``draft`` (a chain or a
    :class:`~xcosd.methods.tree.DraftTree`), its method, space and warper settings,
    the session's ``key`` (its seed) and the ``round`` number that count its random
    numbers, and a ``redo``. A snapshot: nothing here is the live session's, so it
    is verified off the event loop, or on an accelerator, without touching it (and
    nothing changes it once made: not frozen only because a frozen dataclass costs
    the cloud a microsecond a round to build)."""

    method: Method
    space: Space
    params: SamplingParams
    draft: Draft
    key: int
    round: int
    redo: RoundRedo | None = None

    def draws(self) -> RoundDraws:
        """This round's random numbers (:mod:`xcosd.draws`)."""
        return RoundDraws(self.key, self.round)


def verify_round(rd: Round, rows: np.ndarray, warped: np.ndarray | None = None
                 ) -> RoundOutcome:
    """The server's half of round ``rd`` against the target's rows for it: commit,
    verify, answer (or, for a redo, rebuild the rejection and answer the follow-up).

    A pure function of ``rd`` and the rows: its random numbers are the round's
    counters. Each row is warped with ``rd.params`` when verification first reads it
    (:class:`~xcosd.sampling.WarpedRows`: the rows after the first rejection are
    never warped); ``warped``: the rows warped already with those settings (a batch
    warps short rows together), the same bits. Never raises: a failure comes back as
    ``error``."""
    m, sp, draft = rd.method, rd.space, rd.draft
    try:
        rows = np.asarray(rows, dtype=np.float32)
        d = draft.length
        if rows.shape != (d + 1, sp.target_size):
            raise InvalidDistribution(
                f"target returned rows {rows.shape}, expected {(d + 1, sp.target_size)}")
        if warped is not None and warped.shape != rows.shape:
            raise InvalidDistribution(f"warped rows {warped.shape}, expected {rows.shape}")
        # rows no warper changes (T=1, no top-k / top-p) are read as they are
        p = (rows if rd.params.identity
             else warped if warped is not None else WarpedRows(rows, rd.params))
        draws = RoundDraws(rd.key, rd.round)
        redo = rd.redo
        tree = draft if isinstance(draft, DraftTree) else None
        if redo is not None:
            if tree is not None:
                node = redo.accepted - 1
                state = rebuild_tree_reject(m, p, tree, node, sp,
                                            candidate_rounds=redo.candidate_rounds,
                                            fallback_sent=redo.fallback)
                reply = m.on_request(state, Request(redo.kind), sp, draws)
                return RoundOutcome(redo.accepted, reply, state, redo=True)
            state = rebuild_reject(m, p, draft, redo.accepted, sp,
                                   candidate_rounds=redo.candidate_rounds,
                                   fallback_sent=redo.fallback)
            reply = m.on_request(state, Request(redo.kind), sp, draws)
            return RoundOutcome(redo.accepted, reply, state, redo=True)
        if tree is not None:
            t = verify_tree(m, p, tree, sp, draws)
            return RoundOutcome(t.node + 1, t.reply, t.reject)
        return verify_block(m, p, draft, sp, draws)
    except XcosdError as e:
        return failed(e)
    except (ValueError, IndexError, AssertionError) as e:
        return failed(ProtocolError(f"cannot verify this draft: {e}", code="bad_field"))
    except Exception as e:
        return failed(ProtocolError(f"verification failed: {type(e).__name__}",
                                    code="internal"))
