"""Draft trees: several drafted children per node, verified by recursive rejection
sampling, with the rejection at the node where the walk stops resolved by the
session's own method (``docs/METHODS.md``, "Draft trees").

A chain spends a whole round trip when its first draft is rejected; a tree gives
every position several chances. The device draws each node's children from that
node's TLI row ``q``: i.i.d., or without replacement (the default; child ``i`` from
``q`` with the earlier siblings removed, :class:`Siblings`). The server walks the
tree from the root: at a node whose target row is ``r`` it tests the children in
order, child ``c`` drawn from ``q_i`` accepted when ``u * q_i(c) < r(c)``; a rejected
child replaces ``r`` by the residual it leaves, ``normalise(max(r - q_i, 0))``, and
the next sibling is tested against that. The first accepted child continues the walk; a fully accepted path
ends with a bonus token from the leaf's own target row. When every child of a node
is rejected, what is left to draw from is ``max(r - q, 0) / Z`` with ``r`` the row
the last child was tested against: exactly a chain's rejection with ``r`` in place
of ``p_j`` and the last child's row as the draft's, which the method resolves as it
always does (HR's V_C row and
``theta_o``, SR-DV's candidates, straightforward's row, sd-uplink's token).

What crosses the wire: the residual needs the draft's row at every node with two
or more children, and the device has it. The device sends those rows through a
codec it commits to before drawing (``committed_full``, as sd-uplink commits its
``q``): the children are drawn from the committed row, so the server's residual
uses the very numbers the draws came from, and a lossy row codec (``topk:K``) only
changes the proposal, never the law. Single-child nodes need no row (the chain's
test uses ``q(x)`` alone). The downlink is the chain's: the accepted path and the
method's one payload. The target rows stay with the cloud; residual rows are
computed there from the committed target rows, so a lossy *target* codec would make
the rows the device decodes differ from those the residual started from: trees run
with exact target codecs only (:func:`check_tree_method`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np

from ..codecs import Codec, get_codec
from ..draws import ACCEPT, Draws, Uniforms, draw_at, stream_of
from ..errors import InvalidDistribution, ProtocolError
from ..sampling import Rows, sample_index
from .base import (
    ID_BYTES,
    VALUE_BYTES,
    DeviceState,
    Draft,
    Method,
    RejectState,
    Reply,
    Space,
    fixed_total,
)
from .commit import committed_full, decoded_full
from .shape import MAX_NODES, TreeShape

#: bytes per node for its parent's index as counted before framing (u16)
PARENT_BYTES = 2
#: the row codec a tree's branching rows cross with by default: ``sparse``'s bits
#: (exact) for a row of at most 64 non-zeros (greedy, top-k, a confident top-p), and
#: for a dense T = 1 row its 64 likeliest tokens plus its tail's mass spread flat, at
#: most 529 bytes where ``sparse`` sends ``8 |V_C|`` (hundreds of KB); the draft
#: proposes from what it sends, so this is the proposal's shape, never the law's
DEFAULT_ROW_CODEC = "head:64"


# ------------------------------------------------------------------ the uplink


@dataclass(frozen=True, eq=False, kw_only=True)
class DraftTree(Draft):
    """Uplink of one tree round: a :class:`~xcosd.methods.base.Draft` whose ``ids`` and
    ``q_values`` are the nodes' (a target id each, and ``q(x)`` from the row it was
    drawn from), with each node's parent, the encoded committed rows of the nodes the
    server needs them for (``rows[node]``, ``-1`` for the context), all with
    ``row_codec``, and the sibling scheme. A chain is the tree whose node ``i`` hangs
    from node ``i - 1``; what crosses for it is the plain :class:`Draft`. This is what
    the device sends; what it keeps of the round is a :class:`DeviceTree`."""

    #: scored off to the side (``score_tree`` leaves the context as it was), and drafted
    #: so too: the accepted path joins both models' contexts after the verdict
    stays_in_context: ClassVar[bool] = False

    parents: np.ndarray
    rows: dict[int, bytes]
    row_codec: str
    #: siblings drawn without replacement (:class:`Siblings`), else i.i.d.
    distinct: bool = True

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @cached_property
    def shape(self) -> TreeShape:
        return TreeShape(tuple(int(p) for p in self.parents))

    @property
    def depth(self) -> int:
        return self.shape.depth

    def path(self, n: int) -> list[int]:
        return self.shape.path(n - 1)

    def rejects(self, n: int) -> bool:
        return 0 <= n <= self.size and bool(self.shape.children[n])

    @property
    def tree_label(self) -> str | None:
        return self.shape.label

    def nbytes(self) -> int:
        """Payload bytes: per node its id, ``q(x)`` and parent; per sent row its
        node index and encoded bytes; one byte for the sibling scheme."""
        per_row = sum(PARENT_BYTES + len(b) for b in self.rows.values())
        return self.size * (ID_BYTES + VALUE_BYTES + PARENT_BYTES) + per_row + 1


def rows_needed(method: Method, shape: TreeShape) -> list[int]:
    """The nodes whose draft row the server needs: every node with two or more
    children (the residual a rejected sibling leaves), and every node with children
    when the method's own rejection needs ``q`` (sd-uplink)."""
    every = method.codec_applies_to == "q"
    return [node for node in (-1, *range(shape.size))
            if len(shape.children[node + 1]) >= (1 if every else 2)]


