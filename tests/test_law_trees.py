"""The law of generations made of draft-tree rounds (``xcosd/methods/tree.py``).

Each generation is :data:`TOKENS` target tokens, made of tree rounds
(``xcosd.simulate.simulate_tree_round``: the device's draws, the uplink's committed
rows, the server's walk and the method's own rejection exchange, follow-ups
included), with the target's rows scored by ``xcosd.models.tree_scoring.score_tree``
and the draft's TLI rows from the draft model depth by depth. The pair is the
adversarial one of ``tests/test_law.py`` (bigram tables on different vocabularies,
V_O carrying ~40 % of the target's mass), so a residual taken from the wrong row, a
wrong node's row or a sibling tested against the wrong residual changes the law;
the real o200k / cl100k vocabularies run at lower N.

Siblings are drawn without replacement (the default) or i.i.d.; the method tests
run the first on every shape and both on the ragged one and on the trap pair, the
cover alternates them.

Shapes: wide and shallow (5 candidates, each with one child), narrow and deep (two
chains of three), ragged (branching at some nodes, not others, single-child nodes
below branching ones). Every check compares the empirical law of the sequences with
the exact one (``tests/helpers/law.py``); every test also asserts that the walk
really accepted a sibling after rejected ones and rejected every child of a node,
so the residual path is exercised. Two lossy controls fail the same check: a
verifier testing each child against the target row instead of the residual, and
siblings drawn without replacement but verified as if drawn with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import xcosd.methods.tree as tree_mod
import xcosd.simulate as simulate_mod
from xcosd.errors import InvalidDistribution
from xcosd.methods import Space, get_method
from xcosd.methods.tli import restrict_to_common
from xcosd.methods.tree import TreeShape
from xcosd.models.tree_scoring import score_tree
from xcosd.sampling import SamplingParams, sample_index, warp
from xcosd.simulate import simulate_tree_round
from xcosd.vocab import VocabMap

from .helpers.law import bigram_law, check_law, committed_row, support_law
from .helpers.stats import assert_exact
from .session_pairs import DRAFT_EOS, DRAFT_TOKENS, BigramModel, pair, real_pair

TOKENS = 4
PROMPT = "c"

SHAPES = {
    "wide": TreeShape.full((5, 1)),
    "deep": TreeShape.full((2, 1, 1)),
    # the context's 3 children: the first with 2 (the first of those with 1), the
    # second with 1, the third a leaf
    "ragged": TreeShape((-1, -1, -1, 0, 0, 1, 3)),
}
T1 = SamplingParams()
WARPERS = {
    "T1": T1,
    "topk": SamplingParams(temperature=0.7, top_k=4),
    "topp": SamplingParams(top_p=0.85),
    "greedy": SamplingParams(temperature=0.0),
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sd-uplink": ("sd-uplink", {}),
    "straightforward": ("straightforward", {}),
    "xcosd": ("xcosd", {}),
    "xcosd-nopresample": ("xcosd", {"hr_presample": False}),
    "xcosd-e": ("xcosd-e", {}),
    "xcosd-e-K1M2": ("xcosd-e", {"K": 1, "M": 2}),
}
#: the exact codecs of the target's rows (trees refuse lossy ones)
CODECS = ["f32", "sparse"]
#: the draft rows' codecs: exact, a committed top-k, and a top-k with a flat tail (the
#: draft then proposes from its committed row, which changes proposals, never the law)
ROW_CODECS = ["f32", "sparse", "topk:3", "head:3"]

N_METHOD = 2_000
N_COVER = 600
N_REAL = 400


class TreeLink:
    """A target and a draft over their own vocabularies, scored for tree rounds."""

    def __init__(self, target: Any, draft: Any, vmap: VocabMap, prompt: list[int]) -> None:
        self.target, self.draft, self.vmap = target, draft, vmap
        self.space = Space.from_vocab_map(vmap)
        self.prompt = prompt
        self._dctx: dict[int, list[int]] = {}

    def draft_ids(self, tid: int) -> list[int]:
        """The draft's spelling of target token ``tid`` (one id on V_C, a
        re-tokenisation of its bytes on V_O)."""
        if tid not in self._dctx:
            d = int(self.vmap.target_to_draft[tid])
            self._dctx[tid] = ([d] if d >= 0 else
                               self.draft.vocab.encode_bytes(self.target.vocab.token_bytes(tid)))
        return self._dctx[tid]

    def tli(self, row: np.ndarray, params: SamplingParams) -> np.ndarray:
        try:
            return restrict_to_common(warp(row, params), self.vmap.common_draft_index)
        except InvalidDistribution:  # greedy on a draft-only token: warp V_C's part
            return warp(restrict_to_common(row, self.vmap.common_draft_index), params)

    def generate(self, variant: str, codec: str, params: SamplingParams, shape: TreeShape,
                 n: int, seed: int, row_codec: str = "f32", distinct: bool = True,
                 ) -> tuple[np.ndarray, dict[str, int]]:
        name, opts = VARIANTS.get(variant, (variant, {}))
        m = get_method(name, codec=codec, **opts)
        rng = np.random.default_rng(seed)
        seqs = np.empty((n, TOKENS), dtype=np.int64)
        seen = {"later_sibling_accepted": 0, "all_rejected": 0, "full_path": 0}
        t_sess = self.target.start(self.prompt)
        base = len(t_sess.ids)
        for i in range(n):
            out: list[int] = []
            while len(out) < TOKENS:
                done = list(out)

                def trows(ids: list[int]) -> np.ndarray:
                    return warp(score_tree(self.target, t_sess, shape.parents, ids), params)

                def drows(nodes: list[int], ids: list[int],
                          done: list[int] = done) -> list[np.ndarray]:
                    rows = []
                    for node in nodes:
                        ctx = [d for t in [*done, *(ids[k] for k in shape.path(node))]
                               for d in self.draft_ids(t)]
                        d_sess = self.draft.start(ctx)
                        rows.append(self.tli(self.draft.score([(d_sess, [])])[0][-1], params))
                    return rows

                res = simulate_tree_round(m, shape, trows, drows, self.space, rng,
                                          row_codec=row_codec, distinct=distinct)
                firsts = {shape.children[shape.parents[k] + 1][0] for k in res.path}
                seen["later_sibling_accepted"] += any(k not in firsts for k in res.path)
                leaf = not shape.children[(res.path[-1] if res.path else -1) + 1]
                seen["all_rejected"] += not leaf
                seen["full_path"] += leaf
                out.extend(res.tokens)
                self.target.append(t_sess, res.tokens)
            seqs[i] = out[:TOKENS]
            self.target.rollback(t_sess, base)
        return seqs, seen


@pytest.fixture(scope="module")
def small() -> TreeLink:
    target, draft = pair()
    return TreeLink(target, draft, VocabMap(draft.vocab, target.vocab),
                    target.tokenize(PROMPT))


@pytest.fixture(scope="module")
def trap() -> TreeLink:
    """The same target, and a draft that puts 90 % of every row on a token the target
    never emits (``<eos>``, in V_C): the first child is nearly always rejected and
    the next ones are where a wrong residual or a wrong sibling law shows."""
    target, draft = pair()
    table = draft.table.astype(np.float64) * 0.1
    table[:, DRAFT_EOS] += 0.9
    peaked = BigramModel(DRAFT_TOKENS, table.astype(np.float32), DRAFT_EOS, name="d-trap")
    return TreeLink(target, peaked, VocabMap(peaked.vocab, target.vocab),
                    target.tokenize(PROMPT))


def exact_law(link: TreeLink, variant: str, codec: str, params: SamplingParams) -> np.ndarray:
    name = VARIANTS.get(variant, (variant, {}))[0]

    def row(p: np.ndarray) -> np.ndarray:
        return committed_row(name, codec, warp(p, params), link.space)

    return bigram_law(link.target.table, link.prompt, TOKENS, row)


def assert_tree_law(link: TreeLink, variant: str, codec: str, params: SamplingParams,
                    shape: TreeShape, n: int, seed: int, row_codec: str = "f32",
                    distinct: bool = True) -> None:
    seqs, seen = link.generate(variant, codec, params, shape, n, seed, row_codec, distinct)
    report = check_law(seqs, exact_law(link, variant, codec, params))
    label = (f"{variant}/{codec}/{params.label()}/{shape.label}/rows {row_codec}/"
             f"{'distinct' if distinct else 'iid'}")
    assert report.ok, f"{label}: {report}"
    if not params.greedy:
        assert seen["later_sibling_accepted"] > 0 and seen["all_rejected"] > 0, (label, seen)


# -- every lossless method x every shape (T = 1, f32) ---------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tree_law_every_method(small: TreeLink, variant: str, shape: str) -> None:
    """N = 2,000 (TV about 0.06 at one step): the residual a rejected sibling
    leaves, the method's resolution of the residual at the node where the walk
    stops and the bonus after a full path, on each shape; siblings drawn without
    replacement (the default) and, on the ragged shape, i.i.d."""
    assert_tree_law(small, variant, "f32", T1, SHAPES[shape], N_METHOD, seed=1000)
    if shape == "ragged":
        assert_tree_law(small, variant, "f32", T1, SHAPES[shape], N_METHOD, seed=1100,
                        distinct=False)


@pytest.mark.parametrize("distinct", [True, False], ids=["distinct", "iid"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tree_law_trap(trap: TreeLink, variant: str, distinct: bool) -> None:
    """The pair the lossy controls fail on (below), passed by every method with
    either sibling scheme."""
    assert_tree_law(trap, variant, "f32", T1, SHAPES["wide"], N_METHOD, seed=1500,
                    distinct=distinct)


# -- warpers x shapes x codecs x row codecs, every method in rotation -------------


COVER = [(v, w, s, c, rc)
         for i, (w, s, c, rc) in enumerate(
             (w, s, c, rc) for w in WARPERS for s in SHAPES for c in CODECS
             for rc in ROW_CODECS if (c == "f32") == (rc != "sparse"))
         for v in [list(VARIANTS)[i % len(VARIANTS)]]]


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "warper", "shape", "codec", "row_codec"), COVER)
def test_tree_law_cover(small: TreeLink, variant: str, warper: str, shape: str, codec: str,
                        row_codec: str) -> None:
    """Every warper x shape x exact target codec x row codec at N = 600 (TV about
    0.12 at one step), the methods in rotation (36 runs, a minute of CPU: slow);
    greedy's law is a point mass, so a wrong row shows as a token the target never
    emits."""
    assert_tree_law(small, variant, codec, WARPERS[warper], SHAPES[shape], N_COVER,
                    seed=2000, row_codec=row_codec,
                    distinct=(list(WARPERS).index(warper) + list(SHAPES).index(shape)) % 2 == 0)


# -- lossy controls --------------------------------------------------------------


@contextmanager
def without_replacement() -> Iterator[None]:
    """Siblings drawn without replacement (each from the row with the siblings
    already drawn removed) while the tree says they were drawn i.i.d.: their ``q(x)``
    the node's row's, and the server's residuals formed with that row."""
    orig = tree_mod.draw_child
    # by the row's identity, the row held so that its id is not reused: with i.i.d.
    # siblings every child of a node is drawn from the very same row object
    drawn: dict[int, tuple[np.ndarray, set[int]]] = {}

    def draw(row: np.ndarray, rng: np.random.Generator) -> int:
        taken = drawn.setdefault(id(row), (row, set()))[1]
        w = row.astype(np.float64)
        w[list(taken)] = 0.0
        if not w.sum() > 0:  # every token drawn: start over
            taken.clear()
            w = row.astype(np.float64)
        j = sample_index(w, rng)
        taken.add(j)
        return j

    tree_mod.draw_child = draw
    try:
        yield
    finally:
        tree_mod.draw_child = orig


