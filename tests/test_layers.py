"""The package's layers, checked from the source: imports go one way, and no
module imports itself back through others.

Every module of ``xcosd`` belongs to one layer (the longest matching prefix in
:data:`LAYERS`); a module may import its own layer and the layers below it, never
one above. The imports are read with :mod:`ast`, so this holds for imports inside
functions and under ``TYPE_CHECKING`` too: a late import is for a heavy optional
dependency (torch, zmq) or a fast CLI start, never to dodge a cycle, and the
cycle check sees through it.

Where ``models`` sits: above the protocol and the transports, below the nodes.
Neither state machine runs a model: the cloud's asks its node for target scores
(``ScoreNeeded``), the edge's for drafts (``DraftNeeded``), and the nodes (and the
in-process pump) hold the models and answer. So the protocol stays sans-I/O and
model-free, and a model backend can never reach into it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "xcosd"

#: lowest first; a module may import its own layer and any layer listed before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("xcosd.errors",)),
    # a round's counted random numbers (a keyed hash) below the sampling that draws them
    ("draws", ("xcosd.draws",)),
    ("sampling / vocab", ("xcosd.sampling", "xcosd.vocab")),
    ("codecs", ("xcosd.codecs",)),
    ("methods", ("xcosd.methods", "xcosd.simulate")),
    # the edge's drafting policies (draft length, tree shape): decisions from past
    # verdicts over the methods' types, below the protocol that uses them
    ("policies", ("xcosd.policies",)),
    # the methods' server halves in torch, next to the logits (imports torch)
    ("accel", ("xcosd.accel",)),
    ("wire", ("xcosd.wire",)),
    ("protocol", ("xcosd.protocol",)),
    ("transport", ("xcosd.transport", "xcosd.http")),
    ("models", ("xcosd.models",)),
    # the generation config is what an edge node and the CLI are given; the collector
    # setting, what a process with many nodes' sessions runs under
    ("nodes", ("xcosd.nodes", "xcosd.config", "xcosd.gc_tuning")),
    # the OpenAI-compatible HTTP API: an edge node behind HTTP
    ("api", ("xcosd.api",)),
    ("bench", ("xcosd.bench",)),
    # the entry points, and the package root that re-exports the public names
    ("commands", ("xcosd.commands", "xcosd.cli", "xcosd.__main__", "xcosd")),
]


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """``(imported xcosd module, line)`` for every import in ``module``'s source."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                yield (sub if sub in MODULES else target), node.lineno


def _deps(module: str) -> list[tuple[str, int]]:
    out = []
    for name, line in _imports(module):
        if name == "xcosd" or name.startswith("xcosd."):
            while name not in MODULES:  # `import xcosd.a.b` where b is an attribute
                name = name.rpartition(".")[0]
            out.append((name, line))
    return out


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


GRAPH = {m: _deps(m) for m in MODULES}


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if layer_of(m) < 0] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_only(module: str) -> None:
    mine = layer_of(module)
    upward = [f"{module}:{line} imports {dep} ({LAYERS[layer_of(dep)][0]} is above "
              f"{LAYERS[mine][0]})" for dep, line in GRAPH[module] if layer_of(dep) > mine]
    assert upward == []


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over every import edge."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    assert cycles == []


def test_every_layer_entry_names_a_module() -> None:
    """A moved or deleted module leaves no stale entry behind."""
    assert [p for _, ps in LAYERS for p in ps if p not in MODULES] == []


def test_the_protocol_does_not_know_the_accelerator() -> None:
    """The sans-I/O state machines hold a rejection kept on a device as a
    ``KeptReject`` (methods/base.py) and never import ``xcosd.accel`` (torch): a
    device round is built and read back by the nodes (xcosd/nodes/scoring.py)."""
    reach = [f"{m}:{line} imports {dep}" for m in MODULES if m.startswith("xcosd.protocol")
             for dep, line in GRAPH[m] if dep.startswith("xcosd.accel")]
    assert reach == []
