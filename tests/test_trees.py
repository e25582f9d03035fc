"""Draft trees' parts (``xcosd/methods/tree.py``, ``xcosd/models/tree_scoring.py``):
shapes, what a tree sends and what the server checks of it, refusals, the rows a
tree is scored to, and the walk on rows where its outcome is known. The law of
whole tree generations is ``tests/test_law_trees.py``."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from xcosd.errors import CodecError, ProtocolError
from xcosd.methods import Space, get_method
from xcosd.methods.base import Draft
from xcosd.methods.tree import (
    DraftTree,
    Siblings,
    TreeShape,
    check_tree_method,
    device_state,
    draft_tree,
    rebuild_tree_reject,
    residual,
    rows_needed,
    server_rows,
    verify_tree,
)
from xcosd.models.tree_scoring import leaf_paths, rows_after, score_tree
from xcosd.simulate import simulate_tree_round

from .session_pairs import pair

SPACE = Space(6, np.array([0, 2, 3, 5]))  # V_O = {1, 4}


def test_shapes_parse_and_name_themselves() -> None:
    assert TreeShape.parse("chain:3").parents == (-1, 0, 1)
    assert TreeShape.parse("3x2").parents == (-1, -1, -1, 0, 0, 1, 1, 2, 2)
    assert TreeShape.parse("spine:3x2").parents == (-1, -1, -1, 0, 0)
    for text in ("chain:3", "3x2", "spine:3x2x2", "4"):
        assert TreeShape.parse(text).label == text
    assert TreeShape.parse("1x1").label == "chain:2"
    assert TreeShape((-1, -1, 0, 0, 1)).label == "tree:5"
    shape = TreeShape.parse("spine:3x2x2")
    assert shape.depth == 3 and shape.levels() == [[-1], [0], [3]]
    assert shape.path(5) == [0, 3, 5]
    for bad in ("3x0", "spine:", "x3", "tree:4", "chain:-1"):
        with pytest.raises(ValueError):
            TreeShape.parse(bad)
    with pytest.raises(ValueError, match="earlier node"):
        TreeShape((-1, 1))


def test_a_chain_answers_as_the_tree_of_its_shape() -> None:
    """A plain ``Draft`` is the block of shape ``chain:d``: its depth, the path a
    verdict accepts and whether it rejects are what that tree's are, so the state
    machines read either block alike; only ``stays_in_context`` tells them apart."""
    for d in range(6):
        ids = np.arange(d, dtype=np.int64)
        chain = Draft(ids=ids, q_values=np.ones(d, dtype=np.float32))
        tree = DraftTree(ids=ids, q_values=np.ones(d, dtype=np.float32),
                         parents=np.arange(-1, d - 1, dtype=np.int64), rows={},
                         row_codec="f32")
        assert chain.shape == tree.shape == TreeShape.chain(d)
        assert chain.depth == tree.depth == d
        for n in range(-1, d + 2):
            assert chain.rejects(n) == tree.rejects(n) == (0 <= n < d)
            if 0 <= n <= d:
                assert chain.path(n) == tree.path(n) == list(range(n))
        assert chain.stays_in_context and not tree.stays_in_context
        assert chain.tree_label is None and tree.tree_label == f"chain:{d}"
    spine = TreeShape.parse("spine:3x2")
    t = DraftTree(ids=np.zeros(5, dtype=np.int64), q_values=np.ones(5, dtype=np.float32),
                  parents=np.array(spine.parents), rows={}, row_codec="f32")
    assert t.depth == 2 and t.path(4) == [0, 3] and t.path(0) == []
    assert [t.rejects(n) for n in range(7)] == [True, True, False, False, False, False, False]


def test_rows_sent_where_a_residual_or_the_method_needs_them() -> None:
    shape = TreeShape((-1, -1, 0, 2, 2))
    assert rows_needed(get_method("xcosd"), shape) == [-1, 2]
    assert rows_needed(get_method("sd-uplink"), shape) == [-1, 0, 2]


def test_trees_refused_where_they_cannot_stay_exact() -> None:
    for name, codec in (("ar", "f32"), ("uhlm", "f32"), ("xcosd", "q8"),
                        ("straightforward", "topk:3"), ("xcosd-e", "f16")):
        with pytest.raises(ValueError):
            check_tree_method(get_method(name, codec=codec))
    check_tree_method(get_method("sd-uplink", codec="q8"))  # its codec is the draft's
    check_tree_method(get_method("xcosd", codec="sparse"))


def _drafted(method: str = "xcosd", row_codec: str = "f32") -> tuple[DraftTree, np.ndarray]:
    q = np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32)
    shape = TreeShape.parse("3x1")
    d = draft_tree(get_method(method), shape, lambda nodes, ids: [q] * len(nodes), SPACE,
                   np.random.default_rng(0), row_codec)
    return d.draft, q


def test_a_tree_sends_its_branching_rows_and_the_server_checks_them() -> None:
    m = get_method("xcosd")
    tree, q = _drafted()
    assert sorted(tree.rows) == [-1]
    assert tree.nbytes() == 6 * (4 + 4 + 2) + 2 + 4 * 4 + 1
    rows = server_rows(m, tree, SPACE)[-1]
    assert np.array_equal(rows[0], q) and len(rows) == 3
    # siblings drawn without replacement: three different tokens, each row q without
    # the earlier ones, renormalised
    assert len(set(tree.ids[:3].tolist())) == 3
    for k in (1, 2):
        taken = SPACE.to_common[tree.ids[:k]]
        want = q.astype(np.float64)
        want[taken] = 0.0
        np.testing.assert_allclose(rows[k], want / want.sum(), rtol=1e-6)
    lying = dataclasses.replace(tree, q_values=tree.q_values * np.float32(0.5))
    with pytest.raises(ProtocolError, match="q\\(x\\)"):
        server_rows(m, lying, SPACE)
    missing = dataclasses.replace(tree, rows={})
    with pytest.raises(ProtocolError, match="rows of nodes"):
        server_rows(m, missing, SPACE)
    # a committed top-k row: the children come from the committed row, and the
    # server decodes exactly that row
    tree, _ = _drafted(row_codec="topk:2")
    row = server_rows(m, tree, SPACE)[-1][0]
    assert np.count_nonzero(row) == 2 and row.sum() == pytest.approx(1.0)
    assert all(row[SPACE.to_common[t]] > 0 for t in tree.ids[:3])


def test_siblings_without_replacement_start_over_when_nothing_is_left() -> None:
    q = np.array([0.5, 0.5, 0.0, 0.0], dtype=np.float32)
    sib = Siblings(q, distinct=True)
    sib.take(0)
    np.testing.assert_array_equal(sib.current, [0.0, 1.0, 0.0, 0.0])
    sib.take(1)
    assert sib.current is q  # both drawn: the third sibling comes from q again
    iid = Siblings(q, distinct=False)
    iid.take(0)
    assert iid.current is q


def test_residual_after_a_rejected_sibling() -> None:
    r = np.array([0.4, 0.1, 0.1, 0.2, 0.1, 0.1], dtype=np.float32)
    q = np.array([0.7, 0.1, 0.2, 0.0], dtype=np.float32)  # over V_C = {0, 2, 3, 5}
    out = residual(r, q, SPACE)
    assert out is not None
    want = np.maximum(r.astype(np.float64) - SPACE.expand(q), 0.0)
    np.testing.assert_allclose(out, want / want.sum(), rtol=1e-6)
    assert residual(SPACE.expand(q), q, SPACE) is None  # nothing left but by rounding


def test_walk_on_known_rows() -> None:
    """A target that puts all its mass on one V_C token: the walk accepts the first
    child drawn as that token (every earlier sibling is rejected) and the bonus is
    the leaf's own row; a target all on V_O rejects every child and HR returns a
    V_O token."""
    shape = TreeShape.parse("4x1")
    q = np.full(4, 0.25, dtype=np.float32)

    def point(t: int) -> np.ndarray:
        r = np.zeros(6, dtype=np.float32)
        r[t] = 1.0
        return r

    def trows(ids: list[int]) -> np.ndarray:
        # all on 3 after the context; after a 3 all on 5, after anything else on 0
        return np.stack([point(3), *(point(5) if t == 3 else point(0) for t in ids)])

    rng = np.random.default_rng(5)
    for _ in range(50):
        res = simulate_tree_round("xcosd", shape, trows, lambda nodes, ids: [q] * len(nodes),
                                  SPACE, rng)
        if res.path:
            assert res.tokens[:2] == [3, 5]
        else:
            assert res.tokens == [3]
    res = simulate_tree_round("xcosd", shape, lambda ids: np.stack([point(4)] * 9),
                              lambda nodes, ids: [q] * len(nodes), SPACE, rng)
    assert res.tokens == [4] and res.path == []


def test_a_hostile_tree_is_refused_with_a_typed_error() -> None:
    tree, _ = _drafted()
    m, rng = get_method("xcosd"), np.random.default_rng(0)
    p = np.full((7, 6), 1 / 6, dtype=np.float32)

    def variant(**kw: object) -> DraftTree:
        fields = {"parents": tree.parents, "ids": tree.ids, "q_values": tree.q_values,
                  "rows": tree.rows, "row_codec": tree.row_codec, **kw}
        return DraftTree(**fields)  # type: ignore[arg-type]

    bad = {
        "bad_field": [variant(parents=np.array([-1, 2, -1, 0, 1, 2])),  # a later parent
                      variant(parents=tree.parents[:5]),
                      variant(q_values=np.where(np.arange(6) == 4, np.float32(np.nan),
                                                tree.q_values)),
                      variant(q_values=np.where(np.arange(6) == 4, np.float32(0),
                                                tree.q_values))],
        "bad_token": [variant(ids=np.where(np.arange(6) == 4, 1, tree.ids)),  # V_O
                      variant(ids=np.where(np.arange(6) == 4, 99, tree.ids))],
        "bad_message": [variant(rows={})],
    }
    for code, trees in bad.items():
        for t in trees:
            with pytest.raises(ProtocolError) as err:
                verify_tree(m, p, t, SPACE, rng)
            assert err.value.code == code
    for codec in ("f16", "nope"):  # bytes no such row makes, a codec no one knows
        with pytest.raises(CodecError):
            verify_tree(m, p, variant(row_codec=codec), SPACE, rng)


def test_verify_tree_needs_a_row_per_node() -> None:
    tree, _ = _drafted()
    with pytest.raises(ValueError):
        verify_tree(get_method("xcosd"), np.full((3, 6), 1 / 6, dtype=np.float32), tree,
                    SPACE, np.random.default_rng(0))


def test_score_tree_loop_matches_scoring_each_path_and_keeps_the_context() -> None:
    target, _ = pair()
    shape = TreeShape((-1, -1, 0, 0, 1, 3))
    ids = [0, 3, 5, 1, 2, 4]
    assert leaf_paths(shape.parents) == [[0, 2], [1, 4], [0, 3, 5]]
    sess = target.start([2, 7])
    rows = score_tree(target, sess, shape.parents, ids)
    assert sess.ids == [2, 7]
    assert rows.shape == (7, target.vocab.size)
    np.testing.assert_array_equal(rows[0], target.table[7])
    for node in range(shape.size):
        np.testing.assert_array_equal(rows[node + 1], target.table[ids[node]])
    # the rows follow the context: a leaf scored after another is not scored after it
    sess2 = target.start([2, 7])
    assert np.array_equal(score_tree(target, sess2, (-1, -1), [4, 6])[2],
                          target.table[6])
    assert sess2.ids == [2, 7]
    np.testing.assert_array_equal(score_tree(target, sess2, (-1, -1), [4, 6])[0],
                                  target.table[7])


def test_rows_after_a_depth_in_one_call() -> None:
    """The rows a drafter needs before a depth's children, multi-token spellings
    included, equal each node's path scored alone."""
    target, _ = pair()
    parents = (-1, -1, 0, 0, 1)
    spelled = [[1], [2, 3], [4], [], [5, 6]]
    sess = target.start([7])
    got = rows_after(target, sess, parents, spelled, [-1, 0, 1, 3, 4])
    assert sess.ids == [7]
    for v, row in zip([-1, 0, 1, 3, 4], got, strict=True):
        path: list[int] = []
        node = v
        while node >= 0:
            path = spelled[node] + path
            node = parents[node]
        np.testing.assert_array_equal(row, target.table[[7, *path][-1]])


