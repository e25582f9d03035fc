"""One full round of any method, in process, with no network.

For tests, benches and anyone studying the math: it drafts from ``draft_probs``,
verifies against ``target_probs``, runs the method's rejection protocol
(including follow-up requests) and counts what would cross the link. It composes
the round from ``xcosd/methods/round.py``, the functions the state machines run,
so what is proven here is what runs over the wire.

    from xcosd.simulate import simulate_round
    res = simulate_round("xcosd", target_probs, draft_probs, common, rng)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidDistribution
from .methods import DeviceState, Method, RejectState, Space, Verdict, get_method
from .methods.base import ID_BYTES, Reply
from .methods.round import draft_token, resolve_locally, verify_block
from .methods.tree import (
    RowsAt,
    TreeShape,
    device_state,
    draft_tree,
    verify_tree,
)
from .sampling import check_distribution, sample_index


@dataclass
class RoundResult:
    """What one round produced and what it cost on the link (payload bytes, before
    framing; the wire layer's meters count frames)."""

    tokens: list[int]
    accepted: int
    drafted: int
    uplink_bytes: int
    downlink_bytes: int
    round_trips: int
    trials: int = 0
    fallbacks: int = 0
    messages: list[tuple[str, str, int]] = field(default_factory=list)
    #: a tree round's accepted nodes, from the context down
    path: list[int] = field(default_factory=list)

    @property
    def rejected(self) -> bool:
        return self.accepted < self.drafted


def simulate_round(
    method: str | Method,
    target_probs: np.ndarray,
    draft_probs: np.ndarray | None,
    common: np.ndarray | Space,
    rng: np.random.Generator,
    *,
    validate: bool = True,
    **options: Any,
) -> RoundResult:
    """Run one round of ``method``.

    ``target_probs``: (d+1, |V_T|) warped target rows; ``draft_probs``: (d, |V_T|),
    zero outside V_C; ``common``: bool mask over target ids (True on V_C) or a
    prepared :class:`~xcosd.methods.Space`; ``options``: the method's own
    (``K``, ``M``, ``hr_presample``, ``threshold``, ``codec``).
    """
    m = method if isinstance(method, Method) else get_method(method, **options)
    space = common if isinstance(common, Space) else Space.from_mask(common)
    tp = np.asarray(target_probs, dtype=np.float32)
    if tp.ndim != 2 or tp.shape[1] != space.target_size:
        raise InvalidDistribution(
            f"target_probs must have shape (d+1, {space.target_size}), got {tp.shape}")
    if validate:
        check_distribution(tp, what="target_probs")

    if not m.drafts:
        tok = sample_index(m.commit_row(tp[0], space), rng)
        return RoundResult([tok], 0, 0, 0, ID_BYTES, 1, messages=[("down", "token", ID_BYTES)])

    if draft_probs is None:
        raise InvalidDistribution(f"{m.name} needs draft_probs")
    dp = np.asarray(draft_probs, dtype=np.float32)
    d = dp.shape[0] if dp.ndim == 2 else -1
    if dp.ndim != 2 or dp.shape[1] != space.target_size or tp.shape[0] < d + 1 or d < 1:
        raise InvalidDistribution(
            f"draft_probs must have shape (d, {space.target_size}) with d >= 1 and "
            f"target_probs d+1 rows; got {dp.shape} and {tp.shape}")
    if validate:
        check_distribution(dp, what="draft_probs")
        if np.any(dp[:, ~space.common_mask] != 0):
            raise InvalidDistribution("draft_probs must be zero outside V_C")

    # device: draft d tokens from q_i (V_C order)
    q_raw = [dp[i, space.common_ids] for i in range(d)]
    drawn = [draft_token(m, q, space, rng) for q in q_raw]
    ids = np.array([t for t, _ in drawn], dtype=np.int64)
    q_rows = [qr for _, qr in drawn]
    draft = m.draft_message(ids, q_raw, space)
    up = draft.nbytes()
    msgs = [("up", "draft", up)]

    # server: commit, verify, answer
    v = verify_block(m, tp[: d + 1], draft, space, rng)
    n = v.accepted
    if v.reject is None:
        verdict = Verdict(n, v.reply)
        msgs.append(("down", "verdict", verdict.nbytes()))
        return RoundResult([*ids.tolist(), verdict.reply.token], n, d, up,  # type: ignore[union-attr]
                           verdict.nbytes(), 1, messages=msgs)
    assert isinstance(v.reject, RejectState)  # the host's verification keeps it here
    res = _settle_rejection(m, v.reject, DeviceState(q_common=q_rows[n], rejected=int(ids[n])),
                            space, rng, msgs, v.reply)
    res.tokens[:0] = ids[:n].tolist()
    res.accepted, res.drafted = n, d
    res.uplink_bytes += up
    return res


def simulate_tree_round(
    method: str | Method,
    shape: TreeShape,
    target_rows: Callable[[list[int]], np.ndarray],
    draft_rows: RowsAt,
    common: np.ndarray | Space,
    rng: np.random.Generator,
    *,
    row_codec: str | None = None,
    distinct: bool = True,
    **options: Any,
) -> RoundResult:
    """One round with a draft tree of ``shape`` (``xcosd/methods/tree.py``).

    ``draft_rows(nodes, ids)``: the device's TLI rows (V_C order) after each of
    ``nodes`` (``-1``: the context), the tree's tokens so far being ``ids`` (target
    ids by node), asked once per depth; ``target_rows(ids)``: the tree's ``n + 1``
    warped target rows over V_T (after the context, then after each node's path;
    :func:`xcosd.models.tree_scoring.score_tree` scores them). The tokens are the
    accepted path's, then the bonus or the resolved rejection's; ``accepted`` is the
    path's length, ``drafted`` the tree's size; ``distinct``: siblings drawn without
    replacement (else i.i.d.). Downlink: the verdict as the wire has it, its count
    naming the node the walk stopped at (``n`` = node + 1, 0 for the context: the
    path follows from the shape), so it costs what a chain's verdict does."""
    m = method if isinstance(method, Method) else get_method(method, **options)
    space = common if isinstance(common, Space) else Space.from_mask(common)
    drafted = draft_tree(m, shape, draft_rows, space, rng, row_codec, distinct=distinct)
    tree = drafted.draft
    ids = tree.ids.tolist()
    p = np.asarray(target_rows(ids), dtype=np.float32)
    up = tree.nbytes()
    msgs = [("up", "tree", up)]
    v = verify_tree(m, p, tree, space, rng)
    path = [ids[n] for n in v.path]
    if v.reject is None:
        verdict = Verdict(v.node + 1, v.reply)
        down = verdict.nbytes()
        msgs.append(("down", "verdict", down))
        return RoundResult([*path, verdict.reply.token], len(path), shape.size, up,  # type: ignore[union-attr]
                           down, 1, messages=msgs, path=v.path)
    res = _settle_rejection(m, v.reject, device_state(drafted, v.node), space, rng, msgs,
                            v.reply)
    res.tokens[:0] = path
    res.accepted, res.drafted = len(path), shape.size
    res.uplink_bytes += up
    res.path = v.path
    return res


def simulate_resample(
    method: str | Method,
    p: np.ndarray,
    q: np.ndarray,
    rejected: int,
    common: np.ndarray | Space,
    rng: np.random.Generator,
    **options: Any,
) -> RoundResult:
    """Only the rejection protocol: draft ``rejected`` was drawn from ``q`` (over
    target ids, zero outside V_C) and rejected against ``p``; return the token the
    method emits in its place. Its law must be the residual ``max(0, p - q) / Z``.

    This isolates the resampling step, so a test can study it even where
    rejections are rare (``Z`` close to 0).
    """
    m = method if isinstance(method, Method) else get_method(method, **options)
    space = common if isinstance(common, Space) else Space.from_mask(common)
    p32 = np.asarray(p, dtype=np.float32)
    q_raw = np.asarray(q, dtype=np.float32)[space.common_ids]
    q_common = m.draft_row(q_raw)
    draft = m.draft_message(np.array([rejected], dtype=np.int64), [q_raw], space)
    state = RejectState(p_raw=p32, p_star=m.commit_row(p32, space), rejected=int(rejected),
                        q_common=m.server_q(draft, 0, space))
    return _settle_rejection(m, state, DeviceState(q_common=q_common, rejected=int(rejected)),
                             space, rng, [])


def _settle_rejection(m: Method, state: RejectState, dev: DeviceState, space: Space,
                      rng: np.random.Generator, msgs: list[tuple[str, str, int]],
                      reply: Reply | None = None) -> RoundResult:
    """Server reply to a rejection, then device resolution with follow-ups."""
    r = resolve_locally(m, state, dev, space, rng, reply)
    msgs.extend(r.messages)
    return RoundResult([r.token], 0, 1, r.uplink_bytes, r.downlink_bytes, r.round_trips,
                       trials=dev.trials, fallbacks=dev.fallbacks, messages=msgs)
