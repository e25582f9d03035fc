"""Mutation testing of the exactness-critical code: would the tests notice a bug?

    .venv/bin/python -m bench.mutation [--only-named] [--sample N --seed S]
        [--files GLOB ...] [--max-mutants N] [--jobs J] [--timeout S] [--json PATH]

A lossless method that is subtly wrong (a row from the wrong position, an
unnormalised mass, a limit off by one) still produces plausible text, so only the
statistical tests can tell; this harness measures whether they do. It plants small
faults ("mutants") in the methods, the two protocol state machines, the commit rule
and the frame limits, runs the tests mapped to the mutated file against each, and
reports which faults no test noticed.

Why our own harness rather than mutmut: the suite is CPU-bound (exactness tests
sample 10^5 rounds) and the machine has 2 cores, so each mutant must run only the
tests that can see its file (:data:`TEST_MAP`, fastest first, ``-x``), with a
timeout (a mutant that hangs a loop counts as detected, ``timeout``), on a fixed
number of workers, and a deterministic sample must be possible for a quick run.

How a run works:

* Mutants come from the AST (:func:`generate_mutants`): comparison, arithmetic and
  boolean operator swaps, constant perturbations, negated ``if``/``while`` tests,
  dropped ``not``, ``return None``, index shifts, dropped normalisation and clamp
  calls. Each is a splice of the original text (the rest of the file stays byte for
  byte), with a stable id ``file:line:col:operator``.
* :data:`NAMED` mutants are concrete text patches for faults the suite used to miss;
  they run like any other mutant, are reported separately, and the run exits 1 if
  one survives. A stale patch (its old text no longer found exactly once) is an
  error too.
* Each worker owns a copy of ``xcosd/``, ``tests/``, ``bench/`` and
  ``pyproject.toml`` in a temporary directory; pytest runs there with
  ``PYTHONPATH`` set to the copy (the venv has the project installed editable, so
  without it the real tree would be imported; the harness checks) and bytecode
  writing off (a same-size mutant written within the same second could otherwise
  reuse a stale ``.pyc``). The mutated file is restored after every run.
* A failing test on the unmutated code would make every mutant look killed, a flaky
  one some. A full unmutated run of the law tests costs as much as a dozen mutants,
  so by default each test set is only collected first (a file mid-edit stops the
  run), and every kill is checked afterwards (:func:`verify_kills`): its test must
  pass on the unmutated copy and fail again alone on the mutant; otherwise the
  mutant reruns without that test. A kill still unchecked is ``unconfirmed``.
  ``--baseline`` runs the whole sets first instead (and sets the timeouts from them).
* A per-test alarm (a tiny plugin written into the copy, ``--test-timeout``) ends a
  hung test; ``--timeout`` bounds a whole mutant as a backstop.
* The same plugin runs first the test that killed the mutant in the previous report
  (``--json``; ``--no-history`` to skip): the verdict cannot change, since pytest
  still runs every test until one fails, but a repeated run of a mutant the law
  tests kill costs that one test instead of every cheaper file before it.

Statuses: ``killed`` (pytest exit 1), ``timeout``, ``error`` (any other non-zero
exit, e.g. the mutant breaks the import: detected, but cheaply), ``survived``
(exit 0); not scored: ``unconfirmed`` and ``not-run`` (``--budget`` ran out). The
score is detected / run, detected = killed + timeout + error.

Prints a table per file, the named mutants and every survivor with its diff line;
writes ``bench/out/mutation.json``. ``make mutation`` runs the named mutants plus a
deterministic sample; no options at all runs every mutant (a day or more on 2 cores).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import fnmatch
import functools
import json
import os
import queue
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "mutation.json"
PY = sys.executable

#: seconds one test may run before its mutant counts as hung (``timeout``); the
#: slowest unmutated tests (the law tests' 20k generations through the state
#: machines) take a few minutes on a loaded 2-core machine
DEFAULT_TEST_TIMEOUT = 900.0
#: seconds for all of one mutant's tests: only a backstop (a surviving mutant of a
#: method runs every mapped file, ~15 minutes with 2 jobs, more on a loaded machine)
DEFAULT_TIMEOUT = 4 * 3600.0

#: what each worker's copy holds: the package, the tests (with their helpers) and
#: the project file (pytest's options: asyncio mode, markers, warning filters)
COPY = ("xcosd", "tests", "bench", "pyproject.toml")
COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis",
                                     "out", "*.egg-info")

# ------------------------------------------------------------------ scope and tests

#: the files mutated (globs relative to the repository root) and, where only part of
#: a file matters, the top-level names inside which mutants are made
SCOPE: dict[str, frozenset[str] | None] = {
    "xcosd/methods/*.py": None,
    "xcosd/protocol/edge.py": None,
    "xcosd/protocol/cloud.py": None,
    "xcosd/wire/frames.py": frozenset({"check_limits", "StreamDecoder", "Limits"}),
    # the accelerator path's verification, its warpers, draws, sums and uniforms
    "xcosd/accel/*.py": None,
    # a tree's rows scored leaf by leaf, the session's context restored after each
    "xcosd/models/tree_scoring.py": frozenset({"score_tree", "leaf_paths"}),
    # a round's counted random numbers, on the host and the accelerator
    "xcosd/draws.py": None,
}

#: tests that can observe a method's law, cheapest first: ``-x`` stops at the first
#: failure, so a mutant the quick files catch never pays for the statistical ones
#: (unmutated on 2 cores: the first four ~25 s together, e2e and exactness a few
#: minutes, law -- multi-draft generations through the state machines -- the most)
METHOD_TESTS = (
    "tests/test_methods.py",
    "tests/test_sampling.py",
    "tests/test_protocol_sm.py",
    "tests/test_fuzz_cloud.py",
    "tests/test_e2e_exactness.py",
    "tests/test_exactness.py",
    "tests/test_law.py",
)
#: tests of draft trees: their shapes and checks, then the law of tree generations
TREE_TESTS = (
    "tests/test_trees.py",
    "tests/test_law_trees.py",
)
#: tests that drive the edge and cloud state machines (messages, order, faults, law)
PROTOCOL_TESTS = (
    "tests/test_protocol_sm.py",
    "tests/test_protocol_hostile.py",
    "tests/test_fuzz_cloud.py",
    "tests/test_nodes_faults.py",
    "tests/test_nodes.py",
    "tests/test_e2e_exactness.py",
    "tests/test_law.py",
)
#: tests of the frame codec's limits, on messages and on TCP byte streams
FRAME_TESTS = (
    "tests/test_frames.py",
    "tests/test_limits.py",
    "tests/test_transport.py",
    "tests/test_link.py",
    "tests/test_protocol_hostile.py",
    "tests/test_curve.py",
)

#: tests of the accelerator path: its parts (seconds), its CLI and node wiring, then the
#: laws through the state machines on it
ACCEL_TESTS = (
    "tests/test_accel.py",
    "tests/test_accel_cli.py",
    "tests/test_law_accel.py",
)

#: tests of a round's counted random numbers: the streams' bits, then the two paths
#: drawing alike, then every recorded generation (a changed bit changes its tokens)
DRAWS_TESTS = (
    "tests/test_draws.py",
    "tests/test_accel.py",
    "tests/test_golden_generations.py",
)

#: mutated file (glob) -> the test files run against its mutants, in this order.
#: Files that do not exist (yet) are left out at run time and listed in the report.
TEST_MAP: list[tuple[str, tuple[str, ...]]] = [
    # TV(p, p*) only reports how far a lossy codec moves the law: its tests are the codecs'
    ("xcosd/methods/distance.py", ("tests/test_codecs.py",)),
    ("xcosd/methods/tree.py", TREE_TESTS),
    ("xcosd/methods/shape.py", TREE_TESTS),
    ("xcosd/models/tree_scoring.py", TREE_TESTS),
    # a round's server half (verify_round) verifies trees too: their law through the
    # state machines, after the cheap method tests
    ("xcosd/methods/round.py", (*METHOD_TESTS[:3], "tests/test_law_trees_protocol.py",
                                *METHOD_TESTS[3:])),
    ("xcosd/methods/*.py", METHOD_TESTS),
    ("xcosd/protocol/edge.py", PROTOCOL_TESTS),
    ("xcosd/protocol/cloud.py", PROTOCOL_TESTS),
    ("xcosd/wire/frames.py", FRAME_TESTS),
    ("xcosd/accel/*.py", ACCEL_TESTS),
    ("xcosd/draws.py", DRAWS_TESTS),
]


def mapped_tests(path: str, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """``(present, missing)`` test files mapped to ``path`` (first matching glob)."""
    for pattern, tests in TEST_MAP:
        if fnmatch.fnmatch(path, pattern):
            present = [t for t in tests if (root / t).exists()]
            return present, [t for t in tests if t not in present]
    return [], []


# ------------------------------------------------------------------ named mutants


@dataclass(frozen=True)
class NamedPatch:
    """A fault the suite once missed, as a text patch; ``old`` must occur exactly once."""

    name: str
    path: str
    old: str
    new: str
    why: str


NAMED: tuple[NamedPatch, ...] = (
    NamedPatch(
        "edge-q-row-0", "xcosd/protocol/edge.py",
        "rows = {i - 1: row for i, row in enumerate(q_rows)}",
        "rows = {i - 1: q_rows[0] for i, row in enumerate(q_rows)}",
        "a rejection at any drafted position resolves with the first position's q"),
    NamedPatch(
        "srdv-raw-values", "xcosd/methods/sr_dv.py",
        "values=state.p_star[ids].astype(np.float32, copy=False)",
        "values=state.p_raw[ids].astype(np.float32, copy=False)",
        "SR-DV sends the raw, not the committed, values of its candidates"),
    NamedPatch(
        "commit-theta-o-unnormalised", "xcosd/methods/commit.py",
        "return normalise(dec, float(theta_o)), float(theta_o) / total",
        "return normalise(dec, float(theta_o)), float(theta_o)",
        "theta_o* is left unnormalised while p*_C is normalised (lossy codecs)"),
    NamedPatch(
        "stream-per-frame-limit", "xcosd/wire/frames.py",
        "if self._total + need > lim.max_bytes:",
        "if need > lim.max_bytes:",
        "the stream decoder checks each frame against max_bytes, not the running total"),
    NamedPatch(
        "limit-off-by-one", "xcosd/wire/frames.py",
        "if total > limits.max_bytes:",
        "if total >= limits.max_bytes:",
        "check_limits refuses a message of exactly max_bytes"),
    NamedPatch(
        "tree-residual-not-updated", "xcosd/methods/tree.py",
        "return r if nxt is None else nxt",
        "return r",
        "a draft tree's next sibling is tested against the row the rejected one was, "
        "not the residual it left"),
    NamedPatch(
        "tree-bonus-parent-row", "xcosd/methods/tree.py",
        "return TreeVerified(path, node, method.bonus(p_star[node + 1], rng), None, tested)",
        "return TreeVerified(path, node, method.bonus(p_star[shape.parents[node] + 1 if node >= 0 "
        "else 0], rng), None, tested)",
        "the bonus after a fully accepted tree path is drawn from the leaf's parent's row"),
    NamedPatch(
        "tree-rejected-branch-kept", "xcosd/models/tree_scoring.py",
        "        model.rollback(session, base)\n",
        "",
        "scoring a tree leaf by leaf keeps each scored branch in the session's context"),
)


# ------------------------------------------------------------------ mutants


@dataclass
class Mutant:
    """One fault: replace ``source[start:end]`` of ``path`` with ``replacement``."""

    id: str
    path: str
    line: int
    col: int
    operator: str
    start: int
    end: int
    replacement: str
    old_line: str = ""
    new_line: str = ""
    named: str | None = None

    def apply(self, source: str) -> str:
        return source[:self.start] + self.replacement + source[self.end:]

    def describe(self) -> str:
        return f"{self.old_line}  ->  {self.new_line}"


def _line_offsets(source: str) -> list[int]:
    offs = [0]
    for line in source.splitlines(keepends=True):
        offs.append(offs[-1] + len(line))
    return offs


def _char_offset(source_lines: list[str], offsets: list[int], lineno: int, col_byte: int) -> int:
    """A character offset from ast's (1-based line, UTF-8 byte column)."""
    line = source_lines[lineno - 1]
    return offsets[lineno - 1] + len(line.encode("utf-8")[:col_byte].decode("utf-8"))


