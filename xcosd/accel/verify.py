"""The server's half of a round on the target's device, for a whole batch at once.

The numpy path (:func:`xcosd.methods.round.verify_block`) copies every session's
``d + 1`` target rows to the host and warps, commits and verifies them one session at
a time. Here the rows stay where the target computed them: one batched warp
(:mod:`xcosd.accel.warp`), one gather of ``p(x_i)`` for every draft of every session,
one accept test, and the draws each method asks for on its terminal row (its
:class:`~xcosd.methods.base.Answer` kinds: the bonus, a residual, SR-DV's candidates,
hybrid resampling's ``theta_o`` and V_O sample) batched by kind. Which kind a method
answers with, and which follow-up it refuses, the method says
(:attr:`~xcosd.methods.base.Method.rejection`, :meth:`~xcosd.methods.base.Method.follow_up`):
nothing here names a method. Only what crosses the wire comes back to the host: accept counts, token ids,
candidate values, and the rows straightforward (all of V_T) and hybrid resampling (V_C)
send. A rejected row stays on the device (:class:`DeviceReject`) for the follow-ups.

Every uniform is named by the session's seed and ``(round, stream,
index)`` (:mod:`xcosd.draws`), and every sum is a fixed-order one
(:mod:`xcosd.accel.sums`): a session's verdict is a function of its rows, its draft and
its seed, never of the batch it was verified in. So a batch that fails is verified
again session by session with the very same results.

A draft tree (:class:`~xcosd.methods.tree.DraftTree`) is walked here too, node by node
next to its rows (:func:`_verify_tree`): each child's test reads one ``p(x)``, a
rejected sibling's residual is formed on the device, and the rejection at the node
where the walk stops is answered by the same batched payload code as a chain's.

A lossy codec on ``p`` (straightforward, ``xcosd``, ``xcosd-e``) commits on the device
where :mod:`xcosd.accel.commit` reproduces the host's commit bit for bit (``f16``,
``bf16``); for the others (``q8``, ``topk:K``) :func:`supported` says no and the caller
verifies those sessions on the numpy path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..draws import ACCEPT, CANDIDATES, OTHER, TOKEN, uniforms
from ..errors import InvalidDistribution, ProtocolError, XcosdError
from ..methods.base import (
    Answer,
    CandidatesReply,
    CommitRule,
    FullVectorReply,
    HybridReply,
    Method,
    Reply,
    Request,
    Space,
    TokenReply,
)
from ..methods.hybrid_resampling import HybridResampling
from ..methods.round import Round, RoundOutcome
from ..methods.sr_dv import SrDv
from ..methods.tree import DraftTree, check_tree, check_tree_method, server_rows
from .commit import Commit, committed_full, committed_hybrid, device_commit, theta_other
from .draw import draw
from .sums import fixed_sum
from .warp import warp_rows

log = logging.getLogger(__name__)


def supported(method: Method) -> bool:
    """Whether a session of ``method`` is verified on the device: every method (each
    names its answers as :class:`~xcosd.methods.base.Answer` kinds, all of which are
    drawn here), unless its codec compresses ``p`` in a way the device cannot commit
    bit for bit as the host decodes it (:func:`~xcosd.accel.commit.device_commit`)."""
    return method.codec_applies_to != "p" or device_commit(method.codec) is not None


def _commit(method: Method) -> Commit | None:
    """The device commit of a method whose codec compresses ``p`` lossily, else None
    (its committed row is the warped row itself)."""
    if method.codec_applies_to != "p" or method.codec.exact:
        return None
    return device_commit(method.codec)


@dataclass(eq=False)
class DeviceReject:
    """A rejection kept on the device until the device side has its token: the
    committed row ``p*_j`` every decision uses, the warped row ``p_j`` the payloads
    encode (``None``: the same row, an exact codec), the rejected draft, and what
    follow-ups were answered."""

    p_star: torch.Tensor
    rejected: int
    key: int
    round: int
    candidate_rounds: int = 0
    fallback_sent: bool = False
    p_raw: torch.Tensor | None = None

    def answer(self, method: Method, request: Request, space: Space) -> Reply:
        """A follow-up answered from this rejection, on the device
        (:func:`on_request`): what the protocol calls, not knowing where the row is."""
        return on_request(method, self, request, space)

    @property
    def raw(self) -> torch.Tensor:
        """``p_j`` before the codec."""
        return self.p_star if self.p_raw is None else self.p_raw

    def mass(self, token: int) -> float:
        """``p*_j(token)``."""
        return float(self.p_star[int(token)])


class _SpaceOnDevice:
    """A space's id sets as device tensors (built once per space and device)."""

    def __init__(self, space: Space, device: torch.device) -> None:
        self.space = space  # keeps the key's id() from being reused
        self.common = torch.from_numpy(space.common_ids).to(device)
        self.other = torch.from_numpy(space.other_mask).to(device)


