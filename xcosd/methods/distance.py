"""How far a lossy codec moves a distribution: TV(p, p*).

``p*`` is what the commit rule makes of ``p``: ``normalise(commit(p))``, or ``p``
itself for an exact codec (the
methods add ``theta_o`` for vectors over V_C; over a whole vector it is just the
renormalised committed row). Losslessness holds *with respect to p\\**, so this
distance is exactly how much a lossy codec changes the output distribution.

It lives with the methods, not the codecs, because ``p*`` is defined by the
methods' commit rule: a codec only encodes and decodes.
"""

from __future__ import annotations

import numpy as np

from ..codecs import Codec
from ..errors import InvalidDistribution
from .commit import committed_full


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    """``0.5 * sum |p - q|`` in float64."""
    a = np.asarray(p, dtype=np.float64)
    b = np.asarray(q, dtype=np.float64)
    if a.shape != b.shape:
        raise InvalidDistribution(f"shapes differ: {a.shape} vs {b.shape}")
    return 0.5 * float(np.abs(a - b).sum())


def committed(codec: Codec, p: np.ndarray) -> np.ndarray:
    """``p* = normalise(commit(p))``: exactly what the methods commit
    (:func:`xcosd.methods.commit.committed_full`)."""
    return committed_full(codec, p)


def tv_distance(p: np.ndarray, p_star: np.ndarray | Codec) -> float:
    """TV between ``p`` and ``p_star``; given a codec instead, ``p_star`` is
    ``normalise(codec.commit(p))``."""
    q = committed(p_star, p) if isinstance(p_star, Codec) else p_star
    return total_variation(p, q)
