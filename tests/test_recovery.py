"""Recovery, one fault at a time, on the sans-I/O machines: a lost answer is asked
for again and repeated, never recomputed; duplicated and late answers are dropped;
a resume gets a fresh seed, continues the round numbers and completes a round whose
verdict was seen; the resumed context is the original one, start token included.

The law through random faults is ``tests/test_law.py``'s subject; these tests pin
each mechanism so a failure there has a name here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xcosd.nodes.pump import Pump
from xcosd.protocol import (
    CloudConfig,
    CloudConnection,
    DraftNeeded,
    EdgeSession,
    Message,
    RoundVerified,
    ScoreNeeded,
    SessionSettings,
    pack,
)
from xcosd.protocol.edge import EdgePhase
from xcosd.protocol.messages import Error, Open, Opened, ReplyMsg, RequestMsg, VerdictMsg

from .session_pairs import pair


@pytest.fixture()
def link() -> Pump:
    return Pump(*pair())


def _draft(link: Pump, es: EdgeSession) -> Message:
    out = es.next_round()
    for ev in out.events:
        if isinstance(ev, DraftNeeded):
            out = es.take(link.drafters[es.s].run(ev))
    [msg] = out.send
    return msg


def _wire(m: Message) -> list[bytes]:
    return [bytes(f) for f in pack(m)]


def _rounds(link: Pump) -> int:
    return sum(isinstance(e, RoundVerified) for e in link.events)


def test_a_lost_verdict_is_repeated_not_recomputed(link: Pump) -> None:
    es = link.session("xcosd-e", prompt="c", max_new_tokens=6, seed=1)
    [opened] = link.to_cloud(es.open())
    link.receive(es, opened)
    draft = _draft(link, es)
    [verdict] = link.to_cloud(draft)  # ... and lost on the way to the edge
    assert _rounds(link) == 1
    again = es.resend_last()
    assert again is draft  # the same message, the same seq
    [repeat] = link.to_cloud(again)
    assert _rounds(link) == 1  # verified once: no second draw of its random numbers
    assert isinstance(repeat, VerdictMsg) and repeat.ack == draft.seq
    assert _wire(repeat) == _wire(verdict)  # the same answer, bit for bit
    link.receive(es, repeat)
    assert es.phase is not EdgePhase.WAITING
    # the late original arrives now: dropped, counted, nothing changes
    before = (es.phase, list(es.token_ids))
    assert link.receive(es, verdict) == [] and es.stale == 1
    assert (es.phase, list(es.token_ids)) == before


def test_a_duplicated_request_gets_the_same_reply(link: Pump) -> None:
    for seed in range(200):
        es = link.session("xcosd-e", prompt="c", max_new_tokens=6, seed=seed, K=1, M=3)
        link.receive(es, link.to_cloud(es.open())[0])
        [verdict] = link.to_cloud(_draft(link, es))
        sent = link.receive(es, verdict)
        if sent and isinstance(sent[0], RequestMsg):
            break
    else:
        pytest.fail("no follow-up request in 200 generations")
    [req] = sent
    [reply] = link.to_cloud(req)
    [repeat] = link.to_cloud(req)  # duplicated on the way up
    assert isinstance(reply, ReplyMsg) and reply.ack == req.seq and _wire(repeat) == _wire(reply)
    link.receive(es, reply)
    assert link.receive(es, repeat) == [] and es.stale == 1


def test_a_replay_error_is_harmless_to_the_edge(link: Pump) -> None:
    es = link.session("xcosd", prompt="c", max_new_tokens=4, seed=2)
    open_msg = es.open()
    link.receive(es, link.to_cloud(open_msg)[0])
    draft = _draft(link, es)
    link.receive(es, link.to_cloud(draft)[0])
    # a late copy of the open reaches the cloud: it says replay, the edge shrugs
    [err] = link.to_cloud(open_msg)
    assert isinstance(err, Error) and err.code == "replay"
    phase = es.phase
    assert link.receive(es, err) == [] and es.phase is phase


def test_a_resume_draws_a_fresh_seed_and_keeps_counting(link: Pump) -> None:
    es = link.session("ar", prompt="c", max_new_tokens=8, seed=3)
    first = es.open()
    link.receive(es, link.to_cloud(first)[0])
    for _ in range(3):
        for m in link.receive(es, link.to_cloud(_draft(link, es))[0]):
            link.to_cloud(m)
    # the cloud restarts: a new connection that has never seen this edge
    link.cloud = CloudConnection(link.config, b"local")
    link.handshake.ready = False
    again = es.open()
    assert again.seed != first.seed  # never the first stream again
    assert again.seq > first.seq and again.r == es.round == 3
    assert again.resume.tolist() == es.token_ids
    third = EdgeSession(99, SessionSettings(es.method, params=es.params, max_new_tokens=8,
                                            seed=3), vmap=es.vmap, space=es.space, prompt="c")
    seeds = {third.open().seed}
    seeds |= {third.open().seed for _ in range(3)}
    assert first.seed in seeds and len(seeds) == 4  # deterministic per seed, all distinct


def _rejected_with_request(link: Pump, method: str, **opts: object
                           ) -> tuple[EdgeSession, RequestMsg]:
    for seed in range(300):
        es = link.session(method, prompt="c", max_new_tokens=6, seed=seed, **opts)
        link.receive(es, link.to_cloud(es.open())[0])
        [verdict] = link.to_cloud(_draft(link, es))
        sent = link.receive(es, verdict)
        if sent and isinstance(sent[0], RequestMsg):
            return es, sent[0]
    raise AssertionError("no follow-up request in 300 generations")


@pytest.mark.parametrize(("method", "opts"), [("xcosd", {"hr_presample": False}),
                                              ("xcosd-e", {"K": 1, "M": 3})])
def test_a_seen_verdict_is_completed_after_a_restart(link: Pump, method: str,
                                                     opts: dict) -> None:
    es, req = _rejected_with_request(link, method, **opts)
    accepted, tokens = es._accepted, list(es.token_ids)
    # the request is lost with the cloud: a new cloud, a new handshake
    link.config = CloudConfig(link.target.vocab, link.target.tokenize, link.limits, "new")
    link.cloud = CloudConnection(link.config, b"local")
    for m in link.to_cloud(link.handshake.hello()):
        for up in link.handshake.receive(m).send:
            for down in link.to_cloud(up):
                link.handshake.receive(down)
    link.events.clear()
    reopen = es.open()
    assert isinstance(reopen, Open) and reopen.r == es.round
    [opened] = link.to_cloud(reopen)
    assert isinstance(opened, Opened)
    [redo] = link.receive(es, opened)
    assert es.phase is EdgePhase.RESOLVING
    assert redo.redo is not None and redo.redo.accepted == accepted  # type: ignore[attr-defined]
    assert redo.redo.kind == req.kind and redo.token is None  # type: ignore[attr-defined]
    answers = link.to_cloud(redo)
    # scored again to rebuild the rejection, but no verification: the verdict stands
    assert not any(isinstance(e, RoundVerified) for e in link.events)
    assert [type(a) for a in answers] == [ReplyMsg] and answers[0].ack == redo.seq  # type: ignore[attr-defined]
    pending = answers
    while pending:
        for m in link.receive(es, pending.pop(0)):
            pending += link.to_cloud(m)
    # the round settled where it was: the accepted drafts plus the resolved token
    assert es.token_ids[:len(tokens)] == tokens
    assert len(es.token_ids) >= len(tokens) + accepted + 1
    while not es.done:
        pending = link.to_cloud(_draft(link, es))
        while pending:
            for m in link.receive(es, pending.pop(0)):
                pending += link.to_cloud(m)
    assert len(es.token_ids) == 6


def test_the_cloud_enforces_max_new_tokens(link: Pump) -> None:
    es = link.session("ar", prompt="c", max_new_tokens=1, seed=4)
    link.receive(es, link.to_cloud(es.open())[0])
    draft = _draft(link, es)
    link.receive(es, link.to_cloud(draft)[0])
    assert es.done and len(es.token_ids) == 1
    # a peer that asks for a second round anyway is refused
    [err] = link.to_cloud(type(draft)(draft.s, draft.seq + 1, 1, None, draft.draft))  # type: ignore[call-arg, attr-defined]
    assert isinstance(err, Error) and err.code == "bad_field"


def test_a_resumed_context_keeps_the_start_token(tmp_path: Path) -> None:
    """A target whose tokenizer adds no BOS starts an empty prompt from its start
    token; a session resumed with the generated ids must too (it once lost it)."""
    pytest.importorskip("torch")
    from xcosd.models import TransformersModel
    from xcosd.models.tiny import byte_level_tokenizer, save_tiny_llama
    from xcosd.nodes.scoring import _prepare

    tm = TransformersModel.from_pretrained(save_tiny_llama(tmp_path / "m", byte_level_tokenizer()))
    assert not tm._add_bos and tm._start is not None
    lk = Pump(tm, tm)
    ids = tm.tokenize("hello")
    fresh = tm.start([])
    tm.append(fresh, ids)
    want = tm.score([(fresh, [])])[0][0]
    no_start = tm.start(ids)
    assert not np.allclose(tm.score([(no_start, [])])[0][0], want, atol=1e-3)  # it matters
    es = lk.session("ar", prompt="", max_new_tokens=8, seed=5)
    es.token_ids = list(ids)  # as if these were generated before a restart
    link_open = es.open()
    assert link_open.resume.tolist() == ids
    lk.receive(es, lk.to_cloud(link_open)[0])
    out = lk.cloud.receive(_draft(lk, es))
    [req] = [e for e in out.events if isinstance(e, ScoreNeeded)]
    _prepare(tm, req)
    got = tm.score([(req.model.handle, req.new_ids)])[0][0]
    np.testing.assert_allclose(got, want, atol=1e-5)


async def test_a_session_closed_as_idle_is_opened_again_alone() -> None:
    """The cloud closes a session it thinks idle (its peer still pings): the edge's
    next message gets ``no_session`` and that one session is opened again, on the
    same connection (no reconnect, no other session touched); the output is the
    one the target alone gives."""
    import asyncio
    import time

    import xcosd

    from .helpers.waits import HANG_S
    from .session_pairs import greedy_decode

    target, draft = pair()
    want = greedy_decode(target, "ab", 40)
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0", silence_timeout_s=HANG_S,
                               session_idle_s=1.0) as cloud:
        reaps: list[asyncio.Future[int]] = []

        def on_round(_obs: object) -> None:
            if not cloud.stats()["sessions_idle_reaped"]:  # as of 5 s from now: idle
                reaps.append(asyncio.ensure_future(cloud.reap(time.monotonic() + 5.0)))

        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, silence_timeout_s=HANG_S,
                                  on_round=on_round) as edge:
            res = await edge.generate("ab", max_new_tokens=40, temperature=0.0)
            await asyncio.gather(*reaps)
            assert res.token_ids == want
            assert cloud.stats()["sessions_idle_reaped"] >= 1
            assert res.stats.resumes >= 1 and edge.resumes == 0  # the session, not the link
