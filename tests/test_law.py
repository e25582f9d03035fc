"""The law of whole multi-draft generations through the real state machines.

Every generation here is 5 target tokens long and drafts 4 tokens per round, so a
rejection happens at every draft position, and every message crosses its wire form
(pack / unpack, codecs included) between the edge's :class:`EdgeSession` and the
cloud's :class:`CloudConnection`, with the cloud's rows scored by the scheduler's own
``score_batch`` (:class:`tests.session_pairs.Pump`). Target and draft are bigram
tables on different vocabularies (V_O carries ~40 % of the target's mass, the draft
has tokens the target lacks), so a row taken from the wrong position or the wrong
context changes the law.

The empirical law of the 5-token sequences is compared with the exact one
(``tests/helpers/law.py``: every position, every consecutive pair, the pooled
joint). Each test states the deviation it is built to catch: at N = 20,000 a TV 0.02
change of the joint at one step (``tests/test_law_power.py`` measures power >= 0.9).
The fault tests (N = 20,000 for the papers' two methods, 6,000 for the other
lossless variants) run with faults injected (``tests/helpers/faults.py``: cloud
restarts, dropped, duplicated and late messages at random points), so the law is
checked on every fault path and on the fault-free rounds between them at once;
control sessions that recover the old, wrong ways (the cloud's seed replayed on
resume, a seen verdict drawn again) fail the same check;
every warper, every codec and the pairwise cover of method x codec x warper run at
lower N (each test says which deviation it is built to catch: power scales with
``TV * sqrt(N)``). Lossy baselines fail the very same check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from xcosd.methods import Space
from xcosd.nodes.drafter import Drafter
from xcosd.nodes.pump import Pump
from xcosd.protocol import EdgeSession, Message, Open, RoundVerified, VerdictMsg
from xcosd.protocol.edge import EdgeOutput, EdgePhase
from xcosd.sampling import SamplingParams, warp
from xcosd.vocab import VocabMap

from .helpers.faults import Faults, FaultyLink
from .helpers.law import bigram_law, check_law, committed_row, markov_law
from .session_pairs import close_pair, pair, real_pair

PROMPT = "c"
TOKENS = 5
DRAFT_LEN = 4
#: N per test and the one-step TV deviation its check catches with power >= 0.9
#: (measured in tests/test_law_power.py)
N_HIGH = 20_000  # TV 0.02
N_WARPER = 6_000  # TV 0.035
N_CODEC = 4_000  # TV 0.05
N_COVER = 800  # TV 0.12
N_LOSSY = 5_000

T1 = SamplingParams()
TOPK = SamplingParams(temperature=0.7, top_k=4)
TOPP = SamplingParams(top_p=0.85)
WARPERS = {"T1": T1, "T0.7-topk4": TOPK, "topp0.85": TOPP}

LOSSLESS = {
    "ar": ("ar", {}),
    "sd-uplink": ("sd-uplink", {}),
    "straightforward": ("straightforward", {}),
    "xcosd": ("xcosd", {}),
    "xcosd-nopresample": ("xcosd", {"hr_presample": False}),
    "xcosd-e": ("xcosd-e", {}),
    "xcosd-e-K1M3": ("xcosd-e", {"K": 1, "M": 3}),
}
#: f32 and sparse are exact; the others are lossy and the output follows their
#: committed law (sd-uplink's codec compresses q, so its law stays the target's)
CODECS = ["f32", "f16", "bf16", "q8", "sparse", "topk:3", "f32+zstd", "q8+zstd"]


@pytest.fixture(scope="module")
def link() -> Pump:
    return Pump(*pair())


def generate(link: Pump, variant: str, codec: str, params: SamplingParams, n: int,
             seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` generations of :data:`TOKENS` tokens: (sequences, rejections by draft
    position)."""
    name, opts = LOSSLESS.get(variant, (variant, {}))
    seqs = np.empty((n, TOKENS), dtype=np.int64)
    rejected_at = np.zeros(DRAFT_LEN + 1, dtype=np.int64)
    for i in range(n):
        link.events.clear()
        es = link.generate(name, codec=codec, prompt=PROMPT, max_new_tokens=TOKENS,
                           params=params, seed=seed + i, draft_len=DRAFT_LEN,
                           adaptive_draft=False, **opts)
        seqs[i] = es.token_ids
        for ev in link.events:
            if isinstance(ev, RoundVerified) and ev.accepted < ev.drafted:
                rejected_at[ev.accepted] += 1
    return seqs, rejected_at


