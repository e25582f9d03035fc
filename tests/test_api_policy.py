"""What a request may pick of the protocol, and what the tools built for vLLM send:
the official ``openai`` client against a real edge and cloud over ZeroMQ on
loopback, served over HTTP (``tests/test_api.py``'s ``served``).

By default a request picks only ``ar`` and ``xcosd-e``, the codecs f32, f16, bf16
and q8, a first draft of at most 16 and no tree; each pick outside that is a 400
naming its field. An operator who opens more still bounds what a generation
sends: on the embedded pair (a 200k-token draft vocabulary), ``sd-uplink``'s first
round is a 6.6 MB message, which the edge does not send: the request ends with
``uplink_budget_exceeded`` having sent the cloud nothing, and the bytes are
metered. A lossy method is the operator's to allow,
and its response says it is lossy. vLLM's extensions are taken at their neutral
values (the text is that of a request without them) and refused at any other;
``continuous_usage_stats`` puts the usage so far on every chunk.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from xcosd.api.policy import DEFAULT_METHODS, RequestPolicy, tree_nodes
from xcosd.api.requests import VLLM_CHAT_NEUTRAL, VLLM_NEUTRAL
from xcosd.config import GenerationConfig
from xcosd.models import default_pair

from .test_api import metric, served


@pytest.fixture(scope="module")
def embedded() -> tuple[Any, Any]:
    """The embedded pair as (target, draft): vocabularies of real size."""
    draft, target = default_pair()
    return target, draft

#: a pick outside the default policy, for each field of the ``xcosd`` object, and
#: the amplifications a request could try besides
OUTSIDE: list[tuple[dict[str, Any], str]] = [
    ({"xcosd": {"method": "sd-uplink"}}, "xcosd.method"),
    ({"xcosd": {"method": "straightforward"}}, "xcosd.method"),
    ({"xcosd": {"method": "xcosd"}}, "xcosd.method"),
    ({"xcosd": {"method": "uhlm"}}, "xcosd.method"),
    ({"xcosd": {"codec": "sparse+zstd:22"}}, "xcosd.codec"),
    ({"xcosd": {"draft_len": 17}}, "xcosd.draft_len"),
    ({"xcosd": {"draft_len": 64}}, "xcosd.draft_len"),
    ({"xcosd": {"tree": "3x2"}}, "xcosd.tree"),
    ({"xcosd": {"tree": "auto"}}, "xcosd.tree"),
    ({"n": 2}, "n"),
    ({"best_of": 4}, "best_of"),
]


async def test_a_pick_outside_the_policy_is_a_400_naming_its_field() -> None:
    async with served() as s:
        for extra, param in OUTSIDE:
            with pytest.raises(openai.BadRequestError) as e:
                await s.client.completions.create(model=s.model, prompt="c", max_tokens=4,
                                                  extra_body=extra)
            err = e.value.body
            assert isinstance(err, dict) and err["param"] == param, (extra, err)
        # the tree check counts a shape's nodes before building it
        assert tree_nodes("100000x100000x100000", 8) == 100000 and tree_nodes("3by2", 8) is None
        with pytest.raises(openai.BadRequestError, match="at most 8"):
            async with served(policy=RequestPolicy(max_tree_nodes=8)) as t:
                await t.client.completions.create(
                    model=t.model, prompt="c", max_tokens=4,
                    extra_body={"xcosd": {"tree": "999999999x999999999"}})
        assert s.edge.arrivals.pending == 0 and s.api.in_flight == 0
        scrape = (await s.raw("GET", "/metrics")).text
        assert metric(scrape, "xcosd_edge_uplink_bytes_total") == 0  # refused before any work


async def test_what_the_default_policy_allows_stays_within_its_bound() -> None:
    """Each method a request may pick, at the longest draft it may ask for, sends
    the cloud no more than the stated bound, and the bytes are metered."""
    async with served() as s:
        total = 0
        for method in sorted(DEFAULT_METHODS):
            r = await s.client.completions.create(
                model=s.model, prompt="c", max_tokens=48, seed=5,
                extra_body={"xcosd": {"method": method, "draft_len": 16}})
            info = r.model_extra["xcosd"]
            assert info["method"] == method and info["lossless"] is True
            assert 0 < info["uplink_bytes"] <= s.api.policy.uplink_budget(48, 1)
            total += info["uplink_bytes"]
        scrape = (await s.raw("GET", "/metrics")).text
        assert metric(scrape, "xcosd_edge_client_uplink_bytes_total", client="-") == total


@pytest.mark.parametrize("stream", [False, True])
async def test_an_amplifying_request_stops_at_its_uplink_bound(
        stream: bool, embedded: tuple[Any, Any]) -> None:
    """The operator allows ``sd-uplink`` and 64 drafts; its rounds upload a vector
    over the common vocabulary per draft, and the default bound (512 bytes a token
    past 16 KiB) stops it before the message that would pass it."""
    policy = RequestPolicy(methods=DEFAULT_METHODS | {"sd-uplink"}, max_draft_len=64)
    bound = policy.uplink_budget(32, 3)
    async with served(embedded, policy=policy) as s:
        body = {"xcosd": {"method": "sd-uplink", "draft_len": 64}}
        if stream:
            chunks = await s.client.completions.create(model=s.model, prompt="The",
                                                       max_tokens=32, seed=2, stream=True,
                                                       extra_body=body)
            with pytest.raises(openai.APIError, match="bound of"):
                async for _ in chunks:
                    pass
        else:
            with pytest.raises(openai.BadRequestError) as e:
                await s.client.completions.create(model=s.model, prompt="The", max_tokens=32,
                                                  seed=2, extra_body=body)
            assert e.value.code == "uplink_budget_exceeded"
        scrape = (await s.raw("GET", "/metrics")).text
        assert metric(scrape, "xcosd_edge_client_generations_total", client="-") == 1
        assert metric(scrape, "xcosd_edge_client_uplink_bytes_total", client="-") <= bound
        assert metric(scrape, "xcosd_edge_uplink_bytes_total") <= bound
        # the same request within its bound (xcosd-e) completes
        r = await s.client.completions.create(model=s.model, prompt="The", max_tokens=32,
                                              seed=2, extra_body={"xcosd": {"draft_len": 16}})
        assert r.usage is not None and r.usage.completion_tokens == 32
        assert r.model_extra["xcosd"]["uplink_bytes"] <= bound


async def test_a_lossy_method_is_the_operators_to_allow_and_the_response_says_so() -> None:
    with pytest.raises(ValueError, match="lossy"):
        RequestPolicy(methods=frozenset({"uhlm"}))
    async with served(policy=RequestPolicy(methods=DEFAULT_METHODS | {"uhlm"},
                                           lossy=True)) as s:
        r = await s.client.completions.create(model=s.model, prompt="c", max_tokens=6, seed=1,
                                              extra_body={"xcosd": {"method": "uhlm"}})
        assert r.model_extra["xcosd"]["method"] == "uhlm"
        assert r.model_extra["xcosd"]["lossless"] is False
        chunks = await s.client.completions.create(
            model=s.model, prompt="c", max_tokens=6, seed=1, stream=True,
            extra_body={"xcosd": {"method": "uhlm"}})
        last = [ch async for ch in chunks][-1]
        assert last.model_extra["xcosd"]["lossless"] is False


#: a value of each vLLM extension that would change the output
NOT_NEUTRAL: dict[str, Any] = {
    "min_tokens": 3, "repetition_penalty": 1.1, "length_penalty": 0.5, "min_p": 0.1,
    "use_beam_search": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "include_stop_str_in_output": True,
    "stop_token_ids": [3], "bad_words": ["a"], "allowed_token_ids": [1, 2],
    "truncate_prompt_tokens": 4, "prompt_logprobs": 1, "detokenize": False,
    "return_tokens_as_token_ids": True, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "g",
    "guided_decoding_backend": "x", "logits_processors": ["p"], "priority": 1,
    "add_generation_prompt": False, "continue_final_message": True, "echo": True,
    "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1}, "documents": [{"a": "b"}],
}


async def test_vllm_extensions_at_their_neutral_values_change_nothing(
        embedded: tuple[Any, Any]) -> None:
    assert set(NOT_NEUTRAL) == set(VLLM_NEUTRAL) | set(VLLM_CHAT_NEUTRAL)
    neutral = {k: v[0][0] for k, v in VLLM_NEUTRAL.items() if v[0]}
    chat_neutral = {k: v[0][0] for k, v in VLLM_CHAT_NEUTRAL.items() if v[0]}
    msgs = [{"role": "user", "content": "hi"}]
    async with served(embedded) as s:
        plain = await s.client.completions.create(model=s.model, prompt="The", max_tokens=8,
                                                  seed=4)
        ext = await s.client.completions.create(
            model=s.model, prompt="The", max_tokens=8, seed=4,
            extra_body={**neutral, "request_id": "r-1", "allowed_token_ids": None})
        assert ext.choices[0].text == plain.choices[0].text
        chat_plain = await s.client.chat.completions.create(
            model=s.model, messages=msgs, max_tokens=8, seed=4)  # type: ignore[arg-type]
        chat_ext = await s.client.chat.completions.create(
            model=s.model, messages=msgs, max_tokens=8, seed=4,  # type: ignore[arg-type]
            extra_body={**neutral, **chat_neutral})
        assert chat_ext.choices[0].message.content == chat_plain.choices[0].message.content
        for key, value in NOT_NEUTRAL.items():
            chat = key in VLLM_CHAT_NEUTRAL
            with pytest.raises(openai.BadRequestError) as e:
                if chat:
                    await s.client.chat.completions.create(
                        model=s.model, messages=msgs, max_tokens=4,  # type: ignore[arg-type]
                        extra_body={key: value})
                else:
                    await s.client.completions.create(model=s.model, prompt="The", max_tokens=4,
                                                      extra_body={key: value})
            err = e.value.body
            assert isinstance(err, dict) and err["param"] == key, (key, err)
            assert err["code"] == "unsupported_parameter"


async def test_continuous_usage_stats_and_max_completion_tokens(
        embedded: tuple[Any, Any]) -> None:
    async with served(embedded) as s:
        r = await s.client.completions.create(model=s.model, prompt="The", max_tokens=12,
                                              seed=6)
        own = await s.client.completions.create(
            model=s.model, prompt="The", seed=6,
            extra_body={"max_completion_tokens": 12})  # what vLLM's tools send
        assert own.usage is not None and own.usage.completion_tokens == 12
        assert own.choices[0].text == r.choices[0].text
        for chat in (False, True):
            kw: dict[str, Any] = dict(model=s.model, max_tokens=12, seed=6, stream=True,
                                      stream_options={"include_usage": True,
                                                      "continuous_usage_stats": True})
            if chat:
                stream: Any = await s.client.chat.completions.create(
                    messages=[{"role": "user", "content": "hi"}], **kw)
            else:
                stream = await s.client.completions.create(prompt="The", **kw)
            chunks = [ch async for ch in stream]
            assert all(ch.usage is not None for ch in chunks), chunks
            counts = [ch.usage.completion_tokens for ch in chunks]
            assert counts == sorted(counts) and counts[-1] == 12
            assert {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens}
            if not chat:
                text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                assert text == r.choices[0].text


async def test_a_request_may_name_the_operators_own_settings() -> None:
    """The operator serves ``xcosd`` with drafts of 24: a request naming them is
    served, one naming another method outside the policy is not."""
    own = GenerationConfig(method="xcosd", draft_len=24, adaptive_draft=False)
    async with served(config=own) as s:
        r = await s.client.completions.create(
            model=s.model, prompt="c", max_tokens=6, seed=2,
            extra_body={"xcosd": {"method": "xcosd", "draft_len": 24}})
        assert r.model_extra["xcosd"]["method"] == "xcosd"
        with pytest.raises(openai.BadRequestError, match=r"xcosd\.method"):
            await s.client.completions.create(
                model=s.model, prompt="c", max_tokens=6,
                extra_body={"xcosd": {"method": "straightforward"}})


@pytest.mark.parametrize(("flags", "said"), [
    (["--allow-codecs", "bogus"], "unknown codec 'bogus'"),
    (["--allow-methods", "uhlm"], "uhlm is lossy"),
    (["--allow-methods", "nope"], "unknown method 'nope'"),
    (["--api-key", ""], "API key key-1 is empty"),
])
def test_a_policy_or_key_that_cannot_work_is_refused_before_anything_loads(
        flags: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    from xcosd.cli import main

    with pytest.raises(SystemExit) as e:
        main(["edge", "serve", "--http", "127.0.0.1:0", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "loading" not in err
