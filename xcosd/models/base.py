"""The one interface every language model implements.

Both sides of a session talk to their model through :class:`LanguageModel`:

* The cloud's scheduler batches verification of many sessions into **one**
  :meth:`LanguageModel.score` call: each entry appends the drafted tokens to a
  session's context and returns ``len(new_ids) + 1`` rows: the next-token
  distribution after the context as it was, then after each new token. With
  ``d`` drafts that is exactly ``p_1 .. p_{d+1}``.
* The device drafts through the same call, one token at a time
  (``score([(s, [])])`` after :meth:`append`).
* After a rejection, :meth:`rollback` cuts the context (and any cache) back to the
  accepted prefix; :meth:`append` adds the resolved token without scoring it yet.

Rows are float32 probabilities over the model's whole vocabulary, *before* any
warper: the warpers are applied once, outside the model (:func:`xcosd.sampling.warp`).
Models that produce logits convert with a float32 softmax over the full row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..vocab import Vocabulary


@dataclass(eq=False)
class Session:
    """Per-session incremental state: the context as token ids of this model, and
    whatever the backend caches (``cache``), private to the backend."""

    ids: list[int] = field(default_factory=list)
    #: how many of ``ids`` the backend has already folded into its cache
    cached: int = 0
    cache: Any = None


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model over a :class:`~xcosd.vocab.Vocabulary`."""

    name: str
    vocab: Vocabulary

    def tokenize(self, text: str) -> list[int]:
        """Text -> this model's token ids (no special tokens added)."""
        ...

    def start(self, prompt_ids: Sequence[int]) -> Session:
        """A new session whose context is ``prompt_ids`` (may be empty)."""
        ...

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        """For each ``(session, new_ids)``: append ``new_ids`` to the context and
        return float32 rows of shape ``(len(new_ids) + 1, vocab.size)``."""
        ...

    def append(self, session: Session, ids: Sequence[int]) -> None:
        """Append ``ids`` to the context without scoring them now."""
        ...

    def rollback(self, session: Session, length: int) -> None:
        """Keep only the first ``length`` tokens of the context (and of the cache)."""
        ...

    def end(self, session: Session) -> None:
        """Free the session's state."""
        ...
