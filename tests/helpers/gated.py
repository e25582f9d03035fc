"""A target model whose calls wait at a gate the test opens.

A test that must act while the cloud's worker is inside a model call (a device
vanishing mid-round, a session closing during its first round, requests piling
up behind a running batch) holds the call at the gate instead of making it slow
and hoping the timing works out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from xcosd.models.base import ModelWrapper

from .waits import HANG_S


class GatedModel(ModelWrapper):
    """A target whose ``start`` and/or ``score`` calls wait at a gate until the test
    opens it, so the test can act while the cloud's worker is inside one; it says
    when a call is in progress and counts the sessions it started and ended."""

    def __init__(self, inner: Any, *, hold_start: bool = False,
                 hold_score: bool = False) -> None:
        super().__init__(inner)
        self.hold_start, self.hold_score = hold_start, hold_score
        self.gate = threading.Event()
        self.in_start = threading.Event()
        self.in_score = threading.Event()
        self.started = 0
        self.ended = 0

    def _hold(self, held: bool) -> None:
        if held and not self.gate.wait(HANG_S):
            raise RuntimeError("the test never opened the gate")

    def start(self, prompt_ids: Sequence[int]) -> Any:
        self.in_start.set()
        self._hold(self.hold_start)
        handle = self.inner.start(prompt_ids)
        self.started += 1
        return handle

    def score(self, batch: Any) -> list[np.ndarray]:
        self.in_score.set()
        self._hold(self.hold_score)
        return self.inner.score(batch)

    def end(self, session: Any) -> None:
        self.ended += 1
        self.inner.end(session)