def exact_law(link: Pump, variant: str, codec: str, params: SamplingParams) -> np.ndarray:
    name = LOSSLESS.get(variant, (variant, {}))[0]
    target = link.target
    space = Space.from_vocab_map(VocabMap(link.draft.vocab, target.vocab))

    def row(p: np.ndarray) -> np.ndarray:
        return committed_row(name, codec, warp(p, params), space)

    return bigram_law(target.table, target.tokenize(PROMPT), TOKENS, row)


def assert_law(link: Pump, variant: str, codec: str, params: SamplingParams, n: int,
               seed: int) -> None:
    seqs, rejected_at = generate(link, variant, codec, params, n, seed)
    report = check_law(seqs, exact_law(link, variant, codec, params))
    assert report.ok, f"{variant}/{codec}/{params.label()}: {report}"
    if variant != "ar":
        # a rejection really happened at every draft position
        assert (rejected_at[:DRAFT_LEN] > 0).all(), rejected_at


# -- N = 20,000: every lossless method (f32, T = 1), through every fault ------------


def generate_faulty(link: Pump, variant: str, n: int, seed: int,
                    session_cls: type[EdgeSession] = EdgeSession,
                    drafting: Callable[[int], dict[str, Any]] | None = None,
                    rounds: list[list[int]] | None = None, speculate: bool = False,
                    drafter_cls: type[Drafter] | None = None, faults: Faults | None = None,
                    ) -> tuple[np.ndarray, np.ndarray, FaultyLink]:
    """:func:`generate` with faults injected (T = 1, f32). ``drafting(i)``: generation
    ``i``'s draft-length settings (default: :data:`DRAFT_LEN` every round);
    ``rounds``: if given, each generation's drafted lengths are appended to it;
    ``speculate``: draft on while verdicts are in flight (``drafter_cls``: the
    drafter doing it); ``faults``: the rates (default :class:`Faults`' own)."""
    name, opts = LOSSLESS.get(variant, (variant, {}))
    faulty = FaultyLink(link, faults or Faults(), seed=seed)
    seqs = np.empty((n, TOKENS), dtype=np.int64)
    rejected_at = np.zeros(DRAFT_LEN + 1, dtype=np.int64)
    for i in range(n):
        faulty.events.clear()
        how = drafting(i) if drafting else {"draft_len": DRAFT_LEN, "adaptive_draft": False}
        es = faulty.generate(name, seed=seed + i, session_cls=session_cls, prompt=PROMPT,
                             max_new_tokens=TOKENS, params=T1, speculate=speculate,
                             drafter_cls=drafter_cls, **how, **opts)
        seqs[i] = es.token_ids
        lengths = []
        for ev in faulty.events:
            if isinstance(ev, RoundVerified):
                lengths.append(ev.drafted)
                if ev.accepted < ev.drafted:
                    rejected_at[ev.accepted] += 1
        if rounds is not None:
            rounds.append(lengths)
    return seqs, rejected_at, faulty


#: the papers' two methods run at N_HIGH through faults; the other lossless variants
#: (the same state machines and fault paths, another commit rule) at N_WARPER
HIGH_POWER = ("xcosd", "xcosd-e")


def fault_n(variant: str) -> int:
    """N for ``variant``'s fault tests: N_HIGH for :data:`HIGH_POWER`, else N_WARPER."""
    return N_HIGH if variant in HIGH_POWER else N_WARPER


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(LOSSLESS))
def test_every_lossless_method_through_faults(link: Pump, variant: str) -> None:
    """Built to catch TV 0.02 at one step for :data:`HIGH_POWER`, TV 0.035 for the
    others (power >= 0.9, test_law_power.py), with a fault at a random point of most
    generations: every kind of fault happens, and resumes happen before the verdict,
    while opening and (where the method has follow-ups) mid-resolution, where the
    round is completed (Redo)."""
    n = fault_n(variant)
    seqs, rejected_at, faulty = generate_faulty(link, variant, n, seed=1_000_000)
    report = check_law(seqs, exact_law(link, variant, "f32", T1))
    c = faulty.counts
    each = n // 200  # every fault path taken in about one generation in 200 or more
    assert report.ok, f"{variant} through faults ({c}): {report}"
    assert min(c.dropped, c.duplicated, c.delayed, c.restarts, c.resends, c.stale) > each, c
    assert c.by_phase.get("waiting", 0) > each and c.by_phase.get("opening", 0) > each, c
    assert c.open_round > each, c  # faults that hit round 0 riding on its open
    if variant in ("xcosd-nopresample", "xcosd-e-K1M3"):  # K = 20 rarely asks for more
        assert c.redone > each, c  # rounds completed after a restart mid-resolution
    if variant != "ar":
        assert (rejected_at[:DRAFT_LEN] > 0).all(), rejected_at


