"""The device's draft model, kept in step with one generation in draft ids.

The edge state machine (:class:`~xcosd.protocol.edge.EdgeSession`) never runs a
model: when a round drafts it emits :class:`~xcosd.protocol.edge.DraftNeeded`, and
whoever drives it (the :class:`~xcosd.nodes.EdgeNode` in its worker thread, or the
in-process :class:`~xcosd.nodes.pump.Pump`) calls :meth:`Drafter.run` and hands the
result back with :meth:`~xcosd.protocol.edge.EdgeSession.drafted`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import InvalidDistribution, VocabError
from ..methods.base import Method, Space
from ..methods.round import draft_token
from ..methods.tli import restrict_kept_support, restrict_to_common
from ..methods.tree import DeviceTree, TreeShape, draft_tree
from ..models.base import LanguageModel, Session
from ..models.tree_scoring import rows_after
from ..protocol.edge import DraftNeeded
from ..sampling import SamplingParams, warp, warp_kept
from ..vocab import VocabMap

Drafts = tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]


def draft_prompt(model: LanguageModel, prompt: str) -> list[int]:
    """The prompt in draft ids. The draft only conditions on it, so a prompt the draft
    tokenizer cannot fully cover is split around the bytes it lacks (worse drafts,
    never a wrong output: the cloud tokenises the prompt for the target)."""
    if not prompt:
        return []
    try:
        return [int(i) for i in model.tokenize(prompt)]
    except VocabError:
        vocab = model.vocab
        out: list[int] = []
        for ch in prompt:
            with contextlib.suppress(VocabError):
                out.extend(vocab.encode_bytes(ch.encode("utf-8")))
        return out


#: one speculated draft: (target id, TLI row q, row sampled from, draft id)
Speculated = tuple[int, np.ndarray, np.ndarray, int]
#: speculation goes on while at least this share of the rounds that speculated
#: had a later round take some of it (after :data:`SPECULATION_WARMUP` of them);
#: below, one round in :data:`SPECULATION_PROBE` still tries
SPECULATION_MIN_HITS = 0.05
SPECULATION_WARMUP = 8
SPECULATION_PROBE = 16
#: rounds of that history one generation hands the next (older ones halved away)
SPECULATION_MEMORY = 64


def tli_row(row: np.ndarray, vmap: VocabMap, params: SamplingParams
            ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The TLI row (V_C order) of a draft row and, where the warpers kept few
    tokens, its support; where the warped draft puts no mass on V_C, the draft's
    V_C part warped instead (any proposal on V_C keeps the output exact); ``None``
    where that has none either."""
    try:
        if params.identity:  # no warper: what warp_kept would hand back as is
            return restrict_to_common(row, vmap.common_draft_index), None
        # the TLI vector restrict_to_common(warp(row)), from the kept set only
        return restrict_kept_support(warp_kept(row, params), vmap.common_draft_ids,
                                     vmap.draft_to_common)
    except InvalidDistribution:
        # The warped draft has no mass on V_C (greedy picked a draft-only
        # token, say): warp the draft's V_C part instead. Any proposal on V_C
        # keeps the output exact; this one keeps drafting.
        try:
            return warp(restrict_to_common(row, vmap.common_draft_index),
                        params), None
        except InvalidDistribution:
            return None


