"""xcosd: lossless collaborative speculative decoding across vocabularies."""

from __future__ import annotations

__version__ = "0.1.0"
