"""Training text for the n-gram models, and where trained models are cached.

The default corpus is text that every CPython installation ships: the help topics
of ``pydoc_data/topics.py`` and the docstrings of the standard library's modules,
classes and functions (about 2 M characters of English prose about code). It needs
no download, so the embedded default pair works on any machine. Docstrings are read
with :mod:`ast` (no module is imported), in sorted file order, so the text -- and
its hash, which keys the model cache -- is the same on every run of one Python.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import ModelError

#: Standard-library folders left out of the default corpus: tests and tool
#: packages whose docstrings are mostly fixtures, and vendored third-party code.
_SKIP_DIRS = frozenset({
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "tkinter",
    "turtledemo", "ensurepip", "pydoc_data", "__pycache__",
})


def cache_dir() -> Path:
    """Where trained models live: ``$XCOSD_CACHE`` or ``~/.cache/xcosd``."""
    env = os.environ.get("XCOSD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "xcosd"


def text_hash(docs: Iterable[str]) -> str:
    """A stable hash of a corpus (its documents, in order)."""
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:16]


def _stdlib_docstrings(root: Path) -> list[str]:
    files = sorted(
        p for p in root.rglob("*.py")
        if not (set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS)
    )
    docs: list[str] = []
    for f in files:
        try:
            tree = ast.parse(f.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return docs


def default_corpus(*, use_cache: bool = True) -> list[str]:
    """The default training documents: pydoc topics, then standard-library docstrings.

    Extracting the docstrings parses ~600 files (a few seconds), so the result is
    kept in the cache directory, keyed by the interpreter's version and stdlib path.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{sys.version}|{stdlib}|v1".encode()).hexdigest()[:16]
    path = cache_dir() / f"corpus-stdlib-{key}.txt"
    sep = "\n\x1e\n"  # record separator: never inside a docstring or topic
    if use_cache and path.exists():
        try:
            return path.read_text(encoding="utf-8", errors="surrogatepass").split(sep)
        except OSError:
            pass
    try:
        from pydoc_data import topics  # type: ignore[import-not-found,unused-ignore]

        docs = [topics.topics[k] for k in sorted(topics.topics)]
    except ImportError:  # stripped-down Pythons may lack pydoc_data
        docs = []
    docs += _stdlib_docstrings(stdlib)
    docs = [d for d in docs if sep not in d]
    if not docs:
        raise ModelError("no default corpus: this Python ships neither pydoc_data nor stdlib "
                         "sources; train on your own text files instead")
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(sep.join(docs), encoding="utf-8", errors="surrogatepass")
            tmp.replace(path)
        except OSError:
            pass
    return docs


def corpus_from_files(paths: Sequence[str | Path]) -> list[str]:
    """Documents from text files: one document per file (folders are walked for
    ``*.txt``, ``*.md``, ``*.rst`` and ``*.py``, in sorted order)."""
    docs: list[str] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix in {".txt", ".md", ".rst", ".py"}
                           and f.is_file())
        elif p.is_file():
            files = [p]
        else:
            raise ModelError(f"corpus path {p} does not exist")
        for f in files:
            try:
                docs.append(f.read_text(encoding="utf-8", errors="replace"))
            except OSError as e:
                raise ModelError(f"cannot read corpus file {f}: {e}") from e
    if not docs:
        raise ModelError(f"no text found in {[str(p) for p in paths]}")
    return docs
