"""Every command-line mistake is one line, ``xcosd: error: ...``, exit status 2, and
is caught before any model loads (these tests would take seconds, not milliseconds,
if it were not: loading is replaced by a tripwire)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

import xcosd
import xcosd.models
from xcosd.cli import build_parser, main


class ModelLoaded(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*_a: object, **_k: object) -> None:
        raise ModelLoaded("a model was loaded")

    monkeypatch.setattr(xcosd.models, "load_model", tripwire)
    monkeypatch.setattr(xcosd.models, "default_pair", tripwire)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc, out, err = run(argv, capsys)
    lines = err.splitlines()
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1 and lines[0].startswith("xcosd: error: "), (argv, err)
    assert out == ""
    return lines[0]


@pytest.fixture
def key_files(tmp_path: Path) -> tuple[str, str]:
    from xcosd.transport import KeyPair

    pub, sec = KeyPair.generate().save(tmp_path, "k")
    return str(sec), str(pub)


@pytest.mark.parametrize(("argv", "says"), [
    (["edge", "--method", "bogus", "hi"], "invalid choice: 'bogus'"),
    (["serve", "--methods", "xcosd,bogus"], "unknown method 'bogus'"),
    (["demo", "--methods", "nope"], "unknown method 'nope'"),
    (["bench", "methods", "--methods", "xcosd,nope"], "unknown method 'nope'"),
    (["edge", "--codec", "f33", "hi"], "unknown codec 'f33'"),
    (["demo", "--codec", "q8+gzip"], "gzip"),
    (["bench", "methods", "--codecs", "f32,zz"], "unknown codec 'zz'"),
    (["edge", "--temperature", "-1", "hi"], "--temperature: expected a number >= 0"),
    (["edge", "--temperature", "nan", "hi"], "--temperature"),
    (["edge", "--top-p", "0", "hi"], "--top-p: expected a number in (0, 1]"),
    (["demo", "--top-k", "-3"], "--top-k: expected an integer >= 0"),
    (["bench", "load", "--top-p", "1.5"], "--top-p"),
    (["bench", "load", "--temperature", "-1"], "--temperature: expected a number >= 0"),
    (["bench", "load", "--codec", "f33"], "unknown codec 'f33'"),
    (["bench", "load", "-K", "5", "--method", "xcosd"], "'xcosd' does not take -K"),
    (["bench", "load", "--threshold", "0.2"], "'xcosd-e' does not take --threshold"),
    (["bench", "load", "--stop", ""], "stop_strings must be non-empty"),
    (["edge", "--max-new-tokens", "x", "hi"], "--max-new-tokens"),
    (["edge", "-K", "5", "--method", "xcosd", "hi"], "'xcosd' does not take -K"),
    (["edge", "--threshold", "0.2", "hi"], "'xcosd-e' does not take --threshold"),
    (["edge", "--method", "ar", "--no-hr-presample", "hi"], "does not take --no-hr-presample"),
    (["edge", "-K", "0", "hi"], "-K: expected an integer >= 1"),
    (["edge", "serve"], "edge serve needs --http HOST:PORT"),
    (["edge", "serve", "hi", "--http", "127.0.0.1:0"], "--http serves requests: give no prompts"),
    (["edge", "--http", "nohost"], "--http: expected HOST:PORT"),
    (["edge", "--http", "127.0.0.1:99999"], "--http: expected HOST:PORT"),
    (["edge", "--connect", "localhost:5555", "hi"], "bad endpoint"),
    (["edge", "--connect", "tcp://127.0.0.1", "hi"], "no port"),
    (["serve", "--bind", "tcp://127.0.0.1:99999"], "--bind"),
    (["edge", "--draft", "/no/such/model.gguf", "hi"], "model file '/no/such/model.gguf' does not exist"),
    (["serve", "--target", "missing.gguf"], "model file 'missing.gguf' does not exist"),
    (["serve", "--target", "no-such-model"], "unknown model 'no-such-model'"),
    (["bench", "load", "--draft", "ngram:nope:3"], "unknown vocabulary 'nope'"),
    (["vocab", "llama3", "no-such-vocab"], "neither a vocabulary nor a model"),
    (["edge", "--prompts-file", "/no/such/file", "hi"], "does not exist"),
    (["bench", "load", "--scaling", "1,x"], "--scaling"),
    (["serve", "--curve-allow-any"], "need --curve-secret"),
    (["serve", "--slots", "65"], "--slots: expected an integer in 1..64"),
    (["serve", "--slots", "4", "--target", "."], "runs on llama.cpp with the suffix"),
    (["serve", "--context", "0"], "--context: expected an integer >= 1"),
    (["serve", "--context", "512"], "--context applies to llama.cpp and transformers models"),
    (["edge", "--draft-context", "512", "hi"], "--draft-context applies to llama.cpp"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["edge", "--no-such-flag", "hi"], "unrecognized arguments: --no-such-flag"),
])
def test_each_mistake_is_one_line_before_loading(argv: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert says in one_error(argv, capsys)


def test_curve_mistakes(key_files: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    sec, pub = key_files
    assert "--curve-secret and --curve-server-key go together" in one_error(
        ["edge", "--curve-secret", sec, "hi"], capsys)
    assert "go together" in one_error(["edge", "--curve-server-key", pub, "hi"], capsys)
    assert "needs the zmq transport" in one_error(
        ["edge", "--transport", "tcp", "--curve-secret", sec, "--curve-server-key", pub, "hi"],
        capsys)
    assert "needs the zmq transport" in one_error(
        ["serve", "--transport", "tcp", "--curve-secret", sec, "--curve-allow-any"], capsys)
    assert "does not exist" in one_error(
        ["edge", "--curve-secret", sec + ".missing", "--curve-server-key", pub, "hi"], capsys)


def test_unreachable_cloud_is_named_after_the_connect_timeout(
        capsys: pytest.CaptureFixture[str]) -> None:
    # a bound socket that does not listen: connections to it are refused
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        line = one_error(["edge", "--connect", f"tcp://127.0.0.1:{port}",
                          "--connect-timeout", "0.3", "hi"], capsys)
    assert f"cannot reach the cloud at tcp://127.0.0.1:{port}" in line
    assert "tried for 0.3 s" in line


def test_version_and_help_show_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"xcosd {xcosd.__version__}"
    rc, out, _ = run(["edge", "--help"], capsys)
    assert rc == 0
    flat = " ".join(out.split())
    assert "(default: xcosd-e)" in flat and "(default: tcp://127.0.0.1:5555)" in flat
    assert "ar, sd-uplink, straightforward, xcosd, xcosd-e" in flat  # the choices
    for cmd in (["serve"], ["demo"], ["bench", "load"], ["bench", "methods"],
                ["keys", "generate"]):
        rc, out, _ = run([*cmd, "--help"], capsys)
        assert rc == 0 and "(default:" in out, cmd


def test_one_set_of_link_flags_with_the_old_names_hidden(
        capsys: pytest.CaptureFixture[str]) -> None:
    p = build_parser()
    for cmd in (["serve"], ["edge", "hi"], ["demo"], ["bench", "load"]):
        a = p.parse_args([*cmd, "--link-mbps", "50", "--link-rtt-ms", "7"])
        assert (a.link_mbps, a.link_rtt_ms) == (50.0, 7.0), cmd
    old = p.parse_args(["bench", "load", "--link-rate-mbps", "9", "--rtt-ms", "3"])
    assert (old.link_mbps, old.link_rtt_ms) == (9.0, 3.0)
    _rc, out, _ = run(["bench", "load", "--help"], capsys)
    assert "--link-mbps" in out and "--rtt-ms" not in out and "--link-rate-mbps" not in out


#: the argparse dests of the generation flags (xcosd.commands.options.add_generation_args)
GENERATION_DESTS = ("method", "codec", "draft_len", "max_new_tokens", "temperature", "top_k",
                    "top_p", "greedy", "stop", "K", "M", "no_hr_presample", "threshold",
                    "ignore_eos")


def test_bench_load_takes_the_generation_flags_of_edge() -> None:
    """The load test's devices are edges: the same flags, names and defaults (only
    --seed differs: a load run derives every generation's seed from it)."""
    from xcosd.commands.bench import load_config
    from xcosd.config import GenerationConfig

    p = build_parser()
    edge, load = vars(p.parse_args(["edge", "hi"])), vars(p.parse_args(["bench", "load"]))
    assert {k: edge[k] for k in GENERATION_DESTS} == {k: load[k] for k in GENERATION_DESTS}
    flags = ["--method", "xcosd-e", "--codec", "q8", "--draft-len", "6", "--max-new-tokens",
             "9", "--greedy", "--stop", "END", "--stop", "###", "-K", "5", "-M", "3",
             "--no-hr-presample", "--seed", "7", "--ignore-eos"]
    cfg = load_config(p.parse_args(["bench", "load", *flags]))
    assert cfg.generation == GenerationConfig(
        method="xcosd-e", codec="q8", draft_len=6, max_new_tokens=9, do_sample=False,
        stop_strings=("END", "###"), K=5, M=3, hr_presample=False, ignore_eos=True)
    assert cfg.seed == 7  # the run's seed, not one generation's
    assert load_config(p.parse_args(["bench", "load"])).seed == 0


def test_verbose_before_or_after_the_command() -> None:
    p = build_parser()
    assert p.parse_args(["-v", "vocab", "a", "b"]).verbose == 1
    a = p.parse_args(["vocab", "a", "b", "-vv"])
    assert a.verbose + a.verbose_sub == 2
    a = p.parse_args(["bench", "load", "-v"])
    assert a.verbose + a.verbose_sub == 1


def test_vocab_takes_model_names(capsys: pytest.CaptureFixture[str]) -> None:
    from xcosd.commands.vocab import load_vocabulary

    # the embedded models' vocabularies load by name, without the models
    assert load_vocabulary("default-draft").name == load_vocabulary("o200k").name
    assert load_vocabulary("ngram:qwen:4").name == load_vocabulary("qwen").name
    rc, out, err = run(["vocab", "default-draft", "ngram:llama3:4", "--json"], capsys)
    assert rc == 0, err
    assert '"common"' in out


def test_console_script_error_is_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "xcosd", "edge", "-K", "5", "--method", "xcosd",
                        "hi"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "xcosd: error: method 'xcosd' does not take -K (it takes --no-hr-presample)"]
