"""The edge and cloud state machines wired together with no network: whole
generations for every method, greedy equality with the target's own decode, stop
and length rules, and the law of the first two tokens."""

from __future__ import annotations

import numpy as np
import pytest

from xcosd.methods import METHODS
from xcosd.nodes.pump import Pump
from xcosd.protocol import DraftNeeded, RoundVerified, SessionClosed
from xcosd.sampling import SamplingParams

from .session_pairs import TARGET_EOS, greedy_decode, pair


@pytest.fixture(scope="module")
def link() -> Pump:
    return Pump(*pair())


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("prompt", ["", "abcd"])
def test_every_method_generates(link: Pump, method: str, prompt: str) -> None:
    es = link.generate(method, prompt=prompt, max_new_tokens=12, seed=3)
    assert len(es.token_ids) == 12
    assert all(0 <= t < link.target.vocab.size for t in es.token_ids)
    # the text is the target tokens' bytes, whatever the device's own spelling
    assert es.text == link.target.vocab.decode(es.token_ids).decode()
    assert es.finish_reason == "length"


@pytest.mark.parametrize("method", [m for m in METHODS if m != "uhlm"])
def test_greedy_equals_target_greedy(link: Pump, method: str) -> None:
    want = greedy_decode(link.target, "ba", 20)
    es = link.generate(method, prompt="ba", max_new_tokens=20,
                       params=SamplingParams(temperature=0.0))
    assert es.token_ids == want


def test_stops_at_eos_and_frees_the_session() -> None:
    lk = Pump(*pair(eos_mass=0.3))
    for seed in range(10):
        es = lk.generate("xcosd", prompt="a", max_new_tokens=200, seed=seed)
        assert es.token_ids[-1] == TARGET_EOS and TARGET_EOS not in es.token_ids[:-1]
        assert es.finish_reason == "stop"
    assert lk.config.sessions == 0
    assert sum(isinstance(e, SessionClosed) for e in lk.events) == 10


def test_zero_and_one_token(link: Pump) -> None:
    assert link.generate("xcosd-e", max_new_tokens=0).token_ids == []
    es = link.generate("xcosd-e", max_new_tokens=1)
    assert len(es.token_ids) == 1
    # one token left: the device drafts nothing and the cloud samples it
    rounds = [e for e in link.events if isinstance(e, RoundVerified)]
    assert rounds[-1].drafted == 0


def test_rounds_accept_and_reject(link: Pump) -> None:
    n0 = len(link.events)
    link.generate("xcosd-e", max_new_tokens=60, seed=11)
    rounds = [e for e in link.events[n0:] if isinstance(e, RoundVerified)]
    assert any(r.accepted == r.drafted and r.drafted > 0 for r in rounds)
    assert any(r.accepted < r.drafted for r in rounds)
    assert sum(r.accepted + 1 for r in rounds) == 60


@pytest.mark.parametrize("method", ["xcosd", "xcosd-e", "straightforward", "sd-uplink", "uhlm"])
def test_the_draft_context_stays_in_step(link: Pump, method: str) -> None:
    """After a generation the draft model's context is the prompt plus each emitted
    target token in draft spelling (V_C by id, V_O re-tokenised from its bytes)."""
    es = link.session(method, prompt="abca", max_new_tokens=30, seed=5)
    for m in link.to_cloud(es.open()):
        es.receive(m)
    while not es.done:
        pending = link.to_cloud(link.next_draft(es))
        while pending:
            out = es.receive(pending.pop(0))
            for s in out.send:
                pending += link.to_cloud(s)
    drafter = link.drafters[es.s]
    # the edits the last rounds queued reach the drafter with the next DraftNeeded
    drafter.run(DraftNeeded(es, 0, es._drop, es._append))
    want = list(drafter.prompt_ids)
    for t in es.token_ids:
        want += es._draft_ids(t)
    assert drafter.session is not None and drafter.session.ids == want
    assert any(es.space.to_common[t] < 0 for t in es.token_ids)  # V_O tokens were in it
    link.to_cloud(es.close())