def _around(text: str, start: int, end: int) -> str:
    a = text.rfind("\n", 0, start) + 1
    b = text.find("\n", max(end, start))
    b = len(text) if b < 0 else b
    return " ".join(text[a:b].split())


#: typing constructs whose subscripts are types, not indexing
_TYPE_NAMES = frozenset({"list", "dict", "tuple", "set", "frozenset", "type", "ClassVar",
                         "Optional", "Union", "Callable", "Sequence", "Iterable", "Mapping",
                         "Literal", "Iterator", "Awaitable", "Final"})
#: calls whose removal (keeping the first argument) is a meaningful fault
_NORMALISERS = frozenset({"normalise", "normalize", "_normalise"})
_CLAMPS = frozenset({"maximum", "minimum", "max", "min", "clip"})
#: calls whose arguments are messages, not logic
_MESSAGE_CALLS = frozenset({"print", "debug", "info", "warning", "warn", "error",
                            "exception", "critical", "log"})
_SKIP_FUNCS = frozenset({"__repr__", "__str__", "__format__"})

_CMP_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_BIN_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
}


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _is_docstring(node: ast.stmt, parent: ast.AST) -> bool:
    body = getattr(parent, "body", None)
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str) and isinstance(body, list)
            and bool(body) and body[0] is node)


