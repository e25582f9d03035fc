"""The law checks catch what they are built to catch, and nothing else.

``tests/test_law.py`` states, for each N it runs at, the deviation its check is
built to catch. Here that deviation is planted in the exact law of the very pair
those tests use, sequences are drawn straight from the planted law (numpy, no
protocol: this measures the *check*, not the code), and the check must flag at
least 90 % of the seeded runs; drawn from the exact law it must flag almost none.

The planted deviation moves the joint law of a 5-token generation by a given TV at
one step ``t``: every row used at that step is mixed with another row, the same
weight for all, so that the joint TV is exactly the target value. Two directions:
towards the draft's proposal (what a wrong q, a wrong acceptance or a missing
residual does) and towards the uniform row on the target's support (a wrong commit
or a wrong normalisation).
"""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.vocab import VocabMap

from .helpers.law import BUILT_TO_CATCH, bigram_law, check_counts, markov_law, sample_counts
from .session_pairs import pair
from .test_law import N_CODEC, N_COVER, N_HIGH, N_WARPER, PROMPT, TOKENS

SEEDS = 30
POWER = 0.9

#: (N, TV the tests at that N state they catch)
BUILT_FOR = [(N_HIGH, BUILT_TO_CATCH), (N_WARPER, 0.035), (N_CODEC, 0.05), (N_COVER, 0.12)]


def _setup() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(start row, rows, draft-direction rows, draft-direction start) for the pair."""
    target, draft = pair()
    vmap = VocabMap(draft.vocab, target.vocab)
    size = target.vocab.size
    table = target.table.astype(np.float64)
    prompt = target.tokenize(PROMPT)
    start = table[prompt[-1]]
    rows = table[:size]
    # the draft's proposal in target ids: its bigram row after the token's draft
    # spelling, restricted to V_C (the draft's start row after a V_O token)
    to_draft = {int(t): int(d) for t, d in zip(vmap.common_target_ids,
                                                vmap.common_draft_ids, strict=True)}

    def proposal(last_target: int | None) -> np.ndarray:
        d_last = to_draft.get(last_target, draft.vocab.size) if last_target is not None \
            else draft.vocab.size
        q = draft.table[d_last].astype(np.float64)
        out = np.zeros(size)
        out[vmap.common_target_ids] = q[vmap.common_draft_ids]
        return out / out.sum()

    d_rows = np.stack([proposal(a) for a in range(size)])
    d_start = proposal(prompt[-1])
    return start, rows, d_start, d_rows


START, ROWS, D_START, D_ROWS = _setup()


def planted(tv: float, step: int, direction: str) -> np.ndarray:
    """The exact 5-token law moved by ``tv`` (joint TV) at ``step`` (0-based)."""
    support = ROWS.sum(axis=0) > 0
    uniform = support / support.sum()
    if direction == "draft":
        other_start, other_rows = D_START, D_ROWS
    else:
        other_start, other_rows = uniform, np.tile(uniform, (ROWS.shape[0], 1))

    def tv_of(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return 0.5 * np.abs(a - b).sum(axis=-1)

    if step == 0:
        w = tv / tv_of(START, other_start)
        start = (1 - w) * START + w * other_start
        return markov_law(start, ROWS, TOKENS)
    exact = markov_law(START, ROWS, TOKENS)
    prev = exact.sum(axis=tuple(a for a in range(TOKENS) if a != step - 1))
    w = tv / float(prev @ tv_of(ROWS, other_rows))
    assert 0 < w <= 1
    moved = (1 - w) * ROWS + w * other_rows
    # the chain with the moved rows at this one step
    joint = np.asarray(START, dtype=np.float64)
    for t in range(1, TOKENS):
        joint = joint[..., :, None] * (moved if t == step else ROWS)
    return joint


def _power(joint: np.ndarray, n: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    exact = markov_law(START, ROWS, TOKENS)
    return float(np.mean([not check_counts(sample_counts(joint, n, rng), exact).ok
                          for _ in range(SEEDS)]))


def test_the_planted_law_is_what_it_says() -> None:
    exact = markov_law(START, ROWS, TOKENS)
    assert np.isclose(exact.sum(), 1.0)
    target, _ = pair()
    assert np.allclose(exact, bigram_law(target.table, target.tokenize(PROMPT), TOKENS,
                                         lambda p: p / p.sum()))
    for step in range(TOKENS):
        for direction in ("draft", "uniform"):
            moved = planted(0.02, step, direction)
            assert np.isclose(moved.sum(), 1.0)
            assert np.isclose(0.5 * np.abs(moved - exact).sum(), 0.02)


@pytest.mark.parametrize(("n", "tv"), BUILT_FOR)
@pytest.mark.parametrize("direction", ["draft", "uniform"])
def test_the_check_catches_what_it_is_built_for(n: int, tv: float, direction: str) -> None:
    powers = [_power(planted(tv, step, direction), n, seed=100 * step + n)
              for step in range(TOKENS)]
    assert min(powers) >= POWER, f"N={n} TV={tv} {direction}: power by step {powers}"


def test_the_check_rarely_flags_the_exact_law() -> None:
    exact = markov_law(START, ROWS, TOKENS)
    rng = np.random.default_rng(7)
    flagged = sum(not check_counts(sample_counts(exact, N_HIGH, rng), exact).ok
                  for _ in range(100))
    assert flagged <= 1
