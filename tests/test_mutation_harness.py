"""The mutation harness (``bench/mutation.py``) itself: mutants are generated, applied
and undone correctly, and the named mutants still match the code.

The named mutants are text patches of real source lines; if someone rewrites such a
line the patch would silently stop applying and the fault it stands for would no
longer be tested, so each patch's old text must occur exactly once right now.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bench.mutation as harness
from bench.mutation import (
    NAMED,
    ROOT,
    SUMMARY_ID,
    TEST_MAP,
    TIMEOUT_PLUGIN,
    applied,
    generate_mutants,
    mapped_tests,
    named_mutant,
    sample_mutants,
    scope_files,
    update_results,
)

TINY = '''"""Docstring: 1 < 2 is not mutated."""

LIMIT = 3


def f(x: list[int], j: int, mass: float = 0.5) -> float:
    """A docstring with numbers 0 and 1."""
    if j >= len(x) and mass > 0:
        raise ValueError(f"index {j + 1} out of range")
    total = x[j] + LIMIT * 2
    total += 1
    return normalise(total) if not mass == 1 else total


def g() -> None:
    return None


def __repr__(self) -> str:
    return str(1 + 2)
'''


def _ops(mutants):
    return {m.operator.split("->")[0].split(":")[0] for m in mutants}


def test_generator_covers_the_operators_and_skips_text_and_types() -> None:
    mutants = generate_mutants(TINY, "tiny.py")
    ops = {m.operator for m in mutants}
    for op in ("cmp:GtE->Gt", "cmp:Gt->GtE", "boolop:And->Or", "binop:Add->Sub",
               "binop:Mult->Div", "aug:Add->Sub", "const:+1", "const:0->1", "const:1->0",
               "if-neg", "return-None", "index->0", "index+1", "call-drop:normalise",
               "not-drop", "cmp:Eq->NotEq"):
        assert op in ops, op
    assert all(m.line >= 3 for m in mutants)  # nothing in the module docstring
    assert not any(m.line in (7, 9) for m in mutants)  # function docstring, raise message
    assert not any(m.line >= 19 for m in mutants)  # __repr__
    assert not any("list[" in m.new_line and "list[int]" not in m.new_line for m in mutants)
    # ``return None`` in a function annotated ``-> None`` is not a mutant
    assert not any(m.line == 16 for m in mutants)
    # ids are unique and the same on a second run
    ids = [m.id for m in mutants]
    assert len(set(ids)) == len(ids)
    assert ids == [m.id for m in generate_mutants(TINY, "tiny.py")]
    assert ids[0].startswith("tiny.py:3:")


def test_every_mutant_parses_and_changes_the_ast() -> None:
    original = ast.dump(ast.parse(TINY))
    for m in generate_mutants(TINY, "tiny.py"):
        mutated = m.apply(TINY)
        assert ast.dump(ast.parse(mutated)) != original, m.id
        # the splice leaves every other line untouched
        changed = [i for i, (a, b) in enumerate(zip(TINY.splitlines(), mutated.splitlines(),
                                                    strict=True)) if a != b]
        assert changed == [m.line - 1], m.id


def test_scopes_limit_mutants_to_named_top_level_definitions() -> None:
    only_f = generate_mutants(TINY, "tiny.py", frozenset({"f"}))
    assert only_f and all(6 <= m.line <= 12 for m in only_f)  # default, body


def test_applied_writes_the_mutant_and_restores_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    before = path.read_bytes()
    m = next(m for m in generate_mutants(TINY, "tiny.py") if m.operator == "cmp:GtE->Gt")
    with applied(path, m) as text:
        assert path.read_text() == text == m.apply(TINY)
        assert "if j > len(x)" in path.read_text()
    assert path.read_bytes() == before
    with pytest.raises(RuntimeError), applied(path, m):
        raise RuntimeError("a crash mid-run still restores the file")
    assert path.read_bytes() == before


@pytest.mark.parametrize("patch", NAMED, ids=[p.name for p in NAMED])
def test_named_patch_matches_the_current_source_exactly_once(patch) -> None:
    source = (ROOT / patch.path).read_text(encoding="utf-8")
    assert source.count(patch.old) == 1, f"{patch.name} is stale: {patch.old!r}"
    m = named_mutant(patch, source)
    assert m.apply(source).count(patch.new) >= 1
    ast.parse(m.apply(source))
    assert patch.path in {p for p, _ in scope_files()}


def test_stale_named_patch_is_an_error() -> None:
    with pytest.raises(ValueError, match="occurs 0 times"):
        named_mutant(NAMED[0], "nothing to patch here")


def test_sample_is_deterministic_and_spans_files() -> None:
    mutants = generate_mutants(TINY, "a.py") + generate_mutants(TINY, "b.py")
    s1 = sample_mutants(mutants, 6, seed=3)
    assert [m.id for m in s1] == [m.id for m in sample_mutants(mutants, 6, seed=3)]
    assert len(s1) == 6 and {m.path for m in s1} == {"a.py", "b.py"}
    assert sample_mutants(mutants, 10_000, seed=3) == mutants


def test_test_map_covers_the_scope_and_names_the_law_and_limit_tests() -> None:
    for rel, _ in scope_files():
        tests, missing = mapped_tests(rel)
        assert tests or missing, rel
    mapped = {t for _, tests in TEST_MAP for t in tests}
    assert {"tests/test_law.py", "tests/test_limits.py", "tests/test_exactness.py",
            "tests/test_protocol_sm.py", "tests/test_frames.py"} <= mapped
    assert "tests/test_law.py" in mapped_tests("xcosd/protocol/edge.py")[0] + \
        mapped_tests("xcosd/protocol/edge.py")[1]


def test_pytest_plugin_parses_and_summary_ids_keep_their_parameters() -> None:
    ast.parse(TIMEOUT_PLUGIN)
    summary = ("FAILED tests/a.py::t[top-p 0.95] - assert 1\nERROR tests/b.py - x\n"
               "FAILED tests/c.py::u\n")
    assert SUMMARY_ID.findall(summary) == ["tests/a.py::t[top-p 0.95]", "tests/b.py", "tests/c.py::u"]


def test_update_results_replaces_only_its_own_section(tmp_path: Path) -> None:
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# R\n\n## A\n\na\n")
    update_results(doc, "## Mutation testing\n\nold\n")
    assert doc.read_text() == "# R\n\n## A\n\na\n\n## Mutation testing\n\nold\n"
    doc.write_text(doc.read_text() + "\n## Z\n\nz\n")
    update_results(doc, "## Mutation testing\n\nnew\n")
    assert doc.read_text() == "# R\n\n## A\n\na\n\n## Mutation testing\n\nnew\n\n## Z\n\nz\n"


def test_verify_kills_drops_broken_and_flaky_killers(monkeypatch, tmp_path: Path) -> None:
    """A kill by a test that fails unmutated, or that passes when rerun, is rerun
    without that test; only a kill that survives both checks stays ``killed``."""
    import argparse

    broken = {"t.py::broken", "t.py::broken2"}

    def fake_run_tests(workdir, tests, timeout, workers=0, test_timeout=0.0, **kw):
        failed = frozenset(set(tests) & broken)
        return harness.Outcome("killed" if failed else "survived", 1 if failed else 0, 0.1,
                               failed=failed)

    def fake_run_set(workdir, *, tests, timeout, workers):
        return harness.Outcome("killed", 1, 0.1, failed=frozenset(broken))

    def result(mid: str, status: str, killer: str | None) -> harness.Result:
        return harness.Result(mid, "x.py", 1, 1, "op", None, "a", "b", ["t.py"], status,
                              1 if status == "killed" else 0, 0.1, killer)

    def fake_run_one(m, deselect=(), force=False, only=()):
        assert force
        if only:  # the killer alone on the mutant: B's killer is flaky
            return result(m.id, "survived" if m.id == "B" else "killed", None)
        if m.id == "A":
            assert broken <= set(deselect)
            return result("A", "killed", "t.py::good")
        assert m.id == "B" and "t.py::flaky" in deselect
        return result("B", "survived", None)

    monkeypatch.setattr(harness, "run_tests", fake_run_tests)
    monkeypatch.setattr(harness, "_run_set", fake_run_set)
    results = [result("A", "killed", "t.py::broken"), result("B", "killed", "t.py::flaky"),
               result("C", "killed", "t.py::good"), result("D", "survived", None)]
    by_id = {r.id: harness.Mutant(r.id, "x.py", 1, 1, "op", 0, 0, "") for r in results}
    args = argparse.Namespace(timeout=10.0, pytest_workers=0, test_timeout=0.0)
    failing = harness.verify_kills(results, by_id, tmp_path, fake_run_one,
                                   lambda fn: fn(tmp_path), 1, args)
    assert failing == broken
    assert [(r.id, r.status, r.killed_by) for r in results] == [
        ("A", "killed", "t.py::good"), ("B", "survived", None), ("C", "killed", "t.py::good"),
        ("D", "survived", None)]
