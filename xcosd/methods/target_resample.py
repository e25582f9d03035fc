"""``target-resample`` (lossy): on a rejection, send one token drawn from ``p_j``.

Cheap on the link and wrong: the correct law after a rejection is the residual
``max(0, p_j − q_j)``, not ``p_j``, so tokens the draft over-proposes come out
too often. Kept to measure what losslessness costs.
"""

from __future__ import annotations

from typing import ClassVar

from .base import Answer, Method


class TargetResample(Method):
    name = "target-resample"
    lossless = False

    rejection: ClassVar[Answer | None] = Answer.TOKEN
