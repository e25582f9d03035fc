"""``CODEC+zstd``: any codec's bytes through Zstandard.

Zero runs (a sparse row's empty tail under ``q8``), sorted indices and the
repeated exponent bytes of float vectors compress well; the inner codec decides
the numbers, so ``commit`` is the inner codec's and exactness is unchanged.

The level is the sender's choice alone (every level decodes the same way).
``+zstd`` compresses payloads under :data:`FAST_FROM` (128 KiB: an HR payload after
top-p or top-k, any row of a small vocabulary) at level 3, and larger ones (a dense
row's ``f32``, ``f16``, ``sparse``, or ``q8`` of a 262,144-id row) at level 1, which
is 1.5-3x faster there for 0-6 % more bytes (``q8``: 3 % fewer); ``docs/WIRE.md``
has the numbers. ``+zstd:LEVEL`` uses one level for everything.

The frame must state its content size, and the decoder refuses a frame whose
size exceeds what the inner codec can produce for ``n`` entries before it
decompresses anything, so a small hostile payload cannot expand without bound.
"""

from __future__ import annotations

import numpy as np
import zstandard

from ..errors import CodecError
from .base import Buffer, Codec

#: ``+zstd``'s level for payloads under :data:`FAST_FROM` bytes
DEFAULT_LEVEL = 3
#: ``+zstd``'s level from :data:`FAST_FROM` bytes on
FAST_LEVEL = 1
FAST_FROM = 128 * 1024


def _compressor(level: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)


class Zstd(Codec):
    """Wraps ``inner``; ``level`` is Zstandard's compression level (None: level 3
    under 128 KiB of inner payload, level 1 from there on)."""

    def __init__(self, inner: Codec, level: int | None = None) -> None:
        if level is not None and not 1 <= level <= 22:
            raise CodecError(f"zstd: level must be 1..22, got {level}")
        self.inner, self.level = inner, level
        self.exact = inner.exact
        self.name = f"{inner.name}+zstd" + ("" if level is None else f":{level}")
        self._small = _compressor(DEFAULT_LEVEL if level is None else level)
        self._large = self._small if level is not None else _compressor(FAST_LEVEL)

    def encode(self, v: np.ndarray) -> bytes:
        raw = self.inner.encode(v)
        return (self._large if len(raw) >= FAST_FROM else self._small).compress(raw)

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        raw = bytes(data)
        bound = self.inner.max_encoded_size(n)
        try:
            size = zstandard.frame_content_size(raw)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name}: not a zstd frame: {e}") from None
        if size < 0:
            raise CodecError(f"{self.name}: frame does not state its content size")
        if size > bound:
            raise CodecError(f"{self.name}: frame expands to {size} bytes, "
                             f"at most {bound} expected")
        try:
            # one frame, exactly: a truncated frame or trailing bytes raise
            out = zstandard.ZstdDecompressor().decompress(raw, max_output_size=size,
                                                          allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name}: corrupt, truncated or trailing bytes: {e}") from None
        if len(out) != size:
            raise CodecError(f"{self.name}: frame holds {len(out)} bytes, states {size}")
        return self.inner.decode(out, n)

    def commit(self, v: np.ndarray) -> np.ndarray:
        return self.inner.commit(v)

    def max_encoded_size(self, n: int) -> int:
        m = self.inner.max_encoded_size(n)
        return m + m // 128 + 64  # above ZSTD_compressBound for incompressible input
