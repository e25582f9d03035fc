"""Sums whose bits do not depend on the batch, the device or the library's kernels.

A reduction kernel picks its order of additions from the tensor's shape and the
device (a row summed alone and the same row in a batch of 200 can differ in the last
bit), and a draw by inverse CDF that lands within that bit of a boundary then picks a
different token. The accelerator path therefore sums with elementwise additions in a
fixed pattern only: a pairwise tree for totals (:func:`fixed_sum`) and a Hillis-Steele
scan for running sums (:func:`fixed_cumsum`). Each step is one IEEE addition per
element, correctly rounded on every device, so a row gives the same bits alone or in a
batch, on the CPU or a GPU. Both work in float64 along the last axis.
"""

from __future__ import annotations

import torch


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Float64 totals along the last axis by a pairwise tree (the axis zero-padded to a
    power of two, then halved: ``x[:h] + x[h:]`` until one element is left)."""
    n = x.shape[-1]
    if n == 0:
        return x.to(torch.float64).sum(-1)
    width = 1 << (n - 1).bit_length()
    if width == n:
        y = x.to(torch.float64)
    else:  # one copy: the float64 values and their zero padding together
        y = x.new_zeros((*x.shape[:-1], width), dtype=torch.float64)
        y[..., :n] = x
    while width > 1:
        width //= 2
        y = y[..., :width] + y[..., width:]
    return y[..., 0]


def fixed_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Float64 running sums along the last axis (inclusive) by a Hillis-Steele scan:
    ``log2(n)`` passes of ``y[i] += y[i - s]`` for ``s = 1, 2, 4, ...``."""
    y = x.to(torch.float64)
    n = y.shape[-1]
    s = 1
    while s < n:
        y = torch.cat((y[..., :s], y[..., s:] + y[..., :-s]), dim=-1)
        s *= 2
    return y


__all__ = ["fixed_cumsum", "fixed_sum"]
