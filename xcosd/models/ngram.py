"""An interpolated Kneser-Ney n-gram model over any :class:`~xcosd.vocab.Vocabulary`.

The embedded default language model: trained in seconds with numpy on text
tokenised by the vocabulary's own tokenizer, it gives a proper distribution over
the *whole* vocabulary at every step, so it exercises every code path a real model
does (150k-wide rows, V_C/V_O splits, re-tokenisation) at no download cost.

The probability of ``w`` after context ``h`` (length ``k``) is the interpolation

    P_k(w | h) = max(c(h w) - D_k, 0) / c(h)  +  gamma(h) * P_{k-1}(w | h'),
    gamma(h)   = D_k * N1+(h .) / c(h),

where ``h'`` drops the oldest token, ``c`` is the raw count at the highest order and
the continuation count ``N1+(. h w)`` below it (Kneser-Ney), and ``D_k`` is the
Ney estimate ``n1 / (n1 + 2 n2)``. The recursion ends in a dense base row: the
unigram continuation distribution with an add-``alpha`` floor over every regular
token and EOS, so no usable token ever has probability 0. Unused ids and special
tokens other than EOS get 0.

A row is therefore one dense ``base * prod(gamma)`` plus a few sparse scatters of
the seen continuations -- a few hundred microseconds for a 200k vocabulary, never a
Python loop over the vocabulary. Each level's ``D`` terms sum with ``gamma`` to 1, so
every row sums to 1 by construction.

Documents are joined with EOS between them (and before the first), so EOS is both
a predictable token and the start-of-text context: a session with an empty prompt
conditions on a virtual leading EOS.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..vocab import Vocabulary
from .base import ContextModel
from .corpus import cache_dir, default_corpus, text_hash

log = logging.getLogger(__name__)

_HASH_MUL = np.uint64(0x100000001B3)  # FNV-1a prime: a cheap mixing multiplier
_MASK64 = (1 << 64) - 1
_FORMAT = 1


def _hash_rows(rows: np.ndarray) -> np.ndarray:
    """uint64 polynomial hash of each row of ``rows`` (wrapping arithmetic)."""
    h = np.zeros(rows.shape[0], dtype=np.uint64)
    for j in range(rows.shape[1]):
        h = h * _HASH_MUL + (rows[:, j].astype(np.uint64) + np.uint64(1))
    return h


def _hash_ctx(ctx: Sequence[int]) -> int:
    h = 0
    mul = int(_HASH_MUL)
    for t in ctx:
        h = (h * mul + int(t) + 1) & _MASK64
    return h


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a 2-D int array in lexicographic order, with their counts."""
    if a.shape[0] == 0:
        return a.copy(), np.zeros(0, dtype=np.int64)
    order = np.lexsort(a.T[::-1])
    s = a[order]
    new = np.ones(s.shape[0], dtype=bool)
    new[1:] = np.any(s[1:] != s[:-1], axis=1)
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, s.shape[0]))
    return np.ascontiguousarray(s[starts]), counts.astype(np.int64)


@dataclass
class _Level:
    """The corrections for one context length ``k``: contexts (grouped), their
    seen continuations with discounted probabilities, and the back-off weights."""

    k: int
    ctx: np.ndarray  # (G, k) int32 contexts
    hash_sorted: np.ndarray  # (G,) uint64, ascending
    hash_group: np.ndarray  # (G,) int64: group of each sorted hash
    offsets: np.ndarray  # (G+1,) int64 into ids/vals
    ids: np.ndarray  # int32 continuation ids
    vals: np.ndarray  # float32 max(c - D, 0) / c(h)
    gamma: np.ndarray  # (G,) float32 back-off weights
    discount: float

    def find(self, ctx: Sequence[int]) -> int:
        """The group of context ``ctx`` (length ``k``), or -1 if never seen."""
        h = np.uint64(_hash_ctx(ctx))
        pos = int(np.searchsorted(self.hash_sorted, h))
        n = self.hash_sorted.shape[0]
        while pos < n and self.hash_sorted[pos] == h:
            g = int(self.hash_group[pos])
            if self.ctx[g].tolist() == list(ctx):
                return g
            pos += 1
        return -1

    @classmethod
    def build(cls, k: int, grams: np.ndarray, counts: np.ndarray) -> _Level:
        """From the distinct ``(k+1)``-grams (lexicographic order) and their counts."""
        n1 = int(np.count_nonzero(counts == 1))
        n2 = int(np.count_nonzero(counts == 2))
        d = n1 / (n1 + 2 * n2) if n1 + 2 * n2 > 0 else 0.5
        d = float(min(max(d, 0.05), 0.95))
        ctx_all = grams[:, :k]
        new = np.ones(grams.shape[0], dtype=bool)
        if grams.shape[0] > 1:
            new[1:] = np.any(ctx_all[1:] != ctx_all[:-1], axis=1)
        starts = np.flatnonzero(new)
        offsets = np.append(starts, grams.shape[0]).astype(np.int64)
        group = np.cumsum(new) - 1
        totals = np.add.reduceat(counts.astype(np.float64), starts)
        types = np.diff(offsets).astype(np.float64)
        vals = (counts - d) / totals[group]
        gamma = d * types / totals
        ctx = np.ascontiguousarray(ctx_all[starts].astype(np.int32))
        hashes = _hash_rows(ctx)
        order = np.argsort(hashes, kind="stable")
        return cls(k, ctx, hashes[order], order.astype(np.int64), offsets,
                   np.ascontiguousarray(grams[:, k].astype(np.int32)),
                   vals.astype(np.float32), gamma.astype(np.float32), d)


