"""The law tests of ``tests/test_law.py`` on the accelerator path.

The same generations through the same state machines, but the cloud's rows go to
:func:`xcosd.nodes.scoring.score_on_device`: the target's rows become torch tensors
(on the CPU device here; the same code runs on a GPU in ``bench/gpu_check.py``) and
:func:`xcosd.accel.verify_batch` warps, verifies and draws there, with counted
uniforms (xcosd/draws.py) keyed by each session's seed. Every lossless method through the fault
injector (cloud restarts mid-resolution included: Redo on the device path), the
adaptive draft length and speculated drafts through it too, every warper, every codec
(``f16`` and ``bf16`` commit on the device; ``q8`` and ``topk:K`` are verified on the
host, and their committed law must hold through that hand-off), the real 200k-wide
vocabularies, and the controls: lossy methods and a resume that draws a seen round
again fail the very same checks.

N is lower than the numpy path's (each test states the deviation it is built to
catch, from ``tests/test_law_power.py``): the torch path pays a few small tensor
calls per round on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xcosd.methods.round import RoundOutcome
from xcosd.models.on_device import OnDevice
from xcosd.nodes.pump import Pump

from .helpers.law import check_law, markov_law
from .helpers.torch_threads import one_torch_thread  # noqa: F401
from .session_pairs import close_pair, pair, real_pair
from .test_law import (
    CODECS,
    DRAFT_LEN,
    LOSSLESS,
    T1,
    TOKENS,
    TOPK,
    TOPP,
    RedrawnRound,
    ReplayedSeed,
    adaptive,
    assert_law,
    exact_law,
    generate,
    generate_faulty,
    short_blocks,
)

N_FAULTS = 1_500  # TV 0.08 at one step (each round verified on the device: a few ms a generation)
N_WARPER = 1_500  # TV 0.08
N_CODEC = 800  # TV 0.12 and any token off the committed support
N_LOSSY = 3_000
N_REAL = 1_000


@pytest.fixture(scope="module")
def link() -> Pump:
    target, draft = pair()
    return Pump(OnDevice(target, "cpu"), draft, on_device=True)  # type: ignore[arg-type]


def test_the_pump_verifies_on_the_device(link: Pump, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows really go through torch: a verdict's rejection state is kept on the
    device (not a numpy RejectState). Each round's outcome is read as the scheduler
    hands it to the cloud: a session's own state is gone once its generation ends."""
    from xcosd.accel import DeviceReject
    from xcosd.protocol import RoundVerified

    kept: list[object] = []
    scored = link.cloud.scored

    def spy(session: Any, outcome: Any) -> Any:
        if outcome.reject is not None:
            kept.append(outcome.reject)
        return scored(session, outcome)

    monkeypatch.setattr(link.cloud, "scored", spy)
    for i in range(40):
        link.events.clear()
        link.generate("xcosd-e", prompt="c", max_new_tokens=TOKENS, params=T1, seed=i,
                      draft_len=DRAFT_LEN, adaptive_draft=False)
        assert any(isinstance(ev, RoundVerified) for ev in link.events)
    assert len(kept) > 10 and all(isinstance(r, DeviceReject) for r in kept), kept[:3]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(LOSSLESS))
def test_every_lossless_method_through_faults(link: Pump, variant: str) -> None:
    seqs, rejected_at, faulty = generate_faulty(link, variant, N_FAULTS, seed=11_000_000)
    report = check_law(seqs, exact_law(link, variant, "f32", T1))
    c = faulty.counts
    assert report.ok, f"{variant} on the device, through faults ({c}): {report}"
    assert min(c.dropped, c.duplicated, c.restarts, c.resends) > 20, c
    if variant in ("xcosd-nopresample", "xcosd-e-K1M3"):
        assert c.redone > 20, c  # rounds completed on the device after a restart
    if variant != "ar":
        assert (rejected_at[:DRAFT_LEN] > 0).all(), rejected_at


@pytest.mark.slow
def test_adaptive_draft_length_through_faults(link: Pump) -> None:
    """The default policy's lengths (each round's from earlier verdicts, drafting
    stopped after an unsure token) keep the law on the device too, through faults."""
    rounds: list[list[int]] = []
    seqs, _, faulty = generate_faulty(link, "xcosd-e", N_FAULTS, seed=16_000_000,
                                      drafting=adaptive, rounds=rounds)
    report = check_law(seqs, exact_law(link, "xcosd-e", "f32", T1))
    assert report.ok, f"xcosd-e, adaptive, on the device ({faulty.counts}): {report}"
    assert len({len(r) for r in rounds}) > 1 and len({n for r in rounds for n in r}) > 2


@pytest.mark.slow
def test_speculated_drafts_through_faults() -> None:
    """Drafts drawn while a verdict was in flight, kept when the verdict took their
    path, keep the law on the device too (the close pair: most blocks are accepted
    whole, so most rounds speculate on the path taken)."""
    target, draft = close_pair()
    close = Pump(OnDevice(target, "cpu"), draft, on_device=True)  # type: ignore[arg-type]
    seqs, _, faulty = generate_faulty(close, "xcosd-e", N_FAULTS, seed=16_500_000,
                                      drafting=short_blocks, speculate=True)
    report = check_law(seqs, exact_law(close, "xcosd-e", "f32", T1))
    assert report.ok, f"xcosd-e, speculating, on the device ({faulty.counts}): {report}"
    assert faulty.counts.reused > 0.2 * N_FAULTS


