"""Scoring a batch: the compute the cloud's worker thread runs for a batch of
rounds, as plain functions with no event loop and no clock, so that the
:class:`~xcosd.nodes.scheduler.Scheduler`, the sans-I/O :class:`~xcosd.nodes.pump.Pump`
and the benchmarks run exactly the same code.

A batch is scored in two halves that the scheduler runs apart: :func:`score_rows`
(the model: each session's context brought in step, one call for the whole batch,
no randomness drawn) in the worker thread, then :func:`verify_scored` per session
(the method's verification: :func:`~xcosd.methods.round.verify_round`, a pure
function of the round's snapshot and its rows) on the event loop as the verdicts
stream out. Neither half reads the live protocol session: a request carries its
round as plain data (``ScoreNeeded.round``) and its model state apart
(``ScoreNeeded.model``). :func:`score_batch` runs both in one go.
:func:`score_on_device` keeps the rows on the target's accelerator and verifies
them there (:mod:`xcosd.accel`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ModelError, XcosdError
from ..methods.round import Round, RoundOutcome, failed, verify_round
from ..models.base import LanguageModel
from ..models.tree_scoring import score_tree
from ..protocol.cloud import ScoreNeeded
from ..sampling import WHOLE_ROW_MAX, SamplingParams, warp

log = logging.getLogger(__name__)

#: the most row entries (rows x ids) of a batch warped in one call (warp_together):
#: about a millisecond of top-p, so verification still yields the loop every
#: VERIFY_SLICE_S or so
WARP_CHUNK = 1 << 17

def score_batch(model: LanguageModel, batch: Sequence[ScoreNeeded]) -> list[RoundOutcome]:
    """Bring each session's model context in step, score all of them in one call,
    verify each round (warping the rows it reads): :func:`score_rows`, then
    :func:`verify_scored` for each session, in one go (sans-I/O drivers and
    benchmarks; the :class:`Scheduler` runs the two halves apart).

    Isolation: only a failure of the batched model call itself is retried, session
    by session (the model call consumes no randomness). Verification runs exactly
    once per session, after scoring: an exception there (``MemoryError``
    included) fails that session alone, and its batch-mates draw their random
    numbers once, as if it had not been in their batch.
    """
    scored = score_rows(model, batch)
    return [verify_scored(r.round, x, w)
            for r, x, w in zip(batch, scored, warp_together(batch, scored), strict=True)]


#: one session's share of a scored batch: its rows, or the outcome that failed it
Scored = np.ndarray | RoundOutcome


def verify_scored(rd: Round, scored: Scored,
                  warped: np.ndarray | None = None) -> RoundOutcome:
    """Round ``rd``'s outcome from its share of :func:`score_rows` (``warped``: those
    rows warped already, by :func:`warp_together`)."""
    return _verify(rd, scored, warped) if isinstance(scored, np.ndarray) else scored


def warp_together(batch: Sequence[ScoreNeeded], scored: Sequence[Scored]
                  ) -> list[np.ndarray | None]:
    """The rows of a scored batch's sessions warped in one call per sampling setting
    (the scheduler hands it runs of sessions of bounded size, :func:`warp_chunk_end`),
    where that is cheaper than warping each row as verification first reads it: short
    float32 rows (a vocabulary of at most :data:`~xcosd.sampling.WHOLE_ROW_MAX` ids),
    a warper that changes them and is not greedy. Top-p, the costly one, then sorts
    every row of the batch at once (:func:`~xcosd.sampling.warp` on the stacked rows)
    instead of one row at a time: at 256 ids about 3 us a row instead of 11, which
    pays for the rows after a rejection that nothing reads. A row's warp is a pure
    function of the row, so the verdicts, and the random numbers drawn, are the same.

    ``None`` where a session's rows are left to be warped as read: nothing to warp,
    long rows (a band search a row, read ones only), a failed share, or a setting
    whose block would not warp (a row with no mass: the sessions that read it fail
    alone, as they do when warping as they read)."""
    out: list[np.ndarray | None] = [None] * len(batch)
    groups: dict[SamplingParams, list[tuple[int, np.ndarray]]] = {}
    for i, (req, x) in enumerate(zip(batch, scored, strict=True)):
        params = req.round.params
        if (params.identity or params.greedy or not isinstance(x, np.ndarray)
                or x.dtype != np.float32 or x.ndim != 2
                or not 0 < x.shape[1] <= WHOLE_ROW_MAX):
            continue
        groups.setdefault(params, []).append((i, x))
    for params, members in groups.items():
        if len({x.shape[1] for _, x in members}) > 1:
            continue  # sessions of different vocabularies: each warps its own
        try:
            warped = warp(np.concatenate([x for _, x in members]), params)
        except Exception:  # a row without mass (say): warped as read, failing alone
            continue
        start = 0
        for i, x in members:
            out[i] = warped[start:start + x.shape[0]]
            start += x.shape[0]
    return out


def warp_chunk_end(scored: Sequence[Scored], start: int) -> int:
    """Where the run of sessions from ``start`` that :func:`warp_together` takes in one
    call ends: as many as keep it within :data:`WARP_CHUNK` row entries (one at
    least), so a large batch of rows is not one long call on the event loop."""
    size, end = 0, start
    while end < len(scored):
        x = scored[end]
        n = x.size if isinstance(x, np.ndarray) else 0
        if end > start and size + n > WARP_CHUNK:
            break
        size += n
        end += 1
    return end


def score_rows(model: LanguageModel, batch: Sequence[ScoreNeeded],
               score: Callable[[list[tuple[Any, list[int]]]], Sequence[Any]] | None = None,
               tree: Callable[[Any, list[int], list[int]], Any] | None = None) -> list[Any]:
    """The model half of :func:`score_batch`: each session's context brought in step
    and every session scored in one call; per session its rows (float32, owned by
    the caller: they are read after the next call has started), or the outcome of a
    failure that session alone had. No randomness is drawn here. ``score``: the call
    that scores (``model.score`` by default; ``model.score_tensors`` keeps the rows on
    the target's device, :func:`score_on_device`); ``tree``: the call that scores a
    draft tree's request (:func:`~xcosd.models.tree_scoring.score_tree` by default;
    ``model.score_tree_tensors`` on the device)."""
    if score is None:
        score = model.score
    if tree is None:
        def tree(handle: Any, parents: list[int], ids: list[int]) -> Any:
            return score_tree(model, handle, parents, ids)
    out: dict[int, Any] = {}
    prepared: list[tuple[int, ScoreNeeded]] = []
    for i, req in enumerate(batch):
        try:
            _prepare(model, req)
            if req.parents is None:
                prepared.append((i, req))
            else:  # a draft tree: its own call, in one forward where the model can
                out[i] = tree(req.model.handle, req.parents, req.new_ids)
        except Exception as e:  # the model refused this session's context or tree
            out[i] = failed_outcome(e)
    rows: dict[int, Any] = {}
    if prepared:
        try:
            got = score([(r.model.handle, r.new_ids) for _, r in prepared])
            if len(got) != len(prepared):
                raise ModelError(f"the model returned {len(got)} results for "
                                 f"{len(prepared)} sessions")
            rows = {i: rr for (i, _), rr in zip(prepared, got, strict=True)}
        except Exception:
            log.exception("batched score failed; retrying %d sessions one by one",
                          len(prepared))
            rows = {}
            for i, r in prepared:
                try:
                    _rewind(model, r)
                    rows[i] = score([(r.model.handle, r.new_ids)])[0]
                except Exception as e:
                    out[i] = failed_outcome(e)
    out.update(rows)
    return [out[i] for i in range(len(batch))]


def verifies_on_device(model: Any, want: bool | None = None) -> bool:
    """Whether a cloud verifies next to ``model``'s logits (:func:`score_on_device`).
    ``want=None`` decides: yes when the model keeps its rows on an accelerator (it has
    ``score_tensors`` and a non-CPU ``device``), where copying every row to the host
    and warping it in numpy would cost more than the target's forward; on the CPU the
    numpy path stays the default. ``True`` asks for it (a model without
    ``score_tensors`` is a :class:`ValueError`)."""
    has = callable(getattr(model, "score_tensors", None))
    if want is None:
        dev = getattr(model, "device", None)
        return has and dev is not None and getattr(dev, "type", str(dev)) != "cpu"
    if want and not has:
        raise ValueError(f"{model!r} keeps no rows on a device (no score_tensors)")
    return bool(want)


def score_on_device(model: Any, batch: Sequence[ScoreNeeded]) -> list[RoundOutcome]:
    """:func:`score_batch` with the rows kept on the target's device: the model's
    ``score_tensors`` scores the batch, :func:`xcosd.accel.verify_batch` verifies every
    session it supports in one pass, and only a session it does not (a lossy codec on
    ``p``) has its rows copied to the host for the numpy path."""
    from ..accel import supported, verify_batch

    scored = score_rows(model, batch, model.score_tensors,
                        getattr(model, "score_tree_tensors", None))
    out: list[RoundOutcome | None] = [x if isinstance(x, RoundOutcome) else None
                                      for x in scored]
    on_device: list[int] = []
    rounds: list[Round] = []
    for i, (req, x) in enumerate(zip(batch, scored, strict=True)):
        if out[i] is not None:
            continue
        rd = req.round
        if isinstance(x, np.ndarray):  # a tree's rows a model scored on the host
            out[i] = _verify(rd, x)
        elif not supported(rd.method):
            out[i] = _verify(rd, x.float().cpu().numpy())
        else:
            rounds.append(rd)
            on_device.append(i)
    if rounds:
        got = verify_batch(rounds, [scored[i] for i in on_device])
        for i, o in zip(on_device, got, strict=True):
            out[i] = o
    return [o if o is not None else failed_outcome(RuntimeError("unverified")) for o in out]


def _verify(rd: Round, rows: np.ndarray, warped: np.ndarray | None = None) -> RoundOutcome:
    """One round's verification; whatever it raises fails that session only."""
    try:
        return verify_round(rd, rows, warped)
    except Exception as e:  # MemoryError, a method's bug: this session's problem
        log.exception("verifying round %d failed", rd.round)
        return failed(e if isinstance(e, XcosdError) else XcosdError(
            f"verifying this round failed: {type(e).__name__}: {e}", code="internal"))


def _prepare(model: LanguageModel, req: ScoreNeeded) -> None:
    slot = req.model
    if req.start_ids is not None:
        slot.handle = model.start(req.start_ids)
        # the peer's: a model that keeps ended sessions' caches shares its room
        # fairly between peers (xcosd/models/prefix_cache.py)
        slot.handle.tenant = slot.tenant
    model.rollback(slot.handle, req.keep)
    if req.append:
        model.append(slot.handle, req.append)


def _rewind(model: LanguageModel, req: ScoreNeeded) -> None:
    model.rollback(req.model.handle, req.keep + len(req.append))


def failed_outcome(e: BaseException) -> RoundOutcome:
    """The outcome of a round whose scoring failed: the session fails with ``e``
    (a :class:`~xcosd.errors.ModelError` unless it is typed already)."""
    return failed(e if isinstance(e, XcosdError) else ModelError(f"target model failed: {e}"))


def request_rows(req: ScoreNeeded) -> int:
    """What a request costs a batch: the rows the target scores and the session
    verifies (its drafted tokens plus one)."""
    return len(req.new_ids) + 1