def row_codec_for(method: Method, row_codec: Codec | str | None) -> Codec:
    """sd-uplink's rows cross with its own codec; others with ``row_codec``."""
    if method.codec_applies_to == "q":
        return method.codec
    if isinstance(row_codec, Codec):
        return row_codec
    return get_codec(row_codec or DEFAULT_ROW_CODEC)


def check_tree_method(method: Method) -> None:
    """Refuse what trees cannot keep exact: a method that does not draft, uhlm's
    partial verification, and a lossy codec on the target's rows (the residual
    rows are computed from the committed row, and what the device decodes would
    differ from them)."""
    if not method.drafts:
        raise ValueError(f"{method.name} drafts nothing: there is no tree to verify")
    if method.name == "uhlm":
        raise ValueError("uhlm skips verifying some drafts: trees need every child tested")
    if method.codec_applies_to == "p" and not method.codec.exact:
        raise ValueError(f"trees need an exact codec for the target's rows (f32, sparse), "
                         f"not {method.codec.name}")


class Siblings:
    """The rows a node's children are drawn from, in order, and tested with.

    Drawn i.i.d. every child comes from the node's row ``q``. Drawn without
    replacement (``distinct``), child ``i`` comes from ``q`` with the V_C positions
    of the earlier siblings set to 0 and renormalised (by :func:`fixed_total`, so both
    sides get the same bits), and ``q`` again once nothing is left. Either way the row
    of child ``i`` is a function of the earlier siblings alone, which is all the walk
    needs: the device and the server run this same sequence, the device to draw,
    the server to test and to form the residual. Without replacement a draft that is
    sure of one token proposes it once, not at every sibling (where it is rejected
    again, its residual being 0 there), so later siblings are other candidates."""

    def __init__(self, q: np.ndarray, distinct: bool) -> None:
        self.q = q
        self.distinct = distinct
        self.taken: list[int] = []
        self.current = q

    def take(self, pos: int) -> None:
        """Child drawn at V_C position ``pos``; :attr:`current` becomes the next
        sibling's row."""
        if not self.distinct:
            return
        self.taken.append(int(pos))
        w = np.asarray(self.q, dtype=np.float64).copy()
        w[self.taken] = 0.0
        total = fixed_total(w)
        if not total > 0:  # every token of q drawn: start over
            self.taken = []
            self.current = self.q
        else:
            self.current = (w / total).astype(np.float32)


def draw_child(row: np.ndarray, rng: Uniforms) -> int:
    """One child's V_C position, drawn from ``row``."""
    return sample_index(row, rng)


# ------------------------------------------------------------------ the device


@dataclass(eq=False)
class DeviceTree:
    """The device's record of a drafted tree (what it keeps, as
    :class:`~xcosd.methods.base.DeviceState` is for a chain's rejection): the uplink
    it sent (:class:`DraftTree`, the part that crosses) and, per node with children,
    the row its last child was drawn from (V_C order), which resolves a rejection of
    every child there. It never crosses the wire."""

    draft: DraftTree
    rows: dict[int, np.ndarray] = field(default_factory=dict)


#: ``rows_at(nodes)``: the TLI rows (V_C order) at the positions after each node
#: (``-1``: the round's context), one call per depth so a model scores a depth at once
RowsAt = Callable[[list[int], list[int]], list[np.ndarray]]


def draft_tree(method: Method, shape: TreeShape, rows_at: RowsAt, space: Space,
               rng: Uniforms, row_codec: Codec | str | None = None, *,
               distinct: bool = True) -> DeviceTree:
    """Draw a tree of ``shape``: depth by depth, ``rows_at(nodes, ids)`` gives the
    TLI rows after those nodes (``ids``: the tokens drawn so far, by node), then
    each node's children are drawn from its row (committed through the row codec
    first where the server needs the row), without replacement when ``distinct``
    (:class:`Siblings`)."""
    check_tree_method(method)
    codec = row_codec_for(method, row_codec)
    needed = set(rows_needed(method, shape))
    ids = np.zeros(shape.size, dtype=np.int64)
    q_values = np.zeros(shape.size, dtype=np.float32)
    kept: dict[int, np.ndarray] = {}
    sent: dict[int, bytes] = {}
    for level in shape.levels():
        for node, q in zip(level, rows_at(level, ids.tolist()), strict=True):
            q = np.asarray(q, dtype=np.float32)
            if node in needed:
                sent[node] = codec.encode(q)
                q = committed_full(codec, q)
            sib = Siblings(q, distinct)
            for child in shape.children[node + 1]:
                row = sib.current
                pos = draw_child(row, rng)
                ids[child] = space.common_ids[pos]
                q_values[child] = row.item(pos)
                kept[node] = row
                sib.take(pos)
    draft = DraftTree(parents=np.asarray(shape.parents, dtype=np.int64), ids=ids,
                      q_values=q_values, rows=sent, row_codec=codec.name, distinct=distinct)
    return DeviceTree(draft, kept)


