"""The draft-tree policy (``xcosd/protocol/tree_shape.py``): its expected tokens per
round against closed forms and a simulation of its own model, its choice against the
chain policy's where later siblings never win, and the ranks a verdict reports."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.methods.tree import TreeShape
from xcosd.protocol.draft_length import best_length
from xcosd.protocol.tree_shape import (
    RankRates,
    best_shape,
    candidate_shapes,
    expected_tokens,
    walk_ranks,
)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 1.0])
def test_expected_tokens_closed_forms(a: float) -> None:
    for k in range(6):
        assert expected_tokens(TreeShape.chain(k), [a]) == pytest.approx(
            sum(a ** i for i in range(k + 1)))
    b = [a, 0.5, 0.2]
    for w in (1, 2, 3, 5):
        miss = np.prod([1 - b[min(i, 2)] for i in range(w)])
        assert expected_tokens(TreeShape.full((w,)), b) == pytest.approx(2 - miss)


def test_expected_tokens_matches_its_model_simulated() -> None:
    shape = TreeShape((-1, -1, -1, 0, 0, 1, 3, 6))
    rates = [0.6, 0.3, 0.15]
    rng = np.random.default_rng(0)
    n, total = 40_000, 0
    for _ in range(n):
        node, tokens = -1, 1
        while True:
            for i, c in enumerate(shape.children[node + 1]):
                if rng.random() < rates[min(i, 2)]:
                    tokens += 1
                    node = c
                    break
            else:
                break
        total += tokens
    assert total / n == pytest.approx(expected_tokens(shape, rates), abs=0.02)


@pytest.mark.parametrize("a", [0.2, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("cost", [0.02, 0.05, 0.3])
def test_a_chain_where_later_siblings_never_win(a: float, cost: float) -> None:
    """With ``b = (a, 0, ...)`` a sibling only costs: the choice is the chain policy's
    length (0 allowed: ``ar``)."""
    shape = best_shape([a, 0.0], cost)
    assert shape.parents == TreeShape.chain(best_length(a, cost, 16, lo=0)).parents


def test_a_tree_where_later_siblings_win_and_nothing_where_drafting_costs() -> None:
    shape = best_shape([0.3, 0.3, 0.25, 0.2], step_cost=0.05, node_cost=0.002)
    assert not shape.label.startswith("chain:")
    assert expected_tokens(shape, [0.3, 0.3, 0.25, 0.2]) > expected_tokens(
        TreeShape.chain(shape.depth), [0.3, 0.3, 0.25, 0.2])
    assert best_shape([0.05, 0.01], step_cost=1.0).size == 0  # ar
    assert all(s.size <= 32 for s in candidate_shapes())


def test_walk_ranks_and_the_estimates() -> None:
    shape = TreeShape.parse("3x2")  # nodes 0..2, then 3,4 under 0, 5,6 under 1, 7,8 under 2
    assert walk_ranks(shape, [1, 6]) == [(0, False), (1, True), (0, False), (1, True)]
    assert walk_ranks(shape, [0]) == [(0, True), (0, False), (1, False)]
    assert walk_ranks(shape, []) == [(0, False), (1, False), (2, False)]
    rates = RankRates()
    before = list(rates.rates)
    rates.observe(walk_ranks(shape, [1, 6]))
    assert rates.rates[0] < before[0] and rates.rates[1] > before[1]
    assert isinstance(rates.best(0.05), TreeShape)
