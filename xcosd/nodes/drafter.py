"""The device's draft model, kept in step with one generation in draft ids.

The edge state machine (:class:`~xcosd.protocol.edge.EdgeSession`) never runs a
model: when a round drafts it emits :class:`~xcosd.protocol.edge.DraftNeeded`, and
whoever drives it (the :class:`~xcosd.nodes.EdgeNode` in its worker thread, or the
in-process :class:`~xcosd.nodes.pump.Pump`) calls :meth:`Drafter.run` and hands the
result back with :meth:`~xcosd.protocol.edge.EdgeSession.drafted`.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..errors import InvalidDistribution, VocabError
from ..methods.base import Method, Space
from ..methods.round import draft_token
from ..methods.tli import restrict_kept_support, restrict_to_common
from ..models.base import LanguageModel, Session
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


class Drafter:
    """One generation's draft-model session (pure compute, no I/O)."""

    def __init__(self, model: LanguageModel, vmap: VocabMap, params: SamplingParams,
                 prompt: str) -> None:
        self.model = model
        self.vmap = vmap
        self.params = params
        self.prompt_ids = draft_prompt(model, prompt)
        self.session: Session | None = None
        #: draft ids in the model's context
        self.length = len(self.prompt_ids)

    def run(self, need: DraftNeeded) -> Drafts:
        """Apply the context edits ``need`` carries, then draft up to ``need.length``
        tokens: ``(target ids, TLI rows q, rows sampled from)``.

        Stops early when the draft puts no mass on V_C (nothing can be drafted).
        """
        if self.session is None:
            self.session = self.model.start(self.prompt_ids)
        if need.drop or need.append:
            self.length -= need.drop
            self.model.rollback(self.session, self.length)
            if need.append:
                self.model.append(self.session, need.append)
                self.length += len(need.append)
        es = need.session
        return self.draft(need.length, es.method, es.space, es.rng, need.stop_below)

    def draft(self, d: int, method: Method, space: Space, rng: np.random.Generator,
              stop_below: float = 0.0) -> Drafts:
        """Draft up to ``d`` tokens at the model's current context (see :meth:`run`),
        ending after a token drawn with probability below ``stop_below``: it is kept
        (dropping a drawn token for its value would bias the output), only the next
        ones are not drafted."""
        if self.session is None:
            self.session = self.model.start(self.prompt_ids)
        ids: list[int] = []
        q_raw: list[np.ndarray] = []
        q_rows: list[np.ndarray] = []
        cd = self.vmap.common_draft_ids
        to_common = self.vmap.draft_to_common
        for _ in range(d):
            row = self.model.score([(self.session, [])])[0][-1]
            try:
                # the TLI vector restrict_to_common(warp(row)), from the kept set only
                q, support = restrict_kept_support(warp_kept(row, self.params), cd,
                                                   to_common)
            except InvalidDistribution:
                # The warped draft has no mass on V_C (greedy picked a draft-only
                # token, say): warp the draft's V_C part instead. Any proposal on V_C
                # keeps the output exact; this one keeps drafting.
                try:
                    q, support = warp(restrict_to_common(row, cd), self.params), None
                except InvalidDistribution:
                    break
            tid, qr = draft_token(method, q, space, rng, support)
            ids.append(tid)
            q_raw.append(q)
            q_rows.append(qr)
            self.model.append(self.session, [int(self.vmap.target_to_draft[tid])])
            if stop_below > 0.0 and qr[space.to_common[tid]] < stop_below:
                break
        self.length += len(ids)
        return np.array(ids, dtype=np.int64), q_raw, q_rows

    def end(self) -> None:
        if self.session is not None:
            self.model.end(self.session)
            self.session = None
