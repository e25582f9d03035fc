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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ModelError
from ..vocab import Vocabulary
from .chat import plain_chat


@dataclass(eq=False)
class Session:
    """Per-session incremental state: the context as token ids of this model, and
    whatever the backend caches (``cache``), private to the backend."""

    ids: list[int] = field(default_factory=list)
    #: how many of ``ids`` the backend has already folded into its cache
    cached: int = 0
    cache: Any = None
    #: whose session it is (a cloud's peer): a backend that keeps ended sessions'
    #: caches for reuse shares its room fairly between tenants
    #: (:mod:`xcosd.models.prefix_cache`)
    tenant: str = ""


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


def context_tokens(model: Any) -> int:
    """The most ids one session of ``model`` may hold, its prompt and all it
    generates (its ``context_tokens``; 0 where it has none or knows no bound, as an
    n-gram model, which has no positions)."""
    n = getattr(model, "context_tokens", 0)
    return int(n) if isinstance(n, int) and n > 0 else 0


class ModelWrapper:
    """A :class:`LanguageModel` that forwards every call to ``inner``: the base of the
    wrappers that change one thing about a model (where its rows go, what is recorded
    of its calls)."""

    def __init__(self, inner: LanguageModel) -> None:
        self.inner = inner
        self.name = inner.name
        self.vocab = inner.vocab

    @property
    def context_tokens(self) -> int:
        """The inner model's bound on a session's ids (0: none known): a wrapped
        target's cloud refuses what the model could not hold, as the bare one's does."""
        return context_tokens(self.inner)

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

    def start(self, prompt_ids: Sequence[int]) -> Session:
        return self.inner.start(prompt_ids)

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        return self.inner.score(batch)

    def append(self, session: Session, ids: Sequence[int]) -> None:
        self.inner.append(session, ids)

    def rollback(self, session: Session, length: int) -> None:
        self.inner.rollback(session, length)

    def end(self, session: Session) -> None:
        self.inner.end(session)


class ContextModel:
    """Shared bookkeeping for models whose next-token row is a pure function of the
    context (n-gram, table, synthetic): they keep no cache, so :meth:`score`,
    :meth:`append` and :meth:`rollback` only edit ``session.ids``.

    Subclasses set ``name`` and ``vocab`` and implement :meth:`_fill_row`, which
    writes the distribution after ``context`` into a preallocated float32 row. The
    batched :meth:`score` simply loops: there is nothing to share between rows.
    """

    name: str
    vocab: Vocabulary

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """A chat in the plain template (:func:`xcosd.models.chat.plain_chat`), as
        this model's ids: these models have no template of their own."""
        return self.tokenize(plain_chat(messages))

    def start(self, prompt_ids: Sequence[int]) -> Session:
        ids = [int(i) for i in prompt_ids]
        self._check_ids(ids)
        return Session(ids=ids, cached=len(ids))

    def _check_ids(self, ids: Sequence[int]) -> None:
        n = self.vocab.size
        for i in ids:
            if not 0 <= i < n:
                raise ModelError(f"{self.name}: token id {i} outside 0..{n - 1}")

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for session, new_ids in batch:
            new = [int(i) for i in new_ids]
            if new:
                self._check_ids(new)
            rows = np.empty((len(new) + 1, self.vocab.size), dtype=np.float32)
            ctx = session.ids
            base = len(ctx)
            ctx.extend(new)
            for k in range(len(new)):
                self._fill_row(_Prefix(ctx, base + k), rows[k])
            # the last row's context is the whole list: no view needed (a drafting
            # step scores exactly this one row)
            self._fill_row(ctx, rows[len(new)])
            session.cached = len(ctx)
            out.append(rows)
        return out

    def append(self, session: Session, ids: Sequence[int]) -> None:
        new = [int(i) for i in ids]
        self._check_ids(new)
        session.ids.extend(new)
        session.cached = len(session.ids)

    def rollback(self, session: Session, length: int) -> None:
        if length < 0:
            raise ValueError(f"rollback length must be >= 0, got {length}")
        del session.ids[length:]
        session.cached = min(session.cached, len(session.ids))

    def end(self, session: Session) -> None:
        session.ids = []
        session.cached = 0
        session.cache = None


class _Prefix(Sequence[int]):
    """A read-only view of the first ``n`` ids of a list, without copying it."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int) -> None:
        self._ids = ids
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            r = range(self._n)[i]
            if r.step == 1:
                return self._ids[r.start : r.stop]
            return [self._ids[j] for j in r]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._ids[i]