def test_every_small_shape_is_named_so_that_parse_reads_it_back() -> None:
    """A round's shape travels as its label (``RoundSettled``, the metrics, the bench's
    rows), so a label must name that very tree or none (``tree:N``): every shape of
    up to 6 nodes, among them ``(-1, -1, 1, 0)``, as large as the full ``2x1`` and
    with the same widths at its first nodes but not that tree."""
    assert TreeShape((-1, -1, 1, 0)).label == "tree:4"
    shapes = [parents for n in range(1, 7)
              for parents in itertools.product(*(range(-1, i) for i in range(n)))]
    assert len(shapes) == 1 + 2 + 6 + 24 + 120 + 720
    for parents in shapes:
        label = TreeShape(parents).label
        if not label.startswith("tree:"):
            assert TreeShape.parse(label).parents == parents, (parents, label)


def _point(pos: int) -> np.ndarray:
    """A V_C row with all its mass at position ``pos``."""
    row = np.zeros(SPACE.n_common, dtype=np.float32)
    row[pos] = 1.0
    return row


def test_device_state_names_the_rejected_node_s_last_child_and_its_row() -> None:
    """The device's record of a rejection of every child of a node below the root is
    that node's: the row its last child was drawn from and that child's token, not
    the root's. Here the root's two children are both the token at V_C position 0
    (its row is a point there: nothing is left after the first, so the second starts
    over), and node 0's three children, drawn without replacement from the other
    three positions, are each of those once: the last one from a point row. No
    method's device half reads ``rejected`` today (SR-DV's candidates skip the
    rejected draft by the server's record), so no law test can see a wrong one; this
    pins it for the one that will."""
    shape = TreeShape((-1, -1, 0, 0, 0))
    rows = {-1: _point(0), 0: np.array([0.0, 0.5, 0.25, 0.25], dtype=np.float32)}
    for seed in range(5):
        drafted = draft_tree(get_method("xcosd"), shape,
                             lambda nodes, ids: [rows[v] for v in nodes], SPACE,
                             np.random.default_rng(seed), "f32")
        ids = drafted.draft.ids.tolist()
        assert ids[:2] == [0, 0] and sorted(ids[2:]) == [2, 3, 5]
        dev = device_state(drafted, 0)
        assert dev.rejected == ids[4]
        np.testing.assert_array_equal(dev.q_common, _point(int(SPACE.to_common[ids[4]])))
        root = device_state(drafted, -1)
        assert root.rejected == 0
        np.testing.assert_array_equal(root.q_common, rows[-1])


