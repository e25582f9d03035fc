"""Vocabularies: token ids <-> bytes, their loaders, and the draft/target map.

``vocabulary`` holds :class:`Vocabulary` and its loaders (quicktok, tiktoken files,
Hugging Face tokenizers through ``hf``); ``vocab_map`` holds :class:`VocabMap`
(V_C, V_O, the id translation and the fingerprint both sides check). This package
sits low: it knows nothing of models, methods or the wire.
"""

from __future__ import annotations

from .vocab_map import VocabMap
from .vocabulary import MATCHED_ROLES, QUICKTOK_ALIASES, SPECIAL_ROLES, Vocabulary

#: a Hugging Face tokenizer as a :class:`Vocabulary` (the loader under its old name)
vocabulary_from_hf = Vocabulary.from_hf_tokenizer

__all__ = ["MATCHED_ROLES", "QUICKTOK_ALIASES", "SPECIAL_ROLES", "VocabMap", "Vocabulary",
           "vocabulary_from_hf"]
