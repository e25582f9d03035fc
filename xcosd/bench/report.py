"""Small, dependency-free pieces every bench report shares: percentile summaries,
histograms, the machine description and table formatting.

Reports are plain dicts of JSON types, so a test can check their invariants and
:mod:`xcosd.bench.results` can render them without importing the code that made them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: where the benchmarks write their JSON and :mod:`xcosd.bench.results` reads it:
#: ``bench/out`` under the working directory, not next to this file, because the
#: package may be installed (read-only, in site-packages); run them from the
#: repository root, as ``make bench`` does, so docs/RESULTS.md finds them
OUT_DIR = Path("bench") / "out"

#: the percentiles load-testing tools print (wrk, ghz, ``vllm bench serve``)
PERCENTILES = (50, 90, 99)


def rss_mb() -> float:
    """This process's resident set size in MiB (``/proc/self/statm``; 0 where there
    is no /proc)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (every field a ``size_t``)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` from the process's own symbols (``None`` where the C
    library is not glibc 2.33 or later)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


def heap_mb() -> dict[str, float | int]:
    """What RSS alone cannot say, to tell a leak from an allocator that keeps what
    was freed: the C heap's bytes in use (``heap_used_mb``: glibc's ``mallinfo2``,
    small blocks and mmapped ones; numpy buffers, libzmq's queues, msgpack's
    buffers) and those it holds free (``heap_free_mb``), and the interpreter's
    small-object blocks in use (``py_blocks``: ``sys.getallocatedblocks``; Python
    objects up to 512 bytes live in its own arenas, outside the C heap). A leak
    grows what is in use; fragmentation grows what is free. The two heap fields
    are absent where the C library is not glibc 2.33 or later."""
    out: dict[str, float | int] = {"py_blocks": sys.getallocatedblocks()}
    mallinfo2 = _mallinfo2()
    if mallinfo2 is not None:
        m = mallinfo2()
        out["heap_used_mb"] = round((m.uordblks + m.hblkhd) / (1 << 20), 2)
        out["heap_free_mb"] = round(m.fordblks / (1 << 20), 2)
    return out


def write_json(path: Path, rep: Any) -> None:
    """A bench's report to ``path`` (its directory made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1))


def summary(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int]:
    """``count``, ``mean``, ``p50``, ``p90``, ``p99``, ``max`` (and ``min``) of ``values``
    times ``scale``. Percentiles use linear interpolation (numpy's default), so they
    are ordered and never exceed the maximum. An empty input gives zeros."""
    a = np.asarray(list(values), dtype=np.float64) * scale
    if a.size == 0:
        return {"count": 0, "mean": 0.0, "min": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0,
                "max": 0.0}
    out: dict[str, float | int] = {"count": int(a.size), "mean": float(a.mean()),
                                   "min": float(a.min())}
    for q, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{q}"] = float(v)
    out["max"] = float(a.max())
    return out


def package_version(name: str) -> str | None:
    """Installed version of ``name`` without importing it (torch takes seconds)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What a reader needs to weigh the numbers: cores, CPU, OS and library versions."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return {
        "nproc": usable,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_gib": mem,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": package_version("torch"),
        "pyzmq": package_version("pyzmq"),
        "xcosd": package_version("xcosd"),
    }


def table(rows: Sequence[Sequence[Any]], header: Sequence[str], *, markdown: bool = False,
          floatfmt: str = ".3g") -> str:
    """A plain-text (or Markdown) table; floats formatted with ``floatfmt``."""

    def cell(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return "" if v is None else str(v)
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else format(v, floatfmt)
        return str(v)

    body = [[cell(v) for v in r] for r in rows]
    head = [str(h) for h in header]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(head[i]), *(len(r[i]) for r in body)) if body else len(head[i])
              for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), *(fmt.format(*r) for r in body)])
