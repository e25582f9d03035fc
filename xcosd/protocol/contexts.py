"""Contexts both ends of a connection hold, named by digest.

A chat app sends the whole conversation every turn. Sent whole, a turn costs the
uplink its history: the chat to render, then the rendered ids to open with. Both
ends already hold the previous turn, so a request can name it instead
(``base``, ``keep`` on :class:`~xcosd.protocol.messages.Render` and
:class:`~xcosd.protocol.messages.Open`) and send only what is new.

Two stores, one per kind of thing named:

* :class:`RenderStore`: earlier render requests (a text or a chat) with the ids
  they rendered to, by :func:`render_key`. A request repeats the first ``keep``
  messages (or characters) of one of them; the answer repeats the first ``keep``
  ids of that one's answer.
* :class:`ContextStore`: id contexts (a render's answer, an open's prompt) by
  :func:`ids_key`. An open's prompt is the first ``keep`` ids of one of them, then
  its own ids.

The cloud keeps one of each per connection; the edge keeps its own copy of what
it sent and received on the same connection, so each side computes the same
digests and neither sends one back. The edge's copy is a belief: the cloud may
have dropped an entry (its bounds, a restart: a new connection starts empty), and
then refuses the reference with ``no_context``, and the edge sends the request
whole. A digest is 64 bits of BLAKE2b over the content: an entry is named by what
it holds, so a stale or forged name finds nothing rather than something else.

Both stores are bounded in entries and in size, least recently used out first,
and all of one cloud's connections together by a :class:`Budget` of each kind: a
connection past the cloud's budget drops its own oldest entries, and holds nothing
new that would not fit were it to hold nothing else (its next turn is then sent
whole). Pure data: no
clocks, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: entries one connection's stores hold (each kind)
MAX_ENTRIES = 8
#: target ids one connection's context store holds, all entries together
MAX_CONTEXT_TOKENS = 1 << 17
#: characters (texts, chat contents) one connection's render store holds
MAX_RENDER_CHARS = 1 << 21
#: what all of one cloud's connections hold together, by default: ids, characters
BUDGET_IDS = 1 << 24
BUDGET_CHARS = 1 << 26

Chat = tuple[tuple[str, str], ...]


def _ids_bytes(ids: np.ndarray | Sequence[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def ids_key(ids: np.ndarray | Sequence[int]) -> str:
    """The digest that names an id context."""
    return hashlib.blake2b(_ids_bytes(ids), digest_size=8).hexdigest()


def render_key(text: str | None, chat: Chat | None) -> str:
    """The digest that names a render request (a text, or a chat's messages)."""
    h = hashlib.blake2b(digest_size=8)
    if chat is None:
        h.update(b"t\0" + (text or "").encode("utf-8", "surrogatepass"))
    else:
        h.update(b"c\0")
        for role, content in chat:
            body = content.encode("utf-8", "surrogatepass")
            h.update(role.encode() + b"\0" + len(body).to_bytes(8, "little") + body)
    return h.hexdigest()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def common_text(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (slices compared in C,
    halving: no Python loop over a long history)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Budget:
    """What many stores hold together (ids, or characters), against a limit."""

    limit: int
    used: int = 0

    @property
    def over(self) -> bool:
        return self.used > self.limit


class ContextStore:
    """Id contexts by :func:`ids_key`, least recently used first; ``budget``: the
    ids this store shares a limit with (a cloud's connections)."""

    def __init__(self, max_entries: int = MAX_ENTRIES,
                 max_tokens: int = MAX_CONTEXT_TOKENS, budget: Budget | None = None) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.budget = budget
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self.tokens = 0

    def _count(self, n: int) -> None:
        self.tokens += n
        if self.budget is not None:
            self.budget.used += n

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: np.ndarray | Sequence[int]) -> str | None:
        """Hold ``ids``; its key, or ``None`` when it is empty or alone over the bound."""
        a = np.asarray(ids, dtype=np.int32)
        if a.shape[0] == 0 or a.shape[0] > self.max_tokens:
            return None
        key = ids_key(a)
        if key in self._entries:
            self._entries.move_to_end(key)
            return key
        if self.budget is not None and self.budget.used - self.tokens + a.shape[0] > \
                self.budget.limit:
            return None  # would not fit if it held nothing else: keep what it holds
        self._entries[key] = a
        self._count(a.shape[0])
        while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or self.tokens > self.max_tokens
                or (self.budget is not None and self.budget.over)):
            _, old = self._entries.popitem(last=False)
            self._count(-old.shape[0])
        return key

    def get(self, key: str) -> np.ndarray | None:
        a = self._entries.get(key)
        if a is not None:
            self._entries.move_to_end(key)
        return a

    def drop(self, key: str) -> None:
        a = self._entries.pop(key, None)
        if a is not None:
            self._count(-a.shape[0])

    def clear(self) -> None:
        self._entries.clear()
        self._count(-self.tokens)

    def longest(self, ids: np.ndarray | Sequence[int]) -> tuple[str, int] | None:
        """The entry sharing the longest prefix with ``ids``, and that length; ``None``
        when none shares one."""
        a = np.asarray(ids, dtype=np.int32)
        best: tuple[str, int] | None = None
        for key, held in self._entries.items():
            n = common_prefix(held, a)
            if n and (best is None or n > best[1]):
                best = (key, n)
        return best


