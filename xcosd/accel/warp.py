"""The sampling warpers on the accelerator path, for a whole batch of rows at once.

Rules and order are :mod:`xcosd.sampling`'s (Hugging Face transformers' logits
processors): temperature ``softmax(log p / T)``; top-k keeping every value at or above
the k-th largest (ties included); top-p on an ascending *stable* sort, dropping each
token whose cumulative mass (itself and everything below) rounded to float32 is at or
below ``float32(1 - top_p)``, the top token always kept; ``T = 0`` a point mass on the
first maximum. Every row carries its own settings (a batch mixes sessions).

Sorting and selecting are exact; the sums are :mod:`xcosd.accel.sums`'s fixed-order
ones, so a row's warp is a function of the row and its settings alone, never of the
rows beside it. It is not bit-identical to the numpy path's (different summation
orders round differently in the last bit); both are the same law.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling import SamplingParams
from .sums import fixed_cumsum, fixed_sum


def warp_rows(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Warp ``rows`` (``(n, V)`` probabilities) with ``params[i]`` for row ``i``:
    float32 rows summing to 1 (an identity row is returned as it is)."""
    n, size = rows.shape
    if len(params) != n:
        raise ValueError(f"{len(params)} settings for {n} rows")
    p = rows.to(torch.float32)
    if all(sp.identity for sp in params):
        return p
    dev = p.device
    temp = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=dev)
    top_k = [sp.top_k if 0 < sp.top_k < size else 0 for sp in params]
    top_p = [sp.top_p for sp in params]
    greedy = temp == 0
    x = p
    tempered = (temp != 1) & ~greedy
    if bool(tempered.any()):
        with torch.no_grad():
            lg = torch.log(p) / torch.where(tempered, temp, 1.0)[:, None]
            w = torch.exp(lg - lg.max(dim=-1, keepdim=True).values)
        x = torch.where(tempered[:, None], w, p)
    if any(top_k):
        k = torch.tensor(top_k, dtype=torch.int64, device=dev)
        kth = x.topk(max(top_k), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
        x = torch.where((k > 0)[:, None] & (x < kth), 0.0, x)
    if any(tp < 1.0 for tp in top_p):
        x = _top_p(x, top_p)
    norm = (x.to(torch.float64) / fixed_sum(x)[:, None]).to(torch.float32)
    plain = torch.tensor([sp.identity for sp in params], device=dev)
    out = torch.where(plain[:, None], p, norm)
    if bool(greedy.any()):
        hot = torch.zeros_like(p)
        hot.scatter_(1, p.argmax(dim=-1, keepdim=True), 1.0)
        out = torch.where(greedy[:, None], hot, out)
    return out


def _top_p(x: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Top-p of the rows whose ``top_p < 1`` (the others are left as they are)."""
    sel = [i for i, tp in enumerate(top_p) if tp < 1.0]
    sub = x[sel]
    vals, order = torch.sort(sub, dim=-1, stable=True)  # ascending, ties in id order
    frac = (fixed_cumsum(vals) / fixed_sum(sub)[:, None]).to(torch.float32)
    cut = torch.tensor([1.0 - top_p[i] for i in sel], dtype=torch.float32, device=x.device)
    drop = frac <= cut[:, None]
    drop[:, -1] = False  # min_tokens_to_keep = 1: the largest value always stays
    removed = torch.zeros_like(drop).scatter_(1, order, drop)
    out = x.clone()
    out[sel] = torch.where(removed, 0.0, sub)
    return out


__all__ = ["warp_rows"]
