"""``CODEC+zstd``: any codec's bytes through Zstandard.

Zero runs (a sparse row's empty tail under ``q8``), sorted indices and the
repeated exponent bytes of float vectors compress well; the inner codec decides
the numbers, so ``commit`` is the inner codec's and exactness is unchanged.

The frame must state its content size, and the decoder refuses a frame whose
size exceeds what the inner codec can produce for ``n`` entries before it
decompresses anything, so a small hostile payload cannot expand without bound.
"""

from __future__ import annotations

import numpy as np
import zstandard

from ..errors import CodecError
from .base import Buffer, Codec

DEFAULT_LEVEL = 3


class Zstd(Codec):
    """Wraps ``inner``; ``level`` is Zstandard's compression level."""

    def __init__(self, inner: Codec, level: int = DEFAULT_LEVEL) -> None:
        if not 1 <= level <= 22:
            raise CodecError(f"zstd: level must be 1..22, got {level}")
        self.inner, self.level = inner, level
        self.exact = inner.exact
        self.name = f"{inner.name}+zstd" + ("" if level == DEFAULT_LEVEL else f":{level}")
        self._c = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                           write_checksum=False)

    def encode(self, v: np.ndarray) -> bytes:
        return self._c.compress(self.inner.encode(v))

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
        d = zstandard.ZstdDecompressor().decompressobj()
        try:
            out = d.decompress(raw)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name}: corrupt frame: {e}") from None
        if not d.eof or d.unused_data or len(out) != size:
            raise CodecError(f"{self.name}: truncated frame or trailing bytes")
        return self.inner.decode(out, n)

    def commit(self, v: np.ndarray) -> np.ndarray:
        return self.inner.commit(v)

    def max_encoded_size(self, n: int) -> int:
        m = self.inner.max_encoded_size(n)
        return m + m // 128 + 64  # above ZSTD_compressBound for incompressible input
