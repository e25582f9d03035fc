"""A one-line live progress bar on stderr, for long bench runs.

It only draws when asked to (a TTY, or ``--progress``): a bench's stdout is its
report and must stay clean for pipes and files.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``[#####-----] 3.1/8.0 s measuring | 12,345 tok  1,234 tok/s | 0 errors``."""

    def __init__(self, total_s: float, *, enabled: bool | None = None, label: str = "",
                 stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total_s = max(total_s, 1e-9)
        self.label = label
        self.width = width
        self._last_t = time.monotonic()
        self._last_tokens = 0
        self._rate = 0.0
        self._drawn = False

    def update(self, elapsed_s: float, tokens: int, errors: int, phase: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        dt = now - self._last_t
        if dt >= 0.25:
            self._rate = (tokens - self._last_tokens) / dt
            self._last_t, self._last_tokens = now, tokens
        frac = min(1.0, max(0.0, elapsed_s / self.total_s))
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"\r{self.label}[{bar}] {elapsed_s:5.1f}/{self.total_s:.1f} s {phase:<9} | "
                f"{tokens:,} tok {self._rate:8,.0f} tok/s | {errors} errors")
        self.stream.write(line)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
