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
policy's own figure, ``xcosd/policies/draft_length.py``). A round costs a fixed part
(the round trip and the cloud's call) plus ``step_cost`` per depth (a chain's draft
step: a model that batches a depth's rows drafts it in one step), ``node_cost`` per
node beyond the one a depth a chain has, and ``row_cost`` per branching node (its
committed row on the uplink): :class:`TreeCosts`, measured (:meth:`TreeCosts.measured`:
the node's uplink bytes at the link's rate and the draft's and the cloud's compute
per node) or, with nothing measured, a node costing what a draft step does (about
what the embedded n-gram draft pays, more than a draft that batches a depth's rows
pays; with siblings free the pick would always be as wide as allowed, and later
siblings, accepted a fraction as often as a chain's drafts, rarely pay for that). So a
chain costs exactly what the chain policy charges it, and where later siblings do not
pay the pick is the chain policy's length, ``ar`` included. :func:`best_shape` picks
the candidate maximising ``expected_tokens / cost`` (the smallest on a tie). Only a
tree's walks measure the later ranks, so :meth:`RankRates.pick`, what a session asks,
drafts a chain pick's probe (:func:`probe_shape`) one round in :data:`PROBE_EVERY`
while no walk tests them. Any rule of this kind keeps the law exact: the shape is
fixed from past verdicts and round counts before anything of the round is drawn
(``docs/METHODS.md``, "Draft trees"). Pure: the caller hands it what it measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ..methods.tree import TreeShape
from .draft_length import PRIOR_RATE
from .draft_length import STEP as CHAIN_STEP

#: ranks estimated (a later sibling uses the last rank's estimate)
RANKS = 8
#: each observation's weight in a rank's estimate: the chain policy's, so that where
#: the pick is a chain its length follows the acceptance as the chain policy's does
STEP = CHAIN_STEP
#: the most nodes of a tree a cloud verifies by default (``ServerLimits.max_tree``):
#: the policy's candidates have at most 32, and a tree's rows and nodes fit a frame
DEFAULT_MAX_TREE = 64
#: the estimates before any verdict: a chain's acceptance, then much less for later
#: siblings (a tree has to earn its width)
PRIOR = (PRIOR_RATE, 0.1)
#: a tree node's own uplink bytes: its target id (i32), ``q(x)`` (f32), its parent (i16)
NODE_BYTES = 10
#: where the pick is a chain that drafts, one round in this many drafts its probe
#: (:func:`probe_shape`) unless a walk tested a later rank meanwhile: only a tree's
#: walks measure the later ranks, and from the prior alone a tree that would pay is
#: never tried (the chain policy probes a length of 0 the same way)
PROBE_EVERY = 16


def candidate_shapes(max_nodes: int = 32) -> list[TreeShape]:
    """The shapes :func:`best_shape` chooses among: chains of 0..16 (0: ``ar``), one
    level of 2..8 candidates, spines, and full trees of two and three levels, each of
    at most ``max_nodes`` nodes."""
    return list(_candidates(max_nodes))


@lru_cache(maxsize=8)
def _candidates(max_nodes: int) -> tuple[TreeShape, ...]:
    """:func:`candidate_shapes`, built once: a session asks every round, and the
    shapes' children and depths are computed once with them."""
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
    return tuple(keep)


def probe_shape(chain: TreeShape) -> TreeShape:
    """A chain with a second child at each of its nodes (``spine:2x...x2``, as deep):
    a walk that stops short of the end tests rank 2 where it stops, and commits at
    least what the chain would have; ``depth`` more nodes and rows."""
    return TreeShape.spine((2,) * chain.depth) if chain.depth else chain


def policy_shapes(max_nodes: int = DEFAULT_MAX_TREE) -> list[TreeShape]:
    """Every shape :meth:`RankRates.pick` may return: the candidates and the probes of
    their chains (a metric names these)."""
    out = candidate_shapes(max_nodes)
    seen = {s.parents for s in out}
    for probe in (probe_shape(s) for s in list(out) if s.is_chain and s.depth):
        if probe.size <= max_nodes and probe.parents not in seen:
            seen.add(probe.parents)
            out.append(probe)
    return out


def expected_tokens(shape: TreeShape, rates: Sequence[float]) -> float:
    """Expected tokens a round of ``shape`` emits when the ``i``-th child tested at
    any node is accepted with probability ``rates[i]`` (the last rate for later
    ranks) given that the earlier ones were rejected."""
    b = [float(x) for x in rates]
    last = len(b) - 1
    kids = shape.children
    # A(node) from the leaves up: a parent comes before its children
    a = [0.0] * len(kids)  # a[node + 1]
    for v in range(len(kids) - 1, -1, -1):
        total, left = 0.0, 1.0
        for i, c in enumerate(kids[v]):
            bi = b[i if i < last else last]
            total += left * bi * (1.0 + a[c + 1])
            left *= 1.0 - bi
        a[v] = total
    return 1.0 + a[0]


def branching(shape: TreeShape) -> int:
    """The nodes (the context included) with two children or more: those whose
    committed row crosses the uplink."""
    return sum(1 for kids in shape.children if len(kids) >= 2)


@dataclass(frozen=True)
class TreeCosts:
    """What a tree costs beyond a chain of its depth, in units of a round's fixed part
    (the round trip plus the cloud's call): ``node`` for each node beyond the one a
    depth, ``row`` for each branching node's committed row."""

    node: float = 0.0
    row: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.node < 1e6 and 0.0 <= self.row < 1e6):
            raise ValueError(f"tree costs must be >= 0, got {self.node}, {self.row}")

    @classmethod
    def measured(cls, *, fixed_s: float, draft_node_s: float = 0.0,
                 cloud_node_s: float = 0.0, node_bytes: float = NODE_BYTES,
                 row_bytes: float = 0.0, up_bps: float = 100e6) -> TreeCosts:
        """From what a node costs in seconds: the draft's and the cloud's compute for
        one more node, and its bytes (``node_bytes`` each node, ``row_bytes`` each
        branching node's row) at ``up_bps``; over ``fixed_s``, the round's fixed
        seconds."""
        if fixed_s <= 0:
            raise ValueError(f"a round's fixed part must be > 0 s, got {fixed_s}")
        node = max(0.0, draft_node_s) + max(0.0, cloud_node_s) + 8.0 * node_bytes / up_bps
        return cls(node / fixed_s, 8.0 * max(0.0, row_bytes) / up_bps / fixed_s)

    @classmethod
    def default(cls, step_cost: float) -> TreeCosts:
        """With nothing measured: a node costs a draft step (see the module
        docstring), a row nothing beside it."""
        return cls(max(0.0, float(step_cost)), 0.0)


def round_cost(shape: TreeShape, step_cost: float, node_cost: float = 0.0,
               row_cost: float = 0.0) -> float:
    """A round's cost in units of its fixed part: 1 + a step per depth + a share per
    node beyond one a depth + a share per branching node's row (a chain's cost is
    the chain policy's, ``1 + k * step_cost``)."""
    return (1.0 + step_cost * shape.depth + node_cost * (shape.size - shape.depth)
            + row_cost * branching(shape))


def best_shape(rates: Sequence[float], step_cost: float, node_cost: float = 0.0,
               candidates: Iterable[TreeShape] | None = None, row_cost: float = 0.0
               ) -> TreeShape:
    """The candidate maximising ``expected_tokens / round_cost`` (the first, i.e. the
    smaller, on a tie; chains come first among the candidates)."""
    best: TreeShape | None = None
    best_v = -1.0
    for s in candidate_shapes() if candidates is None else candidates:
        v = expected_tokens(s, rates) / round_cost(s, step_cost, node_cost, row_cost)
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
    #: what a tree costs beyond a chain, where measured; ``None``: :meth:`TreeCosts.default`
    costs: TreeCosts | None = None
    #: chain picks since a walk last tested a later rank (a probe is due at
    #: :data:`PROBE_EVERY`)
    unprobed: int = 0

    def observe(self, ranks: Iterable[tuple[int, bool]]) -> None:
        for i, ok in ranks:
            k = min(int(i), RANKS - 1)
            self.rates[k] += STEP * ((1.0 if ok else 0.0) - self.rates[k])
            if k:
                self.unprobed = 0

    def adopt(self, other: RankRates) -> None:
        """Start from what ``other`` (an earlier generation's policy) learned: its
        estimates and the chain picks since its last probe (generations shorter
        than the interval still probe). The caller adopts only where costs are
        measured, so a seeded generation's shapes stay its own."""
        self.rates = list(other.rates)
        self.unprobed = other.unprobed
        if self.costs is None:
            self.costs = other.costs

    def pick(self, step_cost: float) -> TreeShape:
        """A round's shape: :meth:`best`, or where that is a chain that drafts and no
        walk tested a later rank for :data:`PROBE_EVERY` of them, its probe
        (:func:`probe_shape`). A function of past verdicts and round counts, fixed
        before anything of the round is drawn, as any shape rule must be."""
        shape = self.best(step_cost)
        if not shape.is_chain or shape.depth == 0:
            return shape
        self.unprobed += 1
        if self.unprobed < PROBE_EVERY:
            return shape
        self.unprobed = 0
        return probe_shape(shape)

    def best(self, step_cost: float, node_cost: float | None = None,
             row_cost: float | None = None) -> TreeShape:
        """:func:`best_shape` at these estimates: the costs given, else :attr:`costs`,
        else a node costing a draft step."""
        costs = self.costs or TreeCosts.default(step_cost)
        return best_shape(self.rates, step_cost,
                          costs.node if node_cost is None else node_cost,
                          row_cost=costs.row if row_cost is None else row_cost)


__all__ = ["DEFAULT_MAX_TREE", "NODE_BYTES", "PROBE_EVERY", "RANKS", "RankRates", "TreeCosts",
           "best_shape", "branching", "candidate_shapes", "expected_tokens", "policy_shapes",
           "probe_shape", "round_cost", "walk_ranks"]
