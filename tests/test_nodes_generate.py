"""EdgeNode.generate / stream as users call them: a GenerationConfig or transformers'
keyword names, token-id prompts and stop strings; real ZeroMQ on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

import xcosd
from xcosd.config import GenerationConfig
from xcosd.models import TableModel
from xcosd.nodes.pump import Pump
from xcosd.protocol.messages import Error, Open, Opened

from .session_pairs import greedy_decode, pair


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[TableModel, xcosd.EdgeNode]]:
    target, draft = pair(eos_mass=0.01)
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint) as edge:
        yield target, edge


async def test_token_id_prompt_equals_its_text(nodes: tuple[TableModel, xcosd.EdgeNode]) -> None:
    target, edge = nodes
    text = "abcab"
    ids = target.tokenize(text)
    assert target.vocab.decode(ids).decode() == text  # a prompt that round-trips
    for kw in ({"seed": 11}, {"seed": 11, "method": "xcosd"}, {"do_sample": False}):
        a = await edge.generate(text, max_new_tokens=30, **kw)  # type: ignore[arg-type]
        b = await edge.generate(ids, max_new_tokens=30, **kw)  # type: ignore[arg-type]
        c = await edge.generate(np.asarray(ids), max_new_tokens=30, **kw)  # type: ignore[arg-type]
        assert a.token_ids == b.token_ids == c.token_ids and a.text == b.text, kw
    greedy = await edge.generate(ids, max_new_tokens=30, do_sample=False)
    assert greedy.token_ids == greedy_decode(target, text, 30)


async def test_token_id_prompt_is_the_exact_context(
        nodes: tuple[TableModel, xcosd.EdgeNode]) -> None:
    """Ids that tokenise differently as text ("a", "b" versus "ab") still reach the
    target as given: the output is the target's from exactly that context."""
    target, edge = nodes
    ids = [0, 1]  # b"a", b"b"; the text "ab" tokenises to the single token "ab"
    assert target.tokenize("ab") != ids
    r = await edge.generate(ids, max_new_tokens=25, do_sample=False)
    assert r.token_ids == greedy_decode(target, ids, 25)
    empty = await edge.generate([], max_new_tokens=25, do_sample=False)
    assert empty.token_ids == greedy_decode(target, "", 25)
    with pytest.raises(ValueError, match="target ids"):
        await edge.generate([0, 99], max_new_tokens=3)
    with pytest.raises(TypeError, match="integers"):
        await edge.generate([0, "b"], max_new_tokens=3)  # type: ignore[list-item]


def test_open_carries_prompt_ids_on_the_wire() -> None:
    m = Open(1, 0, "f" * 16, "xcosd", "f32", {}, 1.0, 0, 1.0, None, "", 4,
             prompt_ids=np.array([3, 0, 2]))
    h, bufs = m.to_wire()
    back = Open.from_wire(h, bufs)
    assert back.prompt_ids is not None and back.prompt_ids.tolist() == [3, 0, 2]
    text_form = Open(1, 0, "f" * 16, "xcosd", "f32", {}, 1.0, 0, 1.0, None, "ab", 4)
    h, bufs = text_form.to_wire()
    assert "pi" not in h and len(bufs) == 1 and Open.from_wire(h, bufs).prompt_ids is None
    h, bufs = m.to_wire()
    with pytest.raises(xcosd.ProtocolError, match="no text"):
        Open.from_wire({**h, "prompt": "ab"}, bufs)
    with pytest.raises(xcosd.ProtocolError, match="buffers"):
        Open.from_wire(h, bufs[:1])


def test_cloud_takes_prompt_ids_as_the_context_and_checks_them() -> None:
    link = Pump(*pair())
    fp = link.session("xcosd", prompt="").open().map_fp

    def open_with(s: int, ids: list[int]) -> object:
        (reply,) = link.to_cloud(Open(s, 0, fp, "xcosd", "f32", {}, 1.0, 0, 1.0, 1, "", 4,
                                      prompt_ids=np.array(ids, dtype=np.int64)))
        return reply

    opened = open_with(1, [0, 1, 2])
    assert isinstance(opened, Opened) and opened.prompt_tokens == 3  # untokenised
    assert link.cloud.sessions[1].start_ids == [0, 1, 2]
    refused = open_with(2, [0, 9])  # the target has 9 ids: 0..8
    assert isinstance(refused, Error) and refused.code == "bad_token"


async def test_config_and_transformers_names_agree(
        nodes: tuple[TableModel, xcosd.EdgeNode]) -> None:
    _, edge = nodes
    cfg = GenerationConfig(method="xcosd", max_new_tokens=20, temperature=0.8, top_k=4,
                           seed=5)
    a = await edge.generate("ab", config=cfg)
    b = await edge.generate("ab", method="xcosd", max_new_tokens=20, temperature=0.8, top_k=4,
                            seed=5)
    assert a.token_ids == b.token_ids and a.stats.method == "xcosd"
    # do_sample=False is greedy whatever the temperature says
    g1 = await edge.generate("ab", 20, do_sample=False, temperature=0.5)
    g2 = await edge.generate("ab", 20, temperature=0.0)
    assert g1.token_ids == g2.token_ids
    # keywords override the given config
    c = await edge.generate("ab", config=cfg, max_new_tokens=3)
    assert len(c.token_ids) <= 3
    with pytest.raises(ValueError, match="does not take K"):
        await edge.generate("ab", method="xcosd", K=5)
    with pytest.raises(ValueError, match="top_p"):
        await edge.generate("ab", top_p=0.0)


async def test_node_defaults_come_from_a_config() -> None:
    target, draft = pair()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=12)
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, config=cfg,
                           method="xcosd") as edge:
        assert edge.config == cfg.replace(method="xcosd")
        r = await edge.generate("ab")
        assert r.token_ids == greedy_decode(target, "ab", 12) and r.stats.method == "xcosd"
    with pytest.raises(ValueError, match="does not take K"):
        xcosd.EdgeNode(draft=draft, method="xcosd", K=5)


async def test_stop_strings(nodes: tuple[TableModel, xcosd.EdgeNode]) -> None:
    target, edge = nodes
    full = await edge.generate("ab", max_new_tokens=40, seed=2)
    assert len(full.text) > 6
    stop = full.text[3:5]  # appears in the output; cut at its first occurrence
    cut = full.text.index(stop) + len(stop)
    r = await edge.generate("ab", max_new_tokens=40, seed=2, stop=stop)
    assert r.text == full.text[:cut] and r.finish_reason == "stop"
    # token_ids end with the token that completed the stop string
    assert r.token_ids == full.token_ids[:len(r.token_ids)]
    assert target.vocab.decode(r.token_ids).decode().startswith(r.text)
    assert not target.vocab.decode(r.token_ids[:-1]).decode().startswith(r.text)
    assert r.stats.tokens == len(r.token_ids)
    # several stop strings: the one that ends first wins; streaming stops there too
    stops = ["zzz", full.text[-3:], full.text[4:6]]
    first = min(full.text.index(x) + len(x) for x in stops[1:])
    pieces = [p async for p in edge.stream("ab", max_new_tokens=40, seed=2, stop_strings=stops)]
    assert "".join(pieces) == full.text[:first]
    never = await edge.generate("ab", max_new_tokens=40, seed=2, stop_strings=["zzz"])
    assert never.text == full.text and never.finish_reason == full.finish_reason
