"""The cloud's pipelined batching scheduler.

Every session's "needs scoring" request (:class:`~xcosd.protocol.ScoreNeeded`)
goes into the queue of its **peer** (one sub-queue per connection). The scheduler
waits for a request, then up to ``max_wait_s`` for more (never past ``max_batch``
requests or ``max_batch_tokens`` rows, and not at all once every live session has
a request queued: ``live`` counts them, with the places the merge policy keeps for
a closed-loop peer's next session, and nobody else could join, so waiting would
only delay a lone device's every round), and runs the whole batch as **one**
:meth:`LanguageModel.score` call in a single worker thread, so the event loop
keeps moving bytes for every other session while the target computes (network
I/O and compute overlap; while batch *k* computes, batch *k + 1* fills up, and
when requests are queued as batch *k* finishes, batch *k + 1* starts in the
thread before *k* is verified, unless it should wait for *k*'s sessions: see
``merge`` below).

* Verification streams: the loop verifies a scored batch session by session and
  sends each verdict as soon as it is drawn, so the first devices are drafting
  their next round while the last sessions are verified, and the thread (the
  GPU) is free for the next call meanwhile instead of waiting for the CPU: a
  device's wait for its verdict no longer includes its batch-mates'
  verification. A batch whose verification takes long (vocabulary-sized rows)
  yields the loop a turn every :data:`VERIFY_SLICE_S`. ``stream=False`` keeps
  the older order (the thread verifies the whole batch after its call).

* Merging (``merge``, :class:`~xcosd.nodes.merging.MergePolicy`): when the sessions
  just answered come back sooner than a call's measured fixed cost, the queued
  rounds wait for them (at most that cost after the verdicts went out), so that
  closed-loop devices do not split into two groups that take turns in half
  batches, each paying the fixed cost.
* Fairness: a batch takes requests **round-robin across peers** (one per peer per
  pass; the rotation carries over to the next batch), so a peer with many
  sessions cannot fill every batch and push another peer's round behind its own;
  within a peer, first come first served. ``max_batch_tokens`` bounds the rows
  (draft tokens + 1) one batch scores, so the batch a small request waits behind
  is bounded in cost however long other peers' drafts are; a single request
  larger than the bound still runs, alone.
* Backpressure: :meth:`Scheduler.full` tells the node to refuse new work with a
  ``busy`` error once ``max_queue`` requests wait.
* Cancellation: a closed session's queued request (the protocol closed it) is
  skipped when batches form, in O(1) however long the queue is; a result for a
  session that closed while its batch ran is discarded by the
  state machine, and the model state is freed in the worker thread
  (:meth:`Scheduler.free`), never concurrently with a batch.
* Other work for the worker thread (the node's expensive follow-up requests) goes
  through :meth:`Scheduler.run`, between batches, never beside one.
* Cheap batches run on the event loop: handing a batch to the thread costs two
  hand-offs of the interpreter lock, and while the loop is busy each can wait a
  whole switch interval (5 ms), more than a batch of a near-free model costs; and
  a batch that computes in Python holds the lock in the thread anyway. Every
  batch is timed, where it runs; the next one runs inline when the thread is idle
  (so never beside its work), the last :data:`INLINE_WINDOW` batches mostly
  computed (their median share of CPU time is at least :data:`INLINE_CPU_SHARE`:
  a model that waits, on a GPU or a sleep, overlaps with the network in the
  thread) and, by the median of what they say of its cost (as much as one of
  them, for fewer rows: a fixed cost does not shrink; proportionally more for
  more rows), it should take at most ``inline_max_s``. A real model, whose
  batches take milliseconds or wait on a device, keeps the loop free for the
  network; a larger batch of a cheap one goes to the thread. Freeing finished
  sessions' model state follows the same rule.
* Stopping is bounded: :meth:`Scheduler.close` waits at most ``timeout`` for a
  batch still computing, then leaves the thread to finish it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import XcosdError
from ..models.base import LanguageModel
from ..protocol.cloud import CloudSession, ModelSlot, RoundOutcome, ScoreNeeded
from .merging import MergePolicy
from .scoring import (
    Scored,
    failed_outcome,
    request_rows,
    score_batch,
    score_on_device,
    score_rows,
    verifies_on_device,
    verify_scored,
    warp_chunk_end,
    warp_together,
)

log = logging.getLogger(__name__)

#: how long :meth:`Scheduler.close` waits, by default, for work still in the thread
CLOSE_WAIT_S = 2.0
#: a batch expected to take at most this long runs on the event loop (the module
#: docstring says when): the interpreter's switch interval, what each of a thread
#: batch's two hand-offs can cost while the loop is busy
INLINE_MAX_S = 0.005
#: and only while at least this share of a batch's time is CPU time of the thread
#: running it: a batch that mostly waits (a GPU, a sleep) overlaps with the
#: network in a thread
INLINE_CPU_SHARE = 0.5
#: recent batches whose costs predict the next one's
INLINE_WINDOW = 8
#: verifying a batch's sessions on the loop, it yields a turn this often
VERIFY_SLICE_S = 0.002
#: a batch whose sessions have waited at least this long since it was launched (its
#: call, and the loop's turn to verify it) hands its first verdict over at once
#: (:meth:`Scheduler._verify_and_deliver`)
FIRST_TURN_AFTER_S = 0.001
#: the longest the loop blocks, launching a batch into the idle worker thread, for
#: the thread to start it (see :meth:`Scheduler._launch`)
HANDOFF_MAX_S = 0.001


@dataclass
class BatchStats:
    """What the scheduler measured, for :meth:`CloudNode.stats` and Prometheus.

    Totals only, unless ``keep_waits``: then also every request's queue wait, in
    the order its batch ran (a benchmark's own cloud cuts its measured window out
    of them afterwards). A server keeps none: one float per round served is memory
    that grows for as long as it runs."""

    batches: int = 0
    requests: int = 0
    cancelled: int = 0
    busy_refusals: int = 0
    compute_s: float = 0.0
    queue_wait_s: float = 0.0
    #: batch size -> number of batches of that size
    batch_sizes: dict[int, int] = field(default_factory=dict)
    #: whether :attr:`queue_waits` is kept
    keep_waits: bool = False
    queue_waits: list[float] = field(default_factory=list)

    def record(self, size: int, compute: float, waits: list[float]) -> None:
        self.batches += 1
        self.requests += size
        self.compute_s += compute
        self.queue_wait_s += sum(waits)
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        if self.keep_waits:
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


#: hands a verdict to the node: a plain call (the cloud's) or a coroutine to await
Deliver = Callable[[CloudSession, RoundOutcome], Awaitable[None] | None]


class Scheduler:
    """Per-peer queues, one worker thread, batches of up to ``max_batch`` requests
    and ``max_batch_tokens`` rows (``None``: no bound on rows)."""

    def __init__(self, model: LanguageModel, deliver: Deliver, *, max_batch: int = 32,
                 max_wait_s: float = 0.002, max_queue: int = 1024,
                 max_batch_tokens: int | None = None,
                 inline_max_s: float = INLINE_MAX_S,
                 live: Callable[[], int] | None = None, merge: bool = True,
                 stream: bool = True, keep_waits: bool = False,
                 on_device: bool = False) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model = model
        self.deliver = deliver
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        #: 0 keeps every batch in the worker thread
        self.inline_max_s = inline_max_s
        #: how many sessions could submit a request (None: unknown, always wait)
        self.live = live
        self.stats = BatchStats(keep_waits=keep_waits)
        #: when a partial batch waits for the sessions just answered (None: never)
        self.merge = MergePolicy() if merge else None
        #: verify on the loop, sending each verdict as it is drawn (False: the worker
        #: thread verifies the whole batch after its call, the loop then sends)
        self.stream = stream
        #: verify next to the logits (:func:`score_on_device`): the model offers
        #: ``score_tensors``
        self.on_device = on_device
        if on_device:
            verifies_on_device(model, True)  # refuses a model that keeps no rows there
        #: (what it would cost the loop, its share of CPU time, rows) of recent batches
        self._costs: deque[tuple[float, float, int]] = deque(maxlen=INLINE_WINDOW)
        #: peer -> its requests, oldest first; a peer is here only while it has some
        self._queues: dict[bytes, deque[ScoreNeeded]] = {}
        #: peers with queued requests, in the order batches take from them
        self._rr: deque[bytes] = deque()
        self._queued = 0
        self._queued_rows = 0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="xcosd-verify")
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._closed = False
        self._to_free: list[ModelSlot] = []
        #: work handed to the thread and not finished (batches, frees, node jobs)
        self._jobs: set[Future[Any]] = set()

    # -- node side -------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="xcosd-scheduler")

    @property
    def queued(self) -> int:
        return self._queued

    def full(self) -> bool:
        return self._queued >= self.max_queue

    def submit(self, req: ScoreNeeded) -> None:
        req.enqueued_at = time.perf_counter()
        peer = req.session.conn.peer
        q = self._queues.get(peer)
        if q is None:
            q = self._queues[peer] = deque()
            self._rr.append(peer)
        q.append(req)
        if self.merge is not None:
            self.merge.returned(req.session, req.enqueued_at, peer,
                                new=req.session.rounds == 0)
        self._queued += 1
        self._queued_rows += request_rows(req)
        self._wake.set()

    def free(self, session: CloudSession, by_peer: bool = False) -> None:
        """Free the model state of a finished session. The worker thread does it
        before its next batch, so it never races a batch that still uses it.
        ``by_peer``: its peer closed it (and may open the next one at once: the
        merge policy may keep its place, xcosd/nodes/merging.py)."""
        # The handle is read in the worker, not here: on a first round the worker
        # creates it during the batch, and reading it now would miss (and leak) it.
        if self.merge is not None:
            self.merge.forget(session, time.perf_counter(),
                              session.conn.peer if by_peer else None)
        self._to_free.append(session.model)
        self._wake.set()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the worker thread, after the work already handed to
        it: never concurrently with a batch, so ``fn`` may touch what a batch
        touches. The node's expensive follow-up requests come through here."""
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Hand ``fn(*args)`` to the worker thread now (not when some task next runs:
        the loop may be verifying for milliseconds before that)."""
        if self._closed:
            raise XcosdError("the scheduler is closed", code="internal")
        fut = self._executor.submit(fn, *args)
        self._jobs.add(fut)
        fut.add_done_callback(self._jobs.discard)
        return fut

    def _free_pending(self) -> None:
        while self._to_free:
            slot = self._to_free.pop()
            handle, slot.handle = slot.handle, None
            if handle is None:
                continue
            try:
                self.model.end(handle)
            except Exception:
                log.exception("freeing a model session failed")

    def _job(self, batch: list[ScoreNeeded]) -> list[Scored]:
        self._free_pending()
        if not batch:
            return []
        if self.on_device:
            return [*score_on_device(self.model, batch)]
        return score_rows(self.model, batch) if self.stream else [*score_batch(self.model, batch)]

    def _timed_job(self, batch: list[ScoreNeeded], inline: bool = False,
                   started: threading.Event | None = None) -> list[Scored]:
        """:meth:`_job`, timed, in the worker thread or (``inline``) on the loop;
        ``started`` is set as it begins."""
        if started is not None:
            started.set()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._job(batch)
        finally:
            self._note(time.perf_counter() - t0, time.thread_time() - c0, batch, inline)

    def _note(self, wall: float, cpu: float, batch: list[ScoreNeeded], inline: bool) -> None:
        """Record what a batch cost. In the thread, one that computes would have cost
        the loop its CPU time (its wall time there includes waits for the lock the
        loop holds); one that mostly waits, its wall time."""
        if not batch:
            return
        rows = sum(request_rows(r) for r in batch)
        share = min(1.0, cpu / wall) if wall > 0 else 1.0
        cost = wall if inline or share < INLINE_CPU_SHARE else cpu
        self._costs.append((cost, share, rows))
        if self.merge is not None:
            self.merge.record_call(rows, wall)

    def _inline(self, rows: int) -> bool:
        """Whether the next batch, of ``rows`` rows (0: only freeing), runs on the
        event loop: the thread is idle, the recent batches computed rather than
        waited, and by what they say of its cost it should take at most
        ``inline_max_s`` (medians: a busy machine preempts the odd batch)."""
        if self.inline_max_s <= 0 or self._jobs or not self._costs:  # never beside the thread
            return False
        costs = tuple(self._costs)  # one C-level copy (the worker appends to the deque)
        mid = len(costs) // 2
        if sorted(sh for _, sh, _ in costs)[mid] < INLINE_CPU_SHARE:
            return False
        # what each recent batch bounds this one's cost by: as much as it, for fewer
        # rows (a fixed cost does not shrink), proportionally more for more rows
        bound = sorted(c * max(1.0, rows / max(1, n)) for c, _, n in costs)[mid]
        return bound <= self.inline_max_s

    async def stop(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Form no more batches; drop the queued requests (their sessions' model
        state is freed by :meth:`close`); wait at most ``timeout`` seconds for the
        task and for work still in the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._task is not None:
            self._task.cancel()
            # bounded: even a cancellation swallowed somewhere below cannot hang
            # this (the loop also checks ``_stopped``)
            await asyncio.wait({self._task}, timeout=max(0.0, deadline - loop.time()))
            self._task = None
        for q in self._queues.values():
            for req in q:
                self.free(req.session)
        self._queues.clear()
        self._rr.clear()
        self._queued = self._queued_rows = 0
        await self._settle(deadline - loop.time())

    async def _settle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` for the thread's work; whether it is idle."""
        # a C-level copy: the worker thread discards finished futures from the set
        busy = [f for f in tuple(self._jobs) if not f.done()]
        if busy and timeout > 0:
            await asyncio.wait([asyncio.wrap_future(f) for f in busy], timeout=timeout)
        return all(f.done() for f in busy)

    async def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Stop, free every finished session's model state in the worker, end the
        thread. Returns within about ``timeout`` seconds: a batch still computing by
        then is left to finish in its thread (whose results nobody takes), the
        executor shut down without waiting for it."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self.stop(timeout)
        self._closed = True
        idle = await self._settle(deadline - loop.time())
        if idle:
            fut = self._executor.submit(self._free_pending)
            self._jobs.add(fut)
            idle = await self._settle(max(0.05, deadline - loop.time()))
        # an idle worker exits at once, so waiting for it leaves no thread behind;
        # a busy one is not waited for
        self._executor.shutdown(wait=idle, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------

    def _budget_reached(self) -> bool:
        """Whether the batch should form now: it is full, or every live session is
        in it (no other request could arrive while it waits; a place the merge
        policy keeps for a reopener's next session counts as a live session)."""
        return (self._queued >= self.max_batch
                or (self.max_batch_tokens is not None
                    and self._queued_rows >= self.max_batch_tokens)
                or (self.live is not None and self._queued >= self.live() + (
                    self.merge.vacancies() if self.merge is not None else 0)))

    def _oldest(self) -> float:
        return min(q[0].enqueued_at for q in self._queues.values())

    async def _take(self) -> list[ScoreNeeded]:
        while not self._queued:
            if self._to_free or self._stopped:
                return []
            self._wake.clear()
            await self._wake.wait()
        if self._budget_reached():
            return self._form()
        merge = self.merge
        hold = merge.hold_until(time.perf_counter()) if merge is not None else None
        if hold is not None and not self._room_for_answered():
            hold = None
        if self.max_wait_s > 0 or hold is not None:
            deadline = self._oldest() + self.max_wait_s
            while not self._budget_reached() and not self._stopped:
                end = deadline
                now = time.perf_counter()
                if hold is not None and merge is not None and merge.pending(now):
                    end = max(end, hold)
                left = end - now
                if left <= 0:
                    break
                self._wake.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow
                # the cancellation that stops this task
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._wake.wait()
            if hold is not None and merge is not None:
                merge.holds += 1
                merge.filled += (self._budget_reached()
                                 or not merge.pending(time.perf_counter()))
        return self._form()

    def _pop(self, peer: bytes, q: deque[ScoreNeeded]) -> ScoreNeeded:
        """Take ``peer``'s oldest request and move ``peer`` to the back of the
        rotation (or out of it, when that was its last)."""
        req = q.popleft()
        self._queued -= 1
        self._queued_rows -= request_rows(req)
        self._rr.popleft()
        if q:
            self._rr.append(peer)
        else:
            del self._queues[peer]
        return req

    def _form(self) -> list[ScoreNeeded]:
        """A batch: one request per peer per pass, round-robin, until ``max_batch``
        requests or the next request would take it past ``max_batch_tokens`` rows
        (that peer then goes first in the next batch)."""
        batch: list[ScoreNeeded] = []
        rows = 0
        cap = self.max_batch_tokens
        while self._rr and len(batch) < self.max_batch:
            peer = self._rr[0]
            q = self._queues[peer]
            head = q[0]
            if head.session.closed:
                self._pop(peer, q)
                if peer in self._queues:  # a skipped request does not cost its peer its turn
                    self._rr.rotate(1)
                self.stats.cancelled += 1
                continue
            cost = request_rows(head)
            if batch and cap is not None and rows + cost > cap:
                break
            batch.append(self._pop(peer, q))
            rows += cost
        return batch

    async def _run(self) -> None:
        ahead: _Launched | None = None
        try:
            while not self._stopped:
                if ahead is None:
                    batch = await self._take()
                    if self._stopped:
                        return
                    if not batch:
                        with contextlib.suppress(Exception):
                            if self._inline(0):
                                self._timed_job(batch, inline=True)
                            else:
                                await self.run(self._free_pending)
                        continue
                    ahead = self._launch(batch)
                current, ahead = ahead, None
                try:
                    scored = await current.outcomes()
                except Exception as e:  # a bug, or the thread is gone: fail these rounds,
                    log.exception("a batch of %d failed", len(current.batch))  # never hang
                    scored = [failed_outcome(e) for _ in current.batch]
                compute = time.perf_counter() - current.t0
                self.stats.record(len(current.batch), compute, current.waits)
                if self.merge is not None:
                    self.merge.answered([r.session for r in current.batch],
                                        time.perf_counter())
                # the queued rounds start now, unless they wait for the ones just
                # answered (a merge that pays: xcosd/nodes/merging.py)
                ahead = None if self._holding() else self._launch_ahead()
                await self._verify_and_deliver(current, scored)
        finally:
            if ahead is not None and ahead.task is not None:
                ahead.task.cancel()  # its thread job, if started, is settled by stop()

    async def _verify_and_deliver(self, current: _Launched, scored: list[Scored]) -> None:
        """Verify each session of a scored batch and send its verdict at once, in
        batch order, on the loop: the first devices draft their next round while
        the rest are verified, and the worker thread is already free for the next
        call (a GPU does not wait for the CPU's verification). Past
        :data:`VERIFY_SLICE_S` of it the loop gets a turn, so a batch of costly
        rows does not hold back the messages arriving meanwhile. Once a batch's
        sessions have waited :data:`FIRST_TURN_AFTER_S`, the first verdict of several
        gets a turn of its own at once: the sends of one turn go out together
        (xcosd/transport/burst.py), and the first device should start its next
        draft now rather than when a share of the batch is verified (a near-free
        call verified at once is not worth the turn: its devices barely waited)."""
        now = time.perf_counter()
        slice_end = now + VERIFY_SLICE_S
        first = len(current.batch) > 1 and now - current.t0 >= FIRST_TURN_AFTER_S
        warped: list[np.ndarray | None] = []
        for k, (req, item) in enumerate(zip(current.batch, scored, strict=True)):
            if k == len(warped):  # the next run of sessions, warped in one bounded call
                end = warp_chunk_end(scored, k)
                warped += warp_together(current.batch[k:end], scored[k:end])
            outcome = verify_scored(req.round, item, warped[k])
            now = time.perf_counter()
            # what this verdict waited for: the call, and verification up to its own
            outcome.compute_s = now - current.t0
            try:
                sent = self.deliver(req.session, outcome)
                if sent is not None:
                    await sent
            except Exception:
                log.exception("delivering a verdict failed")
            if now > slice_end or first:
                first = False
                await asyncio.sleep(0)
                slice_end = time.perf_counter() + VERIFY_SLICE_S

    def _holding(self) -> bool:
        """Whether the queued rounds wait for the sessions just answered rather than
        start before their verdicts go out."""
        return (self.merge is not None and bool(self._queued) and not self._budget_reached()
                and self.merge.hold_until(time.perf_counter()) is not None
                and self._room_for_answered())

    def _room_for_answered(self) -> bool:
        """Whether the sessions a hold would wait for fit in the batch beside the
        queued rounds (by sessions, and by rows at the queued rounds' mean size): if
        not, the batch fills up without them and holding only delays it."""
        assert self.merge is not None
        n = self.merge.expected(time.perf_counter())
        if self._queued + n > self.max_batch:
            return False
        if self.max_batch_tokens is not None and self._queued:
            per = self._queued_rows / self._queued
            return self._queued_rows + per * n <= self.max_batch_tokens
        return True

    def _launch(self, batch: list[ScoreNeeded]) -> _Launched:
        """Start ``batch``: in the worker thread (a task awaits it), or inline, now."""
        t0 = time.perf_counter()
        waits = [t0 - r.enqueued_at for r in batch]
        if self._inline(sum(request_rows(r) for r in batch)):
            try:
                done: list[Scored] | BaseException = self._timed_job(batch, inline=True)
            except Exception as e:
                done = e
            return _Launched(batch, t0, waits, None, done)
        # submitted here, not from a task of its own: that task would first run when
        # the loop next turns, after a slice of the previous batch's verification
        idle = not self._jobs
        started = threading.Event()
        try:
            task = asyncio.wrap_future(self._submit(self._timed_job, batch, False, started))
        except Exception as e:  # closed, or the executor is gone: these rounds fail
            return _Launched(batch, t0, waits, None, e)
        if idle:
            # Hand the thread the interpreter lock: the loop goes on to verify the
            # last batch in Python, and a thread waiting for the lock gets it only
            # when the loop blocks or after a switch interval (5 ms), with the
            # target idle meanwhile. Blocking here lets it take the lock at once
            # (bounded: a thread that is slow to be scheduled is not waited for).
            started.wait(HANDOFF_MAX_S)
        return _Launched(batch, t0, waits, task, None)

    def _launch_ahead(self) -> _Launched | None:
        """The next batch, started before this one's verdicts go out when requests
        are already queued and it would run in the worker thread: the thread
        computes while the loop encodes and sends (one that would run inline waits,
        as it would hold the loop those verdicts need)."""
        if self._stopped or not self._queued:
            return None
        if self._inline(min(self._queued_rows, self.max_batch_tokens or self._queued_rows)):
            return None
        batch = self._form()
        return self._launch(batch) if batch else None


@dataclass
class _Launched:
    """A batch started: in ``task`` (the worker thread) or ``done`` inline."""

    batch: list[ScoreNeeded]
    t0: float
    waits: list[float]
    task: asyncio.Future[list[Scored]] | None
    done: list[Scored] | BaseException | None

    async def outcomes(self) -> list[Scored]:
        if self.task is not None:
            return await self.task
        if isinstance(self.done, BaseException):
            raise self.done
        assert self.done is not None
        await asyncio.sleep(0)  # a deep queue must not hold the loop
        return self.done
