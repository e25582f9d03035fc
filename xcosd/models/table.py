"""A language model given as a table: for exactness tests.

``TableModel(tokens, next_probs, eos_id=None)`` is the smallest thing that satisfies
:class:`~xcosd.models.base.LanguageModel`: its vocabulary is ``tokens`` (byte
strings, id = index), its next-token distribution is whatever ``next_probs(context)``
returns, and prompts are tokenised by greedy longest match over ``tokens``. Two
TableModels with different token lists form a cross-vocabulary pair whose every
probability the test knows exactly, so a test can compare xcosd's output
distribution with the target's in closed form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import ModelError
from ..sampling import check_distribution
from ..vocab import Vocabulary
from .base import ContextModel


class TableModel(ContextModel):
    """A model whose next-token distribution after ``context`` is ``next_probs(context)``.

    ``tokens[i]`` is the byte string of id ``i``. ``eos_id`` (optional) is the id
    that plays the ``eos`` role; it is a special token, so it is matched across
    vocabularies by role (never by bytes) and contributes no output bytes. Every
    returned row is checked to be a distribution over the ids.
    """

    def __init__(self, tokens: Sequence[bytes], next_probs: Callable[[list[int]], np.ndarray],
                 eos_id: int | None = None, *, name: str | None = None) -> None:
        toks = [bytes(t) for t in tokens]
        if not toks:
            raise ModelError("TableModel needs at least one token")
        if eos_id is not None and not 0 <= eos_id < len(toks):
            raise ModelError(f"eos_id {eos_id} outside 0..{len(toks) - 1}")
        if name is None:
            h = hashlib.sha256(b"\0".join(toks)).hexdigest()[:8]
            name = f"table-{h}"
        self.name = name
        self.eos_id = eos_id
        special = [eos_id] if eos_id is not None else []
        roles = {"eos": eos_id} if eos_id is not None else {}
        self.vocab = Vocabulary(name, toks, special=special, roles=roles)
        self.next_probs = next_probs

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        p = np.asarray(self.next_probs(list(context)), dtype=np.float32)
        check_distribution(p, what=f"{self.name} next_probs", size=self.vocab.size)
        out[:] = p