class ReplayedSeed(EdgeSession):
    """Resumes the old way: the cloud gets the first seed again. With a sequential
    stream per session that replayed the draws before the restart; with a round's
    draws counted by (seed, round, stream, index), it draws what each round would
    have drawn anyway."""

    def open(self) -> Open:
        msg = dataclasses.replace(super().open(), seed=self.server_seed)
        self._expect(msg)  # what a lost answer makes it send again
        return msg


class RedrawnRound(EdgeSession):
    """Resumes the old way: a round whose verdict was seen is thrown away and drawn
    again, so rounds that need more messages (and meet more restarts) are redrawn
    more often."""

    def open(self) -> Open:
        if self.phase is EdgePhase.RESOLVING:
            self._request_kind = None  # forget the outstanding follow-up: abandon
        return super().open()


@pytest.mark.slow
def test_wrong_recovery_fails_the_same_check(link: Pump) -> None:
    """The fault tests have teeth: recovering the old way (a round whose verdict was
    seen, drawn again) biases the law, and the same check at the same fault rates
    says so. At N = 20,000 it fails at p ~ 1e-173, so a quarter of it is plenty."""
    variant = "xcosd-nopresample"
    seqs, _, _ = generate_faulty(link, variant, N_LOSSY, seed=1_000_000,
                                 session_cls=RedrawnRound)
    report = check_law(seqs, exact_law(link, variant, "f32", T1))
    assert not report.ok, f"RedrawnRound passed: {report}"


@pytest.mark.slow
def test_a_replayed_seed_is_harmless(link: Pump) -> None:
    """A resume that gives the cloud its first seed again used to replay the cloud's
    sequential stream from its start, and failed this check at p ~ 1e-105 (for ``ar``,
    whose every token is the cloud's draw). A round's draws are now counted by (seed,
    round, stream, index), on the host as on an accelerator, so the replayed seed
    draws what each round would have drawn anyway, and the law holds."""
    seqs, _, faulty = generate_faulty(link, "ar", N_LOSSY, seed=1_000_000,
                                      session_cls=ReplayedSeed)
    assert faulty.counts.restarts > 0
    assert check_law(seqs, exact_law(link, "ar", "f32", T1)).ok


# -- the adaptive draft length (on by default) ---------------------------------------

#: the stop threshold the adaptive tests use: of the first rounds asked for three
#: drafts, about half stop after one, a quarter after two
CONFIDENCE = 0.3


def adaptive(i: int) -> dict[str, Any]:
    """Generation ``i``'s policy: a first-round ceiling of 1, 2 or 3 (so over five
    tokens the next rounds' lengths follow the first verdicts), the stop threshold,
    a cap the ceiling reaches, and a draft cost at which one verdict moves the
    ceiling (from the prior 0.5, an accepted draft makes it 2, a rejected one 1);
    one generation in four has drafts so dear that after its first verdict it
    drafts nothing (ar rounds, a probe now and then)."""
    return {"draft_len": 1 + i % 3, "adaptive_draft": True,
            "draft_cost": 0.15 if i % 4 else 2.0,
            "draft_confidence": CONFIDENCE, "max_draft_len": 4}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["xcosd-e", "xcosd-nopresample"])
