"""Probability-vector codecs and the registry that finds them by name.

Names: ``f32``, ``f16``, ``bf16``, ``q8`` (= ``q8:log``; also ``q8:lin``,
``q8:sqrt``), ``sparse``, ``topk:K``, ``head:K``, any of them followed by ``+zstd`` or
``+zstd:LEVEL``. ``get_codec`` returns a fresh codec whose ``.name`` is the
canonical spelling.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CodecError
from .base import F32, Codec
from .halves import BF16, F16
from .q8 import Q8
from .sparse import Head, Sparse, TopK
from .zstd import Zstd

_REGISTRY: dict[str, Callable[[], Codec]] = {
    "f32": F32,
    "f16": F16,
    "bf16": BF16,
    "q8": Q8,
    "q8:log": Q8,
    "q8:lin": lambda: Q8("lin"),
    "q8:sqrt": lambda: Q8("sqrt"),
    "sparse": Sparse,
}


def _base(name: str) -> Codec:
    if name in _REGISTRY:
        return _REGISTRY[name]()
    kind, colon, k = name.partition(":")
    if colon and kind in ("topk", "head"):
        if not k.isdigit() or int(k) < 1:
            raise CodecError(f"{kind}:K needs a positive integer K, got {name!r}")
        return TopK(int(k)) if kind == "topk" else Head(int(k))
    raise CodecError(f"unknown codec {name!r}; known: {codec_names()}")


def get_codec(name: str) -> Codec:
    """A codec by its registry name (``f32``, ``f16``, ``bf16``, ``q8``, ``sparse``,
    ``topk:K``, ``head:K``, any of them followed by ``+zstd``)."""
    base, plus, stage = name.strip().partition("+")
    codec = _base(base)
    if not plus:
        return codec
    kind, _, level = stage.partition(":")
    if kind != "zstd" or "+" in stage or (level and not level.isdigit()):
        raise CodecError(f"unknown compressor stage {stage!r} in {name!r}; use +zstd[:LEVEL]")
    return Zstd(codec, int(level)) if level else Zstd(codec)


def codec_names() -> list[str]:
    """The base names (``topk:K`` for any K; each also with ``+zstd``)."""
    return [*sorted(_REGISTRY), "topk:K", "head:K"]


__all__ = ["BF16", "F16", "F32", "Q8", "Codec", "Head", "Sparse", "TopK", "Zstd", "codec_names",
           "get_codec"]
