"""``xcosd bench soak``: a small soak through every fault, the report's fields, the CLI,
and the pieces its verdicts rest on (the mismatch classes, the memory summary).

The soak here is small (16 devices for 6 s, short timeouts so the reaper frees a
killed device's session within the test) and asserts what must hold however slow
the machine is: no token lost, repeated or wrong, no internal error, every
generation completed or killed, no session left on the cloud. Throughput is
measured by ``make bench``, never asserted here.

Its link loses and duplicates messages, handshakes included (a duplicated or lost
``welcome`` is exercised on its own below).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import xcosd
from xcosd.bench.report import heap_mb
from xcosd.bench.results import replace_section
from xcosd.bench.soak import (
    MISMATCH_KINDS,
    SCHEMA_VERSION,
    SECTION_HEADING,
    SoakConfig,
    format_report,
    memory_summary,
    mismatch_kind,
    section_lines,
    soak,
)
from xcosd.cli import main
from xcosd.models import SyntheticModel
from xcosd.transport import LinkSpec

#: top-level fields every soak report carries (docs/RESULTS.md and scripts read them)
FIELDS = ("kind", "schema_version", "config", "pair", "window_s", "tokens_per_s",
          "tokens_checked", "tokens_committed", "generations", "generation_s", "mismatches",
          "mismatches_by_kind", "mismatch_examples", "kills", "replaced", "cloud_restarts",
          "restart_at_s", "edge_errors", "device_start_errors", "cloud", "sessions_left",
          "peers_left", "settle_s", "memory", "samples", "loop_lag_max_s", "cpu_cores_mean", "checks", "ok",
          "machine")
MEMORY_FIELDS = ("series_mb", "start_mb", "warm_at_s", "warm_mb", "end_mb", "peak_mb",
                 "growth", "flat", "late_slope_mb_per_min")


def check_schema(rep: dict) -> None:
    missing = [k for k in FIELDS if k not in rep]
    assert not missing, missing
    assert rep["kind"] == "soak" and rep["schema_version"] == SCHEMA_VERSION
    assert all(k in rep["memory"] for k in MEMORY_FIELDS)
    assert rep["memory"]["series_mb"], "no RSS sample in the window"
    assert set(rep["mismatches_by_kind"]) == set(MISMATCH_KINDS)
    assert {"errors_by_code", "internal_errors", "instances"} <= set(rep["cloud"])
    json.dumps(rep)  # JSON types only


async def test_soak_survives_kills_a_restart_and_a_lossy_link() -> None:
    cfg = SoakConfig(devices=16, duration_s=6.0, kill_rate=1.5, restarts=1, loss=0.02,
                     duplicate=0.02, prompts=16, edge_timeout_s=2.0, cloud_timeout_s=2.0,
                     resend_after_s=0.5, generation_timeout_s=30.0)
    rep = await soak(cfg)  # the awaitable variant, inside the test's running loop
    check_schema(rep)
    report = format_report(rep)
    g = rep["generations"]
    assert rep["mismatches"] == 0, (report, rep["mismatch_examples"])
    assert rep["cloud"]["internal_errors"] == 0, report
    # every generation that started completed or was killed with its device
    assert g["failed"] == 0 and g["unfinished"] == 0, (report, rep["edge_error_examples"])
    assert g["started"] == g["completed"] + g["killed"], report
    assert g["completed"] > 0 and rep["tokens_checked"] > 0
    assert rep["kills"] >= 1 and g["killed"] == rep["kills"], report
    assert rep["cloud_restarts"] == 1 and rep["restart_error"] is None
    assert rep["cloud"]["instances"] == 2
    assert rep["sessions_left"] == 0 and rep["peers_left"] == 0, report
    assert rep["checks"]["no_mismatch"] and rep["checks"]["all_generations_accounted"]
    # the memory baseline and the end each come after a full collection
    kept = rep["memory"]["after_collection"]
    assert kept is not None
    assert kept["to_s"] > kept["from_s"] >= cfg.warmup_fraction * cfg.duration_s
    assert kept["from_s"] == rep["memory"]["warm_at_s"]  # the baseline is the collected sample
    assert [s["phase"] for s in rep["samples"] if s.get("collected")][-1] == "end"
    assert set(heap_mb()) <= set(rep["samples"][0])  # the heap's fields where the C library has them
    # the results section renders from it, every check named
    text = "\n".join(section_lines(rep, "img/soak.png"))
    assert text.startswith(SECTION_HEADING) and "0 mismatches" in text
    assert "after a full collection" in text


def test_cli_soak_runs_and_writes_its_report(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--devices", "8", "--duration", "3", "--edge-timeout", "2",
               "--cloud-timeout", "2", "--resend-after", "0.5", "--json", str(out),
               "--no-progress"])
    rep = json.loads(out.read_text())
    check_schema(rep)
    assert rc == (0 if rep["ok"] else 1)
    assert rep["config"]["devices"] == 8 and rep["config"]["duration_s"] == 3.0
    assert rep["command"].startswith("xcosd ")
    assert rep["mismatches"] == 0, rep["mismatch_examples"]
    assert rep["cloud"]["internal_errors"] == 0
    assert rep["sessions_left"] == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "mismatches" in printed and "checks:" in printed


@pytest.mark.parametrize("args", [["--devices", "0"], ["--loss", "1"], ["--duplicate", "2"],
                                  ["--pair", "nope"], ["--method", "nope"]])
def test_cli_soak_refuses_bad_options(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "soak", *args])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("xcosd: error:")


def test_config_checks_its_values() -> None:
    for bad in ({"devices": 0}, {"duration_s": 0}, {"loss": 1.0}, {"pair": "x"},
                {"method": "nope"}, {"transport": "memory"}, {"kill_rate": -1.0}):
        with pytest.raises(ValueError):
            SoakConfig(**bad)  # type: ignore[arg-type]
    assert SoakConfig().link(0) is not None
    assert SoakConfig(loss=0.0, duplicate=0.0).link(0) is None


@pytest.mark.parametrize(("got", "kind"), [
    ([1, 2, 3, 4], None),
    ([1, 3, 4], "lost"),            # 2 is missing, the rest follows
    ([1, 2, 2, 3, 4], "repeated"),  # 2 twice, the rest follows
    ([1, 2, 2, 3], "repeated"),     # the same, cut at the length limit
    ([1, 2, 3, 4, 5], "long"),      # the reference is a prefix of it
    ([1, 2, 9, 4], "wrong"),
    ([1, 2], "short"),
])
def test_mismatch_kinds(got: list[int], kind: str | None) -> None:
    assert mismatch_kind(got, [1, 2, 3, 4]) == kind


def test_memory_summary_compares_the_end_with_the_warm_sample() -> None:
    def samples(mbs: list[float]) -> list[dict]:
        s = [{"t": float(i), "phase": "running", "rss_mb": mb} for i, mb in enumerate(mbs)]
        s[-1]["phase"] = "end"
        return s

    flat = memory_summary(samples([50, 100, 101, 104, 105]), 4.0, 0.25)
    assert flat["warm_mb"] == 100 and flat["end_mb"] == 105 and flat["flat"]
    assert flat["start_mb"] == 50 and flat["peak_mb"] == 105
    grows = memory_summary(samples([50, 100, 110, 120, 130]), 4.0, 0.25)
    assert grows["growth"] == pytest.approx(1.3) and not grows["flat"]
    # 10 MiB a second over the second half: 600 MiB a minute; a level tail: 0
    assert grows["late_slope_mb_per_min"] == pytest.approx(600)
    level = memory_summary(samples([50, 90, 100, 100, 100]), 4.0, 0.25)
    assert level["late_slope_mb_per_min"] == pytest.approx(0, abs=1e-9)


def test_memory_summary_splits_the_slope_by_heap_where_sampled() -> None:
    # RSS grows 1 MiB a second while the C heap in use is level and the free heap
    # grows: memory the allocator keeps, which the split shows and RSS cannot
    s = [{"t": float(i), "phase": "running", "rss_mb": 100.0 + i, "heap_used_mb": 40.0,
          "heap_free_mb": 5.0 + i, "py_blocks": 1000 + 2 * i} for i in range(6)]
    s[-1]["phase"] = "end"
    m = memory_summary(s, 5.0, 0.2)
    assert m["late_slope_mb_per_min"] == pytest.approx(60)
    assert m["late_slopes"]["heap_used_mb"] == pytest.approx(0, abs=1e-9)
    assert m["late_slopes"]["heap_free_mb"] == pytest.approx(60)
    assert m["late_slopes"]["py_blocks"] == pytest.approx(120)
    # samples without the fields (another C library, an older report): no split
    bare = [{k: v for k, v in x.items() if k in ("t", "phase", "rss_mb")} for x in s]
    assert memory_summary(bare, 5.0, 0.2)["late_slopes"] == {}
    assert m["after_collection"] is None  # no sample was taken after a collection


def test_memory_summary_compares_what_two_full_collections_kept() -> None:
    s = [{"t": float(i), "phase": "running", "rss_mb": 100.0, "heap_used_mb": 40.0 + i,
          "py_blocks": 1000 + 50 * i, "generations": 10 * i} for i in range(6)]
    s[1]["collected"] = True
    s[-1].update(phase="end", collected=True)
    k = memory_summary(s, 5.0, 0.2)["after_collection"]
    assert (k["from_s"], k["to_s"], k["generations"]) == (1.0, 5.0, 40)
    assert k["py_blocks"] == [1050, 1250] and k["py_blocks_per_generation"] == 5
    assert k["heap_used_mb"] == [41.0, 45.0]
    assert k["heap_used_mb_per_generation"] == pytest.approx(0.1)


def test_heap_mb_sees_a_buffer_in_use_and_its_release() -> None:
    import numpy as np

    before = heap_mb()
    assert before["py_blocks"] > 0
    if "heap_used_mb" not in before:
        pytest.skip("the C library has no mallinfo2")
    buf = np.ones(4 << 20)  # 32 MiB, from the C heap (mmapped: counted as in use)
    held = heap_mb()
    del buf
    after = heap_mb()
    assert held["heap_used_mb"] - before["heap_used_mb"] >= 31
    assert held["heap_used_mb"] - after["heap_used_mb"] >= 31


def test_replace_section_rewrites_only_that_section() -> None:
    doc = "# R\n\n## A\n\na\n\n## Soak: old\n\nold\n\n## B\n\nb\n"
    new = replace_section(doc, "## Soak", ["## Soak: new", "", "new", ""], ("## B",))
    assert new == "# R\n\n## A\n\na\n\n## Soak: new\n\nnew\n\n## B\n\nb\n"
    added = replace_section("# R\n\n## A\n\na\n\n## B\n\nb\n", "## Soak",
                            ["## Soak: x", "", "x", ""], ("## B",))
    assert added == "# R\n\n## A\n\na\n\n## Soak: x\n\nx\n\n## B\n\nb\n"


# ------------------------------------------------------- what the soak found


async def test_a_duplicated_welcome_does_not_fail_the_handshake() -> None:
    target = SyntheticModel(64)
    draft = SyntheticModel(target.vocab, skew=0.9, name="d")
    # every message twice: a fresh cloud does not know the edge's V_C map, so the
    # edge uploads it and waits for vmap_ok, and meets the second welcome first
    async with xcosd.CloudNode(target, bind="tcp://127.0.0.1:0") as cloud:
        edge = xcosd.EdgeNode(draft, cloud.endpoint, link=LinkSpec.of(duplicate=1.0),
                              silence_timeout_s=2.0, connect_timeout_s=5.0)
        async with edge:
            r = await edge.generate([1, 2], max_new_tokens=4, do_sample=False)
    assert len(r.token_ids) == 4


async def test_a_lossy_link_does_not_keep_an_edge_from_connecting() -> None:
    """Half of all messages lost, each way: every handshake step and every answer is
    asked for again until it gets through (each connection has its own random
    stream, so a reconnect does not meet the same losses either)."""
    target = SyntheticModel(64)
    draft = SyntheticModel(target.vocab, skew=0.9, name="d")
    async with xcosd.CloudNode(target, bind="tcp://127.0.0.1:0") as cloud:
        edge = xcosd.EdgeNode(draft, cloud.endpoint, link=LinkSpec.of(loss=0.5, seed=3),
                              silence_timeout_s=5.0, connect_timeout_s=30.0, resend_after_s=0.05)
        async with edge:
            # several rounds: one round's two messages both get through a quarter of
            # the time (and how many draws the handshake used depends on its timing)
            r = await edge.generate([1, 2], max_new_tokens=32, do_sample=False,
                                    adaptive_draft=False)
    assert len(r.token_ids) == 32 or r.stats.finish_reason == "stop", r.stats
    assert r.stats.rounds >= 6, r.stats
    assert r.stats.resends > 0


async def test_the_bare_pyzmq_memory_control_echoes_and_samples() -> None:
    """The soak's memory control: real sockets, every connection carrying messages,
    one RSS sample per interval."""
    from xcosd.bench.zmq_memory import measure

    rep = await measure(4, 200.0, 0.6, sample_s=0.2)
    assert rep["connections"] == 4
    assert rep["messages_per_connection_per_s"] > 1
    assert len(rep["series_mb"]) >= 2
    assert all(mb > 0 for _, mb in rep["series_mb"])
    assert rep["end_mb"] == rep["series_mb"][-1][1]
