"""Revoking a device's CURVE key ends what it holds now, not only its next
handshake: a cloud and two edges with keys of their own, over ZeroMQ with CURVE on
loopback, each generating.

Revoked mid-generation, a device's sessions end at once: its generation fails
with the typed ``curve`` error having got at most one more round's tokens, the
cloud holds none of its sessions, and its key's next handshake is refused; the
other device's generation, running beside it, completes token for token as the
same seeded generation does alone. Reloading the allow directory (what ``xcosd
serve`` does on SIGHUP and when the directory changes) does the same for a key
file removed from it, and admits a key file added to it; run as an operator runs
it, with processes and the ``openai`` client, a key file removed and SIGHUP end
that edge server's stream with the typed error while the other serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

import xcosd
from xcosd.errors import XcosdError
from xcosd.transport import CurveClient, CurveServer, KeyPair
from xcosd.transport.zeromq import ZmqListener

from .helpers.waits import HANG_S, until
from .session_pairs import pair

#: tokens the revoked device's generation would run to, and the other's
LONG, SHORT = 100_000, 300


def _peer_sessions(cloud: xcosd.CloudNode, key: bytes) -> int:
    """The sessions the cloud holds for peers holding ``key``."""
    lst = cloud._listener
    assert isinstance(lst, ZmqListener)
    return sum(len(p.conn.sessions) for pid, p in cloud._peers.items()
               if lst.peer_key(pid) == key)


@contextlib.asynccontextmanager
async def two_devices(curve: CurveServer, keys: dict[str, KeyPair],
                      **edge_kw: Any) -> AsyncIterator[tuple[Any, Any, Any]]:
    target, draft = pair()
    async with contextlib.AsyncExitStack() as stack:
        cloud = await stack.enter_async_context(xcosd.CloudNode(
            target=target, bind="tcp://127.0.0.1:0", curve=curve))
        edges = []
        for name in ("a", "b"):
            edges.append(await stack.enter_async_context(xcosd.EdgeNode(
                draft=draft, connect=cloud.endpoint, silence_timeout_s=2.0, connect_timeout_s=4.0,
                curve=CurveClient(keys[name], keys["server"].public), **edge_kw)))
        yield cloud, edges[0], edges[1]


async def _revoked_mid_generation(cloud: Any, a: Any, b: Any, revoke: Any,
                                  key: bytes) -> None:
    reference = (await b.generate("ab", max_new_tokens=SHORT, seed=11,
                                  ignore_eos=True)).token_ids
    seen: list[str] = []
    long_gen = asyncio.ensure_future(a.generate("ab", max_new_tokens=LONG, seed=3,
                                                ignore_eos=True, on_text=seen.append))
    await until(lambda: len(seen) >= 20, "the revoked device generating")
    other = asyncio.ensure_future(b.generate("ab", max_new_tokens=SHORT, seed=11,
                                             ignore_eos=True))
    assert _peer_sessions(cloud, key) == 1
    at_revoke = len("".join(seen))
    revoke()
    # the cloud holds nothing of it from the moment its receiver hears the news
    await until(lambda: _peer_sessions(cloud, key) == 0, "its sessions ended")
    with pytest.raises(XcosdError) as e:
        await asyncio.wait_for(long_gen, HANG_S)
    assert e.value.code == "curve" and "revoked" in e.value.message
    # at most the round in flight (one verdict: up to max_draft + 1 tokens, one
    # character each on this pair) reached it after the revocation
    assert len("".join(seen)) - at_revoke <= a.config.max_draft_len + 1
    assert cloud.counters["peers_revoked"] == 1
    # the other device, generating beside it, is untouched
    assert (await asyncio.wait_for(other, HANG_S)).token_ids == reference
    # and the revoked key's next handshake is refused: it cannot generate again
    with pytest.raises((XcosdError, TimeoutError)):
        await asyncio.wait_for(a.generate("ab", max_new_tokens=4), HANG_S)
    assert (await b.generate("ab", max_new_tokens=SHORT, seed=11,
                             ignore_eos=True)).token_ids == reference


async def test_revoking_a_connected_devices_key_ends_its_session() -> None:
    keys = {n: KeyPair.generate() for n in ("server", "a", "b")}
    curve = CurveServer(keys["server"], {keys["a"].public, keys["b"].public})
    async with two_devices(curve, keys) as (cloud, a, b):
        await _revoked_mid_generation(cloud, a, b, lambda: curve.revoke(keys["a"].public),
                                      keys["a"].public)


async def test_reloading_the_allow_directory_revokes_and_admits(tmp_path: Path) -> None:
    keys = {n: KeyPair.generate() for n in ("server", "a", "b", "c")}
    allow = tmp_path / "allow"
    for name in ("a", "b"):
        KeyPair(keys[name].public).save(allow, name)
    curve = CurveServer.from_files(keys["server"].save(tmp_path, "server")[1] or "", allow)
    async with two_devices(curve, keys) as (cloud, a, b):
        (allow / "a.key").unlink()
        KeyPair(keys["c"].public).save(allow, "c")
        assert curve.admitted(keys["a"].public)  # nothing changes before the reload
        added: list[tuple[int, int]] = []
        await _revoked_mid_generation(cloud, a, b,
                                      lambda: added.append(curve.reload(allow)),
                                      keys["a"].public)
        assert added == [(1, 1)] and curve.admitted(keys["c"].public)
        # the key added to the directory is admitted from then on
        _target, draft = pair()
        async with xcosd.EdgeNode(draft=draft, connect=cloud.endpoint,
                                  curve=CurveClient(keys["c"], keys["server"].public)) as c:
            assert len((await c.generate("ab", max_new_tokens=8)).token_ids) == 8


async def test_a_key_file_removed_ends_a_serving_edges_access(tmp_path: Path) -> None:
    """As an operator runs it: ``xcosd serve`` with CURVE and an allow directory,
    two ``xcosd edge serve`` processes with keys of their own, the official
    ``openai`` client. Device A's key file is removed and the cloud is sent SIGHUP:
    A's stream in flight ends with the typed error (``curve``) and its /health
    turns 503, while B answers as before, token for token."""
    from .helpers.processes import free_port, xcosd_process
    from .test_edge_serve import until_health

    keys = {n: KeyPair.generate() for n in ("server", "a", "b")}
    _, server_secret = keys["server"].save(tmp_path / "server", "cloud")
    allow = tmp_path / "allow"
    device_args = {}
    for name in ("a", "b"):
        KeyPair(keys[name].public).save(allow, name)
        _, secret = keys[name].save(tmp_path / name, name)
        device_args[name] = ["--curve-secret", str(secret), "--curve-server-key",
                             str(tmp_path / "server" / "cloud.key")]
    cloud = f"tcp://127.0.0.1:{free_port()}"
    ports = {n: free_port() for n in ("a", "b")}
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(xcosd_process(
            "serve", "--bind", cloud, "--curve-secret", str(server_secret),
            "--curve-allow", str(allow), "--heartbeat", "0.2"))
        urls = {}
        for name in ("a", "b"):
            await stack.enter_async_context(xcosd_process(
                "edge", "serve", "--connect", cloud, "--http", f"127.0.0.1:{ports[name]}",
                "--timeout", "2", *device_args[name]))
            urls[name] = f"http://127.0.0.1:{ports[name]}"
        clients = {}
        for name, url in urls.items():
            await until_health(url, 200)
            clients[name] = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                               max_retries=0, timeout=HANG_S)
            stack.push_async_callback(clients[name].close)
        model = (await clients["b"].models.list()).data[0].id
        before = await clients["b"].completions.create(model=model, prompt="The", max_tokens=24,
                                                       seed=5)
        stream = await clients["a"].completions.create(
            model=model, prompt="The", max_tokens=4000, seed=1, stream=True,
            extra_body={"ignore_eos": True})
        chunks = stream.__aiter__()
        await chunks.__anext__()  # generating
        (allow / "a.key").unlink()
        assert server.proc.pid is not None
        os.kill(server.proc.pid, signal.SIGHUP)
        with pytest.raises(openai.APIError) as e:
            async for _ in chunks:
                pass
        assert "revoked" in str(e.value.message)
        await until(lambda: any("allow list reloaded (SIGHUP): 1 keys, 0 added, 1 revoked"
                                in ln for ln in server.lines), "the reload reported")
        body = await until_health(urls["a"], 503)
        assert body["status"] == "connecting"
        after = await clients["b"].completions.create(model=model, prompt="The", max_tokens=24,
                                                      seed=5)
        assert after.choices[0].text == before.choices[0].text


def test_a_curve_secret_without_an_allow_list_warns(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from xcosd.commands.serve import curve_server

    _, secret = KeyPair.generate().save(tmp_path, "cloud")
    empty = tmp_path / "allow"
    empty.mkdir()
    for allow, allow_any, warned in ((None, False, "admits no device"),
                                     (str(empty), False, "holds no key yet"),
                                     (None, True, None)):
        curve = curve_server(argparse.Namespace(curve_secret=str(secret), curve_allow=allow,
                                                curve_allow_any=allow_any))
        err = capsys.readouterr().err
        assert (warned in err) if warned else err == ""
        assert curve.allow == set()


async def test_a_changed_allow_directory_is_read_again(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Without a signal: a key file removed (or added) is seen at the next look,
    and a half-written one changes nothing until it is whole."""
    from xcosd.commands.allow_reload import reloading_allow

    keys = {n: KeyPair.generate() for n in ("server", "a", "b")}
    allow = tmp_path / "allow"
    KeyPair(keys["a"].public).save(allow, "a")
    curve = CurveServer(keys["server"], {keys["a"].public})
    told: list[frozenset[bytes]] = []
    curve.watch(told.append)
    async with reloading_allow(curve, str(allow), poll_s=0.01):
        (allow / "b.key").write_text("not a key\n")
        await until(lambda: "not reloaded" in capsys.readouterr().err, "the bad file reported")
        assert curve.admitted(keys["a"].public) and told == []
        (allow / "b.key").unlink()
        KeyPair(keys["b"].public).save(allow, "b")
        (allow / "a.key").unlink()
        await until(lambda: not curve.admitted(keys["a"].public), "a revoked")
        assert curve.admitted(keys["b"].public)
        assert told == [frozenset({keys["a"].public})]
