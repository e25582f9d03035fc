"""Thousands of devices: one process past libzmq's default socket cap and the usual
soft limit on descriptors, over real loopback sockets (xcosd/transport/fds.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from xcosd.bench.load import LoadConfig, run_load
from xcosd.config import GenerationConfig
from xcosd.transport import connect, listen
from xcosd.transport.fds import fd_limit, raise_fd_limit
from xcosd.wire.frames import decode_message, encode_message

from .helpers.waits import HANG_S

#: past libzmq's default cap of 1,023 sockets in a context
MANY = 1100
#: descriptors a process needs for MANY connections to itself: a TCP socket at each
#: end and a mailbox per ZeroMQ socket, with room to spare
NEEDED = 4 * MANY


def _enough_descriptors() -> None:
    limit = raise_fd_limit()
    if limit is not None and limit < NEEDED:
        pytest.skip(f"the hard limit on descriptors ({limit}) is below {NEEDED}")


async def test_one_process_holds_more_connections_than_libzmq_s_default_cap() -> None:
    """Every one of 1,100 devices' connections in one process carries a message each
    way (the 1,024th used to fail with 'Too many open files')."""
    _enough_descriptors()
    lst = await listen("tcp://127.0.0.1:0", transport="zmq")
    conns = []
    try:
        for _ in range(MANY):
            conns.append(await connect(lst.endpoint, transport="zmq"))
        for i, c in enumerate(conns):
            await c.send(encode_message({"t": "ping", "i": i}))
        peers: dict[int, bytes] = {}
        while len(peers) < MANY:
            for peer, frames in await asyncio.wait_for(lst.recv_many(256), HANG_S):
                assert frames is not None
                peers[decode_message(frames)[0]["i"]] = peer
        assert len(set(peers.values())) == MANY
        for i, peer in peers.items():
            await lst.send(peer, encode_message({"t": "pong", "i": i}))
        for i, c in enumerate(conns):
            header, _ = decode_message(await asyncio.wait_for(c.recv(), HANG_S))
            assert header == {"t": "pong", "i": i}
    finally:
        for c in conns:
            await c.close()
        await lst.close()


def test_raise_fd_limit_lifts_the_soft_limit_up_to_the_hard_one() -> None:
    """From a soft limit of 256: raised to the target, or to the hard limit when that
    is lower; never lowered. In a child process, so this one keeps its limits."""
    code = textwrap.dedent("""
        import resource
        from xcosd.transport.fds import fd_limit, raise_fd_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        cap = 10 ** 9 if hard == resource.RLIM_INFINITY else hard
        assert fd_limit() == 256
        assert raise_fd_limit(200) == 256, "never lowered"
        assert raise_fd_limit(4096) == min(4096, cap)
        assert raise_fd_limit(cap + 1) == (cap if hard != resource.RLIM_INFINITY else cap + 1)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert fd_limit() is None or fd_limit() > 0


async def test_load_test_of_more_devices_than_libzmq_s_default_cap() -> None:
    """``run_load`` with 1,100 devices in one device process against a near-free
    target: every device generates and nothing fails.

    Counted, not timed: each device runs one warm-up and one measured generation to
    the end (generations mode), so a busy machine makes the run slower, never a
    device's generation missing from a time window."""
    _enough_descriptors()
    cfg = LoadConfig(devices=MANY, target="synthetic:256:0.01:0.001",
                     generation=GenerationConfig(method="xcosd-e", max_new_tokens=8,
                                                 adaptive_draft=False),
                     duration_s=None, generations=1, warmup_generations=1, timeout_s=120.0)
    rep = await run_load(cfg, progress=False)
    assert rep["errors_total"] == 0
    assert rep["devices"] == MANY
    gens = rep["generations"]
    assert gens["started"] == 2 * MANY  # every device finished its warm-up and went on
    assert gens["warmup"] == MANY
    assert gens["cut_at_end"] == 0  # and every measured generation ran to its end


def test_out_of_descriptors_is_a_typed_error_that_names_the_limit() -> None:
    """A process whose descriptors run out gets a ``TransportError`` (code
    ``connect``) saying which limit, not a bare ZMQError. In a child process with a
    soft limit of 64."""
    code = textwrap.dedent("""
        import asyncio, resource
        from xcosd.errors import TransportError
        from xcosd.transport import connect, listen
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

        async def main():
            lst = await listen("tcp://127.0.0.1:0", transport="zmq")
            conns = []
            try:
                for _ in range(200):
                    conns.append(await connect(lst.endpoint, transport="zmq"))
            except TransportError as e:
                assert e.code == "connect", e.code
                assert "descriptors" in str(e) and "64" in str(e), str(e)
                print("refused after", len(conns))
            else:
                print("never refused")
            for c in conns:
                await c.close()
            await lst.close()

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused after"), out.stdout
