"""Prefix reuse: which cached context a new session starts from, and which cached
context gives way when room is needed.

A chat's next turn repeats its history, and many devices of one app share a
system prompt. A model that keeps the caches of recent sessions (an ended one
stays, *retired*, until its room is needed) starts a new session from the longest
cached prefix of its context, as llama.cpp's server does with a slot's prompt and
vLLM with its prefix blocks, and computes only the rest. The reused positions are
the positions a fresh prefill computes (on llama.cpp bit for bit, its rows being
batch-invariant; on transformers to float rounding, see docs/MODELS.md), so the
output law is the target's either way.

Room is bounded (llama.cpp: its sequences; transformers: cached positions), and
shared fairly: when a cache must give way, a retired one goes before a live one,
and among retired ones, the least recently used of the *tenant* (a cloud's peer)
that holds the most. One device's flood of distinct long prompts then evicts its
own retired caches, not another device's conversation.

Both backends call these functions: the policy is written once, the cache
mechanics are each backend's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..protocol.contexts import common_prefix

#: shared ids from which copying another session's cache beats computing them (a
#: copy of llama.cpp's per-sequence buffer costs about what a few dozen prompt
#: tokens do; a tenant's own retired cache is taken over, not copied)
MIN_COPY = 32

E = TypeVar("E")


@dataclass(eq=False)
class Cached:
    """What both backends record of a session's cache: ``length`` positions of
    ``prefix + ids`` (a live session's ``ids``, the same list as ``Session.ids``),
    or, once the session ended and its cache is kept (retired), ``tokens``; and
    whose it is (``tenant``, a cloud's peer) for the fair share of the room."""

    prefix: list[int]
    length: int = 0
    ids: list[int] | None = field(default=None, repr=False)
    tenant: str = ""
    tokens: np.ndarray | None = field(default=None, repr=False)

    def cells(self) -> np.ndarray:
        """The tokens its cache holds, position by position."""
        if self.tokens is not None:
            return self.tokens
        return np.asarray((self.prefix + (self.ids or []))[: self.length], dtype=np.int64)


def best_donor(context: Sequence[int] | np.ndarray, entries: Iterable[E],
               tokens: Callable[[E], np.ndarray], retired: Callable[[E], bool],
               tenant: Callable[[E], str], mine: str) -> tuple[E, int, bool] | None:
    """Where a session of tenant ``mine`` whose context is ``context`` starts from:
    ``(entry, shared positions, take it over)``, the longest prefix among the
    entries worth it (:func:`worth_reusing`; taking over on a tie), or ``None``. At
    most ``len(context) - 1`` counts: the last position is fed again for its row,
    so sharing all of it gains no more."""
    a = np.asarray(context, dtype=np.int64)
    cap = max(a.shape[0] - 1, 0)
    best: tuple[E, int, bool] | None = None
    for e in entries:
        held = tokens(e)
        n = min(common_prefix(held, a), cap)
        how = worth_reusing(n, held.shape[0], retired(e) and tenant(e) == mine)
        if how is None:
            continue
        if best is None or n > best[1] or (n == best[1] and how and not best[2]):
            best = (e, n, how)
    return best


def worth_reusing(n: int, held: int, own_retired: bool) -> bool | None:
    """How a cache holding ``held`` positions, ``n`` of them shared, is worth
    starting from: taken over (``True``: a retired cache of the same tenant that
    the new session shares at least half of, or :data:`MIN_COPY`: a chat's next
    turn, not an unrelated prompt that shares its first token and would throw a
    long cache away), copied (``False``: at least :data:`MIN_COPY` shared, from any
    cache, so another tenant's stays theirs), or not at all (``None``)."""
    if n <= 0:
        return None
    if own_retired and (2 * n >= held or n >= MIN_COPY):
        return True
    return False if n >= MIN_COPY else None


def victim(evictable: Sequence[E], tenant: Callable[[E], str], retired: Callable[[E], bool],
           held: dict[str, int]) -> E | None:
    """Which of ``evictable`` (least recently used first) gives way: a retired one
    before a live one; among retired ones, the least recently used of the tenant
    holding the most caches (``held``: caches per tenant, live and retired)."""
    old = [e for e in evictable if retired(e)]
    if not old:
        return evictable[0] if evictable else None
    heaviest = max({tenant(e) for e in old}, key=lambda t: held.get(t, 0))
    top = held.get(heaviest, 0)
    # ties between tenants: the least recently used entry among theirs
    return next(e for e in old if held.get(tenant(e), 0) == top)
