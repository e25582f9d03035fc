"""End-to-end exactness over real ZeroMQ on loopback.

A cross-vocabulary pair of TableModels (V_O non-empty and carrying about 40 % of
the target's mass) runs thousands of concurrent generations through ONE cloud; the
empirical law of the first two generated target tokens must match the target's
exact law for every lossless method with ``f32``, match the *committed* law with
a lossy codec, and the lossy ``target-resample`` must fail the same test.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

import xcosd
from xcosd.methods import LOSSLESS, Space, get_method
from xcosd.sampling import SamplingParams
from xcosd.vocab import VocabMap

from .session_pairs import chisquare_vs, closed_sessions_settle, first_two_law, pair

PROMPT = "c"
P_MIN = 1e-3


async def _counts(method: str, codec: str, n: int, **options: object) -> tuple[Counter, dict]:
    target, draft = pair()
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", max_batch=64,
                               max_sessions=2 * n) as cloud:
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
            results = await asyncio.gather(*[
                edge.generate(PROMPT, max_new_tokens=2, seed=50_000 + i, method=method,
                              codec=codec, **options) for i in range(n)])
        stats = await closed_sessions_settle(cloud)
    counts = Counter((r.token_ids[0], r.token_ids[1]) for r in results)
    return counts, stats


def _law(method: str = "xcosd", codec: str = "f32") -> dict:
    target, draft = pair()
    if codec == "f32":
        return first_two_law(target, PROMPT, SamplingParams())
    m = get_method(method, codec=codec)
    space = Space.from_vocab_map(VocabMap(draft.vocab, target.vocab))
    return first_two_law(target, PROMPT, SamplingParams(), commit=lambda p: m.commit_row(p, space))


def test_the_pair_exposes_v_o() -> None:
    law = _law()
    target, draft = pair()
    vmap = VocabMap(draft.vocab, target.vocab)
    first_in_vo = sum(v for (a, _), v in law.items() if vmap.other_mask[a])
    assert vmap.n_other == 3 and first_in_vo > 0.3


@pytest.mark.slow
@pytest.mark.parametrize("method", LOSSLESS)
async def test_lossless_methods_match_the_target(method: str) -> None:
    n = 3000
    counts, stats = await _counts(method, "f32", n)
    p, tv = chisquare_vs(counts, _law(), n)
    assert p > P_MIN and tv < 5 / np.sqrt(n), (method, p, tv)
    # thousands of sessions went through one cloud, in real batches
    assert stats["sessions_opened"] == n and stats["sessions_active"] == 0
    assert max(stats["scheduler"]["batch_size_histogram"]) > 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["xcosd", "xcosd-e"])
async def test_lossy_codec_matches_the_committed_law(method: str) -> None:
    n = 2500
    codec = "topk:3"
    counts, _ = await _counts(method, codec, n)
    committed = _law(method, codec)
    p, tv = chisquare_vs(counts, committed, n)
    assert p > P_MIN and tv < 5 / np.sqrt(n), (method, p, tv)
    # and the codec's distortion is visible: the exact law is rejected
    p_exact, _ = chisquare_vs(counts, _law(), n)
    assert p_exact < P_MIN


@pytest.mark.slow
async def test_a_lossy_method_fails_the_same_test() -> None:
    n = 1500
    counts, _ = await _counts("target-resample", "f32", n)
    p, tv = chisquare_vs(counts, _law(), n)
    assert p < 1e-6 and tv > 5 / np.sqrt(n), (p, tv)
