"""Chat through the OpenAI-compatible API on the real pair (SmolLM2-135M drafts,
Gemma-3-270m verifies): at T = 0 the answer is exactly what Gemma's own
transformers ``generate`` (greedy, with its KV cache) writes after its own
chat-templated prompt, token for token, ending at its end-of-turn token (the
GGUF carries no template: the loader gives the tokenizer Gemma 3's, and both
sides use it). The packaged Gemma-3-270m is the pretrained model, not the
instruction-tuned one: its answers run on past a turn, so they end at
``max_tokens`` here; the end-of-turn stop itself is the cloud's stop ids, which
``tests/test_api.py`` shows ending a generation with ``finish_reason "stop"``."""

from __future__ import annotations

import contextlib
from typing import Any

import openai
import pytest

import xcosd
from xcosd.api import OpenAIApp
from xcosd.http import HttpServer

from .test_models_real import needs_real, real_group

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a prime number between 10 and 20."},
     {"role": "assistant", "content": "11"},
     {"role": "user", "content": "Another one?"}],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    from xcosd.models import load_model

    return load_model("smollm2-135m"), load_model("gemma3-270m")


def _templated(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(out, list):  # a BatchEncoding in newer transformers
        out = out["input_ids"]
    return [int(i) for i in out]


def _own_generate(target: Any, messages: list[dict[str, str]], stops: list[int]) -> list[int]:
    import torch

    ids = _templated(target.tokenizer, messages)
    with torch.no_grad():
        out = target.model.generate(torch.tensor([ids], device=target.device), do_sample=False,
                                    max_new_tokens=MAX_TOKENS, eos_token_id=stops,
                                    pad_token_id=stops[0])
    return [int(t) for t in out[0, len(ids):].tolist()]


@real_group
@pytest.mark.slow
@pytest.mark.real
@needs_real
async def test_greedy_chat_over_http_equals_the_targets_own_generate(pair) -> None:
    draft, target = pair
    stops = sorted({target.vocab.roles[r] for r in ("eos", "eot") if r in target.vocab.roles})
    async with contextlib.AsyncExitStack() as stack:
        cloud = await stack.enter_async_context(
            xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0"))
        edge = await stack.enter_async_context(
            xcosd.EdgeNode(draft=draft, connect=cloud.endpoint, method="xcosd-e",
                           target_vocab=target.vocab))
        http = await stack.enter_async_context(HttpServer(OpenAIApp(edge, model="gemma")))
        client = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        stack.push_async_callback(client.close)
        for messages in CONVERSATIONS:
            expected = _own_generate(target, messages, stops)
            r = await client.chat.completions.create(
                model="gemma", messages=messages, temperature=0,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS, seed=1)
            got = list(r.model_extra["xcosd"]["token_ids"])
            body = [t for t in expected if t not in stops]
            assert [t for t in got if t not in stops] == body
            assert r.choices[0].message.content == target.vocab.decode(body).decode()
            # the context is the template's ids; the start token is the model's own
            ids = await edge.chat_prompt(messages)
            assert [target._start, *ids] == _templated(target.tokenizer, messages)
            assert r.usage.prompt_tokens == len(ids)
            if expected[-1] in stops:  # ended at the end-of-turn (or -sequence) token
                assert r.choices[0].finish_reason == "stop"
            else:
                assert r.choices[0].finish_reason == "length"
            assert r.model_extra["xcosd"]["accepted"] > 0
