"""The embedded default pair: two n-gram models over two different real vocabularies.

The draft is a trigram model over OpenAI's ``o200k`` vocabulary, the target a
4-gram model over Llama 3's vocabulary, both trained on the default corpus
(:func:`~xcosd.models.corpus.default_corpus`). The vocabularies were chosen so the
cross-vocabulary machinery is really exercised: on this corpus about 0.8% of the
target's tokens are Llama-3-only (V_O), so hybrid resampling's V_O branch fires in
ordinary generated text, while the shared vocabulary V_C still carries almost all
of the mass and drafts are accepted at a useful rate (``docs/MODELS.md`` has the
measured numbers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..vocab import Vocabulary
from .ngram import NgramModel

#: (vocabulary, order) of the default draft and target
DEFAULT_DRAFT = ("o200k", 3)
DEFAULT_TARGET = ("llama3", 4)


def default_draft(*, cache: str | Path | None = None, **kw: Any) -> NgramModel:
    """The default draft model (trained and cached on first use)."""
    vocab, order = DEFAULT_DRAFT
    return NgramModel.load_or_train(Vocabulary.load(vocab), order, cache=cache, **kw)


def default_target(*, cache: str | Path | None = None, **kw: Any) -> NgramModel:
    """The default target model (trained and cached on first use)."""
    vocab, order = DEFAULT_TARGET
    return NgramModel.load_or_train(Vocabulary.load(vocab), order, cache=cache, **kw)


def default_pair(*, cache: str | Path | None = None, **kw: Any) -> tuple[NgramModel, NgramModel]:
    """``(draft_model, target_model)``: the embedded default pair. Only the first
    call on a machine trains (seconds); later ones load from the cache directory."""
    return default_draft(cache=cache, **kw), default_target(cache=cache, **kw)
