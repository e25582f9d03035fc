"""CURVE on the ZeroMQ transport: allowlisted devices get through encrypted;
plaintext peers and unknown keys get nothing through; keys from the CLI."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from xcosd.cli import main
from xcosd.errors import TransportError
from xcosd.transport import CurveClient, CurveServer, KeyPair, connect, listen, load_allowlist
from xcosd.transport.zeromq import zmtp_overhead
from xcosd.wire.frames import decode_message, encode_message

from .helpers.waits import HANG_S

QUIET = 0.5  # seconds a refused peer is given to (not) get a message through


async def _nothing_arrives(lst) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(lst.recv(), QUIET)


@pytest.fixture
def keys() -> dict[str, KeyPair]:
    return {n: KeyPair.generate() for n in ("server", "device", "stranger")}


async def test_allowlisted_device_round_trips(keys: dict[str, KeyPair]) -> None:
    server = CurveServer(keys["server"], {keys["device"].public})
    async with await listen("tcp://127.0.0.1:0", curve=server) as lst:
        c = await connect(lst.endpoint, curve=CurveClient(keys["device"],
                                                          keys["server"].public))
        await c.send(encode_message({"t": "hello"}, [b"x" * 300]))
        peer, frames = await asyncio.wait_for(lst.recv(), HANG_S)
        assert frames is not None and decode_message(frames)[0] == {"t": "hello"}
        await lst.send(peer, encode_message({"t": "ok"}))
        assert decode_message(await asyncio.wait_for(c.recv(), HANG_S))[0] == {"t": "ok"}
        # CURVE framing is metered: 33 bytes of box per frame on top of ZMTP's
        up = lst.meter.up["hello"]
        assert up.wire - up.payload == zmtp_overhead(frames, curve=True)
        assert zmtp_overhead([b"a"], curve=True) == 33 + 2
        await c.close()


async def test_plaintext_dealer_gets_nothing_through(keys: dict[str, KeyPair]) -> None:
    server = CurveServer(keys["server"], {keys["device"].public})
    async with await listen("tcp://127.0.0.1:0", curve=server) as lst:
        c = await connect(lst.endpoint)  # no CURVE
        await c.send([b"\x80"])
        await _nothing_arrives(lst)
        await c.close()
        # a bare pyzmq DEALER fares no better
        ctx = zmq.asyncio.Context()
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.connect(lst.endpoint)
        await d.send_multipart([b"\x81\xa1t\xa2hi"])
        await _nothing_arrives(lst)
        d.close()
        ctx.term()


async def test_unknown_key_is_refused_and_admit_lets_it_in(keys: dict[str, KeyPair]) -> None:
    server = CurveServer(keys["server"], {keys["device"].public})
    async with await listen("tcp://127.0.0.1:0", curve=server) as lst:
        stranger = CurveClient(keys["stranger"], keys["server"].public)
        c = await connect(lst.endpoint, curve=stranger)
        await c.send([b"\x80"])
        await _nothing_arrives(lst)
        await c.close()
        wrong_server = CurveClient(keys["device"], keys["stranger"].public)
        c = await connect(lst.endpoint, curve=wrong_server)
        await c.send([b"\x80"])
        await _nothing_arrives(lst)
        await c.close()
        server.admit(keys["stranger"].public)
        c = await connect(lst.endpoint, curve=stranger)
        await c.send([b"\x80"])
        _, frames = await asyncio.wait_for(lst.recv(), HANG_S)
        assert frames == [b"\x80"]
        await c.close()


def test_bad_keys_are_refused() -> None:
    with pytest.raises(TransportError):
        CurveServer(KeyPair(KeyPair.generate().public))  # no secret
    with pytest.raises(TransportError):
        CurveServer(KeyPair.generate(), {b"short"})
    with pytest.raises(TransportError):
        KeyPair.load("/nonexistent/key")


async def test_cli_generates_usable_keys(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", str(tmp_path / "srv"), "--name", "cloud"]) == 0
    assert main(["keys", "generate", str(tmp_path / "dev"), "--name", "phone"]) == 0
    assert main(["keys", "generate", str(tmp_path / "dev"), "--name", "phone"]) == 2  # exists
    sec = tmp_path / "dev" / "phone.key_secret"
    assert oct(os.stat(sec).st_mode & 0o777) == "0o600"
    phone = str(tmp_path / "dev" / "phone.key")
    assert main(["keys", "allow", str(tmp_path / "allow"), phone]) == 0
    capsys.readouterr()
    assert main(["keys", "show", str(sec)]) == 0
    phone_pub = capsys.readouterr().out.strip().encode()
    assert load_allowlist(tmp_path / "allow") == {phone_pub}

    server = CurveServer.from_files(tmp_path / "srv" / "cloud.key_secret", tmp_path / "allow")
    client = CurveClient.from_files(sec, tmp_path / "srv" / "cloud.key")
    async with await listen("tcp://127.0.0.1:0", curve=server) as lst:
        c = await connect(lst.endpoint, curve=client)
        await c.send([b"\x80"])
        assert (await asyncio.wait_for(lst.recv(), HANG_S))[1] == [b"\x80"]
        await c.close()
