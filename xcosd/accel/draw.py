"""Draws from rows of weights on the accelerator path, one uniform per draw.

The rule is :func:`xcosd.sampling.sample_index`'s, inverse CDF on float64 running
sums: the first index whose running mass exceeds ``u * total``, stepped back to the
nearest index with weight when rounding lands past the last one. The running sums are
taken in two levels, as the numpy path's long rows are: each block of :data:`BLOCK`
ids is totalled (:func:`~xcosd.accel.sums.fixed_sum`), the block totals are scanned
(:func:`~xcosd.accel.sums.fixed_cumsum`), and only the block a draw falls in is scanned
id by id. Two passes over the row instead of a scan's ``log2(V)``, and every sum is a
fixed pattern of additions, so a draw is a function of its row and its uniform alone
(not of the batch beside it); the uniforms are counted ones (:mod:`xcosd.draws`).
"""

from __future__ import annotations

import torch

from ..errors import InvalidDistribution
from .sums import fixed_cumsum, fixed_sum

#: ids per block of the two-level running sums (a shorter row: one block)
BLOCK = 1024


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices drawn from each row of ``weights`` (``(n, V)``, non-negative): ``u`` is
    ``(n, k)`` float64 uniforms in ``[0, 1)``, one per draw; the result is ``(n, k)``
    int64. A row without mass raises :class:`~xcosd.errors.InvalidDistribution`."""
    n, size = weights.shape
    # a short row is one block of its own width (the pattern depends on V alone)
    block = min(BLOCK, 1 << max(0, size - 1).bit_length())
    nb = -(-size // block)
    if nb * block == size:
        w = weights.to(torch.float64)
    else:  # one copy: the float64 values and their zero padding together
        w = weights.new_zeros((n, nb * block), dtype=torch.float64)
        w[:, :size] = weights
    blocks = w.view(n, nb, block)
    ends = fixed_cumsum(fixed_sum(blocks))  # (n, nb): the mass up to each block's end
    total = ends[:, -1:]
    if not bool((total > 0).all()):
        raise InvalidDistribution("cannot sample from a vector with no mass")
    target = u * total  # (n, k)
    b = torch.searchsorted(ends, target, right=True).clamp_(max=nb - 1)
    before = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), 0.0)
    rows = torch.arange(n, device=w.device)[:, None].expand_as(b)
    seg = blocks[rows, b]  # (n, k, BLOCK): the blocks the draws fall in
    run = fixed_cumsum(seg) + before[..., None]
    at = torch.searchsorted(run, target[..., None], right=True)[..., 0].clamp_(max=block - 1)
    # a target past the block's last weighted id (the block's scan and its total are
    # sums in different orders, and may differ in the last bit) steps back to that id;
    # the block has mass, since ``ends`` rises across it (``u * total < total`` for any
    # ``u < 1``, so no target lands past the row's last weighted block)
    pos = torch.arange(block, device=w.device).expand_as(seg)
    last_in = torch.where(seg > 0, pos, -1).cummax(dim=-1).values.gather(
        -1, at[..., None])[..., 0]
    first_in = torch.where(seg > 0, pos, block).min(dim=-1).values
    return (b * block + torch.where(last_in >= 0, last_in, first_in)).clamp_(max=size - 1)


__all__ = ["BLOCK", "draw"]
