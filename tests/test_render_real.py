"""Chat prompts on the real pair through EdgeNode itself (SmolLM2-135M drafts,
Gemma-3-270m verifies): the cloud renders a chat with Gemma 3's template, the
cloud's stop ids include Gemma's ``<end_of_turn>``, and a greedy generation from
the rendered ids is exactly Gemma's own transformers ``generate`` (greedy, with its
KV cache) on ``apply_chat_template(..., add_generation_prompt=True)``.

The packaged Gemma-3-270m is the pretrained model: it gives ``<end_of_turn>``
practically no probability (below 1e-4 after every turn of an 8-shot chat whose
turns all end with it), so its greedy answers run to ``max_new_tokens`` and end
``length``; a generation that meets a stop id ends ``stop`` (tests/test_api.py,
with the embedded pair)."""

from __future__ import annotations

import pytest

import xcosd

from .helpers.real_chat import CONVERSATIONS, own_greedy, pair, templated
from .test_models_real import needs_real

__all__ = ["pair"]  # the module's fixture

MAX_NEW = 20


@pytest.mark.slow
@pytest.mark.real
@needs_real
async def test_greedy_chat_through_the_edge_is_the_targets_own_generate(pair) -> None:

    draft, target = pair
    eot = target.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert target.vocab.roles["eot"] == eot == 106 and target.vocab.roles["eos"] == 1
    async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud, \
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd-e",
                           target_vocab=target.vocab) as edge:
        welcome = edge._handshake.welcome
        assert welcome is not None and set(welcome.stop_ids) == {1, eot}
        stops = sorted(welcome.stop_ids)
        for messages in CONVERSATIONS:
            rendered = templated(target.tokenizer, messages)
            ids = await edge.chat_prompt(messages)
            # the start token is the one the model puts first itself
            assert [target._start, *ids] == rendered
            assert ids == target.chat_prompt(messages)
            assert target.tokenizer.decode(ids).endswith("<start_of_turn>model\n")
            want = own_greedy(target, rendered, MAX_NEW, stops)
            # a fixed draft length: the adaptive one may draft nothing when timing says so
            res = await edge.generate(ids, max_new_tokens=MAX_NEW, do_sample=False,
                                      draft_len=4, adaptive_draft=False)
            assert res.token_ids == want
            ended = "stop" if want[-1] in stops else "length"
            assert res.stats.finish_reason == ended
            assert res.stats.accepted > 0
        # the template refuses roles out of turn: a typed error, and it serves on
        with pytest.raises(xcosd.ProtocolError) as e:
            await edge.chat_prompt([{"role": "assistant", "content": "hi"}])
        assert e.value.code == "unsupported"
        assert await edge.chat_prompt(CONVERSATIONS[0]) == target.chat_prompt(CONVERSATIONS[0])
