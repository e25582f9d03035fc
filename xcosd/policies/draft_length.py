"""How many tokens a round drafts: the length that maximises the expected tokens per
second at the acceptance seen so far, and an optional stop when the draft is unsure.

A fixed draft length wastes the draft model's work when acceptance is low (most
drafted tokens are rejected) and leaves speed unused when it is high (a round trip
that could have carried more accepted tokens). :class:`DraftLength`, on by default:

* **The ceiling follows acceptance.** Each drafted token is accepted with some
  probability ``a``; the number of tokens a round of ``k`` drafts yields is then
  ``E(k) = 1 + a + ... + a^k``, and the round costs a fixed part (the link's round
  trip and the cloud's verification) plus ``k`` draft steps. With ``cost`` the
  ratio of a draft step to that fixed part, the ceiling is the ``k`` in 1..``cap``
  maximising ``E(k) / (1 + k * cost)``. ``a`` is estimated from the verdicts: a
  moving average over the drafts tested, each accepted draft a 1 and the first
  rejected one a 0 (the drafts after it were never tested, so they say nothing),
  each test weighing :data:`STEP`, so the estimate follows the last several tokens.
* **Drafting only when it pays.** The ``k`` may be 0: where a draft step costs
  more than the tokens it is expected to add (a slow device, a low acceptance) a
  round drafts nothing and the cloud samples the token, as ``ar`` would; one round
  in :data:`PROBE` then drafts one token, so the acceptance estimate stays current
  (one in twice as many after each probe that finds drafting still does not pay,
  up to :data:`MAX_PROBE`).
* **The cost, measured or set.** With ``measure`` (``draft_cost="auto"``, what an
  unseeded generation gets by default) the node feeds each round's measured
  draft-step and round times to :meth:`DraftLength.observe`: the lengths fit the
  hardware and the link, and depend on timing. A round's wait is fit as a fixed
  part plus a share per token it sent for verification (least squares over the
  recent rounds, which differ in length: the policy's probes see to that), and a
  drafted token costs its draft step plus that share: a cloud that verifies on a
  GPU adds next to nothing per token, one that verifies on a CPU adds most of a
  decode, and drafting there pays far later. Otherwise ``cost`` is a setting
  (:data:`DEFAULT_COST` for a seeded generation), so a seeded generation drafts the
  same lengths on every run. The law is exact either way. A node starts each new generation from what its
  last one learned (:meth:`DraftLength.adopt`), so it does not pay for learning
  the costs again.
* **The stop when unsure** (transformers' ``assistant_confidence_threshold``): once
  a drafted token had probability below ``confidence`` under the row it was drawn
  from, that token is kept and no more are drafted this round. Off by default
  here: on a link whose round trip dominates (this project's setting) a round cut
  short pays a whole round trip for fewer tokens (``bench methods
  --draft-confidence``), whereas transformers runs both models on one machine,
  where a stop costs nothing but a forward.

Why the output law stays exact. Verification makes position *i* follow the target
whatever was drafted there, provided the drafted token itself is a draw from the
proposal row the cloud is told about. So a round may stop drafting at any point
chosen from what is known *before* the next token is drawn: the history (past
verdicts, which set the ceiling) and the tokens drawn so far (the confidence stop
looks at a token already kept). What it must never do is draw a token and then
drop it because of its value; "cut the block before the unsure token" looks
harmless but skews position *i* towards the tokens the draft is sure of (the law
tests carry it as a control that fails). The policy is pure: it reads no clock,
the node hands it what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the stop threshold by default (0: off; see the module docstring)
DEFAULT_CONFIDENCE = 0.0
#: the adaptive ceiling's upper bound by default
DEFAULT_CAP = 16
#: a draft step's cost over a round's fixed cost, by default: a small model on the
#: device against a round trip of tens of milliseconds plus the cloud's forward
DEFAULT_COST = 0.05
#: each tested draft's weight in the acceptance estimate (a memory of ~1/STEP drafts)
STEP = 0.15
#: the acceptance estimate before any verdict
PRIOR_RATE = 0.5
#: while drafting does not pay, one round in this many drafts one token
PROBE = 8
#: the longest interval between probes
MAX_PROBE = 64
#: each measured round's weight in the measured step and round times
COST_STEP = 0.2
#: how much of the round-time fit each older round keeps (a memory of ~20 rounds)
FIT_KEEP = 0.95
#: the least spread of round lengths (variance, tokens^2) the fit needs to tell a
#: round's share per token from its fixed part
FIT_MIN_VAR = 0.1


def best_length(rate: float, cost: float, cap: int, lo: int = 1) -> int:
    """The ``k`` in ``lo``..``cap`` maximising ``(1 + rate + ... + rate^k) / (1 + k * cost)``
    (the smallest on a tie)."""
    best, best_k, gain, term = 1.0 if lo == 0 else -1.0, 0 if lo == 0 else 1, 1.0, 1.0
    for k in range(1, cap + 1):
        term *= rate
        gain += term
        value = gain / (1.0 + k * cost)
        if value > best:
            best, best_k = value, k
    return best_k


@dataclass
class DraftLength:
    """One generation's draft-length policy (pure: fed verdicts, asked lengths).

    ``start``: the first round's ceiling (the fixed length when ``adaptive`` is off);
    ``cap``: the ceiling's upper bound; ``cost``: a draft step's cost over a round's
    fixed cost (the prior, with ``measure``); ``measure``: take the cost from
    :meth:`observe`; ``confidence``: the stop threshold (0: never stop early).
    """

    start: int = 4
    cap: int = DEFAULT_CAP
    confidence: float = DEFAULT_CONFIDENCE
    adaptive: bool = True
    cost: float = DEFAULT_COST
    measure: bool = False
    #: this round's ceiling
    ceiling: int = field(init=False)
    #: the estimated chance that a drafted token is accepted
    rate: float = field(init=False, default=PRIOR_RATE)
    #: measured seconds of one draft step and of a round's fixed part (``measure``)
    step_s: float | None = field(init=False, default=None)
    fixed_s: float | None = field(init=False, default=None)
    #: the fitted seconds a round's wait grows by per token sent for verification
    verify_s: float = field(init=False, default=0.0)
    #: the fit's decayed sums: rounds, tokens, tokens^2, seconds, tokens x seconds
    _fit: tuple[float, float, float, float, float] = field(
        init=False, default=(0.0, 0.0, 0.0, 0.0, 0.0))
    #: rounds drafted nothing since drafting stopped paying
    _idle: int = field(init=False, default=0)
    _probe_every: int = field(init=False, default=PROBE)
    _probing: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"draft length must be >= 0, got {self.start}")
        if self.cap < 1:
            raise ValueError(f"the draft-length cap must be >= 1, got {self.cap}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"draft confidence must be in [0, 1), got {self.confidence}")
        if not 0.0 <= self.cost < 1e6:
            raise ValueError(f"draft cost must be >= 0, got {self.cost}")
        self.ceiling = self.start if not self.adaptive else min(self.start, self.cap)

    @property
    def most_next(self) -> int:
        """The most a later round may draft: the cap, or the fixed length."""
        return self.cap if self.adaptive else self.ceiling

    @property
    def stop_below(self) -> float:
        """The probability under which a drafted token ends the round's drafting."""
        return self.confidence if self.adaptive else 0.0

    def observe(self, step_s: float | None, fixed_s: float, sent: int = 0) -> None:
        """What the node measured of a round: one draft step's seconds (``None`` when
        it drafted nothing), the seconds from sending the draft to its verdict (the
        link and the cloud) and the tokens the round sent for verification. Used
        only with ``measure``: for the lengths when ``adaptive``, and either way for
        how far the node speculates while a verdict is in flight (a fixed length
        speculates too)."""
        if not self.measure or fixed_s <= 0:
            return

        def ema(old: float | None, new: float) -> float:
            return new if old is None else old + COST_STEP * (new - old)

        self.fixed_s = ema(self.fixed_s, fixed_s)
        if step_s is not None and step_s > 0:
            self.step_s = ema(self.step_s, step_s)
        n, k, k2, t, kt = (FIT_KEEP * v for v in self._fit)
        self._fit = (n + 1.0, k + sent, k2 + sent * sent, t + fixed_s, kt + sent * fixed_s)
        base = self.fixed_s
        n, k, k2, t, kt = self._fit
        var = k2 / n - (k / n) ** 2
        if var >= FIT_MIN_VAR:
            slope = max(0.0, (kt / n - (k / n) * (t / n)) / var)
            intercept = t / n - slope * k / n
            if intercept > 0:
                self.verify_s, base = slope, intercept
        if self.step_s is not None:
            self.cost = (self.step_s + self.verify_s) / base

    def settled(self, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and ``accepted`` of them were kept."""
        if not self.adaptive or self.start == 0:
            return
        if drafted == 0:
            if self.ceiling == 0:  # drafting does not pay: probe now and then
                self._idle += 1
                if self._idle >= self._probe_every:
                    self.ceiling, self._idle, self._probing = 1, 0, True
            return
        for x in [1.0] * accepted + ([0.0] if accepted < drafted else []):
            self.rate += STEP * (x - self.rate)
        probing, self._probing = self._probing, False
        self.ceiling = best_length(self.rate, self.cost, self.cap, lo=0)
        if self.ceiling == 0 and probing:
            self._probe_every = min(2 * self._probe_every, MAX_PROBE)
        elif self.ceiling > 0:
            self._probe_every = PROBE

    def adopt(self, other: DraftLength) -> None:
        """With ``measure``, start from what ``other`` (an earlier generation's
        policy, measuring too) learned: its costs, and where both adapt their
        lengths its acceptance estimate, probing interval and the rounds since its
        last probe (generations shorter than the interval still probe); a fixed
        length keeps its length and takes the costs only (how far to speculate). A
        policy with a set cost adopts nothing: its lengths depend on its own
        generation only, so a seeded generation stays reproducible."""
        if not (self.measure and other.measure) or self.start == 0:
            return
        self.step_s, self.fixed_s, self.cost = other.step_s, other.fixed_s, other.cost
        self.verify_s, self._fit = other.verify_s, other._fit
        if not self.adaptive:
            return
        if other.adaptive:
            self.rate = other.rate
            self._probe_every, self._idle = other._probe_every, other._idle
        self.ceiling = min(self.start, best_length(self.rate, self.cost, self.cap, lo=0))
