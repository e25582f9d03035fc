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

import openai
import pytest

import xcosd
from xcosd.api import OpenAIApp
from xcosd.http import HttpServer

from .helpers.real_chat import CONVERSATIONS, own_greedy, pair, templated
from .test_models_real import needs_real

__all__ = ["pair"]  # the module's fixture

MAX_TOKENS = 24


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
            expected = own_greedy(target, templated(target.tokenizer, messages), MAX_TOKENS, stops)
            r = await client.chat.completions.create(
                model="gemma", messages=messages, temperature=0,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS, seed=1)
            got = list(r.model_extra["xcosd"]["token_ids"])
            body = [t for t in expected if t not in stops]
            assert [t for t in got if t not in stops] == body
            assert r.choices[0].message.content == target.vocab.decode(body).decode()
            # the context is the template's ids; the start token is the model's own
            ids = await edge.chat_prompt(messages)
            assert [target._start, *ids] == templated(target.tokenizer, messages)
            assert r.usage.prompt_tokens == len(ids)
            if expected[-1] in stops:  # ended at the end-of-turn (or -sequence) token
                assert r.choices[0].finish_reason == "stop"
            else:
                assert r.choices[0].finish_reason == "length"
            assert r.model_extra["xcosd"]["accepted"] > 0
