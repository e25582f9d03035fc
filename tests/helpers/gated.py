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

from .waits import HANG_S


class GatedModel:
    """A target whose ``start`` and/or ``score`` calls wait at a gate until the test
    opens it, so the test can act while the cloud's worker is inside one; it says
    when a call is in progress and counts the sessions it started and ended."""

    def __init__(self, inner: Any, *, hold_start: bool = False,
                 hold_score: bool = False) -> None:
        self.inner, self.hold_start, self.hold_score = inner, hold_start, hold_score
        self.name, self.vocab = inner.name, inner.vocab
        self.gate = threading.Event()
        self.in_start = threading.Event()
        self.in_score = threading.Event()
        self.started = 0
        self.ended = 0

    def _hold(self, held: bool) -> None:
        if held and not self.gate.wait(HANG_S):
            raise RuntimeError("the test never opened the gate")

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

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

    def append(self, session: Any, ids: Sequence[int]) -> None:
        self.inner.append(session, ids)

    def rollback(self, session: Any, length: int) -> None:
        self.inner.rollback(session, length)

    def end(self, session: Any) -> None:
        self.ended += 1
        self.inner.end(session)
