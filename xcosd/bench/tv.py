"""Measured total-variation distance of a method's output to the target.

At a fixed context the first token a round emits must, for a lossless method, be
distributed exactly as the warped target row ``p``. We run the method's own
server and device halves (composed from ``xcosd/methods/round.py``, as the state
machines compose them, with one draft) many times on real model rows at that context and estimate
``TV(P, p)``, where ``P`` is the law of the emitted token.

The plug-in estimate ``TV(empirical, p)`` is useless here: over a vocabulary of
10^5 tokens it is large even for an exact sampler. Instead we use a **held-out
witness set**. ``TV(P, p) = max_A P(A) - p(A)``; the trials are split in two
halves, the first half picks ``A = {x : P1(x) > p(x)}`` and the second half
estimates ``P(A) - p(A)`` (and the other way round; the two are averaged). For
any ``A`` chosen independently of the second half that estimate is unbiased for
``P(A) - p(A) <= TV(P, p)``: it is a conservative (lower-bound) estimator whose
expectation is exactly 0 for an exact method and whose noise is reported as a
standard error. A method that moves mass shows up as a positive value well
above its standard error.

Cost: a rejection's resolution is the expensive part (it encodes and resamples
vectors of the vocabulary's size), so trials are stratified. Every trial draws a
draft and runs the accept test; only a random subset of the rejected trials
(``resolve`` of them, per half) runs the rejection protocol, and each resolved
token stands for ``rejected / resolved`` trials of its half. That keeps every
estimate unbiased while the cost stays bounded.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..codecs import Codec, get_codec
from ..codecs.base import Buffer
from ..errors import InvalidDistribution
from ..methods import DeviceState, Draft, Method, RejectState, Space, get_method
from ..methods.distance import total_variation
from ..methods.round import resolve_locally
from ..methods.tli import restrict_to_common
from ..models.base import LanguageModel
from ..sampling import SamplingParams, warp
from ..vocab import VocabMap


class MemoCodec(Codec):
    """A codec that remembers its last answers (keyed by a hash of the input).

    The trials encode the same vectors over and over (one context, thousands of
    rounds); codecs are deterministic, so replaying a result is exact and turns a
    vocabulary-sized encode into a hash.
    """

    def __init__(self, inner: Codec, size: int = 64) -> None:
        self.inner = inner
        self.name = inner.name
        self.exact = inner.exact
        self._cache: OrderedDict[tuple[str, bytes, int], object] = OrderedDict()
        self._size = size

    def _memo(self, kind: str, data: bytes, n: int, make: object) -> object:
        key = (kind, hashlib.blake2b(data, digest_size=16).digest(), n)
        hit = self._cache.get(key)
        if hit is None:
            hit = make() if callable(make) else make
            self._cache[key] = hit
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return hit

    def encode(self, v: np.ndarray) -> bytes:
        v32 = np.ascontiguousarray(v, dtype=np.float32)
        out = self._memo("e", v32.tobytes(), 0, lambda: self.inner.encode(v32))
        assert isinstance(out, bytes)
        return out

    def decode(self, data: Buffer, n: int) -> np.ndarray:
        b = bytes(data)
        out = self._memo("d", b, n, lambda: self.inner.decode(b, n))
        return np.array(out, copy=True)

    def commit(self, v: np.ndarray) -> np.ndarray:
        v32 = np.ascontiguousarray(v, dtype=np.float32)
        out = self._memo("c", v32.tobytes(), 0, lambda: self.inner.commit(v32))
        return np.array(out, copy=True)

    def max_encoded_size(self, n: int) -> int:
        return self.inner.max_encoded_size(n)

    def encoded_size(self, v: np.ndarray) -> int:
        return len(self.encode(v))


@dataclass
class TVEstimate:
    """Witness estimate of ``TV(P, p)`` with its standard error, plus ``TV(p, p*)``:
    the distance the commit rule predicts for a lossless method with this codec."""

    tv: float
    stderr: float
    tv_commit: float
    trials: int
    resolved: int
    accept_rate: float


def _sampler(p: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` i.i.d. indices from ``p`` (by inverse CDF over float64 sums)."""
    c = np.cumsum(np.asarray(p, dtype=np.float64))
    return np.minimum(np.searchsorted(c, rng.random(n) * c[-1], side="right"), len(c) - 1)