Edit = tuple[ast.AST, str, str]  # (node whose span is replaced, replacement text, operator)


def _needs_parens(node: ast.AST) -> bool:
    return not isinstance(node, (ast.Name, ast.Constant, ast.Attribute, ast.Subscript,
                                 ast.Call))


def _expr_text(node: ast.expr) -> str:
    text = ast.unparse(node)
    return f"({text})" if _needs_parens(node) else text


def _edits(node: ast.AST, segment: Callable[[ast.AST], str],
           func_returns: ast.expr | None) -> Iterator[Edit]:
    """The mutations of one node (its children are visited separately)."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            swap = _CMP_SWAP.get(type(op))
            if swap is None:
                continue
            new = copy.deepcopy(node)
            new.ops[i] = swap()
            tag = f"#{i}" if len(node.ops) > 1 else ""
            yield node, _expr_text(new), f"cmp:{type(op).__name__}->{swap.__name__}{tag}"
    elif isinstance(node, ast.BinOp):
        bswap = _BIN_SWAP.get(type(node.op))
        if bswap is not None:
            bnew = copy.deepcopy(node)
            bnew.op = bswap()
            yield node, _expr_text(bnew), f"binop:{type(node.op).__name__}->{bswap.__name__}"
    elif isinstance(node, ast.AugAssign):
        bswap = _BIN_SWAP.get(type(node.op))
        if bswap is not None:
            new_stmt = copy.deepcopy(node)
            new_stmt.op = bswap()
            yield node, ast.unparse(new_stmt), f"aug:{type(node.op).__name__}->{bswap.__name__}"
    elif isinstance(node, ast.BoolOp):
        lnew = copy.deepcopy(node)
        lnew.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield node, _expr_text(lnew), f"boolop:{type(node.op).__name__}->{type(lnew.op).__name__}"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node, _expr_text(node.operand), "not-drop"
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            yield node, repr(not v), f"const:{v}->{not v}"
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if v == 0:
                yield node, repr(type(v)(1)), "const:0->1"
            elif v == 1:
                yield node, repr(type(v)(0)), "const:1->0"
            else:
                yield node, repr(v + 1), "const:+1"
    elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
        t = node.test
        # ``a == b`` negated is the cmp swap, ``not a`` negated the not-drop: no duplicate
        exact_swap = (isinstance(t, ast.Compare) and len(t.ops) == 1
                      and not isinstance(t.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE)))
        if not exact_swap and not (isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not)):
            yield t, f"not ({segment(t)})", "if-neg"
    elif isinstance(node, ast.Return):
        returns_none = isinstance(func_returns, ast.Constant) and func_returns.value is None
        if node.value is not None and not returns_none and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            yield node, "return None", "return-None"
    elif isinstance(node, ast.Subscript):
        sl = node.slice
        base = node.value
        typing_like = isinstance(base, ast.Name) and base.id in _TYPE_NAMES
        if not typing_like and not isinstance(sl, (ast.Slice, ast.Tuple, ast.Constant)):
            zero = copy.deepcopy(node)
            zero.slice = ast.Constant(0)
            yield node, ast.unparse(zero), "index->0"
            plus = copy.deepcopy(node)
            plus.slice = ast.BinOp(copy.deepcopy(sl), ast.Add(), ast.Constant(1))
            yield node, ast.unparse(plus), "index+1"
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if node.args and not isinstance(node.args[0], ast.Starred):
            if name in _NORMALISERS:
                yield node, _expr_text(node.args[0]), f"call-drop:{name}"
            elif name in _CLAMPS and len(node.args) >= 2 and not node.keywords:
                yield node, _expr_text(node.args[0]), f"clamp-drop:{name}"


def _mutable_nodes(tree: ast.Module, scopes: frozenset[str] | None
                   ) -> Iterator[tuple[ast.AST, ast.expr | None]]:
    """Every node that may be mutated, with its function's return annotation.

    Skipped: docstrings, annotations, ``raise`` statements (their arguments are
    messages), f-strings, message calls (print / logging), ``__repr__``-like
    methods, ``if TYPE_CHECKING``, and with ``scopes`` everything outside those
    top-level names."""

    def visit(node: ast.AST, returns: ast.expr | None) -> Iterator[tuple[ast.AST, ast.expr | None]]:
        if isinstance(node, (ast.Raise, ast.JoinedStr, ast.Import, ast.ImportFrom,
                             ast.Global, ast.Nonlocal)):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in _SKIP_FUNCS:
                return
            for d in node.decorator_list:
                yield from visit(d, returns)
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    yield from visit(default, returns)
            for stmt in node.body:
                if not _is_docstring(stmt, node):
                    yield from visit(stmt, node.returns)
            return
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if not _is_docstring(stmt, node):
                    yield from visit(stmt, None)
            return
        if isinstance(node, ast.AnnAssign):
            if node.value is not None:
                yield from visit(node.value, returns)
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Call) and _call_name(node) in _MESSAGE_CALLS:
            return
        if isinstance(node, ast.Assert):
            yield from visit(node.test, returns)
            return
        yield node, returns
        for child in ast.iter_child_nodes(node):
            yield from visit(child, returns)

    for stmt in tree.body:
        if _is_docstring(stmt, tree):
            continue
        if scopes is not None:
            name = getattr(stmt, "name", None)
            if name not in scopes:
                continue
        yield from visit(stmt, None)


def generate_mutants(source: str, path: str, scopes: frozenset[str] | None = None) -> list[Mutant]:
    """All mutants of ``source`` (the file at ``path``), in source order.

    Each edit replaces one node's text span by the unparsed mutated node, so the rest
    of the file is untouched; a mutant that does not parse or whose AST equals the
    original's (an equivalent edit) is dropped."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    offsets = _line_offsets(source)
    original_dump = ast.dump(tree)
    out: list[Mutant] = []
    seen: dict[str, int] = {}

    def span(node: ast.AST) -> tuple[int, int]:
        a = _char_offset(lines, offsets, node.lineno, node.col_offset)  # type: ignore[attr-defined]
        b = _char_offset(lines, offsets, node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return a, b

    def segment(node: ast.AST) -> str:
        a, b = span(node)
        return source[a:b]

    for node, returns in _mutable_nodes(tree, scopes):
        for target, replacement, operator in _edits(node, segment, returns):
            a, b = span(target)
            mutated = source[:a] + replacement + source[b:]
            try:
                new_tree = ast.parse(mutated)
            except SyntaxError:
                continue
            # the parentheses were only for safety: drop them where the AST is the same
            bare = re.sub(r"^(not )?\((.*)\)$", r"\1\2", replacement, flags=re.DOTALL)
            if bare != replacement:
                with contextlib.suppress(SyntaxError):
                    if ast.dump(ast.parse(source[:a] + bare + source[b:])) == ast.dump(new_tree):
                        replacement, mutated = bare, source[:a] + bare + source[b:]
            if ast.dump(new_tree) == original_dump:
                continue
            line = target.lineno  # type: ignore[attr-defined]
            col = a - offsets[line - 1] + 1
            base_id = f"{path}:{line}:{col}:{operator}"
            n = seen.get(base_id, 0)
            seen[base_id] = n + 1
            mid = base_id if n == 0 else f"{base_id}#{n + 1}"
            out.append(Mutant(mid, path, line, col, operator, a, b, replacement,
                              _around(source, a, b), _around(mutated, a, a + len(replacement))))
    return out


def named_mutant(patch: NamedPatch, source: str) -> Mutant:
    """The mutant of a :class:`NamedPatch`; ``ValueError`` when its text is stale."""
    count = source.count(patch.old)
    if count != 1:
        raise ValueError(f"named mutant {patch.name}: its old text occurs {count} times in "
                         f"{patch.path} (expected once): {patch.old!r}")
    a = source.index(patch.old)
    line = source.count("\n", 0, a) + 1
    col = a - (source.rfind("\n", 0, a) + 1) + 1
    mutated = source[:a] + patch.new + source[a + len(patch.old):]
    return Mutant(f"{patch.path}:{line}:{col}:named:{patch.name}", patch.path, line, col,
                  f"named:{patch.name}", a, a + len(patch.old), patch.new,
                  _around(source, a, a + len(patch.old)),
                  _around(mutated, a, a + len(patch.new)), named=patch.name)


def scope_files(root: Path = ROOT, patterns: Sequence[str] | None = None
                ) -> list[tuple[str, frozenset[str] | None]]:
    """``(relative path, scopes)`` of the files to mutate, optionally filtered by globs."""
    out: dict[str, frozenset[str] | None] = {}
    for pattern, scopes in SCOPE.items():
        for p in sorted(root.glob(pattern)):
            rel = p.relative_to(root).as_posix()
            if patterns and not any(fnmatch.fnmatch(rel, g) or rel == g for g in patterns):
                continue
            out[rel] = scopes
    return sorted(out.items())


def sample_mutants(mutants: list[Mutant], n: int, seed: int) -> list[Mutant]:
    """A deterministic sample of ``n``, allocated to files in proportion to their mutant
    counts (largest remainder): the sample stays self-weighting, so its total score
    estimates the full run's, with less variance than a simple random sample."""
    if n >= len(mutants):
        return list(mutants)
    by_file: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_file.setdefault(m.path, []).append(m)
    files = sorted(by_file)
    raw = {f: n * len(by_file[f]) / len(mutants) for f in files}
    quota = {f: int(raw[f]) for f in files}
    for f in sorted(files, key=lambda f: (-(raw[f] - quota[f]), f))[:n - sum(quota.values())]:
        quota[f] += 1
    out: list[Mutant] = []
    for f in files:
        rng = random.Random(f"{seed}:{f}")
        pool = sorted(by_file[f], key=lambda m: m.id)
        out += sorted(rng.sample(pool, quota[f]), key=lambda m: (m.line, m.id))
    return out


# ------------------------------------------------------------------ running


@contextlib.contextmanager
def applied(path: Path, mutant: Mutant, original: str | None = None) -> Iterator[str]:
    """Write ``mutant`` into ``path`` for the duration of the block, then restore the
    original bytes (also on error or interrupt). Yields the mutated text."""
    before = path.read_bytes()
    text = original if original is not None else before.decode("utf-8")
    mutated = mutant.apply(text)
    try:
        path.write_text(mutated, encoding="utf-8")
        yield mutated
    finally:
        path.write_bytes(before)


#: a pytest plugin written into each copy: a per-test alarm that ends the process
#: (exit 3) after writing the hung test's id to ``$MUTATION_TIMEOUT_FILE`` (pytest
#: captures stdout and stderr at the descriptor level, so a file is the reliable way
#: out). A hang inside an event-loop callback would swallow an exception, so the
#: plugin exits instead of raising; a hung test costs the per-test limit, not the
#: mutant's whole timeout.
TIMEOUT_PLUGIN_NAME = "_mutation_test_timeout"
TIMEOUT_FILE = ".mutation_timeout"
TIMEOUT_EXIT = 3
TIMEOUT_PLUGIN = f"""\
import os
import signal

import pytest

LIMIT = float(os.environ.get("MUTATION_TEST_TIMEOUT", "0"))
MARK = os.environ.get("MUTATION_TIMEOUT_FILE", "")
_current = ["?"]


def _expired(signum, frame):
    if MARK:
        with open(MARK, "w") as f:
            f.write(_current[0])
    os._exit({TIMEOUT_EXIT})


def pytest_collection_modifyitems(session, config, items):
    first = os.environ.get("MUTATION_FIRST", "")
    if first:  # the test that killed this mutant last time runs first (stable sort)
        items.sort(key=lambda it: it.nodeid != first)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if LIMIT <= 0:
        return (yield)
    _current[0] = item.nodeid
    old = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, LIMIT)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
"""


@dataclass
class Outcome:
    status: str  # killed | survived | timeout | error
    rc: int | None
    seconds: float
    killed_by: str | None = None
    tail: str = ""
    failed: frozenset[str] = frozenset()  # every FAILED / ERROR node id in the summary


_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_LOCK = threading.Lock()


def _env(workdir: Path, test_timeout: float = 0.0, first: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["MUTATION_FIRST"] = first or ""
    env["PYTHONPATH"] = str(workdir) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["MUTATION_TEST_TIMEOUT"] = str(test_timeout)
    env["MUTATION_TIMEOUT_FILE"] = str(workdir / TIMEOUT_FILE)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")  # one BLAS thread per job: the jobs are the parallelism
    env.setdefault("MPLBACKEND", "Agg")
    return env


def pytest_command(tests: Sequence[str], workers: int = 0, *, stop_first: bool = True,
                   deselect: Sequence[str] = ()) -> list[str]:
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", TIMEOUT_PLUGIN_NAME,
           "--no-header"]
    if stop_first:
        cmd.append("-x")
    if workers > 1:
        cmd += ["-n", str(workers)]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    return cmd + list(tests)


#: a node id in pytest's short summary; parametrize ids may hold spaces: ``t[top-p 0.95]``
SUMMARY_ID = re.compile(r"^(?:FAILED|ERROR) ([^\s\[]+(?:\[[^\]]*\])?)", re.MULTILINE)


def run_tests(workdir: Path, tests: Sequence[str], timeout: float, workers: int = 0,
              test_timeout: float = 0.0, *, stop_first: bool = True,
              first: str | None = None, deselect: Sequence[str] = ()) -> Outcome:
    """pytest on ``tests`` in ``workdir`` (``first``: a node id to run before the rest;
    ``deselect``: node ids left out);
    the whole process group dies on timeout (and after the run, so a test's stray
    child process cannot outlive it)."""
    t0 = time.perf_counter()
    mark = workdir / TIMEOUT_FILE
    mark.unlink(missing_ok=True)
    proc = subprocess.Popen(pytest_command(tests, workers, stop_first=stop_first,
                                           deselect=deselect), cwd=workdir,
                            env=_env(workdir, test_timeout, first), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        return Outcome("timeout", None, time.perf_counter() - t0,
                       tail=out.decode(errors="replace")[-2000:])
    finally:
        _kill(proc)
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    text = out.decode(errors="replace")
    rc = proc.returncode
    if rc == TIMEOUT_EXIT and mark.exists():
        hung = mark.read_text()
        mark.unlink()
        return Outcome("timeout", rc, time.perf_counter() - t0, hung, text[-2000:])
    status = "survived" if rc == 0 else "killed" if rc == 1 else "error"
    m = SUMMARY_ID.search(text)
    return Outcome(status, rc, time.perf_counter() - t0, m.group(1) if m else None, text[-2000:],
                   frozenset(SUMMARY_ID.findall(text)))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def make_workdir(root: Path = ROOT) -> Path:
    """A fresh copy of what the tests need, checked to be the ``xcosd`` imported there."""
    work = Path(tempfile.mkdtemp(prefix="xcosd-mutation-"))
    for name in COPY:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, work / name, ignore=COPY_IGNORE)
        elif src.exists():
            shutil.copy2(src, work / name)
    (work / f"{TIMEOUT_PLUGIN_NAME}.py").write_text(TIMEOUT_PLUGIN)
    where = subprocess.run([PY, "-c", "import xcosd; print(xcosd.__file__)"], cwd=work,
                           env=_env(work), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(work.resolve()):
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"the copy imports xcosd from {where}, not from {work}")
    return work


@dataclass
class Result:
    id: str
    path: str
    line: int
    col: int
    operator: str
    named: str | None
    old: str
    new: str
    tests: list[str]
    status: str
    rc: int | None
    seconds: float
    killed_by: str | None
    why: str | None = None
    tail: str = field(default="", repr=False)


#: statuses of mutants that ran and count in the score
RUN = ("killed", "survived", "timeout", "error")
DETECTED = ("killed", "timeout", "error")
#: ``not-run``: the --budget ran out first; ``unconfirmed``: the test that "killed" it
#: fails on the unmutated code too or passed on a rerun, so the kill proves nothing.
#: Neither is scored.
NOT_SCORED = ("not-run", "unconfirmed")


def summarise(results: Sequence[Result]) -> dict[str, Any]:
    """Counts per file and overall, and the score (detected / run)."""
    per: dict[str, dict[str, int]] = {}
    keys = ("mutants", *RUN, *NOT_SCORED)
    for r in results:
        row = per.setdefault(r.path, dict.fromkeys(keys, 0))
        row[r.status] += 1
        row["mutants"] += r.status in RUN
    total = {k: sum(v[k] for v in per.values()) for k in keys}

    def score(row: dict[str, int]) -> float | None:
        return sum(row[k] for k in DETECTED) / row["mutants"] if row["mutants"] else None

    return {"per_file": {f: {**row, "score": score(row)} for f, row in sorted(per.items())},
            "total": {**total, "score": score(total)}}


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths, strict=True)))
    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths),
                      *(fmt(r) for r in cells[1:])])


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def report(results: Sequence[Result]) -> str:
    s = summarise(results)
    cols = ["mutants", *RUN, *(c for c in NOT_SCORED if s["total"][c])]
    rows = [[f, *(r[c] for c in cols), _pct(r["score"])] for f, r in s["per_file"].items()]
    t = s["total"]
    rows.append(["total", *(t[c] for c in cols), _pct(t["score"])])
    lines = [_table(rows, ["file", *cols, "score"])]
    if t["not-run"] or t["unconfirmed"]:
        lines.append(f"not scored: {t['not-run']} not run (budget), {t['unconfirmed']} "
                     "unconfirmed (killing test fails unmutated too, or passed on a rerun)")
    named = [r for r in results if r.named]
    if named:
        lines += ["", "Named mutants (each must be detected):",
                  _table([[r.named, r.status, f"{r.seconds:.0f}s", r.killed_by or "-"]
                          for r in named], ["named", "status", "time", "first failure"])]
    surv = [r for r in results if r.status == "survived"]
    if surv:
        lines += ["", f"Surviving mutants ({len(surv)}):"]
        for r in surv:
            lines += [f"  {r.id}", f"      - {r.old}", f"      + {r.new}"]
    return "\n".join(lines)