class NgramModel(ContextModel):
    """Interpolated Kneser-Ney n-gram model of ``order`` over ``vocab``.

    Build one with :meth:`train` (from documents) or :meth:`load_or_train` (from the
    disk cache, training on the first use). ``order`` is the n-gram length: order 3
    conditions on the last two tokens.
    """

    def __init__(self, vocab: Vocabulary, order: int, base: np.ndarray, levels: list[_Level],
                 *, corpus: str = "", name: str | None = None) -> None:
        if order < 1:
            raise ModelError(f"n-gram order must be >= 1, got {order}")
        if base.shape != (vocab.size,):
            raise ModelError(f"base row has shape {base.shape}, vocabulary size is {vocab.size}")
        self.vocab = vocab
        self.order = order
        self.base = np.ascontiguousarray(base, dtype=np.float32)
        self.levels = levels
        self.corpus = corpus
        self.name = name or f"ngram:{vocab.name}:{order}"
        self._start = vocab.roles.get("eos")

    def __repr__(self) -> str:
        return f"NgramModel({self.name!r}, contexts={[lv.ctx.shape[0] for lv in self.levels]})"

    # -- scoring ---------------------------------------------------------------

    def _fill_row(self, context: Sequence[int], out: np.ndarray) -> None:
        need = self.order - 1
        ctx = list(context[-need:]) if need else []
        if self._start is not None and len(ctx) < need:
            ctx.insert(0, self._start)
        found: list[tuple[_Level, int]] = []
        for lv in self.levels:
            if len(ctx) < lv.k:
                break
            g = lv.find(ctx[len(ctx) - lv.k:])
            if g < 0:
                break
            found.append((lv, g))
        mult = 1.0
        scaled: list[tuple[np.ndarray, np.ndarray]] = []
        for lv, g in reversed(found):
            a, b = lv.offsets[g], lv.offsets[g + 1]
            scaled.append((lv.ids[a:b], lv.vals[a:b] * np.float32(mult)))
            mult *= float(lv.gamma[g])
        np.multiply(self.base, np.float32(mult), out=out)
        for ids, vals in reversed(scaled):
            out[ids] += vals

    def next_probs(self, context: Sequence[int]) -> np.ndarray:
        """The distribution after ``context`` (a fresh float32 row)."""
        out = np.empty(self.vocab.size, dtype=np.float32)
        self._fill_row(list(context), out)
        return out

    # -- training --------------------------------------------------------------

    @classmethod
    def train(cls, vocab: Vocabulary, docs: Sequence[str], order: int, *, alpha: float = 0.01,
              name: str | None = None) -> NgramModel:
        """Count ``order``-grams of ``docs`` tokenised with ``vocab`` and smooth them.

        ``alpha`` is the add-alpha floor of the base row (per regular token, in units
        of one continuation count).
        """
        if order < 1:
            raise ModelError(f"n-gram order must be >= 1, got {order}")
        eos = vocab.roles.get("eos")
        parts: list[list[int]] = []
        for doc in docs:
            if eos is not None:
                parts.append([eos])
            parts.append(vocab.encode(doc))
        if eos is not None:
            parts.append([eos])
        stream = np.fromiter((t for p in parts for t in p), dtype=np.int64)
        if stream.size < order:
            raise ModelError(f"corpus too small for order {order}: {stream.size} tokens")
        if stream.min() < 0 or stream.max() >= vocab.size:
            raise ModelError(f"{vocab.name}: tokenizer produced ids outside the vocabulary")

        # distinct n-grams at the top order with raw counts, then each lower order's
        # distinct n-grams with continuation counts (distinct left extensions)
        win = np.lib.stride_tricks.sliding_window_view(stream, order)
        grams, counts = _unique_rows(np.ascontiguousarray(win))
        per_order: dict[int, tuple[np.ndarray, np.ndarray]] = {order: (grams, counts)}
        for n in range(order - 1, 0, -1):
            grams, counts = _unique_rows(np.ascontiguousarray(per_order[n + 1][0][:, 1:]))
            per_order[n] = (grams, counts)

        allowed = vocab.regular_mask.copy()
        if eos is not None:
            allowed[eos] = True
        uni = np.zeros(vocab.size, dtype=np.float64)
        g1, c1 = per_order[1]
        uni[g1[:, 0]] = c1
        uni = np.where(allowed, uni + alpha, 0.0)
        base = uni / uni.sum()
        levels = [_Level.build(n - 1, *per_order[n]) for n in range(2, order + 1)]
        return cls(vocab, order, base.astype(np.float32), levels, name=name)

    # -- persistence -----------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the model to one ``.npz`` file (atomically)."""
        arrays: dict[str, np.ndarray] = {"base": self.base}
        meta = {"format": _FORMAT, "order": self.order, "vocab": self.vocab.name,
                "fingerprint": self.vocab.fingerprint, "corpus": self.corpus, "name": self.name,
                "discounts": [lv.discount for lv in self.levels]}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        for lv in self.levels:
            for f in ("ctx", "hash_sorted", "hash_group", "offsets", "ids", "vals", "gamma"):
                arrays[f"{f}_{lv.k}"] = getattr(lv, f)
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path, vocab: Vocabulary) -> NgramModel:
        """Read a model written by :meth:`save` for ``vocab``."""
        try:
            with np.load(path) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != _FORMAT:
                    raise ModelError(f"{path}: n-gram file format {meta.get('format')}")
                if meta["fingerprint"] != vocab.fingerprint:
                    raise ModelError(f"{path} was trained on another vocabulary "
                                     f"({meta['vocab']}, {meta['fingerprint']})")
                levels = []
                for k, d in enumerate(meta["discounts"], start=1):
                    f = {n: z[f"{n}_{k}"] for n in ("ctx", "hash_sorted", "hash_group",
                                                    "offsets", "ids", "vals", "gamma")}
                    levels.append(_Level(k=k, discount=float(d), **f))
                return cls(vocab, int(meta["order"]), z["base"], levels,
                           corpus=meta.get("corpus", ""), name=meta.get("name"))
        except (OSError, KeyError, ValueError) as e:
            raise ModelError(f"cannot load n-gram model {path}: {e}") from e

    @classmethod
    def load_or_train(cls, vocab: Vocabulary, order: int, docs: Sequence[str] | None = None, *,
                      alpha: float = 0.01, cache: str | Path | None = None,
                      use_cache: bool = True) -> NgramModel:
        """The model for ``(vocab, order, docs)`` from the disk cache, training and
        caching it on the first call.

        ``docs`` defaults to :func:`~xcosd.models.corpus.default_corpus`. The cache key
        is the vocabulary's fingerprint, the order, ``alpha`` and the corpus hash;
        ``cache`` defaults to :func:`~xcosd.models.corpus.cache_dir`.
        """
        if docs is None:
            docs = default_corpus(use_cache=use_cache)
        chash = text_hash(docs)
        root = Path(cache) if cache is not None else cache_dir()
        path = root / f"ngram-{vocab.name}-{vocab.fingerprint}-o{order}-a{alpha:g}-{chash}.npz"
        if use_cache and path.exists():
            try:
                return cls.load(path, vocab)
            except ModelError as e:
                log.warning("retraining: %s", e)
        t0 = time.perf_counter()
        model = cls.train(vocab, docs, order, alpha=alpha)
        model.corpus = chash
        log.info("trained %s in %.1f s", model.name, time.perf_counter() - t0)
        if use_cache:
            try:
                model.save(path)
            except OSError as e:
                log.warning("cannot cache %s: %s", path, e)
        return model
