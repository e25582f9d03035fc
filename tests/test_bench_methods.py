"""``xcosd bench methods``: records carry the documented keys and agree with each
other; the TV estimator and the local link count what they claim. Speed is
measured by `make bench` (xcosd/bench/), never asserted here."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

from xcosd.bench.methods import (
    RECORD_KEYS,
    MethodsConfig,
    format_report,
    run_methods,
    run_methods_sync,
)
from xcosd.bench.tv import MemoCodec, witness_tv
from xcosd.codecs import get_codec
from xcosd.models import SyntheticModel
from xcosd.nodes.pump import Pump


def test_the_pump_counts_every_message() -> None:
    target = SyntheticModel(256)
    draft = SyntheticModel(target.vocab, skew=0.9, name="draft")
    pump = Pump(target, draft)
    g = pump.generate("xcosd-e", prompt="Once upon a time", max_new_tokens=20, seed=3)
    st = g.stats
    assert st.tokens == len(g.token_ids) > 0
    # the trace is what the generation waits for: every message but the close,
    # which leaves after the output is complete (counted in the bytes only)
    close = st.uplink_by_type["close"]
    assert close > 0
    assert st.uplink_bytes == sum(n for d, n in g.trace if d == "up") + close
    assert st.downlink_bytes == sum(n for d, n in g.trace if d == "down")
    assert st.messages == len(g.trace) + 1
    assert g.trace[-1][0] == "down"  # the last answer ends the modeled time
    assert st.target_calls == st.rounds  # one target call per round
    assert st.accepted <= st.drafted
    assert st.rejection_downlink_bytes <= st.downlink_bytes
    assert (st.rejections == 0) == (st.rejection_downlink_bytes == 0)


def test_memo_codec_replays_exactly() -> None:
    inner = get_codec("q8")
    memo = MemoCodec(inner)
    v = np.random.default_rng(0).dirichlet(np.ones(500)).astype(np.float32)
    assert memo.encode(v) == inner.encode(v) == memo.encode(v)
    assert np.array_equal(memo.commit(v), inner.commit(v))
    data = inner.encode(v)
    assert np.array_equal(memo.decode(data, 500), inner.decode(data, 500))
    assert memo.name == "q8" and memo.exact is False


def test_witness_tv_separates_exact_from_biased() -> None:
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(2000) * 0.3)
    n = 20000
    half = np.arange(n) % 2
    exact = rng.choice(p.size, size=n, p=p)
    tv, se = witness_tv(p, exact, np.ones(n), half)
    assert abs(tv) < 4 * se + 1e-3
    q = p.copy()
    top = np.argsort(-p)[:20]
    q[top] *= 3.0
    q /= q.sum()
    true_tv = 0.5 * np.abs(q - p).sum()
    biased = rng.choice(p.size, size=n, p=q)
    tv_b, se_b = witness_tv(p, biased, np.ones(n), half)
    assert tv_b > 10 * se_b
    assert tv_b <= true_tv + 4 * se_b  # a lower bound, up to noise


@pytest.mark.slow
def test_methods_records_on_the_embedded_pair(tmp_path) -> None:
    cfg = MethodsConfig(methods=["ar", "xcosd", "xcosd-e", "target-resample"],
                        codecs=["f32", "q8"], warpers=["T=1"], prompts=1, tokens=12,
                        tv_trials=200, tv_contexts=1, live_prompts=1)
    rep = run_methods_sync(cfg, progress=False)
    recs = rep["records"]
    combos = {(r["method"], r["codec"]) for r in recs}
    # codecs only multiply methods whose codec applies to a vector
    assert combos == {("ar", "f32"), ("xcosd", "f32"), ("xcosd", "q8"), ("xcosd-e", "f32"),
                      ("xcosd-e", "q8"), ("target-resample", "f32")}
    for r in recs:
        for k in RECORD_KEYS:
            assert k in r, k
        assert r["pair"] == "embedded" and r["warper"] == "T=1"
        assert r["uplink_bytes_per_token"] * r["tokens"] == pytest.approx(r["uplink_bytes"])
        assert r["downlink_bytes_per_token"] * r["tokens"] == pytest.approx(r["downlink_bytes"])
        assert r["cloud_calls_per_token"] * r["tokens"] == pytest.approx(r["target_calls"])
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        if r["rounds"]:
            assert r["mean_acceptance_length"] == pytest.approx(1 + r["accepted"] / r["rounds"])
        rates = sorted(r["modeled_tokens_per_s"], key=float)
        assert rates == ["100", "200", "300"]
        speeds = [r["modeled_tokens_per_s"][x] for x in rates]
        assert all(a <= b + 1e-9 for a, b in itertools.pairwise(speeds))
        assert r["tv_to_target"] is not None and r["tv_stderr"] >= 0
        if r["codec"] == "f32":
            assert r["tv_commit"] == 0.0
            assert r["live"] is not None and r["live"]["tokens"] > 0
    ar = next(r for r in recs if r["method"] == "ar")
    assert ar["cloud_calls_per_token"] == pytest.approx(1.0)
    assert ar["drafted"] == 0
    assert "xcosd-e" in format_report(rep)
    json.dumps(rep)  # JSON-able as written by --json


def test_config_rejects_unknown_names() -> None:
    with pytest.raises(ValueError):
        MethodsConfig(methods=["nope"])
    with pytest.raises(ValueError):
        MethodsConfig(warpers=["T=2"])
    # the settings of each grid point are checked by GenerationConfig, as for EdgeNode
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        MethodsConfig(methods=["nope"])
    with pytest.raises(ValueError, match="unknown codec 'f33'"):
        MethodsConfig(methods=["xcosd"], codecs=["f32", "f33"])
    with pytest.raises(ValueError, match="draft_len"):
        MethodsConfig(draft_len=-1)


def test_each_grid_point_is_one_generation_config() -> None:
    """The in-process and the live runs of a grid point take their settings from one
    GenerationConfig, whose warpers are the named warper's."""
    from xcosd.bench.grid import WARPERS

    cfg = MethodsConfig(methods=["xcosd"], draft_len=3)
    for w, params in WARPERS.items():
        g = cfg.generation("xcosd", "q8", w, 7)
        assert g.sampling_params() == params
        assert (g.method, g.codec, g.draft_len, g.max_new_tokens) == ("xcosd", "q8", 3, 7)


async def test_methods_table_is_awaited_inside_a_running_loop() -> None:
    """``run_methods`` is a coroutine: its live runs use the caller's loop, its
    CPU-bound grid a worker thread (the loop's other tasks keep running); the sync
    wrapper refuses to nest a loop."""
    cfg = MethodsConfig(methods=["ar", "xcosd"], codecs=["f32"], warpers=["T=1"], prompts=1,
                        tokens=8, tv_trials=0, live_prompts=1)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    try:
        rep = await run_methods(cfg, progress=False)
    finally:
        task.cancel()
    assert ticks >= 1  # the loop ran another task meanwhile (a blocking run would not let it)
    assert {(r["method"], r["codec"]) for r in rep["records"]} == {("ar", "f32"), ("xcosd", "f32")}
    for r in rep["records"]:
        assert r["live"] is not None and r["live"]["tokens"] > 0  # through real nodes
        assert r["tokens"] > 0 and r["tv_to_target"] is None
    with pytest.raises(RuntimeError, match=r"await run_methods"):
        run_methods_sync(cfg)