_SPACES: dict[tuple[int, str], _SpaceOnDevice] = {}
_MAX_SPACES = 32


def _on(space: Space, device: torch.device) -> _SpaceOnDevice:
    k = (id(space), str(device))
    got = _SPACES.get(k)
    if got is None:
        if len(_SPACES) >= _MAX_SPACES:
            _SPACES.pop(next(iter(_SPACES)))
        got = _SPACES[k] = _SpaceOnDevice(space, device)
    return got


def _keys(items: Sequence[Round] | Sequence[DeviceReject]) -> tuple[np.ndarray, np.ndarray]:
    """The draws' keys (seeds) and round numbers of rounds or kept rejections."""
    return (np.array([it.key & ((1 << 64) - 1) for it in items], dtype=np.uint64),
            np.array([it.round for it in items], dtype=np.uint64))


def _device(u: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(u).to(device)


def _failed(e: BaseException) -> RoundOutcome:
    if isinstance(e, XcosdError):
        err = e
    elif isinstance(e, (ValueError, IndexError)):
        err = ProtocolError(f"cannot verify this draft: {e}", code="bad_field")
    else:
        err = ProtocolError(f"verification failed: {type(e).__name__}", code="internal")
    return RoundOutcome(0, TokenReply(0), None, err)


def verify_batch(rounds: Sequence[Round], rows: Sequence[torch.Tensor]) -> list[RoundOutcome]:
    """Verify each round against its ``d + 1`` target rows (probabilities over V_T, on
    the target's device). A session's bad draft or failure is its ``error`` alone; a
    failure of the batched work is retried session by session (same results: no draw
    depends on the batch)."""
    if len(rounds) != len(rows):
        raise ValueError(f"{len(rows)} row blocks for {len(rounds)} rounds")
    out: list[RoundOutcome | None] = [None] * len(rounds)
    todo: list[int] = []
    for i, (rd, rw) in enumerate(zip(rounds, rows, strict=True)):
        try:
            _check(rd, rw)
            todo.append(i)
        except Exception as e:
            out[i] = _failed(e)
    if todo:
        try:
            got = _verify([rounds[i] for i in todo], [rows[i] for i in todo])
        except Exception:
            if len(todo) > 1:
                log.exception("batched verification failed; verifying %d sessions alone",
                              len(todo))
            got = []
            for i in todo:
                try:
                    got.extend(_verify([rounds[i]], [rows[i]]))
                except Exception as e:
                    got.append(_failed(e))
        for i, o in zip(todo, got, strict=True):
            out[i] = o
    return [o if o is not None else _failed(RuntimeError("unverified")) for o in out]


def _check(rd: Round, rw: torch.Tensor) -> None:
    d = rd.draft.length
    size = rd.space.target_size
    if tuple(rw.shape) != (d + 1, size):
        raise InvalidDistribution(f"target returned rows {tuple(rw.shape)}, "
                                  f"expected {(d + 1, size)}")
    if not supported(rd.method):
        raise ProtocolError(f"{rd.method!r} is not verified on the device", code="internal")
    ids = rd.draft.ids
    if d and (int(ids.min()) < 0 or int(ids.max()) >= size):
        raise ProtocolError("a drafted id is outside the target vocabulary", code="bad_field")
    q = rd.draft.q_values
    checked = q if rd.draft.verify_mask is None else q[rd.draft.verify_mask]
    if checked.size and not bool(np.all(checked > 0)):
        i = int(np.flatnonzero(~(q > 0))[0])
        raise InvalidDistribution(f"draft {i} has q(x) = {q[i]}: a drafted token must have q > 0")
    if isinstance(rd.draft, DraftTree):
        check_tree_method(rd.method)
        check_tree(rd.draft, rd.space)
        if rd.redo is not None and not (0 <= rd.redo.accepted <= d
                                        and rd.draft.shape.children[rd.redo.accepted]):
            raise ValueError(f"no rejection at node {rd.redo.accepted - 1} of a {d}-node tree")
    elif rd.redo is not None and not 0 <= rd.redo.accepted < d:
        raise ValueError(f"a rejection at {rd.redo.accepted} of a {d}-token draft")


def _verify(rounds: Sequence[Round], rows: Sequence[torch.Tensor]) -> list[RoundOutcome]:
    """Chains in one batch (:func:`_verify_chains`), each tree on its own
    (:func:`_verify_tree`)."""
    trees = [i for i, rd in enumerate(rounds) if isinstance(rd.draft, DraftTree)]
    if not trees:
        return _verify_chains(rounds, rows)
    out: list[RoundOutcome | None] = [None] * len(rounds)
    chains = [i for i in range(len(rounds)) if not isinstance(rounds[i].draft, DraftTree)]
    if chains:
        got = _verify_chains([rounds[i] for i in chains], [rows[i] for i in chains])
        for i, o in zip(chains, got, strict=True):
            out[i] = o
    for i in trees:
        try:
            out[i] = _verify_tree(rounds[i], rows[i])
        except Exception as e:  # this session's tree alone
            out[i] = _failed(e)
    return [o if o is not None else _failed(RuntimeError("unverified")) for o in out]


def _verify_tree(rd: Round, rw: torch.Tensor) -> RoundOutcome:
    """Walk ``rd``'s draft tree next to its rows (``xcosd.methods.tree.verify_tree``'s
    rules): the children of a node tested in order with ``u_c · q(c) < r(c)``, ``u_c``
    the session's uniform for node ``c`` (stream ``ACCEPT``), ``r`` the
    committed row and, after each rejected sibling, the residual it left; a leaf's bonus
    from its row (stream ``TOKEN``); where every child is rejected, the method's payload
    for the row ``r`` the last child was tested against. A redone round rebuilds that
    row from the rows alone (the residuals draw nothing)."""
    tree = rd.draft
    assert isinstance(tree, DraftTree)
    n1 = int(rw.shape[0])
    ps = _committed([rd], warp_rows(rw, [rd.params] * n1), np.zeros(1, dtype=np.int64), [n1])
    shape, space = tree.shape, rd.space
    qs = server_rows(rd.method, tree, space)
    on = _on(space, rw.device)
    key, rnd = _keys([rd])
    if rd.redo is not None:
        node = rd.redo.accepted - 1
        r = ps[node + 1]
        for q in qs.get(node, [])[:-1]:  # (a node with one child sends no row)
            r = _residual_row(r, q, on)
        state = _tree_reject(rd, r, node)
        return RoundOutcome(rd.redo.accepted,
                            on_request(rd.method, state, Request(rd.redo.kind), space), state,
                            redo=True)
    node = -1
    while True:
        kids = shape.children[node + 1]
        if not kids:
            ut = _device(uniforms(key, rnd, TOKEN, 0), rw.device)
            tok = int(draw(ps[node + 1][None, :], ut[:, None])[0, 0])
            return RoundOutcome(node + 1, TokenReply(tok), None)
        r = ps[node + 1]
        accepted = None
        for k, c in enumerate(kids):
            # the test on the host, as a chain's: u and q are there, p(x) comes back
            uq = float(uniforms(key, rnd, ACCEPT, c)[0]) * float(tree.q_values[c])
            if uq < float(r[int(tree.ids[c])]):
                accepted = c
                break
            if k + 1 < len(kids):
                r = _residual_row(r, qs[node][k], on)
        if accepted is None:
            state = _tree_reject(rd, r, node)
            # (the last child's row was sent where the method needs it: sd-uplink)
            q_last = qs[node][-1] if node in qs else None
            return RoundOutcome(node + 1, _tree_reply(rd, state, q_last, key, rnd), state)
        node = accepted


def _residual_row(r: torch.Tensor, q_common: np.ndarray, on: _SpaceOnDevice) -> torch.Tensor:
    """``normalise(max(r - q, 0))`` (``q`` over V_C, 0 on V_O) on the device, by the
    fixed-order sum; ``r`` itself where rounding left the residual no mass (the numpy
    path's rule, ``xcosd.methods.tree.residual``)."""
    res = r.to(torch.float64).clone()
    res[on.common] -= torch.from_numpy(np.asarray(q_common, dtype=np.float64)).to(r.device)
    res.clamp_(min=0.0)
    total = fixed_sum(res[None, :])[0]
    if not float(total) > 0:
        return r
    return (res / total).to(torch.float32)


def _tree_reject(rd: Round, r: torch.Tensor, node: int) -> DeviceReject:
    """The rejection of every child of ``node``: the row the last was tested against."""
    tree = rd.draft
    assert isinstance(tree, DraftTree)
    last = tree.shape.children[node + 1][-1]
    cand, fb = (rd.redo.candidate_rounds, rd.redo.fallback) if rd.redo is not None else (0, False)
    return DeviceReject(r.clone(), int(tree.ids[last]), rd.key, rd.round, cand, fb)


def _tree_reply(rd: Round, state: DeviceReject, q_last: np.ndarray | None, key: np.ndarray,
                rnd: np.ndarray) -> Reply:
    """The method's payload for a tree's rejection (a chain's, with the tree's row)."""
    return _answers(_rejection(rd.method), rd.method, rd.space, [state], state.p_star[None, :],
                    None if q_last is None else q_last[None, :], key, rnd)[0]


def _rejection(method: Method) -> Answer:
    if method.rejection is None:
        raise ProtocolError(f"{method.name} sends no drafts to reject", code="internal")
    return method.rejection


def _answers(kind: Answer, method: Method, space: Space, states: Sequence[DeviceReject],
             term: torch.Tensor, q: np.ndarray | None, key: np.ndarray,
             rnd: np.ndarray) -> list[Reply]:
    """``kind`` (:class:`~xcosd.methods.base.Answer`) drawn on the device, in one batched
    call, for rejections that all want it from the same ``method`` and ``space``:
    ``term`` their committed rows ``p*_j``, ``q`` their ``q_j`` over V_C where the kind
    reads it, ``key`` and ``rnd`` their sessions' draw keys and rounds. The host
    draws the same kinds in :meth:`Method.answer <xcosd.methods.base.Method.answer>`."""
    if kind is Answer.TOKEN:
        u = _device(uniforms(key, rnd, TOKEN, 0), term.device)
        return [TokenReply(int(t)) for t in draw(term, u[:, None])[:, 0].tolist()]
    if kind is Answer.ARGMAX:
        return [TokenReply(int(t)) for t in term.argmax(dim=-1).tolist()]
    if kind is Answer.RESIDUAL:
        if q is None:
            raise ProtocolError(f"{method.name}: no q_j to form the residual with",
                                code="internal")
        return _residual_draws(term, q, space, key, rnd)
    if kind is Answer.FULL:
        host = torch.stack([st.raw for st in states]).cpu().numpy()
        return [FullVectorReply(method.codec.encode(host[k])) for k in range(len(states))]
    if kind is Answer.HYBRID:
        return _hybrid_payloads(method.codec, space, states, _presample(method))
    if kind is Answer.CANDIDATES:
        return _candidate_replies(states, _srdv(method).K)
    if kind is Answer.OTHER:
        return [TokenReply(_other(st, space)) for st in states]
    raise ProtocolError(f"{method.name}: no device draw for {kind}", code="internal")


def _verify_chains(rounds: Sequence[Round], rows: Sequence[torch.Tensor]) -> list[RoundOutcome]:
    dev = rows[0].device
    lens = [int(r.shape[0]) for r in rows]
    offs = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    w = warp_rows(torch.cat([r for r in rows]),
                  [rd.params for rd, n in zip(rounds, lens, strict=True) for _ in range(n)])
    ps = _committed(rounds, w, offs, lens)
    key, rnd = _keys(rounds)
    accepted = _accept(rounds, ps, offs, key, rnd)
    at = torch.from_numpy(offs + accepted).to(dev)
    term = ps[at]
    term_raw = w[at] if ps is not w else None
    out: list[RoundOutcome | None] = [None] * len(rounds)
    # every session whose terminal row is drawn from as it is: a bonus after a full
    # acceptance, a rejection answered with a token from it (target-resample's), ar
    plain = [i for i, rd in enumerate(rounds) if rd.redo is None and (
        accepted[i] == rd.draft.length or rd.method.rejection is Answer.TOKEN)]
    if plain:
        sel = torch.tensor(plain, device=dev)
        u = _device(uniforms(key[plain], rnd[plain], TOKEN, 0), dev)
        toks = draw(term[sel], u[:, None])[:, 0].tolist()
        for i, t in zip(plain, toks, strict=True):
            full = accepted[i] == rounds[i].draft.length
            out[i] = RoundOutcome(int(accepted[i]), TokenReply(int(t)), None if full else
                             _reject(rounds[i], term, term_raw, i, int(accepted[i])))
    # a redo answers a follow-up, whatever the method: its reply comes from
    # :func:`on_request`, session by session
    for i in range(len(rounds)):
        if out[i] is None and rounds[i].redo is not None:
            try:
                out[i] = _redo(rounds[i], _reject(rounds[i], term, term_raw, i,
                                                  int(accepted[i])))
            except Exception as e:  # a follow-up this session may not ask
                out[i] = _failed(e)
    rest = [i for i in range(len(rounds)) if out[i] is None]
    for group in _by_answer(rounds, rest).values():
        first = rounds[group[0]]
        kind = _rejection(first.method)
        states = [_reject(rounds[i], term, term_raw, i, int(accepted[i])) for i in group]
        q = None
        if kind is Answer.RESIDUAL:
            q = np.stack([np.asarray(rounds[i].method.server_q(rounds[i].draft, int(accepted[i]),
                                                               rounds[i].space), dtype=np.float32)
                          for i in group])
        replies = _answers(kind, first.method, first.space, states,
                           term[torch.tensor(group, device=dev)], q, key[group], rnd[group])
        for i, st, rep in zip(group, states, replies, strict=True):
            out[i] = RoundOutcome(int(accepted[i]), rep, st)
    return [o if o is not None else _failed(RuntimeError("unverified")) for o in out]


def _by_answer(rounds: Sequence[Round], idx: list[int]) -> dict[tuple[Any, ...], list[int]]:
    """The rejections to answer, grouped so that one batched call serves a group: by
    the answer the method gives, its codec, the method's options and space (sessions
    of different peers differ in each, and a payload is encoded, sized and gathered
    by them)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i in idx:
        rd = rounds[i]
        m = rd.method
        key = (m.rejection, m.codec.name, tuple(sorted(m.options().items())), id(rd.space))
        groups.setdefault(key, []).append(i)
    return groups


def _accept(rounds: Sequence[Round], w: torch.Tensor, offs: np.ndarray, key: np.ndarray,
            rnd: np.ndarray) -> np.ndarray:
    """Each session's accepted count: ``u < p*(x_i) / q(x_i)`` in draft order, the first
    failure ends it (a redo's count is the one already sent)."""
    job, pos, row, tok, q, test = [], [], [], [], [], []
    for j, rd in enumerate(rounds):
        d = rd.draft.length
        if rd.redo is not None or not d:
            continue
        mask = rd.draft.verify_mask
        job.append(np.full(d, j))
        pos.append(np.arange(d))
        row.append(offs[j] + np.arange(d))
        tok.append(rd.draft.ids)
        q.append(rd.draft.q_values.astype(np.float64))
        test.append(np.ones(d, dtype=bool) if mask is None else np.asarray(mask, dtype=bool))
    accepted = np.array([rd.redo.accepted if rd.redo is not None else rd.draft.length
                         for rd in rounds], dtype=np.int64)
    if not job:
        return accepted
    dev = w.device
    jb = np.concatenate(job)
    pv = w[_device(np.concatenate(row), dev),
           _device(np.concatenate(tok).astype(np.int64), dev)].to(torch.float64)
    # the test u * q < p is made on the host: p(x_i) is the one number per draft that
    # comes back (u and q are there already)
    uq = uniforms(key[jb], rnd[jb], ACCEPT, np.concatenate(pos)) * np.concatenate(q)
    ok_h = (uq < pv.cpu().numpy()) | ~np.concatenate(test)
    at = 0
    for j, rd in enumerate(rounds):
        d = rd.draft.length
        if rd.redo is not None or not d:
            continue
        bad = np.flatnonzero(~ok_h[at: at + d])
        accepted[j] = int(bad[0]) if bad.size else d
        at += d
    return accepted


def _committed(rounds: Sequence[Round], w: torch.Tensor, offs: np.ndarray,
               lens: list[int]) -> torch.Tensor:
    """The committed rows every decision uses: the warped rows themselves, or, for a
    session whose codec compresses ``p`` lossily, its rows committed on the device."""
    lossy = [(i, c) for i, rd in enumerate(rounds) if (c := _commit(rd.method)) is not None]
    if not lossy:
        return w
    out = w.clone()
    for i, commit in lossy:
        rd, lo, hi = rounds[i], int(offs[i]), int(offs[i]) + lens[i]
        if rd.method.commit_rule is CommitRule.FULL:
            out[lo:hi] = committed_full(commit, w[lo:hi])
        else:
            on = _on(rd.space, w.device)
            out[lo:hi] = committed_hybrid(commit, w[lo:hi], on.common, on.other)
    return out


def _reject(rd: Round, term: torch.Tensor, term_raw: torch.Tensor | None, i: int,
            n: int) -> DeviceReject:
    cand, fb = (rd.redo.candidate_rounds, rd.redo.fallback) if rd.redo is not None else (0, False)
    raw = None
    if term_raw is not None and _commit(rd.method) is not None:
        raw = term_raw[i].clone()
    return DeviceReject(term[i].clone(), int(rd.draft.ids[n]), rd.key, rd.round, cand, fb,
                        raw)


def _redo(rd: Round, state: DeviceReject) -> RoundOutcome:
    assert rd.redo is not None
    reply = on_request(rd.method, state, Request(rd.redo.kind), rd.space)
    return RoundOutcome(rd.redo.accepted, reply, state, redo=True)


def _uniform_row(states: Sequence[DeviceReject], stream: np.ndarray | int, k: int,
                 device: torch.device) -> torch.Tensor:
    """``(len(states), k)`` uniforms of ``stream`` (per state, or one for all) for each
    state's session and round, on ``device``."""
    key, rnd = _keys(states)
    st = np.asarray(stream, dtype=np.uint64)
    u = uniforms(key[:, None], rnd[:, None], st[:, None] if st.ndim else st,
                 np.arange(k, dtype=np.uint64)[None, :])
    return _device(u, device)


def _residual_draws(term: torch.Tensor, q: np.ndarray, space: Space, key: np.ndarray,
                    rnd: np.ndarray) -> list[Reply]:
    """A token from each row's ``max(0, p*_j - q_j)`` (``q_j`` over V_C), or from
    ``p*_j`` when rounding left the residual no mass."""
    dev = term.device
    full = torch.zeros_like(term)
    full[:, _on(space, dev).common] = torch.from_numpy(q).to(dev)
    res = (term.to(torch.float64) - full.to(torch.float64)).clamp_(min=0.0)
    empty = fixed_sum(res) <= 0
    res = torch.where(empty[:, None], term.to(torch.float64), res)
    u = _device(uniforms(key, rnd, TOKEN, 0), dev)
    return [TokenReply(int(t)) for t in draw(res, u[:, None])[:, 0].tolist()]


def _hybrid_payloads(codec: Any, space: Space, states: Sequence[DeviceReject],
                     presample: bool) -> list[Reply]:
    """``p_j`` over V_C (to the host, encoded), ``theta_o = p_j(V_O)`` as the float32
    that crosses, and with ``presample`` one ``y ~ p_j | V_O`` drawn up front."""
    dev = states[0].p_star.device
    on = _on(space, dev)
    raw = torch.stack([s.raw for s in states])
    theta = theta_other(raw, on.other).tolist()
    vc = raw[:, on.common].cpu().numpy()
    rows = torch.stack([s.p_star for s in states])
    other: list[int | None] = [None] * len(states)
    if presample:
        want = [k for k, th in enumerate(theta) if th > 0]
        if want:
            other_rows = torch.where(on.other[None, :], rows[want], 0.0)
            u = _uniform_row([states[k] for k in want], OTHER, 1, dev)
            for k, t in zip(want, draw(other_rows, u)[:, 0].tolist(), strict=True):
                other[k] = int(t)
    return [HybridReply(codec.encode(vc[k]), float(theta[k]), other[k])
            for k in range(len(states))]


def _candidate_replies(states: Sequence[DeviceReject], k: int) -> list[Reply]:
    """``K`` candidates ``y ~ p*_j`` conditioned on ``y != x_j`` (all of ``p*_j`` when
    rounding put every bit of mass on ``x_j``), with their values ``p*_j(y)``; each
    state's candidate round numbers its stream."""
    dev = states[0].p_star.device
    rows = torch.stack([s.p_star for s in states])
    w = rows.clone()
    at = torch.arange(len(states), device=dev)
    w[at, torch.tensor([s.rejected for s in states], device=dev)] = 0.0
    w = torch.where((fixed_sum(w) > 0)[:, None], w, rows)
    streams = np.array([CANDIDATES + s.candidate_rounds for s in states], dtype=np.uint64)
    ids = draw(w, _uniform_row(states, streams, k, dev))
    vals = rows.gather(1, ids)
    ids_h, vals_h = ids.cpu().numpy(), vals.cpu().numpy().astype(np.float32)
    for s in states:
        s.candidate_rounds += 1
    return [CandidatesReply(ids=ids_h[i], values=vals_h[i]) for i in range(len(states))]


def on_request(method: Method, state: DeviceReject, request: Request, space: Space) -> Reply:
    """A follow-up answered from a rejection kept on the device: the method says what
    it draws, under its own limits (:meth:`Method.follow_up
    <xcosd.methods.base.Method.follow_up>`: SR-DV's ``more`` and ``fallback``, hybrid
    resampling's ``other``), and it is drawn here."""
    kind = method.follow_up(state, request)
    key, rnd = _keys([state])
    return _answers(kind, method, space, [state], state.p_star[None, :], None, key, rnd)[0]


def _srdv(method: Method) -> SrDv:
    if not isinstance(method, SrDv):
        raise ProtocolError(f"{method.name} has no candidates", code="bad_request")
    return method


def _presample(method: Method) -> bool:
    """Whether the HR payload carries a V_O sample drawn up front (xcosd and
    xcosd-e's fallback have the option)."""
    if not isinstance(method, (HybridResampling, SrDv)):
        raise ProtocolError(f"{method.name} sends no HR payload", code="bad_request")
    return method.hr_presample


def _other(state: DeviceReject, space: Space) -> int:
    """``y ~ p*_j | V_O``."""
    dev = state.p_star.device
    row = torch.where(_on(space, dev).other, state.p_star, 0.0)[None, :]
    return int(draw(row, _uniform_row([state], OTHER, 1, dev))[0, 0])


__all__ = ["ACCEPT", "CANDIDATES", "OTHER", "TOKEN", "DeviceReject",
           "Round", "on_request", "supported", "verify_batch"]
