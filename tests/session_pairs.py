"""Cross-vocabulary TableModel pairs for the protocol, node and end-to-end tests.

The target and the draft spell their tokens differently: V_C = {a, b, c, d, ab,
eos}, V_O = {bc, cd, abc} (target-only, and they carry real probability mass), and
the draft has tokens the target lacks (ca, dd). Both are bigram tables (the next
row depends on the last token), so the exact law of any generated prefix is known
in closed form.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from xcosd.models import TableModel
from xcosd.models.base import ContextModel
from xcosd.sampling import check_distribution
from xcosd.vocab import VocabMap, Vocabulary

from .helpers.waits import until

TARGET_TOKENS = [b"a", b"b", b"c", b"d", b"ab", b"bc", b"cd", b"abc", b"<eos>"]
DRAFT_TOKENS = [b"a", b"b", b"c", b"d", b"ab", b"ca", b"dd", b"<eos>"]
TARGET_EOS = 8
DRAFT_EOS = 7


def _bigram_table(size: int, eos: int, seed: int, eos_mass: float, alpha: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(alpha * np.ones(size), size=size + 1)
    table[:, eos] = 0.0
    table /= table.sum(axis=1, keepdims=True)
    table *= 1.0 - eos_mass
    table[:, eos] = eos_mass
    return table.astype(np.float32)


class BigramModel(TableModel):
    """A TableModel whose next row is ``table[last token]`` (row ``size`` for the
    empty context). The table is checked once here, so scoring a row is a copy: the
    high-N law tests run hundreds of thousands of rounds through it."""

    def __init__(self, tokens: list[bytes], table: np.ndarray, eos: int, *, name: str) -> None:
        check_distribution(table, what=f"{name} table", size=len(tokens))
        if table.shape[0] != len(tokens) + 1:
            raise ValueError("a bigram table has one row per token plus the start row")
        self.table = np.ascontiguousarray(table, dtype=np.float32)
        self._start = len(tokens)
        super().__init__(tokens, self._next, eos_id=eos, name=name)

    def _next(self, ctx: list[int]) -> np.ndarray:
        return self.table[ctx[-1] if ctx else self._start]

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        out[:] = self.table[context[-1] if len(context) else self._start]


def bigram_model(tokens: list[bytes], eos: int, *, seed: int, eos_mass: float = 0.0,
                 alpha: float = 1.0, name: str) -> BigramModel:
    """A bigram model over ``tokens`` with Dirichlet(``alpha``) rows."""
    return BigramModel(tokens, _bigram_table(len(tokens), eos, seed, eos_mass, alpha), eos,
                       name=name)


def pair(*, eos_mass: float = 0.0, seed: int = 0) -> tuple[TableModel, TableModel]:
    """(target, draft)."""
    target = bigram_model(TARGET_TOKENS, TARGET_EOS, seed=100 + seed, eos_mass=eos_mass,
                          alpha=0.8, name="t-target")
    draft = bigram_model(DRAFT_TOKENS, DRAFT_EOS, seed=200 + seed, eos_mass=eos_mass,
                         alpha=0.5, name="t-draft")
    return target, draft


def close_pair() -> tuple[BigramModel, BigramModel]:
    """A pair on the same two vocabularies whose draft nearly is the target (97 % of
    each draft row is the target's row on V_C; V_O keeps 2 % of its mass; the rows
    are peaked): whole blocks are accepted and the bonus is often the draft's next
    token, so speculated drafts are sent in most generations, which the
    adversarial pair, accepting a fifth of its drafts, seldom gets to."""
    t = bigram_model(TARGET_TOKENS, TARGET_EOS, seed=150, alpha=0.15, name="t-close").table
    t = t.astype(np.float64)
    where = {tok: i for i, tok in enumerate(TARGET_TOKENS)}
    for tok in (b"bc", b"cd", b"abc"):
        t[:, where[tok]] *= 0.02
    t /= t.sum(axis=1, keepdims=True)
    noise = bigram_model(DRAFT_TOKENS, DRAFT_EOS, seed=300, name="noise").table
    rows = np.array(noise, dtype=np.float64)
    for r, ctx in enumerate([*DRAFT_TOKENS, None]):
        src = where.get(ctx, len(TARGET_TOKENS) if ctx is None else -1)
        if src >= 0:
            on_vc = np.array([t[src, where[tok]] if tok in where else 0.0
                              for tok in DRAFT_TOKENS])
            rows[r] = 0.97 * on_vc / on_vc.sum() + 0.03 * rows[r]
    return (BigramModel(TARGET_TOKENS, t.astype(np.float32), TARGET_EOS, name="t-close"),
            BigramModel(DRAFT_TOKENS, rows.astype(np.float32), DRAFT_EOS, name="d-close"))


def greedy_decode(target: TableModel, prompt: str | list[int], n: int) -> list[int]:
    """The target's own greedy continuation of ``prompt`` (text, or target ids)."""
    ctx = target.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = int(np.argmax(target.next_probs([*ctx, *out])))
        out.append(t)
        if t == TARGET_EOS:
            break
    return out


