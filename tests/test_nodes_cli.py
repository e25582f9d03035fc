"""The serve / edge / demo commands, run in process on the embedded default pair."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

import xcosd
import xcosd.models
from xcosd.cli import main

from .session_pairs import greedy_decode, pair


@pytest.mark.slow
def test_demo_runs_every_method_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--edges", "2", "--prompts", "2", "--max-new-tokens", "8",
               "--link-rtt-ms", "2", "--no-stream"])
    assert rc == 0
    captured = capsys.readouterr()
    out = captured.out
    # stderr is no terminal here: progress is whole lines, no carriage returns
    assert "\r" not in captured.err
    from xcosd.methods import METHODS

    for name in METHODS:
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "tok/s model" in out and "down B/tok" in out


def test_commands_are_registered() -> None:
    from xcosd.cli import build_parser

    p = build_parser()
    for cmd in ("serve", "edge", "demo"):
        args = p.parse_args([cmd] if cmd != "edge" else [cmd, "hello"])
        assert callable(args.func)


@pytest.fixture
def table_cloud() -> Iterator[str]:
    """A CloudNode on the small table pair, in its own thread and event loop, for a
    command (which runs its own loop) to connect to over real ZeroMQ on loopback."""
    target, _ = pair()
    ready: list[str] = []
    started, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        async with xcosd.CloudNode(target=target, bind="tcp://127.0.0.1:0") as cloud:
            ready.append(cloud.endpoint)
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    t = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    t.start()
    assert started.wait(60), "the cloud did not start"
    yield ready[0]
    stop.set()
    t.join(60)


def test_edge_json_goes_to_stdout(table_cloud: str, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair()
    monkeypatch.setattr(xcosd.models, "load_model", lambda spec: draft)
    rc = main(["edge", "--connect", table_cloud, "--json", "--greedy", "--max-new-tokens", "12",
               "ab", "cd"])
    out = capsys.readouterr().out
    assert rc == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert [d["prompt"] for d in docs] == ["ab", "cd"]
    for d in docs:
        assert d["token_ids"] == greedy_decode(target, d["prompt"], 12)
        assert d["stats"]["tokens"] == len(d["token_ids"]) and d["finish_reason"]


async def test_edge_serves_with_the_open_hold_it_is_given() -> None:
    """``edge serve --open-hold-ms`` reaches the node: a given bound, 0 (never wait),
    or the node's own default when the flag is absent; a negative one is refused."""
    from xcosd.cli import build_parser
    from xcosd.commands.edge import _node
    from xcosd.nodes.arrivals import HOLD_S

    p = build_parser()
    async with xcosd.CloudNode(target=xcosd.models.load_model("synthetic:256"),
                               bind="tcp://127.0.0.1:0") as cloud:
        for flags, hold in ([], HOLD_S), (["--open-hold-ms", "7.5"], 0.0075), (
                ["--open-hold-ms", "0"], 0.0):
            args = p.parse_args(["edge", "serve", "--http", "127.0.0.1:0", "--draft",
                                 "synthetic:256", "--connect", cloud.endpoint, *flags])
            edge = await _node(args)
            assert edge.arrivals.hold_s == hold
    with pytest.raises(SystemExit):
        p.parse_args(["edge", "--open-hold-ms", "-1"])
