"""Vocabularies: token ids <-> bytes, their loaders, and the draft/target map."""

from __future__ import annotations

from .hf import vocabulary_from_hf
from .vocabulary import MATCHED_ROLES, QUICKTOK_ALIASES, SPECIAL_ROLES, VocabMap, Vocabulary

__all__ = ["MATCHED_ROLES", "QUICKTOK_ALIASES", "SPECIAL_ROLES", "VocabMap", "Vocabulary",
           "vocabulary_from_hf"]
