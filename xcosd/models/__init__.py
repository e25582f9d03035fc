"""Language models behind one interface (:class:`LanguageModel`).

``NgramModel`` (the embedded default, :func:`default_pair`), ``TransformersModel``
(Hugging Face models from a local directory or a GGUF file), ``SyntheticModel``
(cost-model target for load tests) and ``TableModel`` (exactness tests).
``import xcosd.models`` never imports torch: the transformers backend loads on
first use. The Hugging Face vocabulary converter lives with the vocabularies
(:mod:`xcosd.vocab.hf`); ``vocabulary_from_hf`` is re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..vocab import vocabulary_from_hf
from .base import ContextModel, LanguageModel, Session
from .corpus import cache_dir, corpus_from_files, default_corpus
from .default import DEFAULT_DRAFT, DEFAULT_TARGET, default_draft, default_pair, default_target
from .ngram import NgramModel
from .registry import REAL_MODELS, load_model, real_model_path
from .synthetic import SyntheticModel, small_vocabulary
from .table import TableModel

if TYPE_CHECKING:
    from .transformers_model import TransformersModel

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "REAL_MODELS",
    "ContextModel",
    "LanguageModel",
    "NgramModel",
    "Session",
    "SyntheticModel",
    "TableModel",
    "TransformersModel",
    "cache_dir",
    "corpus_from_files",
    "default_corpus",
    "default_draft",
    "default_pair",
    "default_target",
    "load_model",
    "real_model_path",
    "small_vocabulary",
    "vocabulary_from_hf",
]


def __getattr__(name: str) -> Any:
    if name == "TransformersModel":
        from .transformers_model import TransformersModel

        return TransformersModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