async def closed_sessions_settle(cloud) -> dict:
    """The cloud's stats once every session the edges closed is freed: ``close`` is
    fire-and-forget, so the cloud may still be reading the last ones."""
    await until(lambda: not cloud.stats()["sessions_active"], "the closed sessions to be freed")
    return cloud.stats()


__all__ = [
    "DRAFT_EOS",
    "TARGET_EOS",
    "BigramModel",
    "bigram_model",
    "close_pair",
    "closed_sessions_settle",
    "greedy_decode",
    "itertools",
    "pair",
]


# ----------------------------------------------------------- real vocabularies


class SparseBigramModel(ContextModel):
    """A bigram model over a real vocabulary (o200k, cl100k ...): the next row after
    token ``a`` puts ``rows[a]`` on ``support`` (the start row after the empty
    context or a token outside ``support``). Rows are full-width, as a real model's
    are, so every id mapping and every 200k-entry vector path runs for real."""

    def __init__(self, vocab: Vocabulary, support: np.ndarray, rows: np.ndarray,
                 start: np.ndarray, *, name: str) -> None:
        self.vocab = vocab
        self.name = name
        self.support = np.asarray(support, dtype=np.int64)
        self.rows = np.asarray(rows, dtype=np.float32)
        self.start_row = np.asarray(start, dtype=np.float32)
        self._index = {int(t): i for i, t in enumerate(self.support)}
        check_distribution(np.vstack([self.rows, self.start_row]), what=name)

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        out[:] = 0.0
        i = self._index.get(int(context[-1])) if len(context) else None
        out[self.support] = self.start_row if i is None else self.rows[i]


def real_pair(seed: int = 0) -> tuple[SparseBigramModel, SparseBigramModel, VocabMap]:
    """(target on o200k, draft on cl100k, their map): the target's support is 4 real
    tokens in V_C and 4 in V_O (o200k tokens cl100k lacks), scattered over the ids;
    the draft proposes the 4 V_C tokens plus 2 tokens o200k lacks."""
    tv, dv = Vocabulary.load("o200k"), Vocabulary.load("cl100k")
    vmap = VocabMap(dv, tv)
    rng = np.random.default_rng(seed)
    common = rng.choice(vmap.common_target_ids, 4, replace=False)
    other = rng.choice(np.flatnonzero(vmap.other_mask), 4, replace=False)
    t_support = np.concatenate([common, other])
    draft_only = rng.choice(np.flatnonzero(~np.isin(np.arange(dv.size),
                                                    vmap.common_draft_ids)
                                           & dv.regular_mask), 2, replace=False)
    d_support = np.concatenate([vmap.target_to_draft[common], draft_only])
    k_t, k_d = t_support.shape[0], d_support.shape[0]
    target = SparseBigramModel(tv, t_support, rng.dirichlet(0.8 * np.ones(k_t), k_t),
                               rng.dirichlet(0.8 * np.ones(k_t)), name="o200k-bigram")
    d_rows = rng.dirichlet(0.5 * np.ones(k_d), k_d)
    # the draft's row follows the target token's draft spelling when it is in V_C
    draft = SparseBigramModel(dv, d_support, d_rows, rng.dirichlet(0.5 * np.ones(k_d)),
                              name="cl100k-bigram")
    return target, draft, vmap