def device_state(drafted: DeviceTree, node: int) -> DeviceState:
    """The device's state for a rejection of every child of ``node``: its row and
    the last child tested."""
    return rejection_state(drafted.draft, drafted.rows, node)


def rejection_state(block: Draft, rows: Mapping[int, np.ndarray], node: int) -> DeviceState:
    """:func:`device_state` for any round block: ``rows[node]``, the row the last
    child of ``node`` was drawn from (a chain's: the row draft ``node + 1`` was drawn
    from), and that child, the last one the cloud tested."""
    last = block.shape.children[node + 1][-1]
    return DeviceState(q_common=rows[node], rejected=int(block.ids[last]))


# ------------------------------------------------------------------ the server


@dataclass
class TreeVerified:
    """The server's half of a tree round: the accepted ``path`` (node indices from
    the context down), the ``reply`` (bonus token, or the method's payload for the
    rejection at ``node``) and the rejection's state."""

    path: list[int]
    node: int
    reply: Reply
    reject: RejectState | None
    #: children tested, and how many of them were rejected siblings of a later one
    tested: int = 0


def residual(r_star: np.ndarray, q_common: np.ndarray, space: Space) -> np.ndarray | None:
    """``normalise(max(r - q, 0))`` over all target ids (``q`` is 0 on V_O), float32,
    or ``None`` when rounding left it no mass (exactly, a rejection leaves some)."""
    r = np.asarray(r_star, dtype=np.float64).copy()
    r[space.common_ids] -= q_common
    np.maximum(r, 0.0, out=r)
    total = fixed_total(r)
    if not total > 0:
        return None
    return (r / total).astype(np.float32)


def next_row(r: np.ndarray, q_common: np.ndarray, space: Space) -> np.ndarray:
    """The row the next sibling is tested against once one drawn from ``q_common`` was
    rejected against ``r``: the residual it left (``r`` itself where rounding left the
    residual no mass)."""
    nxt = residual(r, q_common, space)
    return r if nxt is None else nxt


def check_tree(draft: DraftTree, space: Space) -> None:
    """What a peer's tree must be before anything is scored: as many parents, ids and
    values, parents before their children, at most :data:`MAX_NODES` nodes, every id in
    V_C, every ``q(x)`` a positive finite float32. Raises a typed
    :class:`~xcosd.errors.ProtocolError` (``bad_field`` / ``bad_token``)."""
    n = int(np.asarray(draft.ids).shape[0])
    if not (np.asarray(draft.parents).shape == (n,) == np.asarray(draft.q_values).shape):
        raise ProtocolError("a tree's parents, ids and values differ in length", code="bad_field")
    try:
        draft.shape  # noqa: B018 (built and checked here, kept for the walk)
    except ValueError as e:
        raise ProtocolError(f"not a tree: {e}", code="bad_field") from e
    ids = np.asarray(draft.ids, dtype=np.int64)
    if n and (int(ids.min()) < 0 or int(ids.max()) >= space.target_size
              or int(space.to_common[ids].min()) < 0):
        raise ProtocolError("a drafted id is not in V_C", code="bad_token")
    q = np.asarray(draft.q_values, dtype=np.float32)
    if n and not (np.isfinite(q).all() and (q > 0).all() and (q <= 1).all()):
        raise ProtocolError("a tree's q(x) must be in (0, 1]", code="bad_field")


def server_rows(method: Method, draft: DraftTree, space: Space) -> dict[int, list[np.ndarray]]:
    """Per node whose row was sent, the row each of its children was drawn from
    (:class:`Siblings` over the committed row decoded from the uplink); checked to be
    the nodes the server needs, and each child's ``q(x)`` to be its row's value."""
    shape = draft.shape
    need = rows_needed(method, shape)
    if sorted(draft.rows) != need:
        raise ProtocolError(f"a tree sends the rows of nodes {need}, got {sorted(draft.rows)}",
                            code="bad_message")
    codec = get_codec(draft.row_codec)
    if method.codec_applies_to == "q" and codec.name != method.codec.name:
        raise ProtocolError(f"{method.name}'s rows cross with {method.codec.name}",
                            code="bad_message")
    out: dict[int, list[np.ndarray]] = {}
    for node, data in draft.rows.items():
        sib = Siblings(decoded_full(codec, data, space.n_common), draft.distinct)
        rows = out[node] = []
        for c in shape.children[node + 1]:
            pos = int(space.to_common[int(draft.ids[c])])
            if pos < 0 or sib.current.item(pos) != float(draft.q_values[c]):
                raise ProtocolError(f"node {c}'s q(x) is not its row's value",
                                    code="bad_message")
            rows.append(sib.current)
            sib.take(pos)
    return out


