"""``greedy-resample`` (lossy): on a rejection, send ``argmax p_j``.

One token id down per rejection and deterministic, but it collapses the residual
onto one token (and may even re-emit the rejected draft).
"""

from __future__ import annotations

from typing import ClassVar

from .base import Answer, Method


class GreedyResample(Method):
    name = "greedy-resample"
    lossless = False
    rejection: ClassVar[Answer | None] = Answer.ARGMAX