def first_token_trials(method: Method, p: np.ndarray, q_draft: np.ndarray | None, space: Space,
                       rng: np.random.Generator, trials: int,
                       resolve: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """Run ``trials`` rounds (one draft) at one context.

    ``p``: the warped target row over V_T; ``q_draft``: the draft's TLI row in V_C
    order (None: the device cannot draft here). Returns per trial the emitted token
    (-1 where the rejection was not resolved), its weight and its half (0/1), then
    the acceptance rate and how many rejections were resolved.
    """
    half = np.arange(trials) % 2
    tp = np.stack([p, p]).astype(np.float32)
    p_star = method.commit_rows(tp, space)
    if not method.drafts or q_draft is None:
        tok = _sampler(method.commit_row(tp[0], space), rng, trials)
        return tok, np.ones(trials), half, 0.0, 0
    q_row = method.draft_row(q_draft)
    ids = space.common_ids[_sampler(q_row, rng, trials)]
    drafts: dict[int, Draft] = {}
    accepted = np.zeros(trials, dtype=bool)
    for t in range(trials):
        x = int(ids[t])
        d = drafts.get(x)
        if d is None:
            d = drafts[x] = method.draft_message(np.array([x], dtype=np.int64), [q_draft], space)
        accepted[t] = method.verify(p_star, d, space, rng) == 1
    tokens = np.where(accepted, ids, -1)
    weight = accepted.astype(np.float64)
    resolved = 0
    for h in (0, 1):
        rejected = np.flatnonzero(~accepted & (half == h))
        if rejected.size == 0:
            continue
        chosen = rng.choice(rejected, size=min(resolve, rejected.size), replace=False)
        for t in chosen:
            x = int(ids[t])
            state = RejectState(p_raw=tp[0], p_star=p_star[0], rejected=x,
                                q_common=method.server_q(drafts[x], 0, space))
            dev = DeviceState(q_common=q_row, rejected=x)
            tokens[t] = resolve_locally(method, state, dev, space, rng).token
        weight[chosen] = rejected.size / chosen.size
        resolved += int(chosen.size)
    return tokens, weight, half, float(accepted.mean()), resolved


def witness_tv(p: np.ndarray, tokens: np.ndarray, weight: np.ndarray,
               half: np.ndarray) -> tuple[float, float]:
    """The held-out witness estimate of ``TV(P, p)`` and its standard error."""
    p64 = np.asarray(p, dtype=np.float64)
    ests, vars_ = [], []
    for pick, test in ((0, 1), (1, 0)):
        a = half == pick
        mass = np.bincount(tokens[a & (tokens >= 0)], weights=weight[a & (tokens >= 0)],
                           minlength=p64.shape[0])[: p64.shape[0]] / max(1, int(a.sum()))
        witness = mass > p64
        b = half == test
        v = np.where(tokens[b] >= 0, weight[b] * witness[np.maximum(tokens[b], 0)], 0.0)
        ests.append(float(v.mean()) - float(p64[witness].sum()))
        vars_.append(float(v.var(ddof=1)) / max(1, v.size) if v.size > 1 else 0.0)
    return 0.5 * (ests[0] + ests[1]), 0.5 * float(np.sqrt(vars_[0] + vars_[1]))


def measure_tv(method_name: str, codec: str, contexts: list[tuple[np.ndarray, np.ndarray | None]],
               space: Space, *, trials: int, resolve: int, seed: int) -> TVEstimate:
    """:class:`TVEstimate` averaged over ``contexts`` (``(p, q_draft)`` pairs)."""
    inner = get_codec(codec)
    method = get_method(method_name, codec=inner if inner.exact else MemoCodec(inner))
    rng = np.random.default_rng(seed)
    tvs, errs, commits, acc, res = [], [], [], [], 0
    for p, q in contexts:
        tokens, weight, half, a, r = first_token_trials(method, p, q, space, rng, trials, resolve)
        tv, se = witness_tv(p, tokens, weight, half)
        tvs.append(tv)
        errs.append(se)
        p_star = method.commit_rows(np.stack([p, p]).astype(np.float32), space)[0]
        commits.append(total_variation(p, p_star))
        acc.append(a)
        res += r
    k = len(contexts)
    return TVEstimate(float(np.mean(tvs)), float(np.sqrt(np.sum(np.square(errs)))) / k,
                      float(np.mean(commits)), trials * k, res, float(np.mean(acc)))


def context_rows(draft: LanguageModel, target: LanguageModel, vmap: VocabMap, text: str,
                 params: SamplingParams) -> tuple[np.ndarray, np.ndarray | None]:
    """``(p, q)`` at the end of ``text``: the warped target row and the draft's TLI row
    (None when the warped draft has no mass on V_C)."""
    ts = target.start(target.tokenize(text))
    p = warp(target.score([(ts, [])])[0][-1], params)
    target.end(ts)
    ds = draft.start(draft.tokenize(text))
    row = draft.score([(ds, [])])[0][-1]
    draft.end(ds)
    try:
        q: np.ndarray | None = restrict_to_common(warp(row, params), vmap.common_draft_ids)
    except InvalidDistribution:
        q = None
    return np.asarray(p, dtype=np.float32), q
