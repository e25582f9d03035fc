"""``GenerationConfig``: every setting of one generation, in one validated value.

The same settings used to travel as loose keyword arguments through
:class:`~xcosd.nodes.EdgeNode`, its ``generate`` / ``stream`` and the CLI, each
place checking (or not) what it understood. A frozen dataclass checked once, on
construction, means a wrong setting fails where it is written, with a message
that names it, instead of deep inside a session or, worse, being dropped.

Field names follow ``transformers.GenerationConfig`` where the two overlap
(``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``,
``stop_strings``), so code written for one reads naturally with the other. Two
differences, both deliberate: ``top_k=0`` means "off" (transformers defaults to 50,
which would change the distribution being preserved), and ``temperature=0`` is
accepted as greedy (like ``do_sample=False``).

The internal representation of the warpers stays :class:`~xcosd.sampling.SamplingParams`
(:meth:`GenerationConfig.sampling_params`), which both sides of a session apply.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .policies.draft_length import DEFAULT_CAP, DEFAULT_CONFIDENCE, DEFAULT_COST
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .protocol.messages import Welcome
    from .protocol.session_settings import SessionSettings

#: the method options a GenerationConfig carries, as fields (None: the method's default)
METHOD_OPTION_FIELDS = ("K", "M", "hr_presample", "threshold")


def method_option_names(method: str) -> frozenset[str]:
    """The options ``method`` takes (``xcosd-e``: K, M, hr_presample ...)."""
    from .methods import METHODS

    try:
        cls = METHODS[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}") from None
    return frozenset(cls().options())


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate: method, codec, draft length, sampling, length, stops, seed.

    * ``method``: one of :data:`xcosd.methods.METHODS` (``xcosd-e``, ``xcosd`` ...);
      ``codec``: a codec name (``f32``, ``q8``, ``topk:64+zstd`` ...).
    * ``draft_len``: tokens the first round drafts (``d``); with ``adaptive_draft``
      (the default) each later round drafts the length, up to ``max_draft_len``,
      that maximises the expected tokens per second at the acceptance seen so far
      (0 where drafting does not pay), ``draft_cost`` being a draft step's cost over
      a round's fixed cost (round trip plus verification), or ``"auto"``: measured
      by the node as it goes (the lengths then depend on timing). ``None`` (the
      default): ``"auto"`` for an unseeded generation, the fixed
      :data:`~xcosd.policies.draft_length.DEFAULT_COST` for a seeded one, whose
      output must not depend on timing. ``draft_confidence`` > 0 also stops a
      round after a token the draft gave a probability below it
      (:class:`~xcosd.policies.draft_length.DraftLength`; exact either way).
      ``adaptive_draft=False`` drafts ``draft_len`` tokens every round.
    * ``speculate``: while a block's verdict is in flight the device drafts on, as
      if the block were accepted whole and the bonus were the draft's next token,
      as many steps as the measured wait has room for, up to the next block (a
      fixed length speculates too); when the verdict takes
      that path the next round's drafts are ready (:class:`~xcosd.nodes.drafter.Drafter`;
      exact either way). ``None`` (the default): on for an unseeded generation,
      off for a seeded one (how far it gets depends on timing).
    * ``tree``: draft a tree of candidates per round instead of a chain
      (``docs/METHODS.md``, "Draft trees"): a shape (``"3x2"``: three candidates,
      each with two; ``"spine:4x2x2"``; ``"chain:4"``), or ``"auto"``: the tree
      policy picks each round's shape from the measured acceptance per sibling rank,
      a chain or ``ar`` where a tree does not pay
      (:class:`~xcosd.policies.tree_policy.RankRates`). ``None`` (the default): chains,
      by the draft-length policy above. A cloud that verifies no trees (its
      ``max_tree`` is 0) gets chains; one that verifies smaller trees gets the shape
      pruned to its limit. ``tree_row_codec``: how the draft rows the cloud's
      residuals need cross (``head:64`` by default: a row of at most 64 non-zeros
      whole, else its 64 likeliest tokens and the rest's mass spread flat, the
      row the draft then proposes from; ``sparse`` sends every non-zero, hundreds
      of KB for a dense T = 1 row; the law is exact whatever the codec);
      ``tree_distinct=False`` draws siblings i.i.d. instead of without replacement.
    * ``do_sample=False`` is greedy decoding (temperature, top-k and top-p are then
      ignored); ``temperature`` (0: greedy too), ``top_k`` (0: off), ``top_p`` (1: off).
    * ``max_new_tokens``: target tokens to generate at most.
    * ``ignore_eos``: the target's end tokens (end of sequence, end of turn) do not
      end the generation, which runs to ``max_new_tokens`` or a stop string
      (vLLM's sampling parameter of that name: benchmarks use it for outputs of a
      fixed length). The tokens drawn are the same, the end token included: only
      where the output ends differs.
    * ``stop_strings``: generation stops once the output text contains one of them;
      the text up to and including it is returned (``finish_reason == "stop"``).
    * ``seed``: seeds both halves of a session (``None``: fresh entropy).
    * ``timeout_s``: the whole generation's deadline (``None``: none beyond the
      node's own deadline on every wait); past it ``generate`` raises
      :class:`TimeoutError` and the session is closed.
    * ``max_uplink_bytes``: the most wire bytes the generation may send the cloud
      (``None``: no bound). A message that would pass it is not sent: the
      generation ends with :class:`~xcosd.errors.BudgetError` instead, so a
      setting that makes the edge send a lot (a vector-sending method, long
      drafts) costs the device's link at most this (the HTTP API sets it per
      request: ``docs/API.md``).
    * ``K``, ``M`` (``xcosd-e``), ``hr_presample`` (``xcosd``, ``xcosd-e``),
      ``threshold`` (``uhlm``): the method's own options; ``None`` keeps the method's
      default, and setting one the method does not take is an error.
    """

    method: str = "xcosd-e"
    codec: str = "f32"
    draft_len: int = 4
    adaptive_draft: bool = True
    draft_confidence: float = DEFAULT_CONFIDENCE
    max_draft_len: int = DEFAULT_CAP
    draft_cost: float | str | None = None
    speculate: bool | None = None
    tree: str | None = None
    tree_row_codec: str | None = None
    tree_distinct: bool = True
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    timeout_s: float | None = None
    max_uplink_bytes: int | None = None
    K: int | None = None
    M: int | None = None
    hr_presample: bool | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        # accept one string or any iterable of strings; store a tuple (hashable, frozen)
        stops = self.stop_strings
        if isinstance(stops, str):
            stops = (stops,)
        elif stops is None:
            stops = ()
        if not isinstance(stops, Iterable):
            raise ValueError(f"stop_strings must be a string or a list of strings, got {stops!r}")
        stops = tuple(stops)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop_strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop_strings", stops)
        self._validate()

    def resolved_draft_cost(self) -> float | str:
        """``draft_cost`` as a session takes it: ``None`` is ``"auto"`` unless the
        generation is seeded (a seeded output must not depend on timing)."""
        if self.draft_cost is not None:
            return self.draft_cost
        return "auto" if self.seed is None else DEFAULT_COST

    def resolved_speculate(self) -> bool:
        """``speculate`` as the node takes it: ``None`` is on unless the generation
        is seeded."""
        return self.seed is None if self.speculate is None else self.speculate

    def _validate_tree(self) -> None:
        from .codecs import get_codec
        from .errors import CodecError
        from .methods import get_method
        from .methods.tree import TreeShape, check_tree_method

        if not isinstance(self.tree, str):
            raise ValueError(f"tree must be a shape such as '3x2', 'spine:4x2', 'chain:4' or "
                             f"'auto', got {self.tree!r}")
        if self.tree != "auto":
            TreeShape.parse(self.tree)  # its ValueError names the forms
        try:
            check_tree_method(get_method(self.method, codec=self.codec,
                                         **self.method_options()))
        except CodecError as e:
            raise ValueError(e.message) from None
        if self.tree_row_codec is not None:
            try:
                get_codec(self.tree_row_codec)
            except CodecError as e:
                raise ValueError(f"tree_row_codec: {e.message}") from None

    def _validate(self) -> None:
        from .codecs import get_codec
        from .errors import CodecError
        from .methods import get_method

        if not isinstance(self.method, str):
            raise ValueError(f"method must be a name, got {self.method!r}")
        takes = method_option_names(self.method)
        try:
            get_codec(self.codec)
        except CodecError as e:
            raise ValueError(e.message) from None
        _check_int("draft_len", self.draft_len, 0)
        _check_int("max_draft_len", self.max_draft_len, 1)
        if not isinstance(self.adaptive_draft, bool):
            raise ValueError(f"adaptive_draft must be True or False, got {self.adaptive_draft!r}")
        if (isinstance(self.draft_confidence, bool)
                or not isinstance(self.draft_confidence, int | float)
                or not 0.0 <= self.draft_confidence < 1.0):
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence!r}")
        if self.draft_cost not in (None, "auto") and (
                isinstance(self.draft_cost, bool) or not isinstance(self.draft_cost, int | float)
                or not 0.0 <= self.draft_cost < 1e6):
            raise ValueError(f"draft_cost must be a number >= 0, 'auto' or None, got "
                             f"{self.draft_cost!r}")
        if self.tree is not None:
            self._validate_tree()
        if not isinstance(self.tree_distinct, bool):
            raise ValueError(f"tree_distinct must be True or False, got {self.tree_distinct!r}")
        if self.speculate not in (None, True, False):
            raise ValueError(f"speculate must be True, False or None, got {self.speculate!r}")
        if self.speculate and self.seed is not None:
            raise ValueError("speculate=True with a seed: how far speculation gets depends "
                             "on timing, so a seeded output would not be reproducible")
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        _check_int("top_k", self.top_k, 0)
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float)
                or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.timeout_s is not None and (
                isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
                or not self.timeout_s > 0 or not math.isfinite(self.timeout_s)):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if self.max_uplink_bytes is not None:
            _check_int("max_uplink_bytes", self.max_uplink_bytes, 1)
        given = self.method_options()
        wrong = sorted(set(given) - takes)
        if wrong:
            takes_s = ", ".join(sorted(takes)) if takes else "no options"
            raise ValueError(f"method {self.method!r} does not take {', '.join(wrong)} "
                             f"(it takes {takes_s})")
        for name in ("K", "M"):
            v = given.get(name)
            if v is not None:
                _check_int(name, v, 1)
        if "hr_presample" in given and not isinstance(given["hr_presample"], bool):
            raise ValueError(f"hr_presample must be True or False, got {given['hr_presample']!r}")
        th = given.get("threshold")
        if th is not None and (isinstance(th, bool) or not isinstance(th, int | float)
                               or not 0.0 <= th <= 1.0):
            raise ValueError(f"threshold must be in [0, 1], got {th!r}")
        try:  # whatever else the method itself refuses (a codec it cannot use ...)
            get_method(self.method, codec=self.codec, **given)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None

    # -- views -------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def method_options(self) -> dict[str, Any]:
        """The method options that were set (the rest keep the method's defaults)."""
        return {k: getattr(self, k) for k in METHOD_OPTION_FIELDS if getattr(self, k) is not None}

    def sampling_params(self) -> SamplingParams:
        """The warpers both sides apply: greedy is ``temperature=0`` with the others off."""
        if self.greedy:
            return SamplingParams(0.0, 0, 1.0)
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p))

    def session_settings(self, welcome: Welcome) -> SessionSettings:
        """What a session runs with (:class:`~xcosd.protocol.SessionSettings`): this
        config resolved (the method built, the warpers, the draft cost) within the
        limits of the cloud whose ``welcome`` the connection got (its ``max_draft``,
        ``max_tree`` and end tokens, which ``ignore_eos`` leaves out). The one place
        a config's fields become a session's."""
        from .methods import get_method
        from .protocol.session_settings import SessionSettings

        method = get_method(self.method, codec=self.codec, **self.method_options())
        return SessionSettings.under(
            welcome, method, params=self.sampling_params(),
            max_new_tokens=self.max_new_tokens, seed=self.seed, draft_len=self.draft_len,
            adaptive_draft=self.adaptive_draft, draft_confidence=self.draft_confidence,
            max_draft_len=self.max_draft_len, draft_cost=self.resolved_draft_cost(),
            tree=self.tree, tree_row_codec=self.tree_row_codec,
            tree_distinct=self.tree_distinct, **({"stop_ids": ()} if self.ignore_eos else {}))

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with ``changes`` (validated again). Changing the method drops the
        method options the new method does not take, so ``replace(method="xcosd")``
        on an ``xcosd-e`` config with ``K=5`` is not an error; naming such an option
        in the same call still is."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown generation setting(s): {', '.join(unknown)}")
        if "method" in changes and changes["method"] != self.method:
            takes = method_option_names(changes["method"])
            for k in METHOD_OPTION_FIELDS:
                if k not in takes and k not in changes:
                    changes[k] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-able (``stop_strings`` as a list): how a config travels to
        another process (the load tester's device processes) or into a report;
        :meth:`from_dict` reads it back to an equal config."""
        d = dataclasses.asdict(self)
        d["stop_strings"] = list(self.stop_strings)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GenerationConfig:
        """The config :meth:`to_dict` wrote (validated again, as any construction).

        An unknown key is a ValueError naming it, not a TypeError from ``__init__``:
        a dict comes from a file or a pipe, and a misspelt setting there must fail
        with the same kind of message as a wrong value."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown generation setting(s): {', '.join(unknown)}")
        return cls(**dict(d))

    @classmethod
    def from_kwargs(cls, base: GenerationConfig | None = None,
                    **kw: Any) -> GenerationConfig:
        """``base`` (or the defaults) updated with transformers-style keyword names:
        ``stop`` is an alias of ``stop_strings``; ``None`` values are ignored (not
        given)."""
        kw = {k: v for k, v in kw.items() if v is not None}
        if "stop" in kw:
            if "stop_strings" in kw:
                raise ValueError("give stop or stop_strings, not both")
            kw["stop_strings"] = kw.pop("stop")
        base = base if base is not None else cls()
        return base.replace(**kw) if kw else base


def _check_int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def as_config(obj: GenerationConfig | Mapping[str, Any] | None) -> GenerationConfig:
    """A GenerationConfig from a config, a mapping of its fields, or ``None`` (defaults)."""
    if obj is None:
        return GenerationConfig()
    if isinstance(obj, GenerationConfig):
        return obj
    return GenerationConfig.from_dict(obj)
