"""Token-level intersection (TLI): the draft distribution restricted to V_C.

The device warps its model's distribution over V_D, keeps only the tokens of V_C,
renormalises, and drafts from that. The result is a vector in V_C order, the
layout every method's device half works in.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidDistribution
from ..sampling import Kept


def restrict_to_common(q_draft: np.ndarray,
                       common_draft_ids: np.ndarray | tuple[slice, ...]) -> np.ndarray:
    """``q`` over V_D (already warped) -> ``q_i`` over V_C in V_C order, float32.

    ``common_draft_ids`` may be given as the runs of draft ids V_C reads
    (``VocabMap.common_draft_index``): the values are then copied run by run (one
    run: read through a view of ``q_draft``, never written to), the same numbers in
    the same order as the id-by-id gather.

    Raises :class:`InvalidDistribution` when the draft puts no mass on V_C (a
    warper such as greedy can do that; the device should then draft nothing).
    """
    # gather the float32 values, total them in float64, scale: any normalisation
    # is exact as long as the same vector drafts, travels and resolves
    row = np.asarray(q_draft, dtype=np.float32)
    view = False
    if isinstance(common_draft_ids, tuple):
        view = len(common_draft_ids) == 1
        sub = (row[common_draft_ids[0]] if view
               else np.concatenate([row[r] for r in common_draft_ids]))
    else:
        sub = row[common_draft_ids]
    z = float(np.add.reduce(sub, dtype=np.float64))  # ndarray.sum's own reduction
    if not z > 0:
        raise InvalidDistribution("the draft distribution has no mass on V_C")
    if view:
        return sub / z
    sub /= z  # a copy of its own: scaled in place
    return sub


def restrict_kept_support(kept: Kept, common_draft_ids: np.ndarray,
                          draft_to_common: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`restrict_to_common` of a warped draft row given as
    :func:`~xcosd.sampling.warp_kept` returns it.

    With top-k or a peaked top-p row only a few hundred draft ids survive the warpers;
    their V_C positions are looked up directly, so the edge never builds the dense
    warped V_D row nor gathers V_C out of it. The result is the same TLI vector as
    ``restrict_to_common(warp(row))``: the kept values as float32, renormalised on V_C
    in float64 (only the summation order of that float64 total differs).

    Returns ``(q, support)``: ``support`` holds, ascending, the V_C positions where
    ``q`` may be non-zero when the kept set was small (``None`` otherwise), so a draft
    can be drawn from those few entries (:func:`~xcosd.methods.round.draft_token`).
    """
    if kept.ids is None:
        return restrict_to_common(kept.probs, common_draft_ids), None
    if kept.ids.shape[0] == 1:  # greedy, or a top-k / top-p row with one survivor
        p = int(draft_to_common[kept.ids[0]])
        if p < 0 or not kept.probs[0] > 0:
            raise InvalidDistribution("the draft distribution has no mass on V_C")
        q = np.zeros(common_draft_ids.shape[0], dtype=np.float32)
        q[p] = 1.0  # the kept value over itself, as the general path divides it
        return q, np.array([p], dtype=np.int64)
    pos = draft_to_common[kept.ids]
    inside = pos >= 0
    sub = kept.probs[inside].astype(np.float32).astype(np.float64)
    z = sub.sum()
    if not z > 0:
        raise InvalidDistribution("the draft distribution has no mass on V_C")
    q = np.zeros(common_draft_ids.shape[0], dtype=np.float32)
    support = pos[inside]
    q[support] = (sub / z).astype(np.float32)
    return q, np.sort(support)

