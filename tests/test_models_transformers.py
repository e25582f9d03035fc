"""The transformers backend on tiny local Llamas: cache, rollback and batching agree
with a no-cache reference forward pass."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from xcosd.errors import ModelError  # noqa: E402
from xcosd.models import LanguageModel, TransformersModel, load_model  # noqa: E402
from xcosd.models.tiny import (  # noqa: E402
    byte_level_tokenizer,
    save_tiny_llama,
    sentencepiece_tokenizer,
)

TOL = 1e-4
TEXT = ("Return a new list containing all items from the iterable in ascending order. "
        "A custom key function can be supplied to customize the sort order.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-bl"), byte_level_tokenizer())


@pytest.fixture(scope="module")
def model(model_dir) -> TransformersModel:
    return TransformersModel.from_pretrained(model_dir)


def reference(m: TransformersModel, ids: list[int]) -> np.ndarray:
    """Rows after each prefix of ``ids`` from one full forward pass, no cache."""
    full = ([m._start] if m._add_bos or not ids else []) + ids
    with torch.inference_mode():
        logits = m.model(input_ids=torch.tensor([full])).logits[0].float()
    return torch.softmax(logits, -1).numpy()


def test_import_does_not_pull_torch() -> None:
    import subprocess

    code = "import sys, xcosd.models; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_is_a_language_model(model: TransformersModel) -> None:
    assert isinstance(model, LanguageModel)
    assert model.vocab.size == len(model.tokenizer)
    assert model.vocab.roles["eos"] == model.tokenizer.eos_token_id


def test_incremental_scoring_matches_no_cache_reference(model: TransformersModel) -> None:
    ids = model.tokenize(TEXT)[:24]
    s = model.start(ids[:5])
    got = [model.score([(s, ids[5:9])])[0]]  # p after 5..9 tokens
    model.append(s, ids[9:12])  # appended, not scored
    got.append(model.score([(s, ids[12:13])])[0])  # after 12, 13
    got.append(model.score([(s, [])])[0])  # after 13 again
    ref = reference(model, ids[:13])
    off = len(ref) - 13  # BOS prefix or not
    np.testing.assert_allclose(got[0], ref[off + 4: off + 9], atol=TOL)
    np.testing.assert_allclose(got[1], ref[off + 11: off + 13], atol=TOL)
    np.testing.assert_allclose(got[2][0], ref[off + 12], atol=TOL)
    for rows in got:
        assert rows.dtype == np.float32
        np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)


def test_rollback_crops_the_cache(model: TransformersModel) -> None:
    ids = model.tokenize(TEXT)[:20]
    s = model.start(ids[:6])
    model.score([(s, ids[6:10])])
    model.rollback(s, 7)  # 1 of 4 drafts accepted
    assert s.ids == ids[:7]
    assert s.cached == 7  # the accepted prefix stays cached
    alt = [ids[15], ids[3]]
    rows = model.score([(s, alt)])[0]
    ref = reference(model, ids[:7] + alt)
    np.testing.assert_allclose(rows, ref[-3:], atol=TOL)
    model.rollback(s, 0)
    assert s.ids == [] and s.cached == 0
    np.testing.assert_allclose(model.score([(s, [])])[0][0], reference(model, [])[0], atol=TOL)


def test_empty_prompt_starts_from_bos(model: TransformersModel) -> None:
    s = model.start([])
    row = model.score([(s, [])])[0][0]
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([[model.vocab.roles["bos"]]])).logits[0, -1]
    np.testing.assert_allclose(row, torch.softmax(logits.float(), -1).numpy(), atol=TOL)
    assert s.ids == []


def _batched_equals_one_by_one(model: TransformersModel) -> None:
    ids = model.tokenize(TEXT)
    specs = [(ids[:3], ids[3:7]), (ids[:11], ids[11:12]), ([], []), (ids[:7], [])]
    batched = [model.start(p) for p, _ in specs]
    single = [model.start(p) for p, _ in specs]
    for step in range(2):  # second round runs on caches of different lengths
        news = [n if step == 0 else ids[20: 20 + k] for (_, n), k in zip(specs, (2, 0, 3, 1),
                                                                      strict=True)]
        got = model.score(list(zip(batched, news, strict=True)))
        for s, n, g in zip(single, news, got, strict=True):
            np.testing.assert_allclose(g, model.score([(s, n)])[0], atol=TOL)
        # a rejection in one session only
        model.rollback(batched[0], len(batched[0].ids) - 1)
        model.rollback(single[0], len(single[0].ids) - 1)
    for s in batched:
        model.end(s)


@pytest.mark.parametrize("per_session", [True, False])
def test_batched_equals_one_by_one(model: TransformersModel, per_session: bool) -> None:
    """Both batched paths: attention session by session over the sessions' own
    buffers (Llama's default), and the gathered batch cache (any other
    architecture)."""
    assert model.per_session
    model.per_session = per_session
    try:
        _batched_equals_one_by_one(model)
    finally:
        model.per_session = True


def test_batched_sliding_window_equals_one_by_one_and_the_reference(tmp_path) -> None:
    """A sliding window (Mistral's, 4 positions) shorter than the contexts: the
    per-session attention applies it as the model's own masks do."""
    import transformers

    tok = byte_level_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
        max_position_embeddings=256, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    net = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        net.lm_head.weight.mul_(20.0)
    net.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m = TransformersModel.from_pretrained(tmp_path)
    assert m.per_session
    _batched_equals_one_by_one(m)
    ids = m.tokenize(TEXT)[:16]
    a, b = m.start(ids[:9]), m.start(ids[:4])
    m.score([(a, []), (b, [])])
    rows = m.score([(a, ids[9:12]), (b, ids[4:6])])
    np.testing.assert_allclose(rows[0], reference(m, ids[:12])[-4:], atol=TOL)
    np.testing.assert_allclose(rows[1], reference(m, ids[:6])[-3:], atol=TOL)


def test_sentencepiece_model_and_unused_ids(tmp_path) -> None:
    tok = sentencepiece_tokenizer()
    save_tiny_llama(tmp_path, tok, layers=2)
    # a padded embedding matrix: ids past the tokenizer have no bytes and get 0
    import transformers

    m0 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    m0.resize_token_embeddings(len(tok) + 8)
    m0.save_pretrained(tmp_path)
    m = load_model(str(tmp_path))
    assert isinstance(m, TransformersModel)
    assert m.vocab.size == len(tok) + 8
    rows = m.score([(m.start(m.tokenize("a test, é")), [])])[0]
    assert np.all(rows[:, len(tok):] == 0)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)