@pytest.mark.slow
def test_a_redrawn_round_fails_on_the_device(link: Pump) -> None:
    """The fault test has teeth here too: a resume that throws a seen verdict away and
    draws the round again biases the law, and the same check says so."""
    seqs, _, _ = generate_faulty(link, "xcosd-nopresample", N_LOSSY, seed=11_000_000,
                                 session_cls=RedrawnRound)
    assert not check_law(seqs, exact_law(link, "xcosd-nopresample", "f32", T1)).ok


@pytest.mark.slow
def test_a_replayed_seed_is_harmless_on_the_device(link: Pump) -> None:
    """A resume that gives the cloud its first seed again: a draw is keyed by the round
    as well as the seed, so the replayed seed draws what it would have drawn in each
    round, and the law holds (the host's twin: ``tests/test_law.py``)."""
    seqs, _, _ = generate_faulty(link, "ar", N_LOSSY, seed=11_000_000, session_cls=ReplayedSeed)
    assert check_law(seqs, exact_law(link, "ar", "f32", T1)).ok


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "params"), [("xcosd-e", TOPK), ("xcosd-e", TOPP),
                                                 ("xcosd", TOPP), ("sd-uplink", TOPK)])
def test_every_warper(link: Pump, variant: str, params: object) -> None:
    assert_law(link, variant, "f32", params, N_WARPER, seed=12_000_000)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "codec"),
                         [("xcosd-e", c) for c in CODECS if c != "f32"]
                         + [("sd-uplink", "q8"), ("sd-uplink", "topk:3"),
                            ("straightforward", "sparse"), ("xcosd", "f16")])
def test_every_codec(link: Pump, variant: str, codec: str) -> None:
    assert_law(link, variant, codec, T1, N_CODEC, seed=13_000_000)


@pytest.mark.parametrize("method", ["target-resample", "greedy-resample", "uhlm"])
def test_lossy_methods_fail_the_same_check(link: Pump, method: str) -> None:
    seqs, _ = generate(link, method, "f32", T1, N_LOSSY, seed=14_000_000)
    assert not check_law(seqs, exact_law(link, "ar", "f32", T1)).ok, method


@pytest.mark.slow
def test_real_vocabularies_on_the_device() -> None:
    """200k-wide rows, V_C scattered over the real ids (o200k <- cl100k)."""
    target, draft, _ = real_pair()
    link = Pump(OnDevice(target, "cpu"), draft, on_device=True)  # type: ignore[arg-type]
    seqs, rejected_at = generate(link, "xcosd-e", "f32", T1, N_REAL, seed=15_000_000)
    support = target.support
    assert np.isin(seqs, support).all(), "a token off the target's support"
    index = np.searchsorted(np.sort(support), seqs)
    order = np.argsort(support)
    rows = target.rows[order][:, order]
    start = target.start_row[order]
    report = check_law(index, markov_law(start / start.sum(), rows / rows.sum(1, keepdims=True),
                                         TOKENS))
    assert report.ok, f"xcosd-e on the device, o200k <- cl100k: {report}"
    assert (rejected_at[:DRAFT_LEN] > 0).all(), rejected_at


#: draft trees on the device: wide, deep and ragged, one a generation in turn
TREES = ("4x1", "2x1x1", "spine:3x2")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["xcosd-e-K1M3", "xcosd-nopresample", "sd-uplink",
                                     "straightforward"])
def test_tree_rounds_on_the_device_through_faults(link: Pump, variant: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft trees walked next to their rows (``xcosd.accel.verify``'s tree walk: the
    residuals formed on the device, counted uniforms per node) keep the law through
    the fault injector, redone tree rounds included (rebuilt on the device from the
    rows alone). Built to catch TV 0.07 at one step (N = 2,000)."""
    import xcosd.accel.verify as accel_verify

    walked: list[object] = []
    walk = accel_verify._verify_tree

    def counted(rd: accel_verify.Round, rw: object) -> RoundOutcome:
        out = walk(rd, rw)  # type: ignore[arg-type]
        walked.append(out.reject)
        return out

    monkeypatch.setattr(accel_verify, "_verify_tree", counted)
    rounds: list[list[int]] = []
    seqs, _, faulty = generate_faulty(link, variant, 2_000, seed=17_000_000, rounds=rounds,
                                      drafting=lambda i: {"tree": TREES[i % len(TREES)]})
    report = check_law(seqs, exact_law(link, variant, "f32", T1))
    c = faulty.counts
    assert report.ok, f"{variant}, trees on the device ({c}): {report}"
    assert min(c.dropped, c.duplicated, c.restarts, c.resends) > 10, c
    if variant not in ("sd-uplink", "straightforward"):
        assert c.redone > 10, c  # tree rounds completed on the device after a restart
    # every shape ran (8, 6 and 5 nodes), walked on the device, rejections kept there
    assert {8, 6, 5} <= {n for r in rounds for n in r}
    rejects = [r for r in walked if r is not None]
    assert len(walked) > 2_000 and len(rejects) > 500
    assert all(isinstance(r, accel_verify.DeviceReject) for r in rejects)