def test_session_closed_while_its_round_is_scored() -> None:
    """A session closed between the draft and the batched forward pass must not
    break the batch: its round is verified from its snapshot like the others (the
    compute never reads the live session), and the outcome is dropped on the loop,
    where the closed session answers nothing; the others go on."""
    from xcosd.nodes.scoring import score_batch
    from xcosd.protocol import ScoreNeeded
    from xcosd.protocol.cloud import CloseReason

    link = Pump(*pair())
    sessions = [link.session("xcosd", seed=i) for i in range(2)]
    needs = []
    for es in sessions:
        for m in link.to_cloud(es.open()):
            es.receive(m)
        out = link.cloud.receive(link.wire(link.next_draft(es)))
        needs += [ev for ev in out.events if isinstance(ev, ScoreNeeded)]
    assert len(needs) == 2
    link.cloud.end(needs[0].session, CloseReason.CLOSED)  # the edge went away mid-round
    outcomes = score_batch(link.target, needs)
    assert [o.error for o in outcomes] == [None, None]
    dropped = link.cloud.scored(needs[0].session, outcomes[0])
    assert dropped.send == [] and dropped.events == []
    [verdict] = link.cloud.scored(needs[1].session, outcomes[1]).send
    assert verdict.TYPE == "verdict"


def test_a_batch_warping_its_rows_together_gives_the_verdicts_of_warping_each_as_read(
        ) -> None:
    """The scheduler warps a batch's short rows in one call per sampling setting
    (warp_together) instead of each row as verification reads it: the same rounds,
    verified both ways from the same seeds, get the same verdicts (accepted count,
    reply, rejection row) and draw the same random numbers (the next round's too)."""
    from xcosd.nodes.scoring import score_rows, verify_scored, warp_together
    from xcosd.protocol import ScoreNeeded

    settings = [SamplingParams(top_p=0.9)] * 3 + [SamplingParams(0.7, 0, 0.8)] * 2 + [
        SamplingParams(1.2, 5, 1.0), SamplingParams(), SamplingParams(0.0)]

    def rounds(together: bool) -> list[tuple[int, str, list[float], list[float]]]:
        link = Pump(*pair())
        sessions = [link.session(m, seed=i, params=params, max_new_tokens=40)
                    for i, params in enumerate(settings) for m in ("xcosd-e", "xcosd")]
        seen = []
        for _ in range(3):  # three rounds: a verdict's draws decide the next one's
            needs = []
            for es in sessions:  # round 0's block rides on the open
                out = link.cloud.receive(link.wire(link.next_draft(es)))
                needs += [ev for ev in out.events if isinstance(ev, ScoreNeeded)]
            assert len(needs) == len(sessions)
            scored = score_rows(link.target, needs)
            warped = warp_together(needs, scored) if together else [None] * len(needs)
            if together:  # every setting with a warper that is not greedy went together
                assert [w is not None for w in warped] == [
                    not (r.round.params.identity or r.round.params.greedy) for r in needs]
            for req, x, w in zip(needs, scored, warped, strict=True):
                o = verify_scored(req.round, x, w)
                assert o.error is None
                rej = o.reject
                seen.append((o.accepted, repr(o.reply),
                             [] if rej is None else rej.p_star.tolist(),
                             [] if rej is None else rej.p_raw.tolist()))
                [es] = [e for e in sessions if e.s == req.session.s]
                pending = list(link.cloud.scored(req.session, o).send)
                while pending:  # the verdict, and any follow-up it asks for
                    for back in link.receive(es, link.wire(pending.pop(0))):
                        pending += link.to_cloud(back)
        return seen

    assert rounds(True) == rounds(False)