def test_bad_ids_and_paths(model: TransformersModel, tmp_path) -> None:
    with pytest.raises(ModelError):
        model.score([(model.start([]), [model.vocab.size])])
    with pytest.raises(ModelError):
        TransformersModel.from_pretrained(tmp_path)
    with pytest.raises(ModelError):
        TransformersModel.from_gguf(tmp_path / "missing.gguf")


# -- GGUF files and the model cache ---------------------------------------------------


def write_tiny_gguf(path, *, layers: int = 2, hidden: int = 64, seed: int = 0):
    """A random-weight Llama in GGUF form, written with the ``gguf`` package: Q8_0
    matrices (so loading really dequantises) over the byte-level test tokenizer."""
    import json

    gguf = pytest.importorskip("gguf")
    tok = byte_level_tokenizer()
    tokens = [""] * len(tok)
    for text, i in tok.get_vocab().items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(hidden // 4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(True)
    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), hidden, 1.0)
    matrix("output.weight", len(tokens), hidden, 0.5)
    norm("output_norm.weight")
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for part, rows, cols in (("attn_q", hidden, hidden), ("attn_k", hidden // 2, hidden),
                                 ("attn_v", hidden // 2, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", 2 * hidden, hidden), ("ffn_up", 2 * hidden, hidden),
                                 ("ffn_down", hidden, 2 * hidden)):
            matrix(f"blk.{i}.{part}.weight", rows, cols, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf")


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "xcosd-cache"
    monkeypatch.setenv("XCOSD_CACHE", str(root))
    monkeypatch.delenv("XCOSD_NO_MODEL_CACHE", raising=False)
    return root


def entries(root) -> list:
    hf = root / "hf"
    return sorted(hf.iterdir()) if hf.is_dir() else []


def assert_same_model(a: TransformersModel, b: TransformersModel) -> None:
    """Same weights bit for bit, same vocabulary, same start state, same rows."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert a.vocab.tokens == b.vocab.tokens and a.vocab.special_ids == b.vocab.special_ids
    assert a.vocab.roles == b.vocab.roles and a.vocab.name == b.vocab.name == a.name == b.name
    assert (a._start, a._add_bos, a._pad) == (b._start, b._add_bos, b._pad)
    ids = a.tokenize(TEXT)
    assert ids == b.tokenize(TEXT)
    ra = a.score([(a.start(ids[:6]), ids[6:14])])[0]
    rb = b.score([(b.start(ids[:6]), ids[6:14])])[0]
    np.testing.assert_allclose(ra, rb, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_gguf_is_converted_once_and_then_loaded_from_the_cache(tiny_gguf, cache_root) -> None:
    fresh = TransformersModel.from_gguf(tiny_gguf, cache=False)
    assert entries(cache_root) == []
    assert fresh.vocab.size == len(fresh.tokenizer) and fresh._add_bos
    first = TransformersModel.from_gguf(tiny_gguf)  # converts and writes the entry
    (entry,) = entries(cache_root)
    assert entry.name.startswith("tiny-q8-")
    assert (entry / "model.safetensors").is_file() and (entry / "tokenizer.json").is_file()
    cached = load_model(str(tiny_gguf))
    assert isinstance(cached, TransformersModel)
    assert cached.model.config._name_or_path == str(entry)  # read from the entry, not the file
    assert entries(cache_root) == [entry]  # no leftover temporary directories
    assert_same_model(fresh, first)
    assert_same_model(fresh, cached)
    # the dtype is part of the key: bfloat16 is another entry, in bfloat16
    half = TransformersModel.from_gguf(tiny_gguf, dtype="bfloat16")
    assert half.model.dtype == torch.bfloat16 and len(entries(cache_root)) == 2
    again = TransformersModel.from_gguf(tiny_gguf, dtype="bfloat16")
    assert str(again.model.config._name_or_path).startswith(str(cache_root))
    assert_same_model(half, again)


@pytest.mark.slow
def test_model_cache_opt_out_and_broken_or_stale_entries(tiny_gguf, tmp_path, cache_root,
                                                         monkeypatch) -> None:
    from xcosd.models import model_cache

    monkeypatch.setenv("XCOSD_NO_MODEL_CACHE", "1")
    TransformersModel.from_gguf(tiny_gguf)
    assert entries(cache_root) == []
    monkeypatch.delenv("XCOSD_NO_MODEL_CACHE")
    TransformersModel.from_gguf(tiny_gguf)
    (entry,) = entries(cache_root)
    # an unreadable entry: the GGUF file is loaded instead and the entry rewritten
    (entry / "model.safetensors").write_bytes(b"not safetensors")
    m = TransformersModel.from_gguf(tiny_gguf)
    assert "xcosd-cache" not in str(m.model.config._name_or_path)
    assert entries(cache_root) == [entry] and (entry / "model.safetensors").stat().st_size > 1000
    cached = TransformersModel.from_gguf(tiny_gguf)
    assert cached.model.config._name_or_path == str(entry)
    assert_same_model(m, cached)
    # another process won the race: storing again keeps its entry and leaves no temp dir
    _, ident = model_cache.entry_dir(tiny_gguf, torch.float32)
    assert not model_cache.store(entry, ident, cached.model, cached.tokenizer, cached.vocab)
    assert entries(cache_root) == [entry]
    # the file changes (a copy with a new mtime stands in for a rewrite): a new entry
    # replaces the old one
    moved = tmp_path / tiny_gguf.name
    moved.write_bytes(tiny_gguf.read_bytes())
    key_a = model_cache.entry_dir(moved, torch.float32)[0]
    TransformersModel.from_gguf(moved)
    import os

    st = moved.stat()
    os.utime(moved, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    key_b = model_cache.entry_dir(moved, torch.float32)[0]
    assert key_a != key_b
    TransformersModel.from_gguf(moved)
    assert set(entries(cache_root)) == {entry, key_b}


def test_each_position_is_computed_once(model: TransformersModel) -> None:
    """A draft step (append one token, score) feeds one position, and a round (the
    resolved token plus d drafts) feeds d + 1: the cache holds the whole context.
    Only a score with nothing appended feeds the last token again."""
    fed: list[int] = []
    forward = model.model.forward

    def counting(*a: object, **kw: object) -> object:
        fed.append(int(kw["input_ids"].shape[-1]))  # type: ignore[union-attr]
        return forward(*a, **kw)

    model.model.forward = counting  # type: ignore[method-assign]
    model.prefix_reuse = False  # a whole prompt computed (reuse: the test below)
    try:
        ids = model.tokenize(TEXT)[:24]
        s = model.start(ids[:8])
        model.score([(s, [])])
        assert fed == [8 + int(model._add_bos)]
        for t in ids[8:12]:  # draft steps
            model.append(s, [t])
            row = model.score([(s, [])])[0]
        assert fed[1:] == [1, 1, 1, 1]
        ref = reference(model, ids[:12])
        np.testing.assert_allclose(row[0], ref[-1], atol=TOL)
        model.rollback(s, 10)  # a rejection, then the resolved token and 3 drafts
        model.append(s, [ids[20]])
        rows = model.score([(s, ids[13:16])])[0]
        assert fed[-1] == 4
        np.testing.assert_allclose(rows, reference(model, [*ids[:10], ids[20], *ids[13:16]])[-4:],
                                   atol=TOL)
        model.score([(s, [])])  # nothing appended: the last token once more
        assert fed[-1] == 1
    finally:
        del model.model.forward
        model.prefix_reuse = True


@pytest.mark.parametrize("per_session", [True, False])
def test_the_head_scores_only_the_rows_asked_for(model: TransformersModel,
                                                 per_session: bool) -> None:
    """A prompt's positions are fed for their states; the output head runs on the
    rows the call returns (in a batch, on the positions from the first row any
    session asks for to the end), not on every fed position. Both batched paths."""
    head = model.model.get_output_embeddings()
    seen: list[int] = []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].shape[-2])))
    model.per_session = per_session
    try:
        ids = model.tokenize(TEXT)[:24]
        s = model.start(ids[:12])
        rows = model.score([(s, ids[12:15])])[0]  # 12 context positions fed, 4 rows
        assert rows.shape[0] == 4 and seen == [4]
        a, b = model.start(ids[:2]), model.start(ids[:2])
        model.score([(a, [])])
        model.score([(b, [])])
        model.append(a, ids[2:6])
        model.append(b, ids[2:5])
        seen.clear()
        # a feeds 6 positions (4 of context, 2 drafts: rows at 3..5), b 3 (its row at 2)
        got = model.score([(a, ids[6:8]), (b, [])])
        assert [r.shape[0] for r in got] == [3, 1]
        assert seen == [4]  # positions 2..5, not all 6
        np.testing.assert_allclose(got[0], reference(model, ids[:8])[-3:], atol=TOL)
        np.testing.assert_allclose(got[1][0], reference(model, ids[:5])[-1], atol=TOL)
    finally:
        model.per_session = True
        hook.remove()


def test_prefixes_are_reused_within_float_rounding_and_bounded_fairly(model: TransformersModel
                                                                      ) -> None:
    """An ended session's buffers are taken over by a session that starts with its
    tokens (only the rest is computed), a live one's shared prefix is copied; the
    rows equal the no-cache reference to float rounding (as batched rows do: the
    reused positions were computed in another forward). Retired buffers stay within
    ``prefix_cache_bytes``, the tenant holding the most giving way first."""
    ids = model.tokenize(TEXT)[:40]
    a = model.start(ids[:20])
    model.score([(a, ids[20:24])])
    model.end(a)  # retired: 24 positions (and a BOS, where the model adds one)
    fed, reused = model.tokens_fed, model.reused_tokens
    b = model.start(ids[:30])
    rows_b = model.score([(b, [ids[30]])])[0]
    assert model.reused_tokens - reused == 24 + model._add_bos
    assert model.tokens_fed - fed == (30 - 24) + 1
    ref = reference(model, ids[:31])
    off = len(ref) - 31
    np.testing.assert_allclose(rows_b, ref[off + 29: off + 31], atol=TOL)
    # a live session's prefix is copied (40 shared positions: past MIN_COPY)
    long_ids = model.tokenize(TEXT * 2)[:60]
    c = model.start(long_ids[:50])
    model.score([(c, [])])
    d = model.start([*long_ids[:45], ids[0]])
    reused = model.reused_tokens
    rows_d = model.score([(d, [])])[0]
    assert model.reused_tokens - reused == 45 + model._add_bos
    ref = reference(model, [*long_ids[:45], ids[0]])
    np.testing.assert_allclose(rows_d[0], ref[-1], atol=TOL)
    for s in (b, c, d):
        model.end(s)
    # the bound: tenant "b" ends many distinct sessions; tenant "a"'s stays
    saved = model.prefix_cache_bytes
    model._retired.clear()  # what the tests before left: two tenants only here
    try:
        mine = model.start(ids[:12])
        mine.tenant = "a"
        model.score([(mine, [])])
        history = list(mine.ids)
        model.end(mine)
        one = max(r.nbytes() for r in model._retired.values())
        model.prefix_cache_bytes = 4 * one
        for i in range(8):
            s = model.start([(i * 5 + k) % 50 + 60 for k in range(12)])
            s.tenant = "b"
            model.score([(s, [])])
            model.end(s)
        assert sum(r.nbytes() for r in model._retired.values()) <= 4 * one
        fed = model.tokens_fed
        nxt = model.start(history + ids[12:15])
        nxt.tenant = "a"  # its own next turn: it takes its cache over
        model.score([(nxt, [])])
        assert model.tokens_fed - fed == 3  # its cache was still there
        model.end(nxt)
    finally:
        model.prefix_cache_bytes = saved
    model.prefix_reuse = False
    try:
        fed = model.tokens_fed
        e = model.start(ids[:30])
        model.score([(e, [])])
        assert model.tokens_fed - fed == 30 + model._add_bos  # all of it, reuse off
        model.end(e)
        assert all(r is not e.cache for r in model._retired.values())
    finally:
        model.prefix_reuse = True