@dataclass(frozen=True)
class Rendering:
    """One render request and the ids it rendered to."""

    text: str | None
    chat: Chat | None
    ids: np.ndarray

    @property
    def chars(self) -> int:
        if self.chat is None:
            return len(self.text or "")
        return sum(len(c) for _, c in self.chat)


class RenderStore:
    """Render requests with their answers by :func:`render_key`, least recently
    used first."""

    def __init__(self, max_entries: int = MAX_ENTRIES,
                 max_chars: int = MAX_RENDER_CHARS, budget: Budget | None = None) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.budget = budget
        self._entries: OrderedDict[str, Rendering] = OrderedDict()
        self.chars = 0

    def _count(self, n: int) -> None:
        self.chars += n
        if self.budget is not None:
            self.budget.used += n

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, text: str | None, chat: Chat | None, ids: np.ndarray | Sequence[int]
            ) -> str | None:
        r = Rendering(text, chat, np.asarray(ids, dtype=np.int32))
        if r.chars > self.max_chars:
            return None
        key = render_key(text, chat)
        self.drop(key)
        if self.budget is not None and self.budget.used - self.chars + r.chars > \
                self.budget.limit:
            return None  # would not fit if it held nothing else: keep what it holds
        self._entries[key] = r
        self._count(r.chars)
        while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or self.chars > self.max_chars
                or (self.budget is not None and self.budget.over)):
            _, gone = self._entries.popitem(last=False)
            self._count(-gone.chars)
        return key

    def get(self, key: str) -> Rendering | None:
        r = self._entries.get(key)
        if r is not None:
            self._entries.move_to_end(key)
        return r

    def drop(self, key: str) -> None:
        r = self._entries.pop(key, None)
        if r is not None:
            self._count(-r.chars)

    def clear(self) -> None:
        self._entries.clear()
        self._count(-self.chars)

    def longest(self, text: str | None, chat: Chat | None) -> tuple[str, int] | None:
        """The entry of the same kind that the request repeats the most of, and how
        much (messages of a chat, characters of a text); ``None``: none."""
        best: tuple[str, int] | None = None
        for key, r in self._entries.items():
            if (r.chat is None) != (chat is None):
                continue
            if chat is not None:
                assert r.chat is not None
                n = next((i for i, (mine, theirs) in enumerate(zip(chat, r.chat, strict=False))
                          if mine != theirs), min(len(chat), len(r.chat)))
            else:
                n = common_text(text or "", r.text or "")
            if n and (best is None or n > best[1]):
                best = (key, n)
        return best

    @staticmethod
    def expand(base: Rendering, keep: int, text: str | None, chat: Chat | None
               ) -> tuple[str | None, Chat | None]:
        """The whole request a by-reference one stands for; ``ValueError`` when it does
        not fit its base (another kind, ``keep`` past its end)."""
        if (base.chat is None) != (chat is None):
            raise ValueError("a render request continues one of its own kind (text or chat)")
        if chat is not None:
            assert base.chat is not None
            if not 0 < keep <= len(base.chat):
                raise ValueError(f"keep {keep} outside the base's 1..{len(base.chat)} messages")
            return None, base.chat[:keep] + chat
        held = base.text or ""
        if not 0 < keep <= len(held):
            raise ValueError(f"keep {keep} outside the base's 1..{len(held)} characters")
        return held[:keep] + (text or ""), None
