"""How many tokens a round drafts: a ceiling adapted from recent acceptance, and a
stop when the draft is unsure.

A fixed draft length wastes the draft model's work when acceptance is low (most
drafted tokens are rejected and their forwards thrown away) and leaves speed unused
when it is high. :class:`DraftLength` does what transformers' assisted generation
does, on by default:

* **The ceiling follows acceptance** (transformers' ``"heuristic"`` schedule): +2
  after a round whose every draft was accepted, -1 after a rejection, between 1 and
  ``cap``.
* **The draft stops when it is unsure** (transformers'
  ``assistant_confidence_threshold``): once a drafted token had probability below
  ``confidence`` under the row it was drawn from, that token is kept and no more
  are drafted this round.

Why the output law stays exact. Verification makes position *i* follow the target
whatever was drafted there, provided the drafted token itself is a draw from the
proposal row the cloud is told about. So a round may stop drafting at any point
chosen from what is known *before* the next token is drawn: the history (past
verdicts, which set the ceiling) and the tokens drawn so far (the confidence stop
looks at a token already kept). What it must never do is draw a token and then
drop it because of its value; "cut the block before the unsure token" looks
harmless but skews position *i* towards the tokens the draft is sure of (the law
tests carry it as a control that fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: transformers' ``assistant_confidence_threshold`` default
DEFAULT_CONFIDENCE = 0.4
#: the adaptive ceiling's upper bound by default
DEFAULT_CAP = 16


@dataclass
class DraftLength:
    """One generation's draft-length policy (pure: fed verdicts, asked lengths).

    ``start``: the first round's ceiling (the fixed length when ``adaptive`` is off);
    ``cap``: the ceiling's upper bound; ``confidence``: the stop threshold (0: never
    stop early).
    """

    start: int = 4
    cap: int = DEFAULT_CAP
    confidence: float = DEFAULT_CONFIDENCE
    adaptive: bool = True
    #: this round's ceiling
    ceiling: int = field(init=False)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"draft length must be >= 0, got {self.start}")
        if self.cap < 1:
            raise ValueError(f"the draft-length cap must be >= 1, got {self.cap}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"draft confidence must be in [0, 1), got {self.confidence}")
        self.ceiling = self.start if not self.adaptive else min(max(self.start, 1), self.cap)
        if self.start == 0:
            self.ceiling = 0  # 0 means "never draft" in either mode

    @property
    def stop_below(self) -> float:
        """The probability under which a drafted token ends the round's drafting."""
        return self.confidence if self.adaptive else 0.0

    def settled(self, drafted: int, accepted: int) -> None:
        """A round drafted ``drafted`` tokens and ``accepted`` of them were kept."""
        if not self.adaptive or drafted == 0 or self.ceiling == 0:
            return
        if accepted >= drafted:
            self.ceiling = min(self.ceiling + 2, self.cap)
        else:
            self.ceiling = max(self.ceiling - 1, 1)
