"""What the tree verdicts of a run did, counted on the edge as it takes them.

A law test passes vacuously when the path it means to test never ran: a tree whose
every walk stops at its first child checks nothing of the residual a rejected
sibling leaves. :func:`watching` makes an :class:`~xcosd.protocol.EdgeSession` class
that counts every tree verdict the edge accepts (after the wire, and after the stale
ones are dropped) into a :class:`Walks`, so each test can assert that a later
sibling was accepted after rejected ones and that every child of a node with several
was rejected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from xcosd.methods.tree import TreeShape
from xcosd.protocol import EdgeSession, RoundVerified, VerdictMsg
from xcosd.protocol.edge import EdgeOutput


@dataclass
class Walks:
    """Tree verdicts taken by the edge, and the cloud's verified rounds."""

    #: tree verdicts the edge took
    trees: int = 0
    #: walks whose path went through a child tested after a rejected sibling
    later_sibling: int = 0
    #: walks that stopped at a node with several children, every one rejected
    branch_rejected: int = 0
    #: walks that reached a leaf (a bonus token)
    full_path: int = 0
    #: drafted tokens (tree nodes, or a chain's drafts) of the cloud's verified rounds
    drafted: int = 0
    #: the most drafted in one verified round
    most: int = 0
    #: the cloud's RoundVerified shapes (``None``: a chain round)
    shapes: Counter[str | None] = field(default_factory=Counter)

    def see(self, shape: TreeShape, n: int) -> None:
        """A verdict naming node ``n - 1`` (``0``: the context) of ``shape``."""
        self.trees += 1
        path = shape.path(n - 1)
        firsts = {shape.children[shape.parents[k] + 1][0] for k in path}
        self.later_sibling += any(k not in firsts for k in path)
        kids = shape.children[n]
        self.full_path += not kids
        self.branch_rejected += len(kids) >= 2

    def verified(self, events: Iterable[object]) -> None:
        """Count the cloud's :class:`RoundVerified` events of one generation."""
        rounds = [ev for ev in events if isinstance(ev, RoundVerified)]
        self.shapes.update(ev.shape for ev in rounds)
        self.drafted += sum(ev.drafted for ev in rounds)
        self.most = max([self.most, *(ev.drafted for ev in rounds)])

    @property
    def tree_rounds(self) -> int:
        """Rounds the cloud verified as trees."""
        return sum(n for s, n in self.shapes.items() if s is not None)

    def exercised(self, greedy: bool = False) -> bool:
        """Tree rounds ran and their walks took the residual path: every child of a
        branching node rejected, and (where the warpers leave siblings that can
        differ: not greedy) a later sibling accepted after rejected ones."""
        return (self.tree_rounds > 0 and self.trees > 0 and self.branch_rejected > 0
                and (greedy or self.later_sibling > 0))


def watching(walks: Walks, base: type[EdgeSession] = EdgeSession) -> type[EdgeSession]:
    """``base`` counting each tree verdict it takes into ``walks``."""

    class Watched(base):  # type: ignore[valid-type,misc]
        def _verdict(self, msg: VerdictMsg) -> EdgeOutput:
            block = self._draft
            if block is not None and not block.stays_in_context:  # a tree's verdict
                walks.see(block.shape, msg.accepted)
            return super()._verdict(msg)

    return Watched


__all__ = ["Walks", "watching"]
