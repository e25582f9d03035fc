"""Scoring a draft tree: the target's rows after the context and after every node's
path, from one call wherever the model allows.

A tree round needs ``n + 1`` rows for an ``n``-node tree (``xcosd/methods/tree.py``):
row 0 after the session's context, row ``i + 1`` after the path from the context to
node ``i``. A model with a tree scorer of its own (``score_tree``: one forward over
every node with a tree attention mask) is asked for them at once; any other
:class:`~xcosd.models.base.LanguageModel` scores each leaf's path with its ordinary
``score`` and cuts the context back after each, so every model can verify a tree and
only a model that can do better needs to say how.

Either way the session's context is left as it was: the caller appends the accepted
path once the walk has chosen it, so nothing of a rejected branch stays in a cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .base import LanguageModel, Session


@runtime_checkable
class TreeScorer(Protocol):
    """A model that scores a whole tree in one call (see the module docstring)."""

    def score_tree(self, session: Session, parents: Sequence[int],
                   ids: Sequence[int]) -> np.ndarray: ...


def leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """The node indices from the context to each leaf, leaves in index order."""
    has_child = [False] * len(parents)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    out: list[list[int]] = []
    for leaf in (i for i in range(len(parents)) if not has_child[i]):
        path = []
        node = leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        out.append(path[::-1])
    return out


def score_tree(model: LanguageModel, session: Session, parents: Sequence[int],
               ids: Sequence[int]) -> np.ndarray:
    """``(n + 1, vocab.size)`` float32 rows for the tree ``parents`` / ``ids`` (this
    model's token ids) after ``session``'s context, which is left unchanged."""
    if len(parents) != len(ids):
        raise ValueError(f"a tree of {len(parents)} nodes given {len(ids)} ids")
    if isinstance(model, TreeScorer):
        return model.score_tree(session, parents, ids)
    return score_tree_by_paths(model, session, parents, ids)


def rows_after(model: LanguageModel, session: Session, parents: Sequence[int],
               ids: Sequence[Sequence[int]], nodes: Sequence[int]) -> list[np.ndarray]:
    """The rows after each of ``nodes`` (``-1``: the context) in one :func:`score_tree`
    call: what a drafter needs before drawing a depth's children. ``ids[v]``: node
    ``v``'s spelling in this model's ids (a cross-vocabulary token may take several,
    or none); only the ``nodes`` and their ancestors are scored, each spelling's
    tokens a chain of their own, so a model with a tree scorer drafts a whole depth
    in one forward."""
    keep: set[int] = set()
    for v in nodes:
        while v >= 0 and v not in keep:
            keep.add(v)
            v = parents[v]
    sub_parents: list[int] = []
    sub_ids: list[int] = []
    last: dict[int, int] = {-1: -1}  # node -> index of the last token of its spelling
    for v in sorted(keep):
        at = last[parents[v]]
        for t in ids[v]:
            sub_parents.append(at)
            sub_ids.append(int(t))
            at = len(sub_ids) - 1
        last[v] = at
    rows = score_tree(model, session, sub_parents, sub_ids)
    return [rows[last[v] + 1] for v in nodes]


def score_tree_by_paths(model: LanguageModel, session: Session, parents: Sequence[int],
                        ids: Sequence[int]) -> np.ndarray:
    """:func:`score_tree` by the model's ordinary ``score``, one leaf's path a call
    (what a model without a tree scorer of its own gets)."""
    if len(parents) != len(ids):
        raise ValueError(f"a tree of {len(parents)} nodes given {len(ids)} ids")
    base = len(session.ids)
    out = np.empty((len(parents) + 1, model.vocab.size), dtype=np.float32)
    paths = leaf_paths(parents)
    if not paths:
        out[0] = model.score([(session, [])])[0][-1]
        return out
    for path in paths:
        rows = model.score([(session, [int(ids[n]) for n in path])])[0]
        out[0] = rows[0]
        for k, node in enumerate(path):
            out[node + 1] = rows[k + 1]
        model.rollback(session, base)
    return out


__all__ = ["TreeScorer", "leaf_paths", "rows_after", "score_tree", "score_tree_by_paths"]
