"""The commit rule (``docs/METHODS.md``, "Choices worth knowing"; ``docs/WIRE.md``, "Codecs").

A lossy codec stays exact because sender and receiver make every decision with
the same *committed* numbers. These functions compute them; each side calls the
same function on the same bytes, so both get the same bits. Exact codecs skip the
renormalisation, so with ``f32`` the committed row is the target row itself.
"""

from __future__ import annotations

import numpy as np

from ..codecs import Codec
from .base import Space, fixed_total, normalise


def committed_full(codec: Codec, p: np.ndarray) -> np.ndarray:
    """``p*`` for a vector sent whole (straightforward's ``p_j``, sd-uplink's ``q``)."""
    if codec.exact:
        return np.asarray(p, dtype=np.float32)
    return normalise(codec.commit(p))


def decoded_full(codec: Codec, data: bytes, n: int) -> np.ndarray:
    """The receiver's ``p*`` from the bytes of :func:`committed_full`'s vector."""
    dec = codec.decode(data, n)
    return dec if codec.exact else normalise(dec)


def theta_other(p: np.ndarray, space: Space) -> np.float32:
    """``theta_o``: the target's mass on V_O, as the float32 that crosses the link."""
    return np.float32(np.sum(p[space.other_ids], dtype=np.float64))


def hybrid_view(codec: Codec, dec: np.ndarray, theta_o: float) -> tuple[np.ndarray, float]:
    """``(p*_C, theta_o*)`` from the decoded V_C values and the sent ``theta_o``."""
    if codec.exact:
        return dec, float(theta_o)
    total = fixed_total(dec) + float(theta_o)
    return normalise(dec, float(theta_o)), float(theta_o) / total


def committed_hybrid(codec: Codec, p: np.ndarray, space: Space) -> np.ndarray:
    """``p*`` over all target ids for methods that send ``p`` over V_C plus ``theta_o``
    (hybrid resampling and SR-DV's fallback).

    On V_C it is what the device will decode; on V_O it keeps ``p``'s shape with the
    committed total mass ``theta_o*``.
    """
    p32 = np.asarray(p, dtype=np.float32)
    if codec.exact:
        return p32
    theta_o = theta_other(p32, space)
    p_c, theta_star = hybrid_view(codec, codec.commit(p32[space.common_ids]), float(theta_o))
    out = np.zeros_like(p32)
    out[space.common_ids] = p_c
    if theta_o > 0:
        p_o = p32[space.other_ids].astype(np.float64)
        out[space.other_ids] = (p_o * (theta_star / p_o.sum())).astype(np.float32)
    return out
