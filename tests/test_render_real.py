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

from typing import Any

import pytest

import xcosd

from .test_models_real import needs_real, real_group

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a prime number between 10 and 20."},
     {"role": "assistant", "content": "11"},
     {"role": "user", "content": "Another one?"}],
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    from xcosd.models import load_model

    return load_model("smollm2-135m"), load_model("gemma3-270m")


def _templated(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(out, list):  # a BatchEncoding in newer transformers
        out = out["input_ids"]
    return [int(i) for i in out]


@real_group
@pytest.mark.slow
@pytest.mark.real
@needs_real
async def test_greedy_chat_through_the_edge_is_the_targets_own_generate(pair) -> None:
    import torch

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
            templated = _templated(target.tokenizer, messages)
            ids = await edge.chat_prompt(messages)
            # the start token is the one the model puts first itself
            assert [target._start, *ids] == templated
            assert ids == target.chat_prompt(messages)
            assert target.tokenizer.decode(ids).endswith("<start_of_turn>model\n")
            with torch.no_grad():
                out = target.model.generate(torch.tensor([templated], device=target.device),
                                            do_sample=False, max_new_tokens=MAX_NEW,
                                            eos_token_id=stops, pad_token_id=stops[0])
            want = [int(t) for t in out[0, len(templated):].tolist()]
            res = await edge.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
            assert res.token_ids == want
            ended = "stop" if want[-1] in stops else "length"
            assert res.stats.finish_reason == ended
            assert res.stats.accepted > 0
        # the template refuses roles out of turn: a typed error, and it serves on
        with pytest.raises(xcosd.ProtocolError) as e:
            await edge.chat_prompt([{"role": "assistant", "content": "hi"}])
        assert e.value.code == "unsupported"
        assert await edge.chat_prompt(CONVERSATIONS[0]) == target.chat_prompt(CONVERSATIONS[0])
