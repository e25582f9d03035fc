"""xcosd: lossless collaborative speculative decoding across vocabularies.

    import xcosd
    async with xcosd.CloudNode(target=target_model, bind="tcp://127.0.0.1:5555") as cloud:
        async with xcosd.EdgeNode(draft=draft_model, connect=cloud.endpoint) as edge:
            config = xcosd.GenerationConfig(method="xcosd-e", max_new_tokens=64, seed=7)
            res = await edge.generate("Once upon a time", config=config)

Names are imported lazily, so ``import xcosd`` stays cheap (no zmq, no models).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "CloudNode": "xcosd.nodes",
    "EdgeNode": "xcosd.nodes",
    "GenerationConfig": "xcosd.config",
    "GenerationResult": "xcosd.nodes",
    "GenerationStats": "xcosd.nodes",
    "SamplingParams": "xcosd.sampling",
    "Vocabulary": "xcosd.vocab",
    "VocabMap": "xcosd.vocab",
    "METHODS": "xcosd.methods",
    "LOSSLESS": "xcosd.methods",
    "get_method": "xcosd.methods",
    "get_codec": "xcosd.codecs",
    "LinkSpec": "xcosd.transport",
    "CurveServer": "xcosd.transport",
    "CurveClient": "xcosd.transport",
    "KeyPair": "xcosd.transport",
    "load_model": "xcosd.models",
    "default_pair": "xcosd.models",
    "PROTOCOL_VERSION": "xcosd.protocol",
    "XcosdError": "xcosd.errors",
    "ProtocolError": "xcosd.errors",
    "TransportError": "xcosd.errors",
    "BusyError": "xcosd.errors",
    "VocabError": "xcosd.errors",
}

if TYPE_CHECKING:
    from .codecs import get_codec
    from .config import GenerationConfig
    from .errors import BusyError, ProtocolError, TransportError, VocabError, XcosdError
    from .methods import LOSSLESS, METHODS, get_method
    from .models import default_pair, load_model
    from .nodes import CloudNode, EdgeNode, GenerationResult, GenerationStats
    from .protocol import PROTOCOL_VERSION
    from .sampling import SamplingParams
    from .transport import CurveClient, CurveServer, KeyPair, LinkSpec
    from .vocab import VocabMap, Vocabulary


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'xcosd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "LOSSLESS", "METHODS", "PROTOCOL_VERSION", "BusyError", "CloudNode", "CurveClient",
    "CurveServer", "EdgeNode", "GenerationConfig", "GenerationResult", "GenerationStats",
    "KeyPair", "LinkSpec", "ProtocolError", "SamplingParams", "TransportError", "VocabError", "VocabMap",
    "Vocabulary", "XcosdError", "__version__", "default_pair", "get_codec", "get_method",
    "load_model",
]
