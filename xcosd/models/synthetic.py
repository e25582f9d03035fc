"""A cost-model target for load tests: cheap distributions, configurable forward time.

A real target's verification cost grows with the tokens in the batch; the
scheduler's batching is only worth testing against something that behaves that
way. :class:`SyntheticModel` makes each :meth:`score` call cost
``a + b * tokens`` seconds, where ``tokens`` counts every row the call returns
(``len(new_ids) + 1`` per session), while its distributions cost microseconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..errors import ModelError
from ..vocab import Vocabulary
from .base import ContextModel, Session

#: a batch's rows come from one gather up to this many values, from a slice copy
#: per row beyond (the gather's index array would cost twice the rows' memory)
GATHER_MAX = 1 << 20


def small_vocabulary(size: int, name: str | None = None) -> Vocabulary:
    """A vocabulary of ``size`` ids: the 256 single bytes, then two-byte strings,
    and an EOS (the last id)."""
    if size < 2:
        raise ModelError(f"a synthetic vocabulary needs at least 2 ids, got {size}")
    toks: list[bytes] = []
    for i in range(size - 1):
        toks.append(bytes([i]) if i < 256 else bytes([(i - 256) // 256 % 256, (i - 256) % 256])
                    + b"~" * ((i - 256) // 65536))
    toks.append(b"<eos>")
    return Vocabulary(name or f"synthetic{size}", toks, special=[size - 1],
                      roles={"eos": size - 1})


class SyntheticModel(ContextModel):
    """Deterministic Zipf-shaped distributions whose order is rotated by the last
    context token, over a real or small vocabulary, at a chosen cost per call.

    The cost is paid by **sleeping** by default (``busy=False``): ``time.sleep``
    releases the GIL, so a server that runs the model in a worker thread keeps its
    event loop responsive, just as it does with a real model whose compute runs in
    native code. ``busy=True`` spins the CPU instead, to load a core.

    ``a`` is the fixed cost per :meth:`score` call and ``b`` the cost per returned
    row, in seconds; ``skew`` is the Zipf exponent (higher is more peaked).
    """

    def __init__(self, vocab: Vocabulary | str | int = 256, *, a: float = 0.0, b: float = 0.0,
                 skew: float = 1.1, busy: bool = False, name: str | None = None) -> None:
        if isinstance(vocab, int):
            vocab = small_vocabulary(vocab)
        elif isinstance(vocab, str):
            vocab = Vocabulary.load(vocab)
        if a < 0 or b < 0:
            raise ModelError(f"synthetic costs must be >= 0, got a={a}, b={b}")
        self.vocab = vocab
        self.a = float(a)
        self.b = float(b)
        self.busy = busy
        self.name = name or f"synthetic:{vocab.name}"
        allowed = vocab.regular_mask.copy()
        eos = vocab.roles.get("eos")
        if eos is not None:
            allowed[eos] = True
        self._ids = np.flatnonzero(allowed)
        if self._ids.size == 0:
            raise ModelError(f"{vocab.name}: no usable token")
        w = 1.0 / np.arange(1, self._ids.size + 1, dtype=np.float64) ** skew
        self._zipf = (w / w.sum()).astype(np.float32)
        # two copies back to back: a rotation is one slice of it (np.roll's bits,
        # without its allocations; this model is meant to cost next to nothing)
        self._zipf2 = np.concatenate((self._zipf, self._zipf))
        self._dense = bool(self._ids.size == vocab.size)
        self.calls = 0
        self.rows = 0

    def _rotated(self, context: Sequence[int]) -> np.ndarray:
        """The row's values over the usable ids (a view): the Zipf weights rotated by
        the last context token (``np.roll(self._zipf, shift)``'s bits)."""
        last = int(context[-1]) if len(context) else 0
        n = self._ids.size
        shift = (last * 2654435761 + 97) % n
        return self._zipf2[n - shift: 2 * n - shift]

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        rotated = self._rotated(context)
        if self._dense:
            out[:] = rotated
        else:
            out[:] = 0.0
            out[self._ids] = rotated

    def _score_rows(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        """Every row of the batch from one gather: row ``k`` of a session is the Zipf
        weights rotated by the token before it, so the whole batch is the doubled
        weights read at one index per row (the bits of filling each row with
        :meth:`_fill_row`, without a Python call per row: a load test's null target
        should cost the cloud next to nothing)."""
        lasts: list[int] = []
        counts: list[int] = []
        for session, new_ids in batch:
            new = [int(i) for i in new_ids]
            if new:
                self._check_ids(new)
            ctx = session.ids
            lasts.append(int(ctx[-1]) if ctx else 0)
            lasts.extend(new)
            ctx.extend(new)
            session.cached = len(ctx)
            counts.append(len(new) + 1)
        n = self._ids.size
        starts = n - (np.asarray(lasts, dtype=np.int64) * 2654435761 + 97) % n
        if len(lasts) * n <= GATHER_MAX:
            gathered = self._zipf2[starts[:, None] + np.arange(n)]
        else:  # wide rows: a slice copy each (an index per value would double the memory)
            gathered = np.empty((len(lasts), n), dtype=np.float32)
            for row, a in zip(gathered, starts.tolist(), strict=True):
                row[:] = self._zipf2[a:a + n]
        if self._dense:
            rows = gathered
        else:
            rows = np.zeros((len(lasts), self.vocab.size), dtype=np.float32)
            rows[:, self._ids] = gathered
        out: list[np.ndarray] = []
        at = 0
        for k in counts:
            out.append(rows[at:at + k])
            at += k
        return out

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        free = not (self.a or self.b)  # a load test's draft: no clock to read
        if free and len(batch) == 1 and not batch[0][1] and self._dense:
            # a drafting step (one row at the whole context, the load generator's
            # every step): the rotation itself, as the general path would fill it
            session = batch[0][0]
            session.cached = len(session.ids)
            self.calls += 1
            self.rows += 1
            return [self._rotated(session.ids)[None].copy()]
        t0 = 0.0 if free else time.perf_counter()
        out = self._score_rows(batch)
        n = out[0].shape[0] if len(out) == 1 else sum(r.shape[0] for r in out)
        self.calls += 1
        self.rows += n
        if free:
            return out
        cost = self.a + self.b * n
        remaining = cost - (time.perf_counter() - t0)
        if remaining > 0:
            if self.busy:
                end = time.perf_counter() + remaining
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(remaining)
        return out