def test_a_batch_is_warped_in_calls_of_bounded_size() -> None:
    """The scheduler warps a batch's rows in runs of sessions of at most WARP_CHUNK
    entries (a session larger than that alone), every session in exactly one run,
    so verification still gives the event loop its turns."""
    from xcosd.nodes.scoring import WARP_CHUNK, warp_chunk_end
    from xcosd.protocol.cloud import RoundOutcome

    g = np.random.default_rng(9)
    failed = RoundOutcome(0, None, None)  # type: ignore[arg-type]
    scored = [np.zeros((int(g.integers(1, 6)), int(g.choice([256, 4096, 70_000]))),
                       dtype=np.float32) if g.random() < 0.9 else failed
              for _ in range(300)]
    runs, k = [], 0
    while k < len(scored):
        end = warp_chunk_end(scored, k)
        assert end > k
        runs.append((k, end))
        k = end
    assert runs[0][0] == 0 and runs[-1][1] == len(scored)
    for a, b in runs:
        size = sum(x.size for x in scored[a:b] if isinstance(x, np.ndarray))
        assert size <= WARP_CHUNK or b == a + 1
        if b < len(scored) and isinstance(scored[b], np.ndarray):
            assert size + scored[b].size > WARP_CHUNK  # the run took all that fit


def test_greedy_draft_whose_top_token_is_draft_only_still_drafts() -> None:
    from xcosd.methods import Space, get_method
    from xcosd.models import TableModel
    from xcosd.nodes.drafter import Drafter
    from xcosd.vocab import VocabMap

    def draft_probs(ctx):
        return np.array([0.06, 0.04, 0.9])  # "zz" is the draft's favourite, absent from V_C

    draft = TableModel([b"a", b"b", b"zz"], draft_probs)
    target = TableModel([b"a", b"b", b"c"], lambda ctx: np.array([0.5, 0.3, 0.2]))
    vmap = VocabMap(draft.vocab, target.vocab)
    drafter = Drafter(draft, vmap, SamplingParams(temperature=0), "")
    ids, q_raw, _ = drafter.draft(3, get_method("xcosd"), Space.from_vocab_map(vmap),
                                  np.random.default_rng(0))
    assert ids.tolist() == [0, 0, 0]  # greedy over V_C: "a"
    assert all(q.tolist() == [1.0, 0.0] for q in q_raw)


def test_speculated_drafts_join_the_context_the_verdict_confirms() -> None:
    """A drafter that drafted on past its block (``speculate``) ends every round in
    the context the edits describe: the confirmed part of its speculation kept, the
    part after it taken as the next drafts (the rest rolled back), or all of it
    rolled back. Its draft model, whose rows depend on the whole context, then
    scores what a drafter that never speculated scores at that context."""
    from xcosd.methods import Space, get_method
    from xcosd.models import TableModel
    from xcosd.nodes.drafter import Drafter
    from xcosd.vocab import VocabMap

    from .session_pairs import DRAFT_EOS, DRAFT_TOKENS

    def row(ctx: list[int]) -> np.ndarray:
        seed = abs(hash(tuple(ctx))) % (1 << 32)
        return np.random.default_rng(seed).dirichlet(np.ones(len(DRAFT_TOKENS)))

    target, _ = pair()
    draft = TableModel(DRAFT_TOKENS, row, DRAFT_EOS, name="whole-context")
    vmap = VocabMap(draft.vocab, target.vocab)
    space, method = Space.from_vocab_map(vmap), get_method("xcosd-e")
    to_draft = vmap.target_to_draft
    rng = np.random.default_rng(5)
    for case in range(30):
        d = Drafter(draft, vmap, SamplingParams(), "ab")
        ids, _, _ = d.draft(2, method, space, rng)
        ctx = [*d.prompt_ids, *(int(to_draft[t]) for t in ids)]
        assert d.speculate(4, method, space, rng) == 4
        spec = d.pending[:]
        spec_ids = [s[3] for s in spec]
        if case % 3 == 0:  # the block accepted, the bonus the draft's next token
            drop, append, ready_tids = 0, spec_ids[:1], [s[0] for s in spec[1:]]
        elif case % 3 == 1:  # the whole speculation confirmed, and one token more
            drop, append, ready_tids = 0, [*spec_ids, 1], []
        else:  # a rejection: the last draft out, another token in
            drop, append, ready_tids = 1, [4], []
        ctx = [*ctx[:len(ctx) - drop], *append]
        ready = d._edit(drop, append)
        assert [r[0] for r in ready] == ready_tids and d.length == len(ctx)
        ids, _, _ = d.draft(2, method, space, rng, ready=ready)
        assert ids.tolist()[:len(ready_tids)] == ready_tids[:2]
        assert d.reused == min(2, len(ready_tids))
        ctx += [int(to_draft[t]) for t in ids]
        assert d.length == len(ctx) and not d.pending
        assert d.session is not None
        assert np.allclose(draft.score([(d.session, [])])[0][-1], row(ctx), rtol=1e-6), case
        d.end()


