"""The grid ``xcosd bench methods`` sweeps: codecs and warper settings by name.

Kept free of heavy imports: the CLI reads these names to build its help text.
"""

from __future__ import annotations

from ..sampling import SamplingParams

#: codecs compared for methods whose codec applies to a vector (``codec_applies_to``)
CODECS = ("f32", "f16", "q8", "sparse", "topk:64", "f32+zstd", "f16+zstd", "q8+zstd",
          "sparse+zstd")

#: warper settings by short name
WARPERS: dict[str, SamplingParams] = {
    "T=1": SamplingParams(),
    "top-p 0.95": SamplingParams(top_p=0.95),
    "top-k 50": SamplingParams(top_k=50),
    "greedy": SamplingParams(temperature=0.0),
}

#: the link model's downlink rates (Mbps) and round-trip time (ms)
RATES_MBPS = (100.0, 200.0, 300.0)
RTT_MS = 20.0


def all_methods() -> list[str]:
    from ..methods import METHODS

    return list(METHODS)


def codecs_for(method: str, codecs: tuple[str, ...] | list[str]) -> list[str]:
    """The codecs worth running for ``method``: all of them when its codec applies to a
    vector, else only ``f32`` (the codec changes nothing)."""
    from ..methods import METHODS

    if METHODS[method].codec_applies_to is None:
        return ["f32"]
    return list(codecs)