def test_adaptive_draft_length_through_faults(link: Pump, variant: str) -> None:
    """The default policy keeps the law (built to catch TV 0.02 at one step for
    xcosd-e, TV 0.035 for the other), through the same faults: each round's length
    comes from earlier verdicts and its drafting stops after an unsure token, both
    only from what was known before the next token was drawn. The test checks the
    policy really acted: first rounds cut short by the stop, and second rounds whose
    length the first verdict set."""
    rounds: list[list[int]] = []
    n = fault_n(variant)
    seqs, _, faulty = generate_faulty(link, variant, n, seed=8_000_000,
                                      drafting=adaptive, rounds=rounds)
    report = check_law(seqs, exact_law(link, variant, "f32", T1))
    assert report.ok, f"{variant}, adaptive, through faults ({faulty.counts}): {report}"
    first = [(i % 3 + 1, r[0]) for i, r in enumerate(rounds) if r and i % 3]
    stopped = sum(1 for asked, got in first if got < asked)
    assert stopped > 0.3 * len(first), (stopped, len(first))
    # start 1: a first draft accepted raises the ceiling to 2, so the second round
    # drafts 2; rejected, the ceiling is 1
    second = {r[1] for i, r in enumerate(rounds) if i % 3 == 0 and i % 4 and len(r) > 1}
    assert {1, 2} <= second, second
    # the dear drafts: after the first verdict the rounds draft nothing
    dear = [r[1:] for i, r in enumerate(rounds) if i % 4 == 0]
    assert sum(1 for r in dear if r and max(r) == 0) > 0.5 * len(dear)


class CutBeforeUnsure(Drafter):
    """Stops the wrong way: a drawn token the draft is unsure of is dropped, not
    kept. It looks only at the draft, and yet position ``i`` then leans towards the
    tokens the draft is sure of: kept, they are accepted at the verification's
    rate; dropped, the target draws the position afresh."""

    def draft(self, d: int, method: Any, space: Space, rng: np.random.Generator,
              stop_below: float = 0.0, ready: Any = ()) -> tuple[np.ndarray, list[np.ndarray],
                                                                  list[np.ndarray]]:
        ids, q_raw, q_rows = super().draft(d, method, space, rng, stop_below, ready)
        if len(ids) and q_rows[-1][space.to_common[ids[-1]]] < stop_below:
            ids, q_raw, q_rows = ids[:-1], q_raw[:-1], q_rows[:-1]
            self.length -= 1
            assert self.session is not None
            self.model.rollback(self.session, self.length)
        return ids, q_raw, q_rows


@pytest.mark.slow
def test_dropping_the_unsure_token_fails_the_same_check(link: Pump) -> None:
    """The adaptive test has teeth: the stop that drops the token it stopped at
    fails the same check (N = 5,000, no faults)."""
    name, opts = LOSSLESS["xcosd-e"]
    seqs = np.empty((N_LOSSY, TOKENS), dtype=np.int64)
    for i in range(N_LOSSY):
        es = link.session(name, prompt=PROMPT, max_new_tokens=TOKENS, params=T1,
                          seed=9_000_000 + i, **adaptive(i), **opts)
        link.drafters[es.s].__class__ = CutBeforeUnsure
        seqs[i] = link.drive(es).token_ids
    report = check_law(seqs, exact_law(link, "xcosd-e", "f32", T1))
    assert not report.ok, f"dropping the unsure token passed: {report}"


class MeasuredTimes(EdgeSession):
    """What an unseeded user runs (``draft_cost="auto"``): the policy's cost taken
    from measured times, fed to it on every verdict as the node feeds them. The
    times here are made to swing the cost as far as anything on a device could:
    a draft step is slow after some tokens (``step_s`` follows what was drafted)
    and a round is slow after a rejection (``fixed_s`` follows the verdict), so the
    lengths depend on every earlier value drawn, yet only on earlier ones."""

    def receive(self, msg: Message) -> EdgeOutput:
        draft = self._draft
        if isinstance(msg, VerdictMsg) and draft is not None:
            ids = draft.ids
            step = (0.02 + (0.3 if int(ids[-1]) % 2 else 0.0)) if len(ids) else None
            self.drafting.observe(step, 0.1 if msg.accepted == len(ids) else 0.25)
        return super().receive(msg)


