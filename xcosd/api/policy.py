"""What a request may choose of the edge's protocol, and the bytes it may cost.

A request's ``xcosd`` object picks the method, codec, draft length and draft tree
of its generation. Left open, that lets a 150-byte request make the edge send
megabytes (``sd-uplink`` uploads a vector over the common vocabulary per drafted
token) or get an output that is not the target's (a lossy method). The operator
sets what a request may pick (:class:`RequestPolicy`; ``xcosd edge serve
--allow-methods`` and friends); a pick outside it is a 400 naming the field.
What a request does not pick is the operator's own setting, always allowed (and a
request may name it).

By default a request may pick only the lossless methods whose bytes per token do
not grow with a vocabulary (:data:`DEFAULT_METHODS`, ``ar`` and ``xcosd-e``): each
drafted token costs 8 payload bytes up (its id and its draft probability), a
verdict a few bytes down, a rejection of ``xcosd-e`` its K candidates (8 bytes
each) down and, on the rare fallback, a vector over the common vocabulary.
``sd-uplink`` (a vector over the common vocabulary up per drafted token: 6.6 MB
for one 16-draft round on the embedded pair), ``xcosd`` and ``straightforward``
(a vector down per rejection: 2.5 MB for 32 tokens on that pair) are the
operator's to allow; a lossy method (``uhlm``, ``target-resample``,
``greedy-resample``) needs ``lossy=True`` as well, and every response says
whether its method was lossless.

Whatever is allowed, one generation sends the cloud at most
:meth:`RequestPolicy.uplink_budget` wire bytes: the edge does not send the message
that would pass it (``GenerationConfig.max_uplink_bytes``), and the request ends
with a 400 ``uplink_budget_exceeded``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config import GenerationConfig
from ..methods import LOSSY, METHODS
from ..policies.draft_length import DEFAULT_CAP
from .errors import APIError, invalid
from .requests import Sampling

#: the methods a request may pick by default: lossless, bytes per token bounded
#: independently of the vocabularies
DEFAULT_METHODS = frozenset({"ar", "xcosd-e"})
#: the codecs a request may pick by default (a codec changes the bytes of a vector,
#: never the law: docs/METHODS.md, "The commit rule")
DEFAULT_CODECS = frozenset({"f32", "f16", "bf16", "q8"})
#: draft-tree nodes a request's tree may have by default: none (a tree's branching
#: nodes send their draft rows up, up to 64 pairs each: the operator's to allow)
DEFAULT_MAX_TREE_NODES = 0
#: wire bytes up per token a generation may use by default: a round that yields
#: one token after a chain of 16 drafts (8 bytes each), with its framing, fits
#: four times over
DEFAULT_UPLINK_BYTES_PER_TOKEN = 512
#: wire bytes up every generation may use besides its tokens': the handshake of
#: its session, a resume or two, the close
DEFAULT_UPLINK_BASE_BYTES = 16 << 10


@dataclass(frozen=True)
class RequestPolicy:
    """What the ``xcosd`` object of a request may ask for.

    ``methods``, ``codecs``: the names a request may pick; ``max_draft_len``: the
    longest first draft; ``max_tree_nodes``: the largest draft tree (0: none;
    ``"auto"`` is allowed where any tree is, the cloud bounding it);
    ``lossy``: whether the lossy methods among ``methods`` may be picked.
    ``uplink_bytes_per_token`` and ``uplink_base_bytes``: the uplink bound of one
    generation (:meth:`uplink_budget`)."""

    methods: frozenset[str] = DEFAULT_METHODS
    codecs: frozenset[str] = DEFAULT_CODECS
    max_draft_len: int = DEFAULT_CAP
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES
    lossy: bool = False
    uplink_bytes_per_token: int = DEFAULT_UPLINK_BYTES_PER_TOKEN
    uplink_base_bytes: int = DEFAULT_UPLINK_BASE_BYTES

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown method {unknown[0]!r}; known: {', '.join(METHODS)}")
        from ..codecs import get_codec
        from ..errors import CodecError

        for c in sorted(self.codecs):
            try:
                get_codec(c)
            except CodecError as e:
                raise ValueError(e.message) from None
        lossy = sorted(set(self.methods) & set(LOSSY))
        if lossy and not self.lossy:
            raise ValueError(f"{', '.join(lossy)} {'is' if len(lossy) == 1 else 'are'} lossy: "
                             "allow lossy methods explicitly for a request to pick them")
        for name in ("max_draft_len", "max_tree_nodes", "uplink_bytes_per_token",
                     "uplink_base_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def check(self, req: Sampling, own: GenerationConfig | None = None) -> None:
        """Refuse (400, the field named) a pick outside the policy. ``own``: the
        operator's settings, which a request may always name."""
        def picked(name: str) -> Any:
            v = getattr(req, name)
            return None if own is not None and v == getattr(own, name) else v

        method, codec, draft_len, tree = (picked(k) for k in ("method", "codec", "draft_len",
                                                               "tree"))
        if method is not None and method not in self.methods:
            raise _outside("xcosd.method", method, self.methods)
        if codec is not None and codec not in self.codecs:
            raise _outside("xcosd.codec", codec, self.codecs)
        if draft_len is not None and draft_len > self.max_draft_len:
            raise invalid(f"'xcosd.draft_len' is at most {self.max_draft_len} on this server, "
                          f"got {draft_len}", "xcosd.draft_len", "not_allowed")
        if tree is not None:
            self._check_tree(tree)

    def _check_tree(self, tree: str) -> None:
        if self.max_tree_nodes == 0:
            raise invalid("this server takes no draft trees from a request", "xcosd.tree",
                          "not_allowed")
        if tree == "auto":
            return
        size = tree_nodes(tree, self.max_tree_nodes)
        if size is None:
            raise invalid(f"a tree shape is chain:D, W1xW2x... or spine:W1xW2x..., got "
                          f"{tree!r}", "xcosd.tree")
        if size > self.max_tree_nodes:
            raise invalid(f"'xcosd.tree' {tree!r} has {size} nodes; at most "
                          f"{self.max_tree_nodes} on this server", "xcosd.tree", "not_allowed")

    def uplink_budget(self, max_tokens: int, prompt_bytes: int) -> int:
        """The most wire bytes one generation of ``max_tokens`` tokens after a
        prompt of ``prompt_bytes`` bytes may send the cloud: the prompt twice (its
        open, and a resume's), the base, and the bytes per token."""
        return (2 * prompt_bytes + self.uplink_base_bytes
                + self.uplink_bytes_per_token * max_tokens)


def tree_nodes(text: str, cap: int) -> int | None:
    """The nodes of the tree shape ``text`` (:meth:`xcosd.methods.tree.TreeShape.parse`'s
    forms), counted without building it, up to the first count past ``cap``: a
    request's ``"100000x100000"`` must not allocate its ten billion nodes to be
    refused. ``None``: not a shape."""
    t = text.strip()
    if m := re.fullmatch(r"chain:(\d{1,9})", t):
        return int(m[1])
    kind, _, widths = t.rpartition(":")
    if kind not in ("", "spine") or not re.fullmatch(r"\d{1,9}(x\d{1,9})*", widths):
        return None
    total, level = 0, 1
    for w in (int(x) for x in widths.split("x")):
        level = w if kind == "spine" else level * w  # a spine branches at one node a depth
        total += level
        if total > cap:
            break
    return total


def _outside(param: str, value: str, allowed: frozenset[str]) -> APIError:
    return invalid(f"'{param}' {value!r} is not allowed on this server; allowed: "
                   f"{', '.join(sorted(allowed))}", param, "not_allowed")


def is_lossless(method: str) -> bool:
    """Whether ``method`` keeps the target's law exactly."""
    cls = METHODS.get(method)
    return cls is not None and cls.lossless