def test_speculation_stops_where_it_does_not_pay_and_probes() -> None:
    """A drafter whose speculation no later round took stops speculating after its
    warm-up, but for one round in 16; one hit in the window turns it back on."""
    from xcosd.nodes.drafter import (
        SPECULATION_MIN_HITS,
        SPECULATION_PROBE,
        SPECULATION_WARMUP,
        Drafter,
    )
    from xcosd.vocab import VocabMap

    target, draft = pair()
    d = Drafter(draft, VocabMap(draft.vocab, target.vocab), SamplingParams(), "ab")
    assert d.worth_speculating()
    d.spec_rounds = SPECULATION_WARMUP
    asked = [d.worth_speculating() for _ in range(3 * SPECULATION_PROBE)]
    assert sum(asked) == 3 and asked[SPECULATION_PROBE - 1]
    d.spec_hits = int(SPECULATION_MIN_HITS * d.spec_rounds) + 1
    assert d.worth_speculating()
    # the next generation starts from this record, its older half forgotten
    d.spec_rounds, d.spec_hits = 300, 3
    nxt = Drafter(draft, d.vmap, SamplingParams(), "ab")
    nxt.carry(d.record)
    assert (nxt.spec_rounds, nxt.spec_hits) == (37, 0) and not nxt.worth_speculating()


def test_phases_move_only_along_their_tables(link: Pump) -> None:
    """Every phase change goes through the transition tables: a step the table does
    not list is a ``state`` error and leaves the phase as it was."""
    from xcosd.errors import ProtocolError
    from xcosd.protocol.cloud import CLOUD_TRANSITIONS, CloudPhase, CloudStep
    from xcosd.protocol.edge import EDGE_TRANSITIONS, EdgePhase

    es = link.session("xcosd-e", max_new_tokens=3)
    assert es.phase is EdgePhase.NEW
    with pytest.raises(ProtocolError) as e:
        es.drafted(np.zeros(0, dtype=np.int64), [], [])  # nothing was asked for
    assert e.value.code == "state" and es.phase is EdgePhase.NEW
    opening = es.open()
    with pytest.raises(ProtocolError) as e:
        es.next_round()  # a plain open waits for its answer
    assert e.value.code == "state" and es.phase is EdgePhase.OPENING
    for m in link.to_cloud(opening):
        es.receive(m)
    assert es.phase is EdgePhase.READY
    es.close()
    with pytest.raises(ProtocolError):
        es.close()  # closed is final
    assert es.phase is EdgePhase.CLOSED
    assert {nxt for nxt in EDGE_TRANSITIONS.values()} == set(EdgePhase) - {EdgePhase.NEW}
    # the cloud: closed is final, scoring is left only by a verdict
    assert not any(p is CloudPhase.CLOSED for p, _ in CLOUD_TRANSITIONS)
    assert {s for p, s in CLOUD_TRANSITIONS if p is CloudPhase.SCORING} == {
        CloudStep.ACCEPTED, CloudStep.REJECTED, CloudStep.CLOSE}