@pytest.mark.slow
def test_measured_costs_through_faults(link: Pump) -> None:
    """The adaptive length with measured costs (the unseeded default) keeps the law
    through the same faults (N = 6,000: built to catch TV 0.035 at one step). The
    test checks the times moved the lengths: rounds that draft nothing (the cost
    says drafting does not pay) and rounds that draft several."""
    rounds: list[list[int]] = []

    def measured(i: int) -> dict[str, Any]:
        return {**adaptive(i), "draft_cost": "auto"}

    seqs, _, faulty = generate_faulty(link, "xcosd-e", N_WARPER, seed=8_500_000,
                                      session_cls=MeasuredTimes, drafting=measured,
                                      rounds=rounds)
    report = check_law(seqs, exact_law(link, "xcosd-e", "f32", T1))
    assert report.ok, f"xcosd-e, measured costs, through faults ({faulty.counts}): {report}"
    later = [n for r in rounds for n in r[1:]]
    assert later.count(0) > 0.1 * len(later), later.count(0)
    assert sum(1 for n in later if n >= 2) > 0.1 * len(later)


# -- drafting while a verdict is in flight ---------------------------------------------


@pytest.fixture(scope="module")
def close_link() -> Pump:
    return Pump(*close_pair())


def short_blocks(i: int) -> dict[str, Any]:
    """Blocks of 1 or 2 drafts: most are accepted whole, so most rounds speculate
    on the path the verdict takes."""
    return {"draft_len": 1 + i % 2, "adaptive_draft": False}


@pytest.mark.slow
def test_speculated_drafts_through_faults(close_link: Pump) -> None:
    """Drafts drawn while the last block's verdict was in flight, kept when the
    verdict took their path (the whole block accepted, the bonus the draft's next
    token), keep the law through the same faults (N = 6,000: built to catch TV
    0.035 at one step). The test checks that speculated drafts were really sent."""
    seqs, _, faulty = generate_faulty(close_link, "xcosd-e", N_WARPER, seed=8_700_000,
                                      drafting=short_blocks, speculate=True)
    report = check_law(seqs, exact_law(close_link, "xcosd-e", "f32", T1))
    c = faulty.counts
    assert report.ok, f"xcosd-e, speculating, through faults ({c}): {report}"
    assert c.reused > 0.2 * N_WARPER, (c.reused, c.speculated)


class KeepSureSpeculation(Drafter):
    """Keeps speculated drafts by their value: the first one only when the draft
    gave it at least 0.5, else it is drawn again. Each draft is still drawn from q
    and sent with q, yet the kept ones lean towards the tokens the draft is sure
    of, and the verification, told q, accepts them at q's rate."""

    def draft(self, d: int, method: Any, space: Space, rng: np.random.Generator,
              stop_below: float = 0.0, ready: Any = ()) -> tuple[np.ndarray, list[np.ndarray],
                                                                  list[np.ndarray]]:
        if ready:
            tid, _, qr, _ = ready[0]
            if qr[space.to_common[tid]] < 0.5:
                assert self.session is not None
                self.model.rollback(self.session, self.length)
                ready = ()
        return super().draft(d, method, space, rng, stop_below, ready)


@pytest.mark.slow
def test_keeping_speculated_drafts_by_value_fails_the_same_check(close_link: Pump) -> None:
    """The speculation test has teeth: speculated drafts kept by their value fail
    the same check (same N, no faults)."""
    seqs, _, faulty = generate_faulty(close_link, "xcosd-e", N_WARPER, seed=8_700_000,
                                      drafting=short_blocks, speculate=True,
                                      drafter_cls=KeepSureSpeculation,
                                      faults=Faults(0.0, 0.0, 0.0, 0.0, 0.0))
    report = check_law(seqs, exact_law(close_link, "xcosd-e", "f32", T1))
    assert faulty.counts.reused > 0.2 * N_WARPER
    assert not report.ok, f"keeping speculated drafts by value passed: {report}"


# -- every warper and every codec on the default method -----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("warper", ["T0.7-topk4", "topp0.85"])
def test_every_warper(link: Pump, warper: str) -> None:
    """N = 6,000: built to catch TV 0.035 at one step."""
    assert_law(link, "xcosd-e", "f32", WARPERS[warper], N_WARPER, seed=2_000_000)