def verify_tree(method: Method, p: Rows, draft: DraftTree, space: Space,
                rng: Draws) -> TreeVerified:
    """Walk ``draft`` against the warped target rows ``p`` (``p[0]`` after the
    context, ``p[i + 1]`` after node ``i``'s path): one uniform per tested child,
    siblings tested against the residual the rejected ones before them left, the
    bonus from the last accepted node's row, the method's payload where every child
    was rejected."""
    check_tree_method(method)
    check_tree(draft, space)
    shape = draft.shape
    if len(p) < shape.size + 1:
        raise InvalidDistribution(f"a {shape.size}-node tree needs {shape.size + 1} target "
                                  f"rows, got {len(p)}")
    p_star = method.commit_rows(p, space)
    qs = server_rows(method, draft, space)
    path: list[int] = []
    node, tested = -1, 0
    acc = stream_of(rng, ACCEPT)  # a tested child's uniform is named by the child
    while True:
        kids = shape.children[node + 1]
        if not kids:
            return TreeVerified(path, node, method.bonus(p_star[node + 1], rng), None, tested)
        r = np.asarray(p_star[node + 1], dtype=np.float32)
        accepted = None
        for k, c in enumerate(kids):
            x, q = int(draft.ids[c]), float(draft.q_values[c])
            if not q > 0:
                raise InvalidDistribution(f"node {c} has q(x) = {q}: a drafted token must "
                                          f"have q > 0")
            tested += 1
            if draw_at(acc, c) * q < r.item(x):
                accepted = c
                break
            if k + 1 < len(kids):
                r = next_row(r, qs[node][k], space)
        if accepted is None:
            state = _reject_state(draft, node, r, qs)
            return TreeVerified(path, node, method.on_reject(state, space, rng), state, tested)
        path.append(accepted)
        node = accepted


def _reject_state(draft: DraftTree, node: int, r: np.ndarray,
                  qs: dict[int, list[np.ndarray]]) -> RejectState:
    """The rejection of every child of ``node``, ``r`` being the row its last child
    was tested against."""
    last = draft.shape.children[node + 1][-1]
    return RejectState(p_raw=r, p_star=r, rejected=int(draft.ids[last]),
                       q_common=qs[node][-1] if node in qs else None)


def rebuild_tree_reject(method: Method, p: Rows, draft: DraftTree, node: int, space: Space,
                        *, candidate_rounds: int = 0, fallback_sent: bool = False
                        ) -> RejectState:
    """The server's state after every child of ``node`` was rejected, rebuilt from the
    rows alone: a tree round's :func:`~xcosd.methods.round.rebuild_reject`, for a round
    whose verdict the device saw before a cloud restart lost it. Exact for the same
    reason: the residual each rejected sibling leaves is a function of the committed
    row and the committed draft rows, not of the walk's random numbers."""
    check_tree_method(method)
    check_tree(draft, space)
    kids = draft.shape.children[node + 1] if -1 <= node < draft.size else ()
    if not kids:
        raise ValueError(f"node {node} of a {draft.size}-node tree has no children to reject")
    if len(p) < draft.size + 1:
        raise InvalidDistribution(f"a {draft.size}-node tree needs {draft.size + 1} target "
                                  f"rows, got {len(p)}")
    qs = server_rows(method, draft, space)
    r = np.asarray(method.commit_row(np.asarray(p[node + 1], dtype=np.float32), space),
                   dtype=np.float32)
    for k in range(len(kids) - 1):
        r = next_row(r, qs[node][k], space)
    state = _reject_state(draft, node, r, qs)
    state.candidate_rounds = int(candidate_rounds)
    state.fallback_sent = bool(fallback_sent)
    return state


__all__ = [
    "DEFAULT_ROW_CODEC",
    "MAX_NODES",
    "PARENT_BYTES",
    "DeviceTree",
    "DraftTree",
    "RowsAt",
    "Siblings",
    "TreeShape",
    "TreeVerified",
    "check_tree",
    "check_tree_method",
    "device_state",
    "draft_tree",
    "draw_child",
    "next_row",
    "rebuild_tree_reject",
    "rejection_state",
    "residual",
    "rows_needed",
    "server_rows",
    "verify_tree",
]
