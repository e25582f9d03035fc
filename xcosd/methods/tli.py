"""Token-level intersection (TLI): the draft distribution restricted to V_C.

The device warps its model's distribution over V_D, keeps only the tokens of V_C,
renormalises, and drafts from that. The result is a vector in V_C order, the
layout every method's device half works in.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidDistribution
from ..sampling import sample_index


def restrict_to_common(q_draft: np.ndarray, common_draft_ids: np.ndarray) -> np.ndarray:
    """``q`` over V_D (already warped) -> ``q_i`` over V_C in V_C order, float32.

    Raises :class:`InvalidDistribution` when the draft puts no mass on V_C (a
    warper such as greedy can do that; the device should then draft nothing).
    """
    sub = np.asarray(q_draft, dtype=np.float64)[common_draft_ids]
    z = sub.sum()
    if not z > 0:
        raise InvalidDistribution("the draft distribution has no mass on V_C")
    return (sub / z).astype(np.float32)


def draft_token(q_common: np.ndarray, common_ids: np.ndarray, rng: np.random.Generator) -> int:
    """Sample one draft ``x ~ q`` and return it as a target id."""
    return int(common_ids[sample_index(q_common, rng)])
