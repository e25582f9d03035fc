"""The cloud's pipelined batching scheduler.

Every session's "needs scoring" request (:class:`~xcosd.protocol.ScoreNeeded`)
goes into one FIFO queue. The scheduler takes the oldest request, waits up to
``max_wait_s`` for more (never past ``max_batch``), and runs the whole batch as
**one** :meth:`LanguageModel.score` call plus each session's verification in a
single worker thread, so the event loop keeps moving bytes for every other session
while the target computes (network I/O and compute overlap; while batch *k*
computes, batch *k + 1* fills up).

* Fairness: strict FIFO by arrival; a session has at most one request queued (the
  protocol allows one round in flight), so no session can crowd others out.
* Backpressure: :meth:`Scheduler.full` tells the node to refuse new work with a
  ``busy`` error once ``max_queue`` requests wait.
* Cancellation: a closed session's queued request (the protocol closed it) is
  skipped when batches form, in O(1) however long the queue is; a result for a
  session that closed while its batch ran is discarded by the
  state machine, and the model state is freed in the worker thread
  (:meth:`Scheduler.free`), never concurrently with a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelError, XcosdError
from ..methods.base import TokenReply
from ..models.base import LanguageModel
from ..protocol.cloud import CloudSession, RoundOutcome, ScoreNeeded
from ..sampling import warp_batch

log = logging.getLogger(__name__)


def score_batch(model: LanguageModel, batch: Sequence[ScoreNeeded]) -> list[RoundOutcome]:
    """Bring each session's model context in step, score all of them in one call,
    warp all their rows in one call, verify each round. Runs in the worker thread (or
    inline in sans-I/O tests).

    A failure of the whole batched call is retried per session, so one bad session
    cannot fail its batch-mates.
    """
    prepared: list[ScoreNeeded] = []
    out: dict[int, RoundOutcome] = {}
    for i, req in enumerate(batch):
        try:
            _prepare(model, req)
            prepared.append(req)
        except Exception as e:  # the model refused this session's context
            out[i] = _failed(e)
    index = {id(r): i for i, r in enumerate(batch)}
    if prepared:
        try:
            rows = model.score([(r.session.handle, r.new_ids) for r in prepared])
            warped = _warp_all(prepared, rows)
            for r, rr, p in zip(prepared, rows, warped, strict=True):
                out[index[id(r)]] = r.session.verify_rows(rr, p)
        except Exception:
            log.exception("batched score failed; retrying %d sessions one by one",
                          len(prepared))
            for r in prepared:
                try:
                    _rewind(model, r)
                    rows1 = model.score([(r.session.handle, r.new_ids)])
                    out[index[id(r)]] = r.session.verify_rows(rows1[0])
                except Exception as e:
                    out[index[id(r)]] = _failed(e)
    return [out[i] for i in range(len(batch))]


def _warp_all(prepared: Sequence[ScoreNeeded], rows: Sequence[np.ndarray]
              ) -> Sequence[np.ndarray | None]:
    """Every session's rows warped with its own sampling parameters, in one
    :func:`~xcosd.sampling.warp_batch` call for the whole batch. Rows one session's
    verification would refuse anyway (wrong shape, no mass) make the call fail; then
    each session warps its own rows and reports its own error."""
    try:
        return warp_batch([np.asarray(rr, dtype=np.float32) for rr in rows],
                          [r.session.params for r in prepared])
    except (XcosdError, ValueError, IndexError):
        return [None] * len(prepared)


def _prepare(model: LanguageModel, req: ScoreNeeded) -> None:
    sess = req.session
    if req.start_ids is not None:
        sess.handle = model.start(req.start_ids)
    model.rollback(sess.handle, req.keep)
    if req.append:
        model.append(sess.handle, req.append)


def _rewind(model: LanguageModel, req: ScoreNeeded) -> None:
    model.rollback(req.session.handle, req.keep + len(req.append))


def _failed(e: BaseException) -> RoundOutcome:
    err = e if isinstance(e, XcosdError) else ModelError(f"target model failed: {e}")
    return RoundOutcome(0, TokenReply(0), None, err)


@dataclass
class BatchStats:
    """What the scheduler measured, for :meth:`CloudNode.stats` and Prometheus."""

    batches: int = 0
    requests: int = 0
    cancelled: int = 0
    busy_refusals: int = 0
    compute_s: float = 0.0
    queue_wait_s: float = 0.0
    #: batch size -> number of batches of that size
    batch_sizes: dict[int, int] = field(default_factory=dict)
    compute_times: list[float] = field(default_factory=list)
    queue_waits: list[float] = field(default_factory=list)

    def record(self, size: int, compute: float, waits: list[float]) -> None:
        self.batches += 1
        self.requests += size
        self.compute_s += compute
        self.queue_wait_s += sum(waits)
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        # bounded samples for histograms
        if len(self.compute_times) < 100_000:
            self.compute_times.append(compute)
            self.queue_waits.extend(waits)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches, "requests": self.requests, "cancelled": self.cancelled,
            "busy_refusals": self.busy_refusals,
            "mean_batch_size": self.requests / self.batches if self.batches else 0.0,
            "batch_size_histogram": dict(sorted(self.batch_sizes.items())),
            "compute_s": self.compute_s,
            "mean_compute_s": self.compute_s / self.batches if self.batches else 0.0,
            "mean_queue_wait_s": self.queue_wait_s / self.requests if self.requests else 0.0,
        }


Deliver = Callable[[CloudSession, RoundOutcome], Awaitable[None]]


class Scheduler:
    """One queue, one worker thread, batches of up to ``max_batch``."""

    def __init__(self, model: LanguageModel, deliver: Deliver, *, max_batch: int = 32,
                 max_wait_s: float = 0.002, max_queue: int = 1024) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.deliver = deliver
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.stats = BatchStats()
        self._queue: deque[ScoreNeeded] = deque()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="xcosd-verify")
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._to_free: list[CloudSession] = []
        self._current: Future[Any] | None = None

    # -- node side -------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="xcosd-scheduler")

    @property
    def queued(self) -> int:
        return len(self._queue)

    def full(self) -> bool:
        return len(self._queue) >= self.max_queue

    def submit(self, req: ScoreNeeded) -> None:
        req.enqueued_at = time.perf_counter()
        self._queue.append(req)
        self._wake.set()

    def free(self, session: CloudSession) -> None:
        """Free the model state of a finished session. The worker thread does it
        before its next batch, so it never races a batch that still uses it."""
        # The handle is read in the worker, not here: on a first round the worker
        # creates it during the batch, and reading it now would miss (and leak) it.
        self._to_free.append(session)
        self._wake.set()

    def _free_pending(self) -> None:
        while self._to_free:
            session = self._to_free.pop()
            handle, session.handle = session.handle, None
            if handle is None:
                continue
            try:
                self.model.end(handle)
            except Exception:
                log.exception("freeing a model session failed")

    def _job(self, batch: list[ScoreNeeded]) -> list[RoundOutcome]:
        self._free_pending()
        return score_batch(self.model, batch) if batch else []

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in self._queue:
            self.free(req.session)
        self._queue.clear()
        # wait for a batch that is still computing, so no thread outlives the node
        if self._current is not None and not self._current.done():
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self._current)
        await self._in_worker(self._free_pending)
        self._executor.shutdown(wait=True)  # the worker is idle: this returns at once

    async def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the worker thread; the future is kept so ``close`` can wait."""
        self._current = self._executor.submit(fn, *args)
        return await asyncio.wrap_future(self._current)

    # -- the loop ------------------------------------------------------------------

    async def _take(self) -> list[ScoreNeeded]:
        while not self._queue:
            if self._to_free:
                return []
            self._wake.clear()
            await self._wake.wait()
        if len(self._queue) < self.max_batch and self.max_wait_s > 0:
            deadline = self._queue[0].enqueued_at + self.max_wait_s
            while len(self._queue) < self.max_batch:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), left)
        batch: list[ScoreNeeded] = []
        while self._queue and len(batch) < self.max_batch:
            req = self._queue.popleft()
            if req.session.closed:
                self.stats.cancelled += 1
                continue
            batch.append(req)
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._take()
            if not batch:
                await self._in_worker(self._free_pending)
                continue
            now = time.perf_counter()
            waits = [now - r.enqueued_at for r in batch]
            t0 = time.perf_counter()
            outcomes = await self._in_worker(self._job, batch)
            compute = time.perf_counter() - t0
            self.stats.record(len(batch), compute, waits)
            for req, outcome in zip(batch, outcomes, strict=True):
                outcome.compute_s = compute
                try:
                    await self.deliver(req.session, outcome)
                except Exception:
                    log.exception("delivering a verdict failed")
