"""API keys on ``xcosd edge serve --http``, run as a user runs it: a cloud and an
edge server as ``python -m xcosd`` processes on loopback (the embedded default
pair), driven by the official ``openai`` client and httpx.

Every route but ``/health`` answers 401 (an OpenAI error object, ``code``
``invalid_api_key``) to no key, a wrong key and a key that differs from a right
one only in its last byte, and the edge has then sent its cloud not one byte; the
right keys, from ``--api-key``, ``--api-key-file`` and ``XCOSD_API_KEY`` alike,
get the answers an open server gives, and the bytes each key's requests cost are
metered under that key's name.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from xcosd.api.keys import API_KEY_ENV, ApiKeys

from .helpers.processes import free_port, xcosd_process
from .helpers.waits import HANG_S
from .test_api import metric as scraped
from .test_edge_serve import until_health

KEYS = ["sk-xcosd-" + "a1" * 16, "sk-xcosd-" + "b2" * 16, "sk-xcosd-" + "c3" * 16]

#: every route but /health, and the body a right key gets its answer for
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/completions", {"prompt": "The", "max_tokens": 4, "seed": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4, "seed": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/{model}", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/nothing", None),
]


def last_byte_off(key: str) -> str:
    return key[:-1] + ("0" if key[-1] != "0" else "1")


@contextlib.asynccontextmanager
async def keyed_pair(tmp_path: Path, *flags: str) -> Any:
    """A cloud and an edge server whose keys are KEYS[0] (``--api-key``), KEYS[1]
    (``--api-key-file``) and KEYS[2] (``XCOSD_API_KEY``); yields the server's URL."""
    key_file = tmp_path / "keys"
    key_file.write_text(f"# the second key\n{KEYS[1]}\n\n")
    cloud = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = KEYS[2]
    try:
        async with xcosd_process("serve", "--bind", cloud), xcosd_process(
                "edge", "serve", "--connect", cloud, "--http", f"127.0.0.1:{port}",
                "--api-key", KEYS[0], "--api-key-file", str(key_file), *flags):
            url = f"http://127.0.0.1:{port}"
            await until_health(url, 200)  # /health needs no key
            yield url
    finally:
        if old is None:
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = old


async def test_every_route_but_health_needs_a_right_key(tmp_path: Path) -> None:
    async with keyed_pair(tmp_path) as url, httpx.AsyncClient(base_url=url,
                                                              timeout=HANG_S) as c:
        assert (await c.get("/health")).status_code == 200  # open: a probe sends no key
        r = await c.get("/v1/models", headers={"authorization": f"Bearer {KEYS[0]}"})
        model = r.json()["data"][0]["id"]
        wrong = [None, "wrong", last_byte_off(KEYS[0]), last_byte_off(KEYS[2]), "Basic x"]
        refused = 0
        for method, path, body in ROUTES:
            path = path.format(model=model)
            payload = None if body is None else {**body, "model": model}
            for key in wrong:
                headers = {} if key is None else {
                    "authorization": key if key.startswith("Basic") else f"Bearer {key}"}
                r = await c.request(method, path, json=payload, headers=headers)
                assert r.status_code == 401, (path, key, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key", err
                assert err["type"] == "invalid_request_error" and err["param"] is None
                refused += 1
        # nothing refused did any work: no generation ran, no byte went to the cloud
        scrape = (await c.get("/metrics", headers={"authorization": f"Bearer {KEYS[1]}"})).text
        assert scraped(scrape, "xcosd_edge_http_unauthorized_total") == refused
        assert scraped(scrape, "xcosd_edge_uplink_bytes_total") == 0
        assert scraped(scrape, "xcosd_edge_num_requests_running") == 0
        assert sum(scraped(scrape, "xcosd_edge_generations_total", finish_reason=f)
                   for f in ("stop", "length", "abort", "error")) == 0
        # each right key: what an open server answers
        for key in KEYS:
            for method, path, body in ROUTES:
                path = path.format(model=model)
                payload = None if body is None else {**body, "model": model}
                r = await c.request(method, path, json=payload,
                                    headers={"authorization": f"Bearer {key}"})
                assert r.status_code == (404 if path == "/v1/nothing" else 200), (path, r.text)
        scrape = (await c.get("/metrics", headers={"authorization": f"Bearer {KEYS[0]}"})).text
        for i in range(3):  # each key's two generations, metered under its name
            assert scraped(scrape, "xcosd_edge_client_generations_total",
                           client=f"key-{i + 1}") == 2
            assert scraped(scrape, "xcosd_edge_client_uplink_bytes_total",
                           client=f"key-{i + 1}") > 0
        assert scraped(scrape, "xcosd_edge_http_unauthorized_total") == refused


async def test_the_openai_client_with_and_without_the_key(tmp_path: Path) -> None:
    async with keyed_pair(tmp_path, "--open-metrics") as url:
        async with httpx.AsyncClient(timeout=HANG_S) as c:  # opened by the operator
            assert (await c.get(url + "/metrics")).status_code == 200
        for key in ("wrong", last_byte_off(KEYS[1])):
            bad = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                                     timeout=HANG_S)
            with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
                await bad.models.list()
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model="m", prompt="The", max_tokens=4)
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            await bad.close()
        good = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0,
                                  timeout=HANG_S)
        model = (await good.models.list()).data[0].id
        r = await good.completions.create(model=model, prompt="The", max_tokens=4, seed=3)
        stream = await good.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=3,
            stream=True)
        chunks = [ch async for ch in stream]
        await good.close()
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_keys_match_only_whole_and_never_empty() -> None:
    keys = ApiKeys(["k-one", ("ops", "k-two")])
    assert keys.match(b"k-one") == "key-1" and keys.match(b"k-two") == "ops"
    for token in (b"", b"k-on", b"k-one ", b"k-onf", b"K-ONE", b"k-one\x00"):
        assert keys.match(token) is None
    for bad in ("", " k", "k k", "k\u00e9"):
        with pytest.raises(ValueError):
            ApiKeys([bad])


def test_an_open_api_beyond_loopback_warns(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from xcosd.commands.api_access import warn_if_open

    for host, keys, warned in (("0.0.0.0", [], True), ("192.0.2.1", [], True),
                               ("127.0.0.1", [], False), ("::1", [], False),
                               ("localhost", [], False), ("0.0.0.0", ["k"], False)):
        warn_if_open(argparse.Namespace(http=(host, 8000)), keys)
        assert ("has no key" in capsys.readouterr().err) == warned, host
