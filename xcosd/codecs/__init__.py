"""Probability-vector codecs and the registry that finds them by name."""

from __future__ import annotations

from .base import F32, Codec

_REGISTRY: dict[str, type[Codec]] = {"f32": F32}


def get_codec(name: str) -> Codec:
    """A codec by its registry name (``f32``, ``f16``, ``bf16``, ``q8``, ``sparse``,
    ``topk:K``, any of them followed by ``+zstd``)."""
    from ..errors import CodecError

    if name in _REGISTRY:
        return _REGISTRY[name]()
    raise CodecError(f"unknown codec {name!r}; known: {sorted(_REGISTRY)}")


def codec_names() -> list[str]:
    return sorted(_REGISTRY)


__all__ = ["F32", "Codec", "codec_names", "get_codec"]