@contextmanager
def against_target_row() -> Iterator[None]:
    """Every child tested against its node's target row: the residual a rejected
    sibling leaves is never formed."""
    orig = tree_mod.residual
    tree_mod.residual = lambda r, q, space: None  # type: ignore[assignment]
    try:
        yield
    finally:
        tree_mod.residual = orig


CONTROLS: dict[str, Callable[[], Any]] = {
    "against-target-row": against_target_row,
    "without-replacement": without_replacement,
}


@pytest.mark.parametrize("variant", ["xcosd", "xcosd-e", "straightforward", "sd-uplink"])
@pytest.mark.parametrize("control", list(CONTROLS))
def test_tree_lossy_controls_fail(trap: TreeLink, control: str, variant: str) -> None:
    """Each control fails the check every method passes on the trap pair
    (:func:`test_tree_law_trap`), at the same N and seed on the same shape: siblings
    drawn without replacement by a tree that says they were drawn i.i.d., and every
    sibling (drawn without replacement, as the default) tested against the target
    row."""
    distinct = control != "without-replacement"
    with CONTROLS[control]():
        seqs, _ = trap.generate(variant, "f32", T1, SHAPES["wide"], N_METHOD, seed=1500,
                                distinct=distinct)
    report = check_law(seqs, exact_law(trap, variant, "f32", T1))
    assert not report.ok, f"{control}/{variant} passed: {report}"


