"""A transformers model scores a draft tree in one forward (tree attention mask,
positions by depth): its rows equal scoring each leaf's path alone, the session's
context and cache are left as they were, and a tree after a partly cached context or
from an empty one agrees too (``xcosd/models/transformers_model.py``,
``score_tree``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from xcosd.methods.tree import TreeShape  # noqa: E402
from xcosd.models import TransformersModel  # noqa: E402
from xcosd.models.tiny import byte_level_tokenizer, save_tiny_llama  # noqa: E402
from xcosd.models.tree_scoring import TreeScorer, score_tree, score_tree_by_paths  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> TransformersModel:
    return TransformersModel.from_pretrained(
        save_tiny_llama(tmp_path_factory.mktemp("tiny-tree"), byte_level_tokenizer()))


@pytest.mark.parametrize("shape", ["3x2", "spine:3x2x2", "chain:4", "5"])
def test_one_forward_equals_each_path_alone(model: TransformersModel, shape: str) -> None:
    assert isinstance(model, TreeScorer) and model.per_session
    tree = TreeShape.parse(shape)
    rng = np.random.default_rng(len(shape))
    ids = rng.integers(3, model.vocab.size, tree.size).tolist()
    prompt = model.tokenize("The tree of drafts")
    a, b = model.start(prompt), model.start(prompt)
    model.score([(a, [])])  # a's context cached, b's not: both paths of the call
    one = score_tree(model, a, tree.parents, ids)
    loop = score_tree_by_paths(model, b, tree.parents, ids)
    np.testing.assert_allclose(one, loop, atol=TOL)
    assert a.ids == prompt and b.ids == prompt
    # what is cached is the context alone: the next round scores as a fresh session
    nxt = ids[: 2]
    fresh = model.start(prompt)
    np.testing.assert_allclose(model.score([(a, nxt)])[0], model.score([(fresh, nxt)])[0],
                               atol=TOL)


def test_tree_after_appended_tokens_and_from_an_empty_context(model: TransformersModel) -> None:
    tree = TreeShape.parse("2x2")
    ids = [40, 41, 42, 43, 44, 45]
    s = model.start(model.tokenize("abc"))
    model.score([(s, [])])
    model.append(s, model.tokenize(" def"))  # uncached tokens fed with the tree
    ref = model.start(list(s.ids))
    np.testing.assert_allclose(score_tree(model, s, tree.parents, ids),
                               score_tree_by_paths(model, ref, tree.parents, ids), atol=TOL)
    e, f = model.start([]), model.start([])
    np.testing.assert_allclose(score_tree(model, e, tree.parents, ids),
                               score_tree_by_paths(model, f, tree.parents, ids), atol=TOL)
    with pytest.raises(ValueError):
        score_tree(model, e, (-1, 1), [4, 5])
