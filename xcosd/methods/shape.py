"""The shape of a round's drafted block: where each node hangs (:class:`TreeShape`).

A chain is the shape whose node ``i`` hangs from node ``i - 1``
(:meth:`TreeShape.chain`), so every round block has one: a plain
:class:`~xcosd.methods.base.Draft`'s is its chain, a
:class:`~xcosd.methods.tree.DraftTree`'s is sent with it. It lives apart from
:mod:`xcosd.methods.tree` so that :mod:`xcosd.methods.base` (below the trees) can
name it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

#: the most nodes one tree may hold (a parent index fits a u16)
MAX_NODES = 1024


@dataclass(frozen=True)
class TreeShape:
    """Where each node of a draft tree hangs: ``parents[i]`` is node ``i``'s parent
    (``-1``: the round's context), every parent before its children. Siblings are
    tested in index order.

    Any shape keeps the law (the shape is fixed before anything is drawn); which
    one pays is the drafting policy's question."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.parents) > MAX_NODES:
            raise ValueError(f"a draft tree holds at most {MAX_NODES} nodes, got "
                             f"{len(self.parents)}")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be -1 or an earlier node")

    @classmethod
    def chain(cls, d: int) -> TreeShape:
        """``d`` drafts in a row: the chain every round drafted before trees (made
        once per length: a chain round's rejection reads its shape)."""
        return _chain(d) if cls is TreeShape else cls(tuple(range(-1, d - 1)))

    @classmethod
    def full(cls, widths: Sequence[int]) -> TreeShape:
        """Every node at depth ``t`` (the context is depth 0) has ``widths[t]``
        children: ``(4,)`` is four one-token candidates, ``(1,)*d`` a chain."""
        parents: list[int] = []
        level = [-1]
        for w in widths:
            if w < 1:
                raise ValueError(f"a tree's widths must be positive, got {tuple(widths)}")
            nxt: list[int] = []
            for node in level:
                for _ in range(int(w)):
                    parents.append(node)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def spine(cls, widths: Sequence[int]) -> TreeShape:
        """Ragged: ``widths[t]`` children at depth ``t``, of which only the first
        (the one tested first) has children of its own (SpecInfer's and Sequoia's
        trees lean the same way: the first child is the likeliest to be kept)."""
        parents: list[int] = []
        node = -1
        for w in widths:
            if w < 1:
                raise ValueError(f"a tree's widths must be positive, got {tuple(widths)}")
            first = len(parents)
            parents.extend([node] * int(w))
            node = first
        return cls(tuple(parents))

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """``"chain:4"``, ``"3x2x1"`` (:meth:`full`) or ``"spine:3x2x2"``
        (:meth:`spine`), as the CLI and the benches spell shapes."""
        t = text.strip()
        if m := re.fullmatch(r"chain:(\d+)", t):
            return cls.chain(int(m[1]))
        kind, _, widths = t.rpartition(":")
        if kind not in ("", "spine") or not re.fullmatch(r"\d+(x\d+)*", widths):
            raise ValueError(f"a tree shape is chain:D, W1xW2x... or spine:W1xW2x..., "
                             f"got {text!r}")
        ws = [int(w) for w in widths.split("x")]
        return cls.spine(ws) if kind == "spine" else cls.full(ws)

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[node + 1]``: the children of ``node`` (``-1``: the context's)."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return tuple(tuple(c) for c in out)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth (a child of the context is at depth 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def levels(self) -> list[list[int]]:
        """The nodes with children, one list per depth (``-1`` at depth 0): what a
        drafter scores in one batch before it draws the next depth."""
        out: list[list[int]] = [[] for _ in range(self.depth)]
        for node in (-1, *range(self.size)):
            if self.children[node + 1]:
                out[0 if node < 0 else self.depths[node]].append(node)
        return out

    @property
    def is_chain(self) -> bool:
        """No node with two or more children: a chain (or nothing)."""
        return all(len(c) <= 1 for c in self.children)

    def pruned(self, max_depth: int, max_nodes: int) -> TreeShape:
        """The nodes at depth ``max_depth`` or less, then the first ``max_nodes`` of
        them in index order (parents come before children, so what is kept is a
        tree): a shape fitted to what a generation has left and a cloud verifies."""
        keep: dict[int, int] = {-1: -1}
        parents: list[int] = []
        for i, p in enumerate(self.parents):
            if len(parents) >= max_nodes:
                break
            if self.depths[i] <= max_depth and p in keep:
                keep[i] = len(parents)
                parents.append(keep[p])
        return TreeShape(tuple(parents))

    def path(self, node: int) -> list[int]:
        """The nodes from the context's child down to ``node``."""
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    @cached_property
    def label(self) -> str:
        """The shape as :meth:`parse` reads it (``tree:N`` for a shape of no family)."""
        if self.parents == TreeShape.chain(self.size).parents:
            return f"chain:{self.size}"
        widths = [len(self.children[lv[0] + 1]) for lv in self.levels()]
        full_size = sum(int(np.prod(widths[: k + 1])) for k in range(len(widths)))
        if full_size == self.size and self.parents == TreeShape.full(widths).parents:
            return "x".join(map(str, widths))
        if self.parents == TreeShape.spine(widths).parents:
            return "spine:" + "x".join(map(str, widths))
        return f"tree:{self.size}"


__all__ = ["MAX_NODES", "TreeShape"]


@functools.lru_cache(maxsize=256)
def _chain(d: int) -> TreeShape:
    return TreeShape(tuple(range(-1, d - 1)))