# -- after a cloud restart ----------------------------------------------------------


@contextmanager
def after_a_restart() -> Iterator[dict[str, int]]:
    """Every follow-up of a tree round's rejection answered from the state
    ``rebuild_tree_reject`` makes from the rows alone, as a cloud restarted between
    the verdict and the device's request answers the redone round; the count is of
    the rejections so rebuilt at a node below the root."""
    orig = simulate_mod.verify_tree
    seen = {"rebuilt_below_root": 0}

    def verify(method: Any, p: Any, draft: Any, space: Space,
               rng: np.random.Generator) -> tree_mod.TreeVerified:
        v = orig(method, p, draft, space, rng)
        if v.reject is not None:
            v.reject = tree_mod.rebuild_tree_reject(
                method, p, draft, v.node, space, candidate_rounds=v.reject.candidate_rounds,
                fallback_sent=v.reject.fallback_sent)
            seen["rebuilt_below_root"] += v.node >= 0
        return v

    simulate_mod.verify_tree = verify
    try:
        yield seen
    finally:
        simulate_mod.verify_tree = orig


#: V_C = {0, 2, 3, 5} of a 6-token target, V_O = {1, 4}
RESTART_SPACE = Space(6, np.array([0, 2, 3, 5]))


def test_tree_round_law_after_a_cloud_restart() -> None:
    """One ``spine:1x3`` round (the root's one child, three below it) after a prompt
    whose next token is certainly 3, drafted as 3: node 0 is always accepted, and the
    round's next token must follow the target's row after it, whatever the walk did
    below. xcosd-e with K = 1, M = 2, every follow-up answered from a rebuilt state
    (:func:`after_a_restart`). With these rows the walk rejects all three children
    in about a quarter of the rounds and a follow-up comes in one round of 16, enough
    that a state rebuilt with the wrong number of rejected siblings (the root's one
    child: no residual step, where node 0's first two need two) moves the token's law
    by TV ~0.04 (chi-square p ~1e-8 against ~0.5 here); N = 6,000 rounds of a
    6-token vocabulary, a few seconds."""
    space = RESTART_SPACE
    q = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32)
    after = np.array([0.35, 0.05, 0.1, 0.05, 0.05, 0.4], dtype=np.float32)
    point = np.zeros(space.n_common, dtype=np.float32)
    point[space.to_common[3]] = 1.0
    p = np.stack([np.eye(6, dtype=np.float32)[3], after, *[np.full(6, 1 / 6, np.float32)] * 3])
    m = get_method("xcosd-e", codec="f32", K=1, M=2)
    rng = np.random.default_rng(1700)
    tokens: list[int] = []
    with after_a_restart() as seen:
        for _ in range(6_000):
            res = simulate_tree_round(m, TreeShape.parse("spine:1x3"), lambda ids: p,
                                      lambda nodes, ids: [point if v < 0 else q for v in nodes],
                                      space, rng, row_codec="f32")
            assert res.tokens[0] == 3
            tokens.append(res.tokens[1])
    assert seen["rebuilt_below_root"] > 1_000, seen
    assert_exact(tokens, after, "xcosd-e K=1 M=2, follow-ups from a rebuilt state")