def test_rebuilt_rejection_is_the_walk_s_at_a_node_below_the_root() -> None:
    """After a cloud restart the redone round's state is rebuilt from the rows
    (``rebuild_tree_reject``); at node 0 of ``spine:1x3`` (one child at the root,
    three below it) it must be the residual the walk left after node 0's first two
    children, ``normalise(max(normalise(max(p - q_1, 0)) - q_2, 0))`` with ``q_k``
    the row node ``k`` was drawn from, and equal the state the walk itself reached
    when it rejected all three: a residual taken over the root's children instead
    would resample from the wrong law. A leaf has no children to reject."""
    m = get_method("xcosd")
    shape = TreeShape.parse("spine:1x3")
    q = np.full(4, 0.25, dtype=np.float32)
    # after the context all on token 3 (node 0, drawn from a point there, is
    # accepted); after node 0 a row above q at two positions of V_C (each rejected
    # child changes the residual there) and below it at two (the walk can reject
    # all three: 11 of these 40 seeds)
    after = np.array([0.35, 0.1, 0.05, 0.05, 0.1, 0.35], dtype=np.float32)
    p = np.stack([np.eye(6, dtype=np.float32)[3], after, *[np.full(6, 1 / 6, np.float32)] * 3])
    rows = {-1: _point(int(SPACE.to_common[3])), 0: q}
    walked = 0
    for seed in range(40):
        drafted = draft_tree(m, shape, lambda nodes, ids: [rows[v] for v in nodes], SPACE,
                             np.random.default_rng(seed), "f32")
        tree = drafted.draft
        rebuilt = rebuild_tree_reject(m, p, tree, 0, SPACE)
        r = after.astype(np.float64)
        sib = q.astype(np.float64)
        for c in (1, 2):
            r = np.maximum(r - SPACE.expand(sib), 0.0)
            r /= r.sum()
            sib[SPACE.to_common[tree.ids[c]]] = 0.0
            sib /= sib.sum()
        np.testing.assert_allclose(rebuilt.p_star, r, rtol=1e-5, atol=1e-7)
        assert rebuilt.q_common is not None
        np.testing.assert_allclose(rebuilt.q_common, sib, rtol=1e-6)
        assert rebuilt.rejected == int(tree.ids[3])
        v = verify_tree(m, p, tree, SPACE, np.random.default_rng(seed))
        if v.reject is not None and v.node == 0:
            walked += 1
            np.testing.assert_array_equal(rebuilt.p_star, v.reject.p_star)
            np.testing.assert_array_equal(rebuilt.p_raw, v.reject.p_raw)
            np.testing.assert_array_equal(rebuilt.q_common, v.reject.q_common)
            assert rebuilt.rejected == v.reject.rejected
        with pytest.raises(ValueError, match="no children"):
            rebuild_tree_reject(m, p, tree, 1, SPACE)
    assert walked > 0