class Drafter:
    """One generation's draft-model session (pure compute, no I/O).

    **Speculation** (drafting while a verdict is in flight, :meth:`speculate`): the
    draft model goes on past the block just sent, as if the cloud would accept it
    whole and its bonus token be the next token the draft draws. The tokens it
    draws there wait in :attr:`pending`, past the model's committed ``length``.
    When the next round's edits arrive (:meth:`run`), the ones the verdict
    confirmed join the context and the ones after them become that round's first
    drafts; on any other verdict they are rolled back. Each was drawn from the TLI
    row of the context it now has, with the draft's own random numbers, so it is a
    draft like any other: keeping or dropping the chain by what the cloud answered
    (the past) leaves the output law exact, as the length policy's stops do.
    Where verdicts seldom take that path (sampling at T = 1 from a loose pair, say)
    :meth:`worth_speculating` says so, and the device stops spending the work.
    """

    def __init__(self, model: LanguageModel, vmap: VocabMap, params: SamplingParams,
                 prompt: str) -> None:
        self.model = model
        self.vmap = vmap
        self.params = params
        self.prompt_ids = draft_prompt(model, prompt)
        self.session: Session | None = None
        #: draft ids in the model's context (speculated tokens not counted)
        self.length = len(self.prompt_ids)
        #: speculated drafts in the model's context after ``length``, in order
        self.pending: list[Speculated] = []
        #: tokens speculated, and those that became drafts of a later round
        self.speculated = 0
        self.reused = 0
        #: rounds that speculated, those a later round took some of it from, and
        #: rounds passed over since speculation stopped paying
        self.spec_rounds = 0
        self.spec_hits = 0
        self._passed = 0
        #: context tokens computed in the wait of rounds that drafted nothing
        self.caught_up = 0
        #: prompt tokens in the model's cache after :meth:`prefill` (0: not run)
        self.prefilled = 0

    def _start(self) -> Session:
        if self.session is None:
            self.session = self.model.start(self.prompt_ids)
        return self.session

    def run(self, need: DraftNeeded) -> Drafts | DeviceTree:
        """Apply the context edits ``need`` carries, then draft up to ``need.length``
        tokens: ``(target ids, TLI rows q, rows sampled from)``. Speculated tokens the
        edits confirm come first (see the class docstring). With a ``shape``, draft
        that tree instead (:meth:`tree`). Hand the result to
        :meth:`~xcosd.protocol.edge.EdgeSession.take`.

        Stops early when the draft puts no mass on V_C (nothing can be drafted).
        """
        self._start()
        ready = self._edit(need.drop, need.append)
        es = need.session
        if need.shape is not None:
            if ready:  # speculated past the last block: a tree starts at the context
                assert self.session is not None
                self.model.rollback(self.session, self.length)
            return self.tree(need.shape, es.method, es.space, es.rng, need.row_codec,
                             need.distinct)
        return self.draft(need.length, es.method, es.space, es.rng, need.stop_below, ready)

    def uncached_prompt(self) -> int:
        """Prompt tokens the draft model would compute for this generation: all of
        them, less a cached prefix where the model keeps one (``cached_prefix``)."""
        cached = getattr(self.model, "cached_prefix", None)
        n = len(self.prompt_ids)
        return n - (cached(self.prompt_ids) if cached is not None and n else 0)

    def prefill(self) -> None:
        """Compute the prompt now (in the wait of round 0, which drafts nothing: see
        ``EdgeSession.draft_later``), so round 1 drafts at once."""
        session = self._start()
        self.model.score([(session, [])])
        self.prefilled = session.cached

    def catch_up(self, drop: int, append: list[int]) -> None:
        """Apply context edits now and compute them (the model's cache takes the new
        tokens), so the next :meth:`run` starts from an evaluated context: done in
        the wait of a round that drafted nothing, where the edge's core is idle. A
        speculation still pending is given up (it drafted past a context these
        edits have moved on from)."""
        self._start()
        self._edit(drop, append)
        if append:
            assert self.session is not None
            self.model.score([(self.session, [])])
        self.caught_up += len(append)

    def tree(self, shape: TreeShape, method: Method, space: Space, rng: np.random.Generator,
             row_codec: str | None = None, distinct: bool = True) -> DeviceTree:
        """Draft a tree of ``shape`` at the model's context, which is left as it was:
        a depth's rows in one call (:func:`~xcosd.models.tree_scoring.rows_after`: one
        forward for a model with a tree scorer), each node's children drawn from its
        TLI row (``xcosd.methods.tree.draft_tree``)."""
        session = self._start()
        spell = self.vmap.target_to_draft

        def rows_at(nodes: list[int], ids: list[int]) -> list[np.ndarray]:
            spelled = [[int(spell[t])] for t in ids]
            rows = rows_after(self.model, session, shape.parents, spelled, nodes)
            # a row without mass on V_C: any proposal on V_C keeps the law, and a
            # tree's shape is fixed, so the uniform one
            uniform = np.full(space.n_common, 1.0 / space.n_common, dtype=np.float32)
            tli = [tli_row(row, self.vmap, self.params) for row in rows]
            return [uniform if got is None else got[0] for got in tli]

        return draft_tree(method, shape, rows_at, space, rng, row_codec, distinct=distinct)

    def _edit(self, drop: int, append: list[int]) -> list[Speculated]:
        """Bring the committed context in step with the edits; the speculated
        drafts that remain valid (those after the tokens the edits confirm)."""
        assert self.session is not None
        spec, self.pending = self.pending, []
        m = min(len(append), len(spec))
        self.spec_rounds += bool(spec)
        if spec and drop == 0 and [s[3] for s in spec[:m]] == list(append[:m]):
            # the verdict took the speculated path: its first m tokens are context,
            # the ones after them drafts at the new context
            self.length += m
            if m < len(spec):
                self.spec_hits += 1
                return spec[m:]
            append = append[m:]
        # else edits there are (none would have matched), and the rollback to the
        # committed context below takes the speculated tokens out too
        if drop or append:
            self.length -= drop
            self.model.rollback(self.session, self.length)
            if append:
                self.model.append(self.session, append)
                self.length += len(append)
        return []

    @property
    def record(self) -> tuple[int, int]:
        """How often this generation speculated and was paid (rounds, hits), the
        older half forgotten past :data:`SPECULATION_MEMORY` rounds: what the node's
        next generation with the same method and warpers starts from
        (:meth:`carry`), since whether speculation pays is the pair's and the
        sampling's nature, not one generation's."""
        rounds, hits = self.spec_rounds, self.spec_hits
        while rounds > SPECULATION_MEMORY:
            rounds, hits = rounds // 2, hits // 2
        return rounds, hits

    def carry(self, record: tuple[int, int]) -> None:
        """Start from an earlier generation's :attr:`record`."""
        self.spec_rounds, self.spec_hits = record

    def worth_speculating(self) -> bool:
        """Whether to speculate this round: yes while few rounds have, or while
        enough of them paid; else once every :data:`SPECULATION_PROBE` rounds."""
        if (self.spec_rounds < SPECULATION_WARMUP
                or self.spec_hits >= SPECULATION_MIN_HITS * self.spec_rounds):
            return True
        self._passed += 1
        if self._passed >= SPECULATION_PROBE:
            self._passed = 0
            return True
        return False

    def speculate(self, n: int, method: Method, space: Space, rng: np.random.Generator,
                  stop: Callable[[], bool] | None = None) -> int:
        """Draft up to ``n`` tokens past the context (the block in flight) into
        :attr:`pending`, checking ``stop()`` before each; how many were drawn."""
        self._start()
        k = 0
        while k < n and not (stop is not None and stop()):
            got = self._step(method, space, rng)
            if got is None:
                break
            self.pending.append(got)
            k += 1
        self.speculated += k
        return k

    def _step(self, method: Method, space: Space,
              rng: np.random.Generator) -> Speculated | None:
        """Draw one token at the model's context and add it there; ``None`` when
        the draft puts no mass on V_C."""
        assert self.session is not None
        row = self.model.score([(self.session, [])])[0][-1]
        got = tli_row(row, self.vmap, self.params)
        if got is None:
            return None
        q, support = got
        tid, qr = draft_token(method, q, space, rng, support)
        did = int(self.vmap.target_to_draft[tid])
        self.model.append(self.session, [did])
        return tid, q, qr, did

    def draft(self, d: int, method: Method, space: Space, rng: np.random.Generator,
              stop_below: float = 0.0, ready: Sequence[Speculated] = ()) -> Drafts:
        """Draft up to ``d`` tokens at the model's current context (see :meth:`run`),
        ending after a token drawn with probability below ``stop_below``: it is kept
        (dropping a drawn token for its value would bias the output), only the next
        ones are not drafted. ``ready``: speculated drafts already in the model's
        context, taken first (those not taken are rolled back)."""
        self._start()
        assert self.session is not None
        ids: list[int] = []
        q_raw: list[np.ndarray] = []
        q_rows: list[np.ndarray] = []
        # the speculated drafts first, then fresh ones (drawn only when asked for)
        fresh = iter(lambda: self._step(method, space, rng), None)
        for tid, q, qr, _ in itertools.chain(ready, fresh) if d > 0 else ():
            ids.append(tid)
            q_raw.append(q)
            q_rows.append(qr)
            if len(ids) >= d or (stop_below > 0.0 and qr[space.to_common[tid]] < stop_below):
                break
        if len(ids) < len(ready):
            self.model.rollback(self.session, self.length + len(ids))
        self.reused += min(len(ids), len(ready))
        self.length += len(ids)
        return np.array(ids, dtype=np.int64), q_raw, q_rows

    def end(self) -> None:
        if self.session is not None:
            self.model.end(self.session)
            self.session = None
