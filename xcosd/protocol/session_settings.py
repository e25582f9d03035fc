"""``SessionSettings``: what one generation on the device is asked to do, in one value.

A generation's settings used to be written out again at every step between the
caller and the state machine: ``GenerationConfig``'s fields, then the same names as
keywords of :class:`~xcosd.protocol.edge.EdgeSession`'s constructor (twenty of
them), of the in-process pump's ``session`` and of the node's generation. Each
copy was a place to drop one, or to read the cloud's limits from somewhere else.
Here they are one frozen value, made once per session and handed over whole.

It holds the *resolved* form a session runs with: a built
:class:`~xcosd.methods.Method` (the method's options and codec in it), the warpers
as :class:`~xcosd.sampling.SamplingParams`, a draft cost that is a number or
``"auto"`` (never ``None``), and the limits the cloud's welcome announced
(``max_draft``, ``max_tree``, its end tokens). The caller-facing settings, with
their defaults that depend on one another, are :class:`~xcosd.config.GenerationConfig`;
``GenerationConfig.session_settings(welcome)`` turns one into this. The protocol
layer cannot import that config (it sits above), so this value knows nothing of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..methods.base import Method
from ..methods.tree import TreeShape, check_tree_method
from ..policies.draft_length import DEFAULT_CAP, DEFAULT_CONFIDENCE, DEFAULT_COST
from ..sampling import SamplingParams
from .messages import Welcome


@dataclass(frozen=True)
class SessionSettings:
    """One generation's settings, as :class:`~xcosd.protocol.edge.EdgeSession` runs them.

    * ``method``: the built method (its codec and options inside it).
    * ``params``: the warpers both sides apply.
    * ``max_new_tokens``: target tokens to generate at most.
    * ``stop_ids``: target ids that end the generation (the cloud's end tokens, from
      its welcome; empty to run to ``max_new_tokens``).
    * ``seed``: seeds both halves of the session (``None``: fresh entropy).
    * ``draft_len``, ``adaptive_draft``, ``draft_confidence``, ``max_draft_len``,
      ``draft_cost``: the draft-length policy
      (:class:`~xcosd.policies.draft_length.DraftLength`; ``draft_len`` is its first
      round's ceiling, ``draft_cost="auto"``: measured by the node).
    * ``tree``: a draft-tree shape, ``"auto"`` (the tree policy picks each round's
      shape) or ``None`` (chains); a shape's text is parsed on construction.
      ``tree_row_codec``, ``tree_distinct``: how a tree's rows cross and whether its
      siblings are drawn without replacement.
    * ``max_draft``: the longest block the cloud verifies; ``max_tree``: the most
      nodes of a tree it verifies (0: chains only, and a tree asked for is drafted
      as chains). Both are the cloud's, from its welcome (:meth:`under`).
    """

    method: Method
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 64
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    draft_len: int = 4
    adaptive_draft: bool = True
    draft_confidence: float = DEFAULT_CONFIDENCE
    max_draft_len: int = DEFAULT_CAP
    draft_cost: float | str = DEFAULT_COST
    tree: TreeShape | str | None = None
    tree_row_codec: str | None = None
    tree_distinct: bool = True
    max_draft: int = 64
    max_tree: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.draft_len < 0:
            raise ValueError(f"draft length must be >= 0, got {self.draft_len}")
        stop_ids: Collection[int] = self.stop_ids
        object.__setattr__(self, "stop_ids", frozenset(int(i) for i in stop_ids))
        tree = self.tree
        if isinstance(tree, str) and tree != "auto":
            tree = TreeShape.parse(tree)
            object.__setattr__(self, "tree", tree)
        if tree is not None:
            check_tree_method(self.method)
        object.__setattr__(self, "max_tree", int(self.max_tree))
        object.__setattr__(self, "tree_distinct", bool(self.tree_distinct))

    @classmethod
    def under(cls, welcome: Welcome, method: Method, **settings: Any) -> SessionSettings:
        """Settings for ``method`` within what a cloud's ``welcome`` announced: its
        ``max_draft`` and ``max_tree``, and its end tokens as ``stop_ids`` unless
        ``settings`` gives others (``()`` runs past them)."""
        settings.setdefault("stop_ids", welcome.stop_ids)
        return cls(method=method, max_draft=welcome.limits.max_draft,
                   max_tree=welcome.limits.max_tree, **settings)

    def replace(self, **changes: Any) -> SessionSettings:
        """A copy with ``changes`` (checked again, as any construction)."""
        return dataclasses.replace(self, **changes)


#: the names :class:`SessionSettings` takes, for callers that fold keywords into it
SESSION_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(SessionSettings))