MAKE_COMMAND = "make mutation"
RESULTS_MD = ROOT / "docs" / "RESULTS.md"


def update_results(path: Path, section: str) -> None:
    """Replace the "## Mutation testing" section of ``path`` (up to the next ``## ``
    heading) with ``section``, or append it."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head = "## Mutation testing"
    start = text.find("\n" + head + "\n") + 1 if ("\n" + head + "\n") in text else (
        0 if text.startswith(head + "\n") else -1)
    if start < 0:
        path.write_text(text.rstrip("\n") + "\n\n" + section, encoding="utf-8")
        return
    nxt = text.find("\n## ", start + len(head))
    rest = "" if nxt < 0 else "\n" + text[nxt + 1:]
    path.write_text(text[:start] + section + rest, encoding="utf-8")


def markdown_section(data: dict[str, Any] | None) -> list[str]:
    """The "Mutation testing" section of ``docs/RESULTS.md`` from a saved report
    (``None``: not run yet). Every number comes from the JSON, none is typed by hand."""
    lines = [
        "## Mutation testing", "",
        "`bench/mutation.py` plants small faults (mutants) in the code whose bugs would "
        "not show in plausible-looking output: the methods (`xcosd/methods/*.py`, the "
        "commit rule included), the edge and cloud state machines "
        "(`xcosd/protocol/edge.py`, `cloud.py`) and the frame limits "
        "(`xcosd/wire/frames.py`: `Limits`, `check_limits`, `StreamDecoder`). Mutants "
        "are generated from the AST (comparison, arithmetic and boolean operator swaps, "
        "constants 0<->1 and +1, negated conditions, `return None`, index shifts "
        "`x[j]` -> `x[0]` / `x[j + 1]`, dropped normalise / clamp calls), each with a "
        "stable id `file:line:col:operator`. Each mutant runs, in its own copy of the "
        "repository, only the test files mapped to its file (fastest first, `-x`, with a "
        "timeout; a hang counts as detected). Five *named* mutants are faults an earlier "
        "suite missed (the first position's q used for a later rejection; SR-DV sending "
        "raw instead of committed values; `theta_o` left unnormalised; the stream decoder "
        "checking each frame instead of the running total; a limit check off by one): "
        "`make mutation` fails if one survives.", "",
        f"Regenerate with `{MAKE_COMMAND}`: the named mutants plus a deterministic, "
        "proportionally allocated sample of the generated ones (`MUTANTS`, `SEED`; no new "
        "mutant starts after `BUDGET` minutes). A mutant that survives runs every mapped "
        "test file, the law tests included (about 15 minutes for a method, measured with 2 "
        "jobs on 2 cores), so that sample is small and its score a rough estimate; every "
        "generated mutant: "
        "`python -m bench.mutation` (a day or more on 2 cores), or one file at a time "
        "(`--files xcosd/wire/frames.py`). The report is `bench/out/mutation.json`; "
        "`python -m bench.mutation --update-results` rewrites this section from it "
        "(`bench/results.py` does not: rerun that after `make bench`).", ""]
    if data is None:
        return [*lines, "Not run yet: the figures appear here after the run above.", ""]
    s = data["summary"]
    cols = ["mutants", *RUN]
    rows = [[f"`{f}`", *(r[c] for c in cols), _pct(r["score"])] for f, r in s["per_file"].items()]
    t = s["total"]
    rows.append(["**total**", *(t[c] for c in cols), _pct(t["score"])])
    head = ["file", *cols, "score"]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
          *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]
    cfg = data["config"]
    n_named = sum(1 for m in data["mutants"] if m.get("named"))
    lines += [f"Command: `{data['command']}` ({data['elapsed_s'] / 60:.1f} min, "
              f"{cfg['jobs']} jobs): {n_named} named and {len(data['mutants']) - n_named} of "
              f"{cfg['generated_total']} generated mutants, {t['mutants']} of them scored. "
              "Score = detected / scored, detected = killed + timeout + error.", "", *md, ""]
    if t["not-run"] or t["unconfirmed"]:
        lines += [f"Not scored: {t['not-run']} mutants not run (the time budget ran out), "
                  f"{t['unconfirmed']} whose kill could not be confirmed (the killing test "
                  "fails on the unmutated code too, or passed when rerun).", ""]
    named = [m for m in data["mutants"] if m.get("named")]
    if named:
        lines += ["| named mutant | fault | status |", "|---|---|---|",
                  *(f"| {m['named']} | {m['why']} | {m['status']} |" for m in named), ""]
    if data.get("stale_named"):
        lines += ["Stale named patches: " + "; ".join(data["stale_named"]), ""]
    surv = [m for m in data["mutants"] if m["status"] == "survived" and not m.get("named")]
    if surv:
        lines += [f"Surviving mutants ({len(surv)}):", "",
                  *(f"- `{m['id']}`: `{m['old']}` -> `{m['new']}`" for m in surv), ""]
    if cfg.get("missing_tests"):
        lines += ["Mapped test files absent at the time of the run: "
                  + ", ".join(f"`{t}`" for t in cfg["missing_tests"]) + ".", ""]
    return lines


def collect(files: Sequence[str] | None, only_named: bool, root: Path = ROOT
            ) -> tuple[list[Mutant], list[Mutant], list[str]]:
    """``(named, generated, problems)`` for the selected files."""
    problems: list[str] = []
    named: list[Mutant] = []
    for patch in NAMED:
        if files and not any(fnmatch.fnmatch(patch.path, g) or patch.path == g for g in files):
            continue
        try:
            named.append(named_mutant(patch, (root / patch.path).read_text(encoding="utf-8")))
        except (ValueError, OSError) as e:
            problems.append(str(e))
    generated: list[Mutant] = []
    if not only_named:
        for rel, scopes in scope_files(root, files):
            generated += generate_mutants((root / rel).read_text(encoding="utf-8"), rel, scopes)
    return named, generated, problems


RunOne = Callable[..., Result]


def verify_kills(results: list[Result], by_id: dict[str, Mutant], clean: Path, run_one: RunOne,
                 in_workdir: Callable[[Callable[[Path], Any]], Any], jobs: int,
                 args: argparse.Namespace) -> set[str]:
    """Check every kill, in place; returns the tests that fail on the unmutated code.

    A kill counts only if (1) the killing test passes on the unmutated code (a test
    file mid-edit would otherwise "kill" everything) and (2) it fails again when rerun
    alone on the mutant (a flaky test fails now and then by itself). A mutant whose
    killer fails either check runs again without it, up to three rounds; when one
    test fails unmutated, its whole test set runs unmutated once, so every broken
    test is left out at the next round. What is still unchecked at the end is
    ``unconfirmed`` (not scored)."""
    timeout = args.timeout or DEFAULT_TIMEOUT
    confirmed: set[str] = set()
    broken: set[str] = set()
    whole_sets_run: set[tuple[str, ...]] = set()
    flaky: dict[str, set[str]] = {}
    reproduced: set[str] = set()

    def killed() -> list[int]:
        return [i for i, r in enumerate(results) if r.status == "killed" and r.killed_by
                and "::" in r.killed_by]

    def pmap(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=jobs) as ex:
            return list(ex.map(fn, items))

    for round_ in range(4):
        idx = killed()
        todo = sorted({str(results[i].killed_by) for i in idx} - confirmed - broken)
        if todo:
            print(f"checking {len(todo)} killing test(s) on the unmutated code", flush=True)
            o = run_tests(clean, todo, timeout, args.pytest_workers, args.test_timeout,
                          stop_first=False)
            bad = set(todo) if o.status in ("timeout", "error") else set(o.failed) & set(todo)
            if o.status in ("timeout", "error"):
                print(o.tail, file=sys.stderr)
            confirmed |= set(todo) - bad
            broken |= bad
            hit = sorted({tuple(results[i].tests) for i in idx if results[i].killed_by in bad}
                         - whole_sets_run)
            if hit:
                print(f"{', '.join(sorted(bad))} fail(s) unmutated: running "
                      f"{len(hit)} test set(s) unmutated to find every failing test", flush=True)
                whole = pmap(lambda t: in_workdir(functools.partial(
                    _run_set, tests=t, timeout=timeout, workers=args.pytest_workers)), hit)
                for t, o in zip(hit, whole, strict=True):
                    broken |= set(o.failed)
                    whole_sets_run.add(t)
        check = [i for i in killed() if results[i].killed_by not in broken
                 and results[i].id not in reproduced]
        if check:
            print(f"rerunning {len(check)} killing test(s) alone on their mutants", flush=True)
            again = pmap(lambda i: run_one(by_id[results[i].id], force=True,
                                           only=[str(results[i].killed_by)]), check)
            for i, r in zip(check, again, strict=True):
                if r.status == "killed":
                    reproduced.add(results[i].id)
                else:
                    flaky.setdefault(results[i].id, set()).add(str(results[i].killed_by))
                    print(f"  flaky: {results[i].killed_by} passed on rerun ({results[i].id})",
                          flush=True)
        redo = [i for i in killed() if results[i].killed_by in broken
                or results[i].killed_by in flaky.get(results[i].id, set())]
        if not redo or round_ == 3:
            break
        print(f"rerunning {len(redo)} mutant(s) without the failing or flaky tests", flush=True)
        jobs_ = [(by_id[results[i].id], sorted(broken | flaky.get(results[i].id, set())))
                 for i in redo]
        again = pmap(lambda md: run_one(md[0], force=True, deselect=md[1]), jobs_)
        for i, r in zip(redo, again, strict=True):
            print(f"  {r.status:8s} {r.seconds:6.1f}s  {r.id}"
                  + (f"  ({r.killed_by})" if r.killed_by else ""), flush=True)
            results[i] = r
    for i in killed():
        r = results[i]
        if r.killed_by not in confirmed or r.id not in reproduced:
            r.status = "unconfirmed"
    return broken


def _check_collection(workdir: Path, sets: Sequence[tuple[str, ...]]) -> list[str]:
    """Problems collecting each test set on the unmutated copy (a file mid-edit would
    make every mutant look detected)."""
    problems = []
    for tests in sets:
        r = subprocess.run([PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *tests], cwd=workdir, env=_env(workdir), capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"collecting {' '.join(tests)} fails unmutated:\n{r.stdout[-3000:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.mutation", description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="+", default=None,
                    help="globs of files to mutate (default: the whole scope)")
    ap.add_argument("--only-named", action="store_true", help="run the named mutants only")
    ap.add_argument("--sample", type=int, default=None,
                    help="run a deterministic sample of N generated mutants (named ones always run)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample")
    ap.add_argument("--max-mutants", type=int, default=None,
                    help="at most N generated mutants (after --sample), in id order")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="mutants run in parallel, each in its own copy (default: min(2, cores))")
    ap.add_argument("--pytest-workers", type=int, default=0,
                    help="pytest-xdist workers per mutant (-n); 0 runs each in one process")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per mutant, all its tests (default: 3x the baseline + 60 s "
                         f"with --baseline, else {DEFAULT_TIMEOUT:g}: a backstop, hangs are "
                         "caught by --test-timeout)")
    ap.add_argument("--test-timeout", type=float, default=DEFAULT_TEST_TIMEOUT,
                    help=f"seconds per single test (default {DEFAULT_TEST_TIMEOUT:g}; 0: none)")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every test set unmutated (slow; sets the timeouts). Without "
                         "it the sets are only collected, and kills are confirmed afterwards")
    ap.add_argument("--budget", type=float, default=None,
                    help="minutes after which no further mutant starts (the rest: not-run)")
    ap.add_argument("--no-history", action="store_true",
                    help="do not run first the test that killed each mutant in the previous "
                         "report (--json); the order changes the cost, not the verdict")
    ap.add_argument("--list", action="store_true", help="list the selected mutants and exit")
    ap.add_argument("--section", action="store_true",
                    help="print the RESULTS.md section from the saved --json report and exit")
    ap.add_argument("--update-results", action="store_true",
                    help="write that section into docs/RESULTS.md (replacing the old one) and exit")
    ap.add_argument("--json", type=Path, default=OUT,
                    help=f"report path (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    if args.section or args.update_results:
        data = json.loads(args.json.read_text()) if args.json.exists() else None
        section = "\n".join(markdown_section(data)).rstrip() + "\n"
        if args.section:
            print(section, end="")
        if args.update_results:
            update_results(RESULTS_MD, section)
            print(f"updated {RESULTS_MD}")
        return 0

    named, generated, stale = collect(args.files, args.only_named)
    n_generated = len(generated)
    if args.sample is not None:
        generated = sample_mutants(generated, args.sample, args.seed)
    if args.max_mutants is not None:
        generated = sorted(generated, key=lambda m: m.id)[:args.max_mutants]
    mutants = named + generated
    for p in stale:
        print(f"STALE: {p}", file=sys.stderr)
    if args.list:
        for m in mutants:
            print(f"{m.id}\n    - {m.old_line}\n    + {m.new_line}")
        print(f"{len(named)} named + {len(generated)} of {n_generated} generated mutants")
        return 1 if stale else 0

    # the previous run's killer of each mutant: tried first, most mutants die in seconds
    history: dict[str, str] = {}
    if not args.no_history and args.json.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            # a named mutant by its name: its line moves whenever the code above it changes
            history = {m.get("named") or m["id"]: m["killed_by"]
                       for m in json.loads(args.json.read_text())["mutants"]
                       if m["status"] == "killed" and m.get("killed_by")}
    plan = {m.path: mapped_tests(m.path) for m in mutants}
    missing = sorted({t for _, miss in plan.values() for t in miss})
    if missing:
        print(f"mapped test files not present (left out): {', '.join(missing)}")
    unmapped = sorted(p for p, (tests, _) in plan.items() if not tests)
    if unmapped:
        print(f"no tests mapped to: {', '.join(unmapped)}", file=sys.stderr)
        return 2
    sets = sorted({tuple(tests) for tests, _ in plan.values()})
    print(f"{len(named)} named + {len(generated)} of {n_generated} generated mutants, "
          f"{len(sets)} test set(s), {args.jobs} job(s)", flush=True)

    t_start = time.perf_counter()
    # a plain `kill` (SIGTERM) unwinds like Ctrl-C: running pytest groups die, the
    # copies are removed
    signal.signal(signal.SIGTERM, _interrupt)
    jobs = max(1, args.jobs)
    workdirs: queue.Queue[Path] = queue.Queue()
    made: list[Path] = []
    baseline: dict[tuple[str, ...], float] = {}
    results: list[Result] = []
    unconfirmed: set[str] = set()
    try:
        for _ in range(jobs):
            w = make_workdir()
            made.append(w)
            workdirs.put(w)
        print(f"copies: {', '.join(map(str, made))} (each imports its own xcosd)", flush=True)
        problems = _check_collection(made[0], sets)
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 2

        def in_workdir(fn: Callable[[Path], Any]) -> Any:
            w = workdirs.get()
            try:
                return fn(w)
            finally:
                workdirs.put(w)

        if args.baseline:
            with ThreadPoolExecutor(max_workers=jobs) as ex:
                futs = {ex.submit(in_workdir, functools.partial(
                    _run_set, tests=s, timeout=args.timeout or DEFAULT_TIMEOUT,
                    workers=args.pytest_workers)): s for s in sets}
                for fut in as_completed(futs):
                    s, o = futs[fut], fut.result()
                    print(f"baseline {'passed' if o.rc == 0 else o.status} in {o.seconds:.0f} s: "
                          f"{' '.join(s)}", flush=True)
                    if o.rc != 0:
                        print(o.tail, file=sys.stderr)
                        print("the unmutated tests do not pass: no mutant result would mean "
                              "anything", file=sys.stderr)
                        return 2
                    baseline[s] = o.seconds

        def timeout_for(tests: tuple[str, ...]) -> float:
            if args.timeout is not None:
                return float(args.timeout)
            return 3 * baseline[tests] + 60 if tests in baseline else DEFAULT_TIMEOUT

        def run_one(m: Mutant, deselect: Sequence[str] = (), force: bool = False,
                    only: Sequence[str] = ()) -> Result:
            tests = tuple(only) or tuple(plan[m.path][0])
            patch = next((p for p in NAMED if p.name == m.named), None)
            late = args.budget is not None and time.perf_counter() - t_start > 60 * args.budget
            if late and m.named is None and not force:
                o = Outcome("not-run", None, 0.0)
            else:
                def go(w: Path) -> Outcome:
                    with applied(w / m.path, m):
                        return run_tests(w, tests, timeout_for(tests), args.pytest_workers,
                                         args.test_timeout, first=history.get(m.named or m.id),
                                         deselect=deselect)

                o = in_workdir(go)
            return Result(m.id, m.path, m.line, m.col, m.operator, m.named, m.old_line,
                          m.new_line, list(tests), o.status, o.rc, round(o.seconds, 2),
                          o.killed_by, patch.why if patch else None, o.tail)

        # named first (they decide the exit status), then the generated ones in a seeded
        # shuffle, so that a --budget cut leaves a random subset rather than whole files
        order = named + sorted(generated, key=lambda m: random.Random(f"{args.seed}:{m.id}").random())
        with ThreadPoolExecutor(max_workers=jobs) as ex:
            futs2 = [ex.submit(run_one, m) for m in order]
            for i, fut in enumerate(as_completed(futs2), 1):
                r = fut.result()
                results.append(r)
                if r.status != "not-run":
                    print(f"[{i}/{len(mutants)}] {r.status:8s} {r.seconds:6.1f}s  {r.id}"
                          + (f"  ({r.killed_by})" if r.killed_by else ""), flush=True)

        unconfirmed = verify_kills(results, {m.id: m for m in mutants}, made[0], run_one,
                                   in_workdir, jobs, args)
    except KeyboardInterrupt:
        with _LIVE_LOCK:
            for proc in list(_LIVE):
                _kill(proc)
        raise
    finally:
        for w in made:
            shutil.rmtree(w, ignore_errors=True)

    index = {m.id: i for i, m in enumerate(mutants)}
    results.sort(key=lambda r: index[r.id])
    print()
    print(report(results))
    if unconfirmed:
        print(f"\nWARNING: these tests fail on the unmutated code (left out of the reruns): "
              f"{', '.join(sorted(unconfirmed))}", file=sys.stderr)
    elapsed = time.perf_counter() - t_start
    named_res = [r for r in results if r.named]
    named_bad = [r.named for r in named_res if r.status not in DETECTED]
    shown = [PY, "-m", "bench.mutation", *(sys.argv[1:] if argv is None else argv)]
    from xcosd.bench.report import machine

    out = {
        "command": " ".join(shlex.quote(a) for a in shown).replace(PY, "python"),
        "machine": machine(),
        "config": {"jobs": jobs, "pytest_workers": args.pytest_workers,
                   "timeout_s": args.timeout, "test_timeout_s": args.test_timeout,
                   "sample": args.sample, "seed": args.seed, "budget_min": args.budget,
                   "max_mutants": args.max_mutants, "files": args.files,
                   "only_named": args.only_named, "generated_total": n_generated,
                   "test_map": {p: list(t) for p, t in TEST_MAP},
                   "missing_tests": missing},
        "baseline_s": {" ".join(s): round(v, 1) for s, v in baseline.items()},
        # tests that failed on the unmutated code: left out of the reruns
        "failing_unmutated": sorted(unconfirmed),
        "elapsed_s": round(elapsed, 1),
        "summary": summarise(results),
        "named": {r.named: r.status for r in named_res},
        "stale_named": stale,
        # the output tail only where it explains the status (an error, a hang)
        "mutants": [{k: v for k, v in asdict(r).items()
                     if k != "tail" or r.status in ("error", "timeout")} for r in results],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"\n{elapsed / 60:.1f} min; wrote {args.json}")
    if stale or named_bad:
        print("FAIL: " + "; ".join([*(f"named mutant {n} not detected" for n in named_bad),
                                     *(f"stale: {p}" for p in stale)]), file=sys.stderr)
        return 1
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_set(workdir: Path, *, tests: tuple[str, ...], timeout: float, workers: int) -> Outcome:
    return run_tests(workdir, tests, timeout, workers, stop_first=False)


if __name__ == "__main__":
    raise SystemExit(main())