@pytest.mark.slow
@pytest.mark.parametrize("codec", [c for c in CODECS if c != "f32"])
def test_every_codec(link: Pump, codec: str) -> None:
    """N = 4,000: built to catch TV 0.05 at one step; lossy codecs against their
    committed law."""
    assert_law(link, "xcosd-e", codec, T1, N_CODEC, seed=3_000_000)


# -- the rest of method x codec x warper, covered pairwise --------------------------


def _cover() -> list[tuple[str, str, str]]:
    """Every (method, base codec) pair not run above, each with a warper in rotation,
    so every (method, warper) and (codec, warper) pair is met too."""
    out: list[tuple[str, str, str]] = []
    warpers = list(WARPERS)
    i = 0
    out += [("ar", "f32", w) for w in warpers if w != "T1"]  # ar sends no vector
    for variant in LOSSLESS:
        if variant in ("ar", "xcosd-e"):
            continue  # xcosd-e's codecs run above
        for codec in CODECS:
            if codec == "f32" or "+zstd" in codec:
                continue  # +zstd is a lossless byte stage: its law runs on xcosd-e above
            out.append((variant, codec, warpers[i % len(warpers)]))
            i += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "codec", "warper"), _cover())
def test_method_codec_warper_cover(link: Pump, variant: str, codec: str,
                                   warper: str) -> None:
    """N = 800: a test of the path (built to catch TV 0.12 at one step and any token
    outside the committed support)."""
    assert_law(link, variant, codec, WARPERS[warper], N_COVER, seed=4_000_000)


# -- lossy controls: the same check fails them -------------------------------------


@pytest.mark.parametrize("method", ["target-resample", "greedy-resample", "uhlm"])
def test_lossy_methods_fail_the_same_check(link: Pump, method: str) -> None:
    seqs, _ = generate(link, method, "f32", T1, N_LOSSY, seed=5_000_000)
    report = check_law(seqs, exact_law(link, "ar", "f32", T1))
    assert not report.ok, f"a lossy method passed: {report}"


def test_a_lossy_codec_fails_the_exact_law(link: Pump) -> None:
    """A lossy codec's committed law is not the target's: ``topk:3`` output passes
    against its committed law and fails against the exact one, so the committed-law
    tests above do not pass by slack."""
    seqs, _ = generate(link, "straightforward", "topk:3", T1, N_LOSSY, seed=6_000_000)
    assert check_law(seqs, exact_law(link, "straightforward", "topk:3", T1)).ok
    assert not check_law(seqs, exact_law(link, "ar", "f32", T1)).ok


def test_the_pair_is_adversarial(link: Pump) -> None:
    """V_O carries real mass at every step and the draft disagrees with the target,
    so rejections and target-only tokens are common."""
    vmap = VocabMap(link.draft.vocab, link.target.vocab)
    joint = exact_law(link, "ar", "f32", T1)
    first_in_vo = joint.sum(axis=(1, 2, 3, 4))[vmap.other_mask].sum()
    assert vmap.n_other == 3 and first_in_vo > 0.3


# -- real vocabularies: o200k target, cl100k draft -----------------------------------

N_REAL = 1_500


@pytest.fixture(scope="module")
def real_link() -> Pump:
    target, draft, _ = real_pair()
    return Pump(target, draft)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["xcosd-e", "straightforward"])
def test_real_vocabularies(real_link: Pump, variant: str) -> None:
    """5-token generations whose every vector is 200k wide, V_C scattered over the real
    ids. Built to catch any id-mapping error (a token off the target's support) and
    TV 0.1 at one step (N = 1,500 over 8 support tokens)."""
    target = real_link.target
    seqs, rejected_at = generate(real_link, variant, "f32", T1, N_REAL, seed=7_000_000)
    support = target.support  # type: ignore[attr-defined]
    assert np.isin(seqs, support).all(), "a token off the target's support"
    index = np.searchsorted(np.sort(support), seqs)
    order = np.argsort(support)
    rows = target.rows[order][:, order]  # type: ignore[attr-defined]
    start = target.start_row[order]  # type: ignore[attr-defined]
    report = check_law(index, markov_law(start / start.sum(), rows / rows.sum(1, keepdims=True),
                                         TOKENS))
    assert report.ok, f"{variant} on o200k <- cl100k: {report}"
    assert (rejected_at[:DRAFT_LEN] > 0).all(), rejected_at