# -- the real vocabularies ---------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> TreeLink:
    target, draft, vmap = real_pair()
    return TreeLink(target, draft, vmap, [])


@pytest.mark.parametrize(("variant", "warper", "shape"), [
    ("xcosd", "T1", "ragged"),
    pytest.param("xcosd-e", "topk", "ragged", marks=pytest.mark.slow),
    pytest.param("sd-uplink", "T1", "ragged", marks=pytest.mark.slow),
    pytest.param("xcosd-e", "greedy", "wide", marks=pytest.mark.slow),
])
def test_tree_law_real_vocabularies(real: TreeLink, variant: str, warper: str,
                                    shape: str) -> None:
    """o200k target, cl100k draft: every row 200k / 100k wide, the rows crossing
    with ``sparse``; the first 3 tokens at N = 400 (TV about 0.15 at one step; a
    200k-wide round costs milliseconds, so all but one are marked slow). Top-p over
    such rows crosses the protocol in ``tests/test_law_trees_protocol.py``'s
    real-vocabulary tests; straightforward's trees (a whole 200k row a node, a minute
    here) are checked on the small pairs."""
    params = WARPERS[warper]
    seqs, _ = real.generate(variant, "f32", params, SHAPES[shape], N_REAL, seed=3000,
                            row_codec="sparse")
    index = np.full(real.target.vocab.size, -1, dtype=np.int64)
    index[real.target.support] = np.arange(real.target.support.shape[0])
    mapped = index[seqs[:, :3]]
    assert (mapped >= 0).all()
    report = check_law(mapped, support_law(real.target, params, 3))
    assert report.ok, f"{variant}/{warper}/{shape}: {report}"
