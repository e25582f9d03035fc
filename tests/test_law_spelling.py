"""The law where the target spells one string with two ids, and emits both.

SentencePiece vocabularies with byte fallback hold strings twice (Gemma-3's ``,``
is a piece, 236764, and a byte token, 282). V_C pairs the draft's token with the id
the target's tokenizer writes (``xcosd/vocab/spelling.py``); the other id stays in
V_O. Real Gemma-3 almost never emits its byte tokens, but nothing in the methods may
rely on that: here a bigram target whose vocabulary spells ``,`` twice (id 2, the
"byte token", and id 6, the one its tokenizer writes) puts real mass on both, and a
draft that spells ``b`` twice too (ids 1 and 6, its tokenizer writing 6).

Every lossless method keeps the target's law through the state machines (chains and
trees, exact and row codecs, faults injected) and over ZeroMQ, the target vocabulary crossing the
wire as a table (the edge has no tokenizer to ask which id is written). A control
that folds both ids' mass onto the written one, as a verifier comparing by bytes
would, fails the same check, and so does a lossy method: the check tells the two
ids apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import xcosd
from xcosd.methods import Space
from xcosd.methods.tree import TreeShape
from xcosd.nodes.pump import Pump
from xcosd.protocol.vocab_transfer import table_to_vocab, vocab_to_table
from xcosd.sampling import SamplingParams, warp
from xcosd.vocab import VocabMap, Vocabulary

from .helpers.faults import Faults, FaultyLink
from .helpers.law import bigram_law, check_law, committed_row
from .session_pairs import BigramModel, _bigram_table, closed_sessions_settle

#: the target spells "," twice: id 2 (lowest, the byte token) and id 6 (written)
TARGET_TOKENS = [b"a", b"b", b",", b"ab", b"b,", b"cd", b",", b"<eos>"]
TARGET_EOS, TARGET_WRITTEN, TARGET_BYTE = 7, 6, 2
#: the draft spells "b" twice: id 1 (lowest) and id 6 (written)
DRAFT_TOKENS = [b"a", b"b", b",", b"ab", b"ba", b"c", b"b", b"<eos>"]
DRAFT_EOS, DRAFT_WRITTEN = 7, 6
PROMPT = "a"
TOKENS = 4
DRAFT_LEN = 3
N_CHAIN = 1_500  # TV about 0.1 at one step
N_TREE = 600  # TV about 0.12
N_SOCKET = 1_200
N_CONTROL = 2_000
T1 = SamplingParams()
TOPP = SamplingParams(temperature=0.8, top_p=0.9)


def _with_spelling(model: BigramModel, written: int) -> BigramModel:
    """``model`` whose vocabulary says its tokenizer writes ``written`` for the bytes
    it shares with a lower id (a table model has no tokenizer to ask)."""
    v = model.vocab
    model.vocab = Vocabulary(v.name, v.tokens, special=v.special_ids, roles=v.roles,
                             spelled=[written])
    return model


def dup_pair() -> tuple[BigramModel, BigramModel]:
    """(target, draft): Dirichlet bigram tables; the target's rows put at least 12 %
    on each of its two ``,`` ids."""
    t = _bigram_table(len(TARGET_TOKENS), TARGET_EOS, 700, 0.0, 0.8).astype(np.float64)
    t[:, TARGET_BYTE] += 0.15
    t[:, TARGET_WRITTEN] += 0.15
    t /= t.sum(axis=1, keepdims=True)
    target = BigramModel(TARGET_TOKENS, t.astype(np.float32), TARGET_EOS, name="t-dup")
    draft = BigramModel(DRAFT_TOKENS, _bigram_table(len(DRAFT_TOKENS), DRAFT_EOS, 701, 0.0, 0.6),
                        DRAFT_EOS, name="d-dup")
    return _with_spelling(target, TARGET_WRITTEN), _with_spelling(draft, DRAFT_WRITTEN)


@pytest.fixture(scope="module")
def link() -> Pump:
    return Pump(*dup_pair())


def exact_law(target: BigramModel, space: Space, method: str = "ar", codec: str = "f32",
              params: SamplingParams = T1) -> np.ndarray:
    return bigram_law(target.table, target.tokenize(PROMPT), TOKENS,
                      lambda p: committed_row(method, codec, warp(p, params), space))


def generate(link: Pump, method: str, n: int, seed: int, *, codec: str = "f32",
             params: SamplingParams = T1, tree: TreeShape | str | None = None,
             row_codec: str | None = None, **opts: Any) -> np.ndarray:
    seqs = np.empty((n, TOKENS), dtype=np.int64)
    for i in range(n):
        es = link.session(method, codec=codec, prompt=PROMPT, max_new_tokens=TOKENS,
                          params=params, seed=seed + i, draft_len=DRAFT_LEN,
                          adaptive_draft=False, tree=tree, tree_row_codec=row_codec, **opts)
        seqs[i] = link.drive(es).token_ids
    return seqs


# -- the pairing -----------------------------------------------------------------------


def test_v_c_pairs_the_written_ids_and_leaves_the_other_to_v_o() -> None:
    target, draft = dup_pair()
    vmap = VocabMap(draft.vocab, target.vocab)
    comma_d = DRAFT_TOKENS.index(b",")
    assert vmap.draft_to_target[comma_d] == TARGET_WRITTEN
    assert vmap.other_mask[TARGET_BYTE] and not vmap.common_mask[TARGET_BYTE]
    # the draft's own duplicate: its written id drafts "b", the other none
    assert vmap.draft_to_target[DRAFT_WRITTEN] == TARGET_TOKENS.index(b"b")
    assert vmap.draft_to_target[1] == -1
    # without the spelling (the lowest-id rule) both would pair the other way
    bare = VocabMap(Vocabulary("d", DRAFT_TOKENS, special=[DRAFT_EOS], roles={"eos": DRAFT_EOS}),
                    Vocabulary("t", TARGET_TOKENS, special=[TARGET_EOS],
                               roles={"eos": TARGET_EOS}))
    assert bare.draft_to_target[comma_d] == TARGET_BYTE and bare.draft_to_target[1] == 1
    assert bare.fingerprint != vmap.fingerprint


def test_the_spelling_crosses_the_wire_and_is_fingerprinted() -> None:
    target, _ = dup_pair()
    table = vocab_to_table(target.vocab)
    assert np.frombuffer(table.kinds, np.uint8)[TARGET_WRITTEN] == 3
    back = table_to_vocab(table)
    assert back.spelled == {TARGET_WRITTEN} and back.fingerprint == target.vocab.fingerprint
    unmarked = Vocabulary(target.vocab.name, TARGET_TOKENS, special=[TARGET_EOS],
                          roles={"eos": TARGET_EOS})
    assert unmarked.fingerprint != target.vocab.fingerprint


def test_the_target_emits_both_ids(link: Pump) -> None:
    law = exact_law(link.target, link.space)  # type: ignore[arg-type]
    first = law.sum(axis=tuple(range(1, TOKENS)))
    assert first[TARGET_BYTE] > 0.12 and first[TARGET_WRITTEN] > 0.12


# -- the law through the state machines --------------------------------------------------

CHAINS: list[tuple[str, dict[str, Any], str, SamplingParams]] = [
    ("sd-uplink", {}, "f32", T1),
    ("straightforward", {}, "sparse", T1),
    ("xcosd", {}, "f32", TOPP),
    ("xcosd", {"hr_presample": False}, "sparse", T1),
    ("xcosd-e", {}, "f32", T1),
    ("xcosd-e", {"K": 1, "M": 3}, "f32", TOPP),
]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "opts", "codec", "params"), CHAINS,
                         ids=[f"{m}{'-' + str(o) if o else ''}-{c}-{p.label()}"
                              for m, o, c, p in CHAINS])
def test_chains_keep_the_law(link: Pump, method: str, opts: dict[str, Any], codec: str,
                             params: SamplingParams) -> None:
    seqs = generate(link, method, N_CHAIN, 10_000, codec=codec, params=params, **opts)
    report = check_law(seqs, exact_law(link.target, link.space, method, codec, params))  # type: ignore[arg-type]
    assert report.ok, f"{method} {opts} {codec} {params.label()}: {report}"
    assert np.isin(TARGET_BYTE, seqs) and np.isin(TARGET_WRITTEN, seqs)


TREES: list[tuple[str, str, str | None, SamplingParams]] = [
    ("xcosd-e", "2x2", None, T1),
    ("xcosd", "4x1", "f32", TOPP),
    ("straightforward", "spine:3x2", "topk:3", T1),
    ("sd-uplink", "2x2", "head:3", T1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "shape", "row_codec", "params"), TREES)
def test_trees_keep_the_law(link: Pump, method: str, shape: str, row_codec: str | None,
                            params: SamplingParams) -> None:
    seqs = generate(link, method, N_TREE, 20_000, params=params,
                    tree=TreeShape.parse(shape), row_codec=row_codec)
    report = check_law(seqs, exact_law(link.target, link.space, method, "f32", params))  # type: ignore[arg-type]
    assert report.ok, f"{method} {shape} rows {row_codec}: {report}"


@pytest.mark.slow
@pytest.mark.parametrize(("method", "opts"), [("xcosd-e", {"K": 1, "M": 3}),
                                              ("xcosd", {"hr_presample": False})])
def test_faults_keep_the_law(link: Pump, method: str, opts: dict[str, Any]) -> None:
    """Dropped, duplicated and late messages and cloud restarts (mid-resolution too,
    where the round is redone): the replies that resume a round name the byte id
    bare, and the edge spells it from its table."""
    faulty = FaultyLink(link, Faults(), seed=50_000)
    seqs = np.empty((N_CHAIN, TOKENS), dtype=np.int64)
    for i in range(N_CHAIN):
        es = faulty.generate(method, seed=50_000 + i, prompt=PROMPT, max_new_tokens=TOKENS,
                             params=T1, draft_len=DRAFT_LEN, adaptive_draft=False, **opts)
        seqs[i] = es.token_ids
    report = check_law(seqs, exact_law(link.target, link.space, method))  # type: ignore[arg-type]
    c = faulty.counts
    assert report.ok, f"{method} through faults ({c}): {report}"
    assert min(c.dropped, c.duplicated, c.restarts) > 20 and c.redone > 0, c
    assert np.isin(TARGET_BYTE, seqs)


# -- lossy controls fail the same check --------------------------------------------------


class FoldedTarget(BigramModel):
    """A target whose rows put the byte token's mass on the written id: what a
    verifier that compares tokens by bytes, not ids, emits."""

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        super()._fill_row(context, out)
        out[TARGET_WRITTEN] += out[TARGET_BYTE]
        out[TARGET_BYTE] = 0.0


def test_folding_the_two_ids_fails_the_same_check(link: Pump) -> None:
    target, draft = dup_pair()
    folded = _with_spelling(FoldedTarget(TARGET_TOKENS, target.table, TARGET_EOS,
                                         name="t-folded"), TARGET_WRITTEN)
    seqs = generate(Pump(folded, draft), "xcosd-e", N_CONTROL, 30_000)
    report = check_law(seqs, exact_law(link.target, link.space))  # type: ignore[arg-type]
    assert not report.ok, f"folding the duplicates passed: {report}"


def test_a_lossy_method_fails_the_same_check(link: Pump) -> None:
    seqs = generate(link, "target-resample", N_CONTROL, 40_000)
    report = check_law(seqs, exact_law(link.target, link.space))  # type: ignore[arg-type]
    assert not report.ok, f"target-resample passed: {report}"


# -- over ZeroMQ, the table crossing the wire ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("method", "tree"), [("xcosd-e", None), ("xcosd", "2x2")])
async def test_over_zeromq(method: str, tree: str | None) -> None:
    target, draft = dup_pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_batch=64,
                               max_sessions=2 * N_SOCKET) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            results = await asyncio.gather(*[
                edge.generate(PROMPT, max_new_tokens=TOKENS, seed=90_000 + i,
                              method=method, draft_len=DRAFT_LEN, tree=tree)
                for i in range(N_SOCKET)])
            # the edge was given no target vocabulary: it came as a table, spelling
            # marked, and V_C pairs the draft's "," with the written id
            vmap = edge.vocab_map
            assert vmap is not None
            assert vmap.draft_to_target[DRAFT_TOKENS.index(b",")] == TARGET_WRITTEN
        await closed_sessions_settle(cloud)
    seqs = np.array([r.token_ids for r in results], dtype=np.int64)
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    report = check_law(seqs, exact_law(target, space))
    assert report.ok, f"{method} tree {tree} over ZeroMQ: {report}"
    text = {r.text for r in results}
    assert any("," in t for t in text)
