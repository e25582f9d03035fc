"""The draft-tree policy (``xcosd/policies/tree_policy.py``): its expected tokens per
round against closed forms and a simulation of its own model, its costs (a chain's is
the chain policy's; a node's from its bytes and compute), its choice against the
chain policy's where later siblings never win or a node costs what a step does, and
the ranks a verdict reports."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.methods.tree import TreeShape
from xcosd.policies.draft_length import DEFAULT_COST, PRIOR_RATE, STEP, DraftLength, best_length
from xcosd.policies.tree_policy import (
    NODE_BYTES,
    PROBE_EVERY,
    RankRates,
    TreeCosts,
    best_shape,
    branching,
    candidate_shapes,
    expected_tokens,
    policy_shapes,
    probe_shape,
    round_cost,
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
@pytest.mark.parametrize("node", [0.0, 0.01, 0.3])
def test_a_chain_where_later_siblings_never_win(a: float, cost: float, node: float) -> None:
    """With ``b = (a, 0, ...)`` a sibling only costs: the choice is the chain policy's
    length (0 allowed: ``ar``), whatever a node costs."""
    shape = best_shape([a, 0.0], cost, node, row_cost=node / 10)
    assert shape.parents == TreeShape.chain(best_length(a, cost, 16, lo=0)).parents


def test_round_cost_charges_a_chain_as_the_chain_policy_and_a_tree_its_extras() -> None:
    for k in range(6):
        assert round_cost(TreeShape.chain(k), 0.05, 7.0, 9.0) == pytest.approx(1 + 0.05 * k)
    shape = TreeShape.parse("3x2")  # 9 nodes, depth 2, rows at the context and 3 nodes
    assert branching(shape) == 4
    assert round_cost(shape, 0.1, 0.02, 0.001) == pytest.approx(
        1 + 0.1 * 2 + 0.02 * 7 + 0.001 * 4)
    assert branching(TreeShape.parse("spine:4x2x2")) == 3


def test_tree_costs_from_bytes_and_compute() -> None:
    c = TreeCosts.measured(fixed_s=0.05, draft_node_s=0.001, cloud_node_s=0.0005,
                           row_bytes=200, up_bps=1e6)
    assert c.node == pytest.approx((0.001 + 0.0005 + 8 * NODE_BYTES / 1e6) / 0.05)
    assert c.row == pytest.approx(8 * 200 / 1e6 / 0.05)
    # a slower link makes a row dearer, a longer round trip every node cheaper
    assert TreeCosts.measured(fixed_s=0.05, row_bytes=200, up_bps=1e5).row > c.row
    assert TreeCosts.measured(fixed_s=0.5, draft_node_s=0.001).node < c.node
    assert TreeCosts.default(0.05) == TreeCosts(0.05, 0.0)
    with pytest.raises(ValueError):
        TreeCosts.measured(fixed_s=0.0)
    with pytest.raises(ValueError):
        TreeCosts(-1.0, 0.0)


def test_the_default_costs_keep_a_session_on_chains() -> None:
    """As ``EdgeSession.round_shape`` asks (``pick(step_cost)``, which is ``best`` but
    for its probes): at the prior and at
    the acceptance measured on the embedded pair a node costs a step and the pick is
    the chain policy's; with nodes free it would be a wide tree, which does not pay
    there (``docs/RESULTS.md``, "Draft trees")."""
    rates = RankRates()
    first = DraftLength(4, 16, 0.0, True, DEFAULT_COST, False)
    assert rates.rates[0] == PRIOR_RATE == first.rate
    assert rates.best(DEFAULT_COST).parents == TreeShape.chain(
        best_length(PRIOR_RATE, DEFAULT_COST, 16, lo=0)).parents
    assert rates.best(DEFAULT_COST, node_cost=0.0).size >= 16
    rates.rates = [0.73, 0.05, 0.02, 0.02, 0.0]
    assert rates.best(DEFAULT_COST).is_chain
    # measured costs stand in for the default once set
    rates.rates = [0.3, 0.3, 0.25, 0.2]
    rates.costs = TreeCosts(0.01, 0.0003)
    assert not rates.best(DEFAULT_COST).is_chain
    rates.costs = TreeCosts(5.0, 0.0)
    assert rates.best(DEFAULT_COST).is_chain


def test_a_chain_pick_is_probed_for_later_ranks_until_a_walk_tests_them() -> None:
    """Only a tree's walks measure the later ranks: one chain pick in PROBE_EVERY is
    drafted as its probe, a chain with a second child at each node, unless a walk
    tested a later rank meanwhile; a pick of nothing (``ar``) is not probed here (the
    chain policy's probes draft then)."""
    rates = RankRates()
    chain = rates.best(DEFAULT_COST)
    assert chain.is_chain and chain.depth > 0
    probe = probe_shape(chain)
    assert probe.parents == TreeShape.spine((2,) * chain.depth).parents
    assert probe.depth == chain.depth and probe.size == 2 * chain.depth
    # under the model a probe commits at least what its chain would
    assert expected_tokens(probe, rates.rates) > expected_tokens(chain, rates.rates)
    picks = [rates.pick(DEFAULT_COST) for _ in range(2 * PROBE_EVERY)]
    assert [i for i, s in enumerate(picks) if not s.is_chain] == [PROBE_EVERY - 1,
                                                                  2 * PROBE_EVERY - 1]
    assert picks[PROBE_EVERY - 1].parents == probe.parents
    assert all(s.parents == chain.parents for s in picks if s.is_chain)
    # a walk that tested rank 2 puts the next probe off by a full interval
    for _ in range(PROBE_EVERY - 2):
        assert rates.pick(DEFAULT_COST).is_chain
    rates.observe(walk_ranks(TreeShape.spine((2, 1)), []))  # ranks 1 and 2 rejected
    assert all(rates.pick(DEFAULT_COST).is_chain for _ in range(PROBE_EVERY - 1))
    assert not rates.pick(DEFAULT_COST).is_chain
    # a tree pick is not a chain's: no probe, and the count does not move
    rates.rates, rates.costs = [0.3, 0.3, 0.25, 0.2], TreeCosts(0.001, 0.0)
    before = rates.unprobed
    assert not rates.pick(DEFAULT_COST).is_chain and rates.unprobed == before
    # nothing to probe where drafting does not pay
    rates.rates, rates.costs = [0.05, 0.01], None
    assert all(rates.pick(1.0).size == 0 for _ in range(3 * PROBE_EVERY))
    # every probe is a shape a metric names
    names = {s.label for s in policy_shapes()}
    assert {probe_shape(TreeShape.chain(k)).label for k in range(1, 17)} <= names
    assert len(names) == len(policy_shapes())


def test_a_policy_adopts_what_an_earlier_one_learned() -> None:
    """A node's next generation (measured costs) starts from the last one's per-rank
    estimates and its count towards a probe, so generations shorter than the probe
    interval still probe; its own costs, where set, stay."""
    old = RankRates()
    for _ in range(PROBE_EVERY - 3):
        old.pick(DEFAULT_COST)
    old.observe(walk_ranks(TreeShape.chain(4), [0, 1]))
    new = RankRates()
    new.adopt(old)
    assert new.rates == old.rates and new.rates is not old.rates
    assert new.unprobed == old.unprobed == PROBE_EVERY - 3
    assert [new.pick(DEFAULT_COST).is_chain for _ in range(3)] == [True, True, False]
    old.observe([(1, True)])
    assert new.rates[1] != old.rates[1]  # a copy: the old one's verdicts are its own
    mine = RankRates(costs=TreeCosts(0.5, 0.0))
    mine.adopt(RankRates(costs=TreeCosts(0.01, 0.0)))
    assert mine.costs == TreeCosts(0.5, 0.0)


def test_a_chain_estimate_moves_as_the_chain_policy_s() -> None:
    """A chain round's verdict moves rank 1's estimate as it moves the chain policy's
    acceptance, so where the pick is a chain it is the chain policy's length."""
    rates, chain = RankRates(), DraftLength(4, 16, 0.0, True, DEFAULT_COST, False)
    for d, n in [(4, 4), (4, 1), (6, 0), (3, 3), (5, 2)]:
        rates.observe(walk_ranks(TreeShape.chain(d), list(range(n))))
        chain.settled(d, n)
        assert rates.rates[0] == pytest.approx(chain.rate)
        assert rates.best(DEFAULT_COST).parents == TreeShape.chain(chain.ceiling).parents
    assert STEP > 0


def test_a_tree_where_later_siblings_win_and_nothing_where_drafting_costs() -> None:
    shape = best_shape([0.3, 0.3, 0.25, 0.2], step_cost=0.05, node_cost=0.002)
    assert not shape.label.startswith("chain:")
    assert expected_tokens(shape, [0.3, 0.3, 0.25, 0.2]) > expected_tokens(
        TreeShape.chain(shape.depth), [0.3, 0.3, 0.25, 0.2])
    assert best_shape([0.05, 0.01], step_cost=1.0).size == 0  # ar
    assert all(s.size <= 32 for s in candidate_shapes())


def test_every_candidate_is_named_and_read_back() -> None:
    """A round's shape is named in its ``RoundSettled`` and the bench's rows: a deep
    spine (``spine:4x4x4x4x4x4``, whose full tree would hold 5460 nodes) too."""
    for s in candidate_shapes():
        assert TreeShape.parse(s.label).parents == s.parents


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
