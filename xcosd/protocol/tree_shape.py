"""Which draft tree a round should draft: the shape that maximises expected tokens
per unit of cost at the acceptance measured so far, a chain (or nothing, ``ar``)
where a tree does not pay.

What a tree buys depends on how often a *later* sibling is accepted once the earlier
ones were rejected, not only on a draft's acceptance: a draft sure of one token
proposes it first, and with siblings drawn without replacement the next ones are its
less likely tokens, which the target's residual may or may not want. So the estimate
is per rank: ``b[i]`` is the probability that the ``i``-th child tested at a node is
accepted given that the ones before it were rejected (``b[0]`` is a chain's
acceptance). :class:`RankRates` keeps moving averages of them from the walks the
verdicts report (:func:`walk_ranks`).

Under the model that these probabilities hold at every node, the expected number of
tokens a round emits is ``1 + A(root)`` with ``A(v) = sum_i P(child i of v is the one
accepted) * (1 + A(child i))`` and ``P(child i is the one) = b[i] * prod_{j<i} (1 - b[j])``
(:func:`expected_tokens`; a chain of ``k`` gives ``1 + a + ... + a^k``, the chain
policy's own figure, ``xcosd/protocol/draft_length.py``). A round costs a fixed part
(the round trip and the cloud's call) plus ``step_cost`` per depth (a model that
batches a depth's rows drafts it in one step) plus ``node_cost`` per node (its share
of the draft's and the cloud's work and of the uplink); :func:`best_shape` picks the
candidate maximising ``expected_tokens / cost`` (the smallest on a tie). Any rule of
this kind keeps the law exact: the shape is fixed from past verdicts before anything
of the round is drawn (``docs/METHODS.md``, "Draft trees"). Pure: the caller hands it
what it measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..methods.tree import TreeShape

#: ranks estimated (a later sibling uses the last rank's estimate)
RANKS = 8
#: each observation's weight in a rank's estimate
STEP = 0.1
#: the most nodes of a tree a cloud verifies by default (``ServerLimits.max_tree``):
#: the policy's candidates have at most 32, and a tree's rows and nodes fit a frame
DEFAULT_MAX_TREE = 64
#: the estimates before any verdict: a chain's acceptance, then much less for later
#: siblings (a tree has to earn its width)
PRIOR = (0.5, 0.1)


def candidate_shapes(max_nodes: int = 32) -> list[TreeShape]:
    """The shapes :func:`best_shape` chooses among: chains of 0..16 (0: ``ar``), one
    level of 2..8 candidates, spines, and full trees of two and three levels, each of
    at most ``max_nodes`` nodes."""
    out = [TreeShape.chain(k) for k in range(17)]
    for w in (2, 3, 4, 6, 8):
        out.append(TreeShape.full((w,)))
        for tail in ((1,), (1, 1), (1, 1, 1), (2,), (2, 1), (2, 2), (3, 1)):
            out.append(TreeShape.full((w, *tail)))
            out.append(TreeShape.spine((w, *tail)))
        for d in (2, 3, 4, 6):
            out.append(TreeShape.spine((w,) * d))
    seen: set[tuple[int, ...]] = set()
    keep = []
    for s in out:
        if s.size <= max_nodes and s.parents not in seen:
            seen.add(s.parents)
            keep.append(s)
    return keep


def expected_tokens(shape: TreeShape, rates: Sequence[float]) -> float:
    """Expected tokens a round of ``shape`` emits when the ``i``-th child tested at
    any node is accepted with probability ``rates[i]`` (the last rate for later
    ranks) given that the earlier ones were rejected."""

    def rate(i: int) -> float:
        return float(rates[min(i, len(rates) - 1)])

    def accepted(node: int) -> float:
        total, left = 0.0, 1.0
        for i, c in enumerate(shape.children[node + 1]):
            b = rate(i)
            total += left * b * (1.0 + accepted(c))
            left *= 1.0 - b
        return total

    return 1.0 + accepted(-1)


def round_cost(shape: TreeShape, step_cost: float, node_cost: float) -> float:
    """A round's cost in units of its fixed part: 1 + a step per depth + a share per
    node."""
    return 1.0 + step_cost * shape.depth + node_cost * shape.size


def best_shape(rates: Sequence[float], step_cost: float, node_cost: float = 0.0,
               candidates: Iterable[TreeShape] | None = None) -> TreeShape:
    """The candidate maximising ``expected_tokens / round_cost`` (the first, i.e. the
    smaller, on a tie; chains come first among the candidates)."""
    best: TreeShape | None = None
    best_v = -1.0
    for s in candidate_shapes() if candidates is None else candidates:
        v = expected_tokens(s, rates) / round_cost(s, step_cost, node_cost)
        if v > best_v + 1e-12:
            best, best_v = s, v
    assert best is not None
    return best


def walk_ranks(shape: TreeShape, path: Sequence[int]) -> list[tuple[int, bool]]:
    """What one verdict says about the ranks: ``(rank, accepted)`` for every child
    the walk tested (the ones before an accepted child were rejected; at the node
    where the walk stopped without reaching a leaf, every child was)."""
    out: list[tuple[int, bool]] = []
    node = -1
    for c in path:
        kids = shape.children[node + 1]
        i = kids.index(c)
        out.extend((j, False) for j in range(i))
        out.append((i, True))
        node = c
    kids = shape.children[node + 1]
    out.extend((j, False) for j in range(len(kids)))
    return out


@dataclass
class RankRates:
    """Moving estimates of the per-rank acceptance (see the module docstring)."""

    rates: list[float] = field(default_factory=lambda: [PRIOR[0]] + [PRIOR[1]] * (RANKS - 1))

    def observe(self, ranks: Iterable[tuple[int, bool]]) -> None:
        for i, ok in ranks:
            k = min(int(i), RANKS - 1)
            self.rates[k] += STEP * ((1.0 if ok else 0.0) - self.rates[k])

    def best(self, step_cost: float, node_cost: float = 0.0) -> TreeShape:
        return best_shape(self.rates, step_cost, node_cost)


__all__ = ["DEFAULT_MAX_TREE", "RANKS", "RankRates", "best_shape", "candidate_shapes", "expected_tokens",
           "round_cost", "walk_ranks"]
