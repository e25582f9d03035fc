"""``ar``: the target alone, one token per round trip, no drafting.

The reference every speed-up is measured against: each token costs one target
call and one round trip.
"""

from __future__ import annotations

from typing import ClassVar

from .base import Method


class Autoregressive(Method):
    name = "ar"
    lossless = True
    drafts: ClassVar[bool] = False
