"""The serve / edge / demo commands, run in process on the embedded default pair."""

from __future__ import annotations

import pytest

from xcosd.cli import main


@pytest.mark.slow
def test_demo_runs_every_method_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--edges", "2", "--prompts", "2", "--max-new-tokens", "8",
               "--link-rtt-ms", "2", "--no-stream"])
    assert rc == 0
    out = capsys.readouterr().out
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
