"""Draws from rows of weights on the accelerator path, one uniform per draw.

The rule is :func:`xcosd.sampling.sample_index`'s, inverse CDF on float64 running
sums: the first index whose running mass exceeds ``u * total``, stepped back to the
nearest index with weight when rounding lands past the last one. The running sums are
:func:`~xcosd.accel.sums.fixed_cumsum`'s, so a draw is a function of its row and its
uniform alone (not of the batch beside it); the uniforms are Philox's
(:mod:`xcosd.accel.philox`).
"""

from __future__ import annotations

import torch

from ..errors import InvalidDistribution
from .sums import fixed_cumsum


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices drawn from each row of ``weights`` (``(n, V)``, non-negative): ``u`` is
    ``(n, k)`` float64 uniforms in ``[0, 1)``, one per draw; the result is ``(n, k)``
    int64. A row without mass raises :class:`~xcosd.errors.InvalidDistribution`."""
    c = fixed_cumsum(weights)
    total = c[:, -1:]
    if not bool((total > 0).all()):
        raise InvalidDistribution("cannot sample from a vector with no mass")
    idx = torch.searchsorted(c, u * total, right=True).clamp_(max=weights.shape[-1] - 1)
    # a target rounded onto the total lands past the last weighted index: the nearest
    # weighted index at or before it (a running maximum of weighted positions)
    pos = torch.arange(weights.shape[-1], device=weights.device).expand_as(weights)
    last = torch.where(weights > 0, pos, torch.zeros_like(pos)).cummax(dim=-1).values
    return last.gather(1, idx)


__all__ = ["draw"]
