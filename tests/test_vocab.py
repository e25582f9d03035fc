"""Real vocabularies from quicktok and the V_C / V_O map between them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xcosd.cli import main
from xcosd.errors import VocabError
from xcosd.vocab import VocabMap, Vocabulary


@pytest.fixture(scope="module")
def vocabs():
    return {n: Vocabulary.load(n) for n in ("llama3", "qwen", "cl100k", "o200k")}


def test_quicktok_tables_are_read_by_id(vocabs):
    import quicktok

    enc = quicktok.get_encoding("llama3")
    v = vocabs["llama3"]
    # token_byte_values() is sorted by bytes; our table must follow ids
    for i in (0, 1000, 50_000, 127_999):
        assert v.token_bytes(i) == enc.decode_single_token_bytes(i)
    text = "Speculative decoding across vocabularies, exactly."
    assert v.decode(v.encode(text)).decode() == text


def test_holes_and_specials(vocabs):
    cl = vocabs["cl100k"]
    assert cl.size == 100_277 and cl.n_regular == 100_256
    with pytest.raises(VocabError):
        cl.token_bytes(100_256)  # unused id
    assert cl.roles["eos"] in cl.special_ids
    assert cl.piece(cl.roles["eos"]) == b""
    with pytest.raises(VocabError):
        cl.token_bytes(10**6)


@pytest.mark.parametrize(
    "draft,target,common",
    [("llama3", "qwen", 109_566), ("llama3", "cl100k", 100_256), ("cl100k", "o200k", 85_033)],
)
def test_common_vocabulary_sizes(vocabs, draft, target, common):
    vm = VocabMap(vocabs[draft], vocabs[target])
    assert vm.summary()["common"] == common


def test_llama3_qwen_shares(vocabs):
    s = VocabMap(vocabs["llama3"], vocabs["qwen"]).summary()
    assert round(100 * s["draft"]["common_share"], 2) == 85.60
    assert round(100 * s["target"]["common_share"], 2) == 72.25


def test_map_is_consistent_by_bytes(vocabs):
    d, t = vocabs["cl100k"], vocabs["o200k"]
    vm = VocabMap(d, t)
    assert np.all(np.diff(vm.common_target_ids) > 0)  # V_C order = ascending target id
    rng = np.random.default_rng(0)
    for k in rng.choice(vm.n_common, 2000, replace=False):
        tid, did = int(vm.common_target_ids[k]), int(vm.common_draft_ids[k])
        if tid in t.special_ids:
            continue
        assert t.token_bytes(tid) == d.token_bytes(did)
        assert vm.draft_to_target[did] == tid and vm.target_to_draft[tid] == did
    # V_O tokens really are absent from the draft vocabulary
    for tid in rng.choice(np.flatnonzero(vm.other_mask), 2000, replace=False):
        assert t.token_bytes(int(tid)) not in d.byte_index or int(tid) in t.special_ids
    # the eos role is matched across vocabularies, whatever its text
    assert vm.draft_to_target[d.roles["eos"]] == t.roles["eos"]


def test_map_fingerprint_is_stable(vocabs):
    # how fast the map builds is measured by the benchmarks (xcosd/bench/), never asserted here
    d, t = vocabs["llama3"], vocabs["qwen"]
    a = VocabMap(d, t)
    assert a.fingerprint == VocabMap(d, t).fingerprint
    assert a.fingerprint != VocabMap(vocabs["cl100k"], t).fingerprint


def test_tli_restricts_and_renormalises(vocabs):
    vm = VocabMap(vocabs["cl100k"], vocabs["o200k"])
    rng = np.random.default_rng(1)
    q = rng.dirichlet(np.ones(vocabs["cl100k"].size)).astype(np.float32)
    out = vm.draft_to_target_probs(q)
    assert out.shape == (vocabs["o200k"].size,)
    assert abs(out.sum() - 1) < 1e-5 and np.all(out[~vm.common_mask] == 0)
    k = int(vm.common_draft_ids[5])
    ratio = out[vm.draft_to_target[k]] / q[k]
    assert np.isclose(ratio, 1 / q[vm.common_draft_ids].sum(dtype=np.float64), rtol=1e-4)


def test_encode_bytes_greedy(vocabs):
    v = vocabs["qwen"]
    data = "naïve 東京 \x00".encode()
    assert v.decode(v.encode_bytes(data)) == data


def test_a_map_readies_its_drafts_look_ahead_for_re_tokenising():
    # built afresh: the module's shared vocabularies may have computed it already
    draft, target = Vocabulary.load("o200k"), Vocabulary.load("llama3")
    assert "max_token_len" not in vars(draft)
    VocabMap(draft, target)
    # computed with the map, not in the first round that re-tokenises a V_O token
    assert vars(draft)["max_token_len"] == max(len(b) for b in draft.byte_index)
    assert draft.decode(draft.encode_bytes(b" tokenisation")) == b" tokenisation"


def test_tiktoken_file(tmp_path):
    import base64

    lines = [base64.b64encode(b).decode() + f" {i}" for i, b in enumerate([b"a", b"b", b"ab"])]
    f = tmp_path / "tiny.tiktoken"
    f.write_text("\n".join(lines))
    v = Vocabulary.from_tiktoken_file(f, special_tokens={"<eos>": 3}, roles={"eos": "<eos>"})
    assert v.size == 4 and v.roles["eos"] == 3 and v.encode_bytes(b"abab") == [2, 2]
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all here\n")
    with pytest.raises(VocabError):
        Vocabulary.from_tiktoken_file(bad)


def test_cli_vocab_json(capsys):
    assert main(["vocab", "llama3", "qwen", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["common"] == 109_566
    assert info["draft"]["name"] == "llama3" and info["target"]["size"] == 151_669


def test_unknown_vocabulary():
    with pytest.raises(VocabError, match="unknown vocabulary"):
        Vocabulary.load("no-such-vocab")


def test_roles_pair_one_to_one():
    # one draft token playing eos and eot (and pad), two distinct target tokens
    draft = Vocabulary("d", [b"a", b"b", b"<end>"], special=[2],
                       roles={"eos": 2, "eot": 2, "pad": 2})
    target = Vocabulary("t", [b"<pad>", b"<eos>", b"<eot>", b"a", b"c"], special=[0, 1, 2],
                        roles={"pad": 0, "eos": 1, "eot": 2})
    vm = VocabMap(draft, target)
    assert vm.common_target_ids.tolist() == [1, 3]
    assert vm.common_draft_ids.tolist() == [2, 0]
    assert len(set(vm.common_draft_ids.tolist())) == vm.n_common
    assert vm.other_mask.tolist() == [True, False, True, False, True]


def test_the_sparse_tli_row_is_the_dense_one_on_a_real_map(vocabs):
    """The device builds its TLI row from the kept set (``restrict_kept_support``),
    with a shortcut for a kept set of one token (greedy, top-k 1). On a real map
    (Llama-3 drafting for Qwen: V_C is not in draft-id order) it must be the dense
    ``restrict_to_common(warp(row))`` (bit for bit for one kept token; else but for
    the order the float64 total is summed in), its support ascending, and refuse a
    kept set outside V_C as the dense path does."""
    from xcosd.errors import InvalidDistribution
    from xcosd.methods.tli import restrict_kept_support, restrict_to_common
    from xcosd.sampling import SamplingParams, warp, warp_kept

    vm = VocabMap(vocabs["llama3"], vocabs["qwen"])
    size = vocabs["llama3"].size
    rng = np.random.default_rng(4)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_k=50),
              SamplingParams(top_p=0.9), SamplingParams(top_k=50, temperature=0.7)]
    rows = [rng.dirichlet(np.full(size, a)).astype(np.float32) for a in (0.01, 0.5)]
    tied = np.full(size, 1.0 / size, dtype=np.float32)  # every entry the maximum
    rows.append(tied)
    for row in rows:
        for p in params:
            q, support = restrict_kept_support(warp_kept(row, p), vm.common_draft_ids,
                                               vm.draft_to_common)
            dense = restrict_to_common(warp(row, p), vm.common_draft_ids)
            if support is not None and support.shape[0] == 1:
                assert np.array_equal(q, dense), p.label()
            else:  # the float64 total is summed in another order: an ulp apart
                assert np.allclose(q, dense, rtol=1e-6, atol=0), p.label()
            if support is not None:  # None: a large kept set, built densely
                assert np.all(np.diff(support) > 0)
                assert np.array_equal(np.flatnonzero(q), support), p.label()
    # a greedy choice outside V_C: no mass on V_C, on either path
    other = int(np.flatnonzero(vm.draft_to_common < 0)[0])
    row = np.full(size, 1e-7, dtype=np.float32)
    row[other] = 0.5
    greedy = SamplingParams(temperature=0)
    with pytest.raises(InvalidDistribution):
        restrict_kept_support(warp_kept(row, greedy), vm.common_draft_ids, vm.draft_to_common)
    with pytest.raises(InvalidDistribution):
        restrict_to_common(warp(row, greedy), vm.common_draft_ids)


@pytest.mark.parametrize(("draft", "target", "runs"), [
    ("llama3", "llama3", 3), ("o200k", "o200k", 2), ("llama3", "cl100k", 2),
    ("cl100k", "o200k", None), ("qwen", "llama3", None)])
def test_v_c_read_by_runs_is_the_gathered_row(vocabs, draft, target, runs):
    """A draft that shares the target's ids reads V_C out of its row as a few runs
    (slices) instead of id by id; the TLI vector is the same, bit for bit, and the
    draft's row is left as it was."""
    from xcosd.methods.tli import restrict_to_common

    vm = VocabMap(vocabs[draft], vocabs[target])
    idx = vm.common_draft_index
    if runs is None:
        assert idx is vm.common_draft_ids  # scattered ids: gathered as before
    else:
        assert isinstance(idx, tuple) and len(idx) == runs
        assert np.array_equal(np.concatenate([np.arange(r.start, r.stop) for r in idx]),
                              vm.common_draft_ids)
    rng = np.random.default_rng(3)
    row = rng.dirichlet(np.full(vocabs[draft].size, 0.1)).astype(np.float32)
    before = row.copy()
    q = restrict_to_common(row, idx)
    assert np.array_equal(q.view(np.uint32), restrict_to_common(row, vm.common_draft_ids)
                          .view(np.uint32))
    assert np.array_equal(row, before)
    # one run: the row is read through a view, and the vector is still its own array
    one = (slice(0, 7),)
    q1 = restrict_to_common(row, one)
    q1[0] = -1.0
    assert np.array_equal(row, before)
    assert np.array_equal(restrict_to_common(row, one).view(np.uint32),
                          restrict_to_common(row, np.arange(7)).view(np.uint32))
