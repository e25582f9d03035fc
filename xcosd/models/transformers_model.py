"""Hugging Face causal language models behind :class:`~xcosd.models.base.LanguageModel`.

:class:`TransformersModel` wraps ``AutoModelForCausalLM`` loaded from a local
directory or a GGUF file (``gguf_file=``, dequantised by transformers), on CPU by
default. It keeps a KV cache per session and verifies many sessions in **one**
forward pass.

Cache layout. Each session keeps, per layer, preallocated key and value buffers
``(1, heads, capacity, head_dim)`` whose first ``length`` positions hold every
context token fed so far, so each position is computed once: a call feeds only
the tokens appended since (a draft step, one token; a round, the resolved or
bonus token plus the drafts). The model's cache update writes the new states
into the buffers in place (:class:`_Slab`, a transformers cache layer) and
attends over views of them, so a step copies nothing already cached; a buffer
that fills is doubled (amortised, one copy per doubling). Only when nothing was
appended (a rollback into the cached part, then a score) is the last cached
token fed again, because the first row a call returns is the distribution after
the context as it is. Rolling back after a rejection only lowers ``length``.
Keeping the full history (never a sliding-window ring) makes that exact for
every architecture; sliding-window layers still see only their window through
the attention mask.

Batching. One forward scores every session: new tokens are right-padded and
explicit position ids keep every session's positions its own. For the
architectures in :data:`SESSION_ATTENTION_TYPES` the projections and MLPs run on
the batch while the attention runs session by session (:func:`_session_attention`,
registered with transformers and switched on for the call): each session's new
states go straight into its own buffers and its queries attend over them, so no
history is copied. Other architectures gather the caches into one batch buffer
per layer, left-padded to a common length with room for the new states after it
(the one copy of the history such a call makes; a 2-D attention mask hides both
paddings), and copy only the new states back. :attr:`TransformersModel.copy_s`
counts the seconds spent copying, for the benchmark's copy share. Batched and
one-by-one scoring agree to float32 rounding (the tests check 1e-4).

Rows. The output head runs only on the positions whose rows a call returns
(``logits_to_keep``; in a batch, from the first such position of any session to
the end of the padded block): the other fed positions (a prompt, a context
appended without scoring) need their keys and values, not rows, and a 262k-id
head costs more than the rest of a small model's forward.

Start state. A model whose tokenizer adds a BOS gets it in front of every
context; a session with an empty prompt starts from BOS (or EOS when there is
none, the document separator of GPT-2-style models). The BOS is internal:
``session.ids`` and the lengths given to :meth:`rollback` count only real ids.

torch and transformers are imported only here, so ``import xcosd.models`` stays
light.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError

try:
    from transformers import AttentionInterface, DynamicCache
    from transformers.cache_utils import DynamicLayer
except ImportError as e:  # the cache layers below subclass transformers' own
    raise ModelError("the transformers backend needs: pip install 'xcosd[models]'") from e
from ..vocab import Vocabulary, vocabulary_from_hf
from . import model_cache
from .base import Session
from .prefix_cache import Cached, best_donor, victim

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


#: a session buffer's first capacity, in positions (then doubled as needed)
MIN_CAPACITY = 64
#: the buffers ended sessions keep for later ones by default (``prefix_cache_bytes``)
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20


@dataclass(eq=False)
class _KV(Cached):
    """A session's cache: per layer, (key, value) buffers whose first ``length``
    positions hold ``prefix + ids[:n]``, where ``n = session.cached``."""

    bufs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        """The memory its buffers take."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in self.bufs)

    def crop(self, n: int) -> None:
        self.length = min(self.length, n)

    def reserve(self, n: int, like: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Room for ``n`` positions in every layer (buffers shaped as ``like``'s
        layers, ``(batch, heads, positions, head_dim)``, when there are none yet)."""
        if not self.bufs:
            cap = max(MIN_CAPACITY, n)
            self.bufs = [(k.new_empty((1, k.shape[1], cap, k.shape[3])),
                          v.new_empty((1, v.shape[1], cap, v.shape[3]))) for k, v in like]
            return
        cap = int(self.bufs[0][0].shape[-2])
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        grown = []
        for k, v in self.bufs:
            k2 = k.new_empty((1, k.shape[1], cap, k.shape[3]))
            v2 = v.new_empty((1, v.shape[1], cap, v.shape[3]))
            k2[:, :, : self.length] = k[:, :, : self.length]
            v2[:, :, : self.length] = v[:, :, : self.length]
            grown.append((k2, v2))
        self.bufs = grown

    def write(self, at: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
              row: int = 0, lo: int = 0, hi: int | None = None) -> None:
        """Copy positions ``lo:hi`` of batch row ``row`` of ``layers`` into the
        buffers at ``at`` (room reserved first); ``length`` becomes their end."""
        hi = int(layers[0][0].shape[-2]) if hi is None else hi
        self.reserve(at + hi - lo, layers)
        for (kb, vb), (k, v) in zip(self.bufs, layers, strict=True):
            kb[:, :, at: at + hi - lo] = k[row: row + 1, :, lo:hi]
            vb[:, :, at: at + hi - lo] = v[row: row + 1, :, lo:hi]
        self.length = at + hi - lo


#: the attention implementation a batched call switches to (:func:`_session_attention`)
SESSIONS_ATTENTION = "xcosd-sessions"
#: model types whose attention layers update the cache and then call the attention
#: interface with (query, key, value, mask, scaling=, sliding_window=) and nothing
#: else in between: for them a batched call attends session by session (no gather)
SESSION_ATTENTION_TYPES = frozenset({"llama", "gemma3_text", "mistral", "qwen2", "qwen3"})


@dataclass
class _Batch:
    """A batched call's sessions, as the attention reads them."""

    kvs: list[_KV]
    past: list[int]
    lens: list[int]
    #: seconds spent writing the new states into the sessions' buffers
    copy_s: float = 0.0
    #: each session's attention mask, by (session, sliding window): the same for
    #: every layer with that window, so made once per call
    masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def mask(self, i: int, window: int | None, device: torch.device) -> torch.Tensor:
        """Session ``i``'s new positions may see every earlier position (within
        ``window``, when given): ``(1, 1, new, past + new)``, True where allowed."""
        key = (i, window)
        if key not in self.masks:
            past, n = self.past[i], self.past[i] + self.lens[i]
            at = torch.arange(past, n, device=device).unsqueeze(1)  # query positions
            keys = torch.arange(n, device=device).unsqueeze(0)
            allowed = keys <= at
            if window is not None:
                allowed &= keys > at - window
            self.masks[key] = allowed[None, None]
        return self.masks[key]


_current = threading.local()


def _session_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float | None = None, sliding_window: int | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for a batched call without a batch cache: each session's queries
    attend over views of its own buffers (which :class:`_Sessions` has just written
    the new states into), with its own causal (and sliding-window) mask. The batch
    still shares every projection and MLP; only this step runs per session."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch: _Batch = _current.batch
    li = int(module.layer_idx)  # type: ignore[arg-type]
    b, heads, f, _ = query.shape
    out = query.new_zeros((b, f, heads, value.shape[-1]))
    window = None if sliding_window is None else int(sliding_window)
    for i, kv in enumerate(batch.kvs):
        m = batch.lens[i]
        n = batch.past[i] + m
        kb, vb = kv.bufs[li]
        o, _ = sdpa_attention_forward(module, query[i: i + 1, :, :m], kb[:, :, :n], vb[:, :, :n],
                                      batch.mask(i, window, query.device), scaling=scaling,
                                      is_causal=False, **kwargs)
        out[i, :m] = o[0]
    return out, None


AttentionInterface.register(SESSIONS_ATTENTION, _session_attention)

#: the attention implementation a tree call switches to (:func:`_tree_attention`)
TREE_ATTENTION = "xcosd-tree"


@dataclass
class _Tree:
    """A tree call's mask: which fed position each new query may see, by its
    ancestry, and the positions for a sliding window."""

    allowed: torch.Tensor  # (new, past + new) bool
    q_pos: torch.Tensor  # (new, 1) the queries' positions
    k_pos: torch.Tensor  # (1, past + new) the keys' positions
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            m = self.allowed
            if window is not None:
                m = m & (self.k_pos > self.q_pos - window)
            self.masks[window] = m[None, None]
        return self.masks[window]


def _tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, sliding_window: int | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for a tree call: each node's query sees the cached context, the
    context fed with it and its own ancestors (:class:`_Tree`), not its siblings'
    branches, so every node's row is the one its path alone would give."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tree: _Tree = _current.tree
    window = None if sliding_window is None else int(sliding_window)
    return sdpa_attention_forward(module, query, key, value, tree.mask(window),
                                  scaling=scaling, is_causal=False, **kwargs)


AttentionInterface.register(TREE_ATTENTION, _tree_attention)


class _Sessions(DynamicLayer):
    """One layer of a batched call's cache that is no tensor: ``update`` writes each
    session's new states into that session's buffers (room reserved before the
    call) and :func:`_session_attention` attends over them. ``keys`` is a
    zero-size stand-in with the batch's shape, for the mask sizes."""

    def __init__(self, batch: _Batch, li: int, like: torch.Tensor, p_max: int) -> None:
        super().__init__()
        self.batch, self.li = batch, li
        shape = (len(batch.kvs), like.shape[1], p_max, like.shape[3])
        self.keys = self.values = like.new_zeros(()).expand(shape)
        self.device = like.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        t0 = time.perf_counter()
        for i, kv in enumerate(b.kvs):
            kb, vb = kv.bufs[self.li]
            kb[:, :, b.past[i]: b.past[i] + b.lens[i]] = key_states[i: i + 1, :, : b.lens[i]]
            vb[:, :, b.past[i]: b.past[i] + b.lens[i]] = value_states[i: i + 1, :, : b.lens[i]]
        b.copy_s += time.perf_counter() - t0
        return key_states, value_states


class _Slab(DynamicLayer):
    """One layer's cache in a preallocated buffer whose first ``n`` positions are
    cached: the model's ``update`` writes the new states after them in place and
    attends over a view, instead of concatenating (a copy of the whole history)."""

    def __init__(self, kb: torch.Tensor, vb: torch.Tensor, n: int) -> None:
        super().__init__()
        self.kb, self.vb, self.n = kb, vb, n
        self.keys, self.values = kb[:, :, :n], vb[:, :, :n]
        self.device = kb.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        m = int(key_states.shape[-2])
        self.kb[:, :, self.n: self.n + m] = key_states
        self.vb[:, :, self.n: self.n + m] = value_states
        self.n += m
        self.keys, self.values = self.kb[:, :, : self.n], self.vb[:, :, : self.n]
        return self.keys, self.values


def trained_context(config: Any) -> int:
    """The positions a Hugging Face config says its model was trained for (0: none
    said): ``max_position_embeddings``, or GPT-2's ``n_positions``."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    text = getattr(config, "text_config", None)  # a multimodal config's language model
    return trained_context(text) if text is not None and text is not config else 0


class TransformersModel:
    """A Hugging Face causal LM with per-session KV caches and batched scoring.

    Build with :meth:`from_pretrained` (a local model directory) or
    :meth:`from_gguf` (a ``.gguf`` file), or wrap an already-loaded model and
    tokenizer. ``device`` and ``dtype`` follow torch (``"cpu"``, ``"cuda"``;
    ``"float32"``, ``"bfloat16"`` ...); rows are always float32 probabilities.
    ``context``: the positions one session may hold (default: the model's trained
    context, its config's ``max_position_embeddings``; at most that). Caches grow
    with what a session holds, so no memory is set aside for it.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None,
                 vocab: Vocabulary | None = None, device: str | torch.device | None = None,
                 prefix_reuse: bool = True,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 context: int | None = None) -> None:
        #: the positions the model was trained for (0: its config does not say)
        self.trained_context = trained_context(model.config)
        if context is not None and int(context) < 1:
            raise ModelError(f"context must be >= 1 position, got {context}")
        if context is not None and 0 < self.trained_context < int(context):
            raise ModelError(f"context={context} is longer than the {self.trained_context} "
                             f"positions {name or 'the model'} was trained for")
        #: the positions one session may hold (0: no bound known)
        self.context = int(context) if context is not None else self.trained_context
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if device is not None:
            self.model.to(self.device)
        out = model.get_output_embeddings()
        width = int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)
        v = vocab or vocabulary_from_hf(tokenizer, name=name)
        if v.size < width:  # padded embedding rows: ids with no token
            v = v.with_size(width)
        elif v.size > width:
            raise ModelError(f"{v.name}: tokenizer has {v.size} ids but the model scores {width}")
        self.vocab = v
        self.name = name or v.name
        unused = np.array([b is None for b in v.tokens], dtype=bool)
        self._unused = torch.from_numpy(unused).to(self.device) if unused.any() else None
        bos = v.roles.get("bos")
        probe = list(tokenizer.encode("a", add_special_tokens=True))
        self._add_bos = bos is not None and len(probe) > 0 and probe[0] == bos
        start = bos if bos is not None else v.roles.get("eos")
        self._start = start
        self._pad = int(v.roles.get("pad", start if start is not None else 0))
        # transformers renamed ``past_key_values`` to ``cache``; pass whichever this one takes
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the output head runs only on the positions whose rows are asked for: a
        # prompt's other positions need states, not rows (the head of a 262k
        # vocabulary costs more than the rest of a small model's forward)
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        #: seconds batched calls spent copying caches (gathering them into the batch,
        #: copying the new states back): the benchmark's copy share
        self.copy_s = 0.0
        #: batched calls attend session by session over the sessions' own buffers
        #: (no gather) where the architecture is known to allow it
        self.per_session = getattr(model.config, "model_type", None) in SESSION_ATTENTION_TYPES
        self._configs = list({id(m.config): m.config for m in model.modules()
                              if hasattr(m, "layer_idx") and hasattr(m, "config")}.values())
        # a batched call switches the model's attention implementation for its
        # duration: one forward at a time on this instance (an instance used as both
        # draft and target, by two threads, must not see the other's switch)
        self._lock = threading.Lock()
        #: whether ended sessions' caches stay for later sessions that start with the
        #: same tokens, up to ``prefix_cache_bytes`` of buffers (``_retire``)
        self.prefix_reuse = bool(prefix_reuse)
        self.prefix_cache_bytes = int(prefix_cache_bytes)
        #: live sessions' caches (donors to copy from; weakly: a session dropped
        #: without ``end`` takes its buffers with it) and retired ones, least
        #: recently used first; ``_pool`` guards both (ends and starts come from
        #: the cloud's worker thread, the edge's draft thread, the event loop)
        self._live: weakref.WeakValueDictionary[int, _KV] = weakref.WeakValueDictionary()
        self._retired: OrderedDict[int, _KV] = OrderedDict()
        self._pool = threading.Lock()
        #: positions a session took from another's cache instead of computing, and
        #: positions fed to forwards (for the benches and tests)
        self.reused_tokens = 0
        self.tokens_fed = 0

    def __repr__(self) -> str:
        return f"TransformersModel({self.name!r}, vocab={self.vocab.size}, device={self.device})"

    @property
    def context_tokens(self) -> int:
        """The most ids one session may hold, its prompt and all it generates: the
        context less the BOS put in front of it (0: no bound known). The cloud's
        ``ServerLimits.context``: a longer session is refused before any compute,
        where past its trained positions the model would compute rows it never learned."""
        if not self.context:
            return 0
        return self.context - (1 if self._add_bos else 0)

    # -- loading ---------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None,
                        device: str = "cpu", dtype: str | torch.dtype | None = None,
                        name: str | None = None, attn_implementation: str | None = None,
                        threads: int | None = None, cache: bool | None = None,
                        context: int | None = None, **kw: Any) -> TransformersModel:
        """Load a local model directory (``config.json``, weights, tokenizer), or
        the GGUF file ``gguf_file`` inside ``path``. Never downloads.

        A GGUF file is converted once and kept in the model cache
        (:mod:`xcosd.models.model_cache`); ``cache=False`` (or
        ``$XCOSD_NO_MODEL_CACHE=1``) loads it from the file every time.
        ``threads`` sets torch's intra-op thread count (process-wide): on a small,
        shared CPU one thread per forward is often faster than oversubscribing.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads is not None:
            torch.set_num_threads(max(1, int(threads)))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        td = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if isinstance(dtype, str) and td is None:
            raise ModelError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
        td = td if td is not None else torch.float32
        default = Path(gguf_file).stem if gguf_file else Path(path).name
        extra: dict[str, Any] = {"local_files_only": True}
        if attn_implementation is not None:
            extra["attn_implementation"] = attn_implementation
        entry = None
        if gguf_file is not None and model_cache.enabled(cache):
            try:
                entry, ident = model_cache.entry_dir(Path(path) / gguf_file, td)
            except OSError as e:
                log.warning("model cache unavailable for %s: %s", gguf_file, e)
            else:
                hit = model_cache.load(entry, ident, name=name or default, dtype=td,
                                       **{k: v for k, v in extra.items()
                                          if k != "local_files_only"}, **kw)
                if hit is not None:
                    return cls(hit[0], hit[1], name=name or default, vocab=hit[2], device=device,
                               context=context)
        if gguf_file is not None:
            extra["gguf_file"] = gguf_file
        try:
            tok = AutoTokenizer.from_pretrained(str(path), **extra)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=td, **extra, **kw)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelError(f"cannot load a causal LM from {path}"
                             f"{' / ' + gguf_file if gguf_file else ''}: {e}") from e
        out = cls(model, tok, name=name or default, device=device, context=context)
        if entry is not None:
            model_cache.store(entry, ident, out.model, tok, out.vocab)
        return out

    @classmethod
    def from_gguf(cls, file: str | Path, **kw: Any) -> TransformersModel:
        """Load a ``.gguf`` file (quantised weights are dequantised on load)."""
        p = Path(file)
        if not p.is_file():
            raise ModelError(f"no GGUF file at {p}")
        return cls.from_pretrained(p.parent, gguf_file=p.name, **kw)

    # -- the LanguageModel interface -------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """A chat rendered by the tokenizer's own chat template, the generation
        prompt added, as the ids :meth:`start` is given: the template's leading
        start token is left out when :meth:`start` adds it anyway, so the context is
        exactly the template's ids, as transformers' ``generate`` sees them. A
        tokenizer without a template raises :class:`~xcosd.errors.ModelError`."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(f"{self.name}: the tokenizer has no chat template",
                             code="unsupported")
        out = self.tokenizer.apply_chat_template([dict(m) for m in messages],
                                                 add_generation_prompt=True, tokenize=True)
        if not isinstance(out, list):  # a BatchEncoding in newer transformers
            out = out["input_ids"]
        ids = [int(i) for i in out]
        if self._add_bos and ids and ids[0] == self._start:
            ids = ids[1:]
        return ids

    def start(self, prompt_ids: Sequence[int]) -> Session:
        ids = [int(i) for i in prompt_ids]
        self._check(ids)
        prefix = [self._start] if self._start is not None and (self._add_bos or not ids) else []
        kv = _KV(prefix=prefix, ids=ids)
        with self._pool:
            self._live[id(kv)] = kv
        return Session(ids=ids, cached=0, cache=kv)

    def append(self, session: Session, ids: Sequence[int]) -> None:
        new = [int(i) for i in ids]
        self._check(new)
        session.ids.extend(new)

    def rollback(self, session: Session, length: int) -> None:
        if length < 0:
            raise ValueError(f"rollback length must be >= 0, got {length}")
        kv = self._kv(session)
        del session.ids[length:]
        keep = len(kv.prefix) + len(session.ids)
        if kv.length > keep:
            kv.crop(keep)
        session.cached = max(0, kv.length - len(kv.prefix))

    def end(self, session: Session) -> None:
        kv = session.cache
        if isinstance(kv, _KV):
            self._retire(kv)
        session.ids = []
        session.cached = 0
        session.cache = None

    def cached_prefix(self, prompt_ids: Sequence[int], tenant: str = "") -> int:
        """How many of ``prompt_ids`` a session started with them would take from a
        cached prefix instead of computing."""
        if not self.prefix_reuse:
            return 0
        prefix = [self._start] if self._start is not None and (
            self._add_bos or not prompt_ids) else []
        with self._pool:
            found = best_donor([*prefix, *prompt_ids], [*self._retired.values(),
                                                         *self._live.values()],
                               _KV.cells, lambda r: r.tokens is not None, lambda r: r.tenant,
                               tenant)
        if found is None:
            return 0
        return max(0, found[1] - len(prefix))

    def _retire(self, kv: _KV) -> None:
        """An ended session's buffers stay for a later session that starts with the
        same tokens, within ``prefix_cache_bytes`` (retired ones give way by the fair
        share's pick, :func:`~xcosd.models.prefix_cache.victim`)."""
        with self._pool:
            self._live.pop(id(kv), None)
            held = kv.prefix + (kv.ids or [])
            if not self.prefix_reuse or not kv.bufs or kv.length == 0 or len(held) < kv.length:
                return
            kv.tokens = np.asarray(held[: kv.length], dtype=np.int64)
            kv.ids = None
            self._retired[id(kv)] = kv
            total = sum(r.nbytes() for r in self._retired.values())
            while total > self.prefix_cache_bytes and self._retired:
                count: dict[str, int] = {}
                for r in [*self._retired.values(), *self._live.values()]:
                    count[r.tenant] = count.get(r.tenant, 0) + 1
                out = victim(list(self._retired.values()), lambda r: r.tenant,
                             lambda r: True, count)
                assert out is not None
                del self._retired[id(out)]
                total -= out.nbytes()
                out.bufs, out.length, out.tokens = [], 0, None

    def _reuse(self, kv: _KV, full: list[int]) -> None:
        """A session with nothing cached starts from the longest cached prefix of its
        context ``full``: its own retired cache is taken over, another's shared
        positions are copied (:func:`~xcosd.models.prefix_cache.best_donor`)."""
        if not self.prefix_reuse or kv.bufs or kv.length:
            return
        with self._pool:
            found = best_donor(full, [*self._retired.values(),
                                      *(r for r in self._live.values() if r is not kv)],
                               _KV.cells, lambda r: r.tokens is not None, lambda r: r.tenant,
                               kv.tenant)
            if found is None:
                return
            donor, n, take = found
            if take:  # its own retired buffers: take them over
                del self._retired[id(donor)]
                kv.bufs, kv.length = donor.bufs, n
                donor.bufs, donor.length, donor.tokens = [], 0, None
            else:
                kv.reserve(n, donor.bufs)
                for (kb, vb), (dk, dv) in zip(kv.bufs, donor.bufs, strict=True):
                    kb[:, :, :n] = dk[:, :, :n]
                    vb[:, :, :n] = dv[:, :, :n]
                kv.length = n
            self.reused_tokens += n

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        return [r.cpu().numpy() for r in self.score_tensors(batch)]

    @torch.inference_mode()
    def score_tensors(self, batch: Sequence[tuple[Session, Sequence[int]]]
                      ) -> list[torch.Tensor]:
        """:meth:`score`, with each session's rows left on the model's device as float32
        probabilities: a cloud that verifies there (xcosd/accel/) copies to the host only
        what crosses the wire."""
        if not batch:
            return []
        plan = []
        for session, new_ids in batch:
            new = [int(i) for i in new_ids]
            self._check(new)
            kv = self._kv(session)
            if not kv.prefix and not session.ids and not new:
                if self._start is None:
                    raise ModelError(f"{self.name}: empty context and no BOS/EOS to start from")
                kv.prefix = [self._start]
            full = kv.prefix + session.ids
            if not full:  # no start token: the first new token is the context
                raise ModelError(f"{self.name}: cannot score an empty context without BOS/EOS")
            kv.tenant = session.tenant
            self._reuse(kv, full)
            if kv.length >= len(full):
                # all cached: the row after the context needs its last token fed again
                kv.crop(len(full) - 1)
            feed = full[kv.length:] + new
            n_out = len(new) + 1
            self.tokens_fed += len(feed)
            plan.append((session, kv, new, feed, n_out))
        with self._lock:
            if len(plan) == 1:
                logits = self._forward_one(plan[0][1], plan[0][3], plan[0][4])
            else:
                logits = self._forward_batch([(p[1], p[3], p[4]) for p in plan])
        out: list[torch.Tensor] = []
        for (session, kv, new, _feed, n_out), lg in zip(plan, logits, strict=True):
            session.ids.extend(new)
            session.cached = kv.length - len(kv.prefix)
            out.append(self._probs(lg[-n_out:]))
        return out

    @torch.inference_mode()
    def score_tree(self, session: Session, parents: Sequence[int],
                   ids: Sequence[int]) -> np.ndarray:
        """The rows of a draft tree (``xcosd/models/tree_scoring.py``) in one forward:
        the uncached context and every node fed together, each node at its depth's
        position and attending only to the context and its ancestors. The tree's
        states are dropped after the call (the cache keeps the context), so a
        rejected branch never stays; the accepted path is appended by the caller.
        Architectures without the per-session attention hook score leaf by leaf."""
        from .tree_scoring import score_tree_by_paths

        if not self.per_session:
            return score_tree_by_paths(self, session, parents, ids)
        return self.score_tree_tensors(session, parents, ids).cpu().numpy()

    def score_tree_tensors(self, session: Session, parents: Sequence[int],
                           ids: Sequence[int]) -> torch.Tensor:
        """:meth:`score_tree` with the rows left on the model's device (float32
        probabilities), as :meth:`score_tensors` leaves a chain's: a cloud that
        verifies there (xcosd/accel/) walks the tree next to them."""
        from .tree_scoring import score_tree_by_paths

        if not self.per_session:
            return torch.from_numpy(score_tree_by_paths(self, session, parents, ids)).to(
                self.device)
        nodes = [int(i) for i in ids]
        if len(parents) != len(nodes):
            raise ValueError(f"a tree of {len(parents)} nodes given {len(nodes)} ids")
        self._check(nodes)
        kv = self._kv(session)
        if not kv.prefix and not session.ids:
            if self._start is None:
                raise ModelError(f"{self.name}: empty context and no BOS/EOS to start from")
            kv.prefix = [self._start]
        full = kv.prefix + session.ids
        kv.tenant = session.tenant
        self._reuse(kv, full)
        if kv.length >= len(full):
            kv.crop(len(full) - 1)
        past = kv.length
        ctx = full[past:]
        depth: list[int] = []
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be -1 or an earlier node")
            depth.append(1 if p < 0 else depth[p] + 1)
        m, n = len(ctx), len(nodes)
        dev = self.device
        q_pos = [past + k for k in range(m)] + [len(full) - 1 + d for d in depth]
        allowed = torch.zeros((m + n, past + m + n), dtype=torch.bool, device=dev)
        allowed[:, :past] = True
        allowed[:m, past: past + m] = torch.ones((m, m), dtype=torch.bool, device=dev).tril()
        allowed[m:, past: past + m] = True
        for i, p in enumerate(parents):
            row = m + i
            allowed[row, past + row] = True
            if p >= 0:
                allowed[row] |= allowed[m + p] & (torch.arange(past + m + n, device=dev)
                                                  >= past + m)
        pos = torch.tensor(q_pos, dtype=torch.long, device=dev)
        tree = _Tree(allowed, pos.unsqueeze(1),
                     torch.cat([torch.arange(past, device=dev), pos]).unsqueeze(0))
        with self._lock:
            slabs = None
            if kv.bufs and past > 0:
                kv.reserve(past + m + n, [])
                slabs = [_Slab(k, v, past) for k, v in kv.bufs]
            cache = self._cache_obj(slabs)
            _current.tree = tree
            try:
                with self._attention(TREE_ATTENTION):
                    res = self.model(input_ids=torch.tensor([ctx + nodes], dtype=torch.long,
                                                            device=dev),
                                     position_ids=pos.unsqueeze(0), use_cache=True,
                                     **{self._cache_kw: cache}, **self._keep(n + 1))
            finally:
                _current.tree = None
            if slabs is None:
                kv.write(0, [(layer.keys, layer.values) for layer in cache.layers], hi=m)
            kv.length = len(full)  # the context's states; the tree's are dropped
        session.cached = kv.length - len(kv.prefix)
        return self._probs(res.logits[0, -(n + 1):])

    # -- internals ---------------------------------------------------------------

    def _check(self, ids: Sequence[int]) -> None:
        n = self.vocab.size
        for i in ids:
            if not 0 <= i < n:
                raise ModelError(f"{self.name}: token id {i} outside 0..{n - 1}")

    @staticmethod
    def _kv(session: Session) -> _KV:
        if not isinstance(session.cache, _KV):
            raise ModelError("session does not belong to a transformers model (or has ended)")
        return session.cache

    @staticmethod
    def _cache_obj(layers: Sequence[DynamicLayer] | None = None) -> Any:
        """A transformers cache over ``layers`` (none: a fresh one that grows as
        usual, for a session with nothing cached yet). No config: every layer is a
        plain full-history one, as the cropping and the batching above need."""
        cache = DynamicCache()
        if layers:
            cache.layers = list(layers)
        return cache

    def _keep(self, n: int) -> dict[str, int]:
        """The keyword that has the head score only the last ``n`` positions."""
        return {self._keep_kw: n} if self._keep_kw is not None else {}

    def _forward_one(self, kv: _KV, feed: list[int], n_out: int) -> list[torch.Tensor]:
        """Feed ``feed`` after the cached positions; the logits of (at least) the
        last ``n_out`` positions."""
        past = kv.length
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(past, past + len(feed), device=self.device).unsqueeze(0)
        slabs = None
        if kv.bufs and past > 0:
            kv.reserve(past + len(feed), [])
            slabs = [_Slab(k, v, past) for k, v in kv.bufs]
        cache = self._cache_obj(slabs)
        res = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kw: cache},
                         **self._keep(n_out))
        if slabs is not None:  # the new states are already in the session's buffers
            kv.length = past + len(feed)
        else:
            kv.write(0, [(layer.keys, layer.values) for layer in cache.layers])
        return [res.logits[0]]

    @contextlib.contextmanager
    def _attention(self, name: str) -> Iterator[None]:
        """The model's attention layers use implementation ``name`` meanwhile."""
        old = [c._attn_implementation for c in self._configs]
        try:
            for c in self._configs:
                c._attn_implementation = name
            yield
        finally:
            for c, o in zip(self._configs, old, strict=True):
                c._attn_implementation = o

    def _forward_batch(self, items: list[tuple[_KV, list[int], int]]) -> list[torch.Tensor]:
        """Feed each session's ``feed`` after its cached positions, in one call; per
        session, the logits of (at least) its last ``n_out`` fed positions."""
        b = len(items)
        past = [kv.length for kv, _, _ in items]
        lens = [len(f) for _, f, _ in items]
        p_max, f_max = max(past), max(lens)
        # rows are right-padded: the head scores the positions from the first one any
        # session asks for to the end, and each session's rows end at its length
        first = min(n - k for n, (_, _, k) in zip(lens, items, strict=True))
        if self._keep_kw is None:
            first = 0
        ids = torch.full((b, f_max), self._pad, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, p_max + f_max), dtype=torch.long, device=self.device)
        pos = torch.zeros((b, f_max), dtype=torch.long, device=self.device)
        for i, (_kv, feed, _n) in enumerate(items):
            ids[i, : lens[i]] = torch.tensor(feed, dtype=torch.long)
            mask[i, p_max - past[i]: p_max + lens[i]] = 1
            pos[i] = torch.arange(past[i], past[i] + f_max)
        if p_max > 0 and self.per_session:
            return self._forward_sessions([(kv, f) for kv, f, _ in items], ids, mask, pos,
                                          past, lens, p_max, first)
        slabs = None
        t0 = time.perf_counter()
        if p_max > 0:
            # the one copy of the history: every session's cache into one batch buffer
            # per layer, left-padded, with room for the new states after it
            shapes = self._donor(items)
            slabs = []
            for li, (k0, v0) in enumerate(shapes):
                kb = k0.new_empty((b, k0.shape[1], p_max + f_max, k0.shape[3]))
                vb = v0.new_empty((b, v0.shape[1], p_max + f_max, v0.shape[3]))
                for i, (kv, _, _) in enumerate(items):
                    lo = p_max - past[i]
                    if lo:  # padding: masked, but kept finite (0 x NaN would be NaN)
                        kb[i, :, :lo].zero_()
                        vb[i, :, :lo].zero_()
                    if past[i]:
                        k, v = kv.bufs[li]
                        kb[i, :, lo:p_max] = k[0, :, : past[i]]
                        vb[i, :, lo:p_max] = v[0, :, : past[i]]
                slabs.append(_Slab(kb, vb, p_max))
        self.copy_s += time.perf_counter() - t0
        cache = self._cache_obj(slabs)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self._cache_kw: cache}, **self._keep(f_max - first))
        t0 = time.perf_counter()
        out_layers = [(layer.keys, layer.values) for layer in cache.layers]
        for i, (kv, _, _) in enumerate(items):
            # only the new states go back (the history is already in the session)
            kv.write(past[i], out_layers, row=i, lo=p_max, hi=p_max + lens[i])
        self.copy_s += time.perf_counter() - t0
        return [res.logits[i, : lens[i] - first] for i in range(b)]

    @staticmethod
    def _donor(items: Sequence[tuple[Any, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The buffers of a session with something cached: the layers' shapes, for
        sessions in the batch that have no buffers yet."""
        return next(it[0].bufs for it in items if it[0].bufs and it[0].length)

    def _forward_sessions(self, items: list[tuple[_KV, list[int]]], ids: torch.Tensor,
                          mask: torch.Tensor, pos: torch.Tensor, past: list[int],
                          lens: list[int], p_max: int, first: int) -> list[torch.Tensor]:
        """A batched call with no batch cache: the new states go straight into each
        session's buffers and each session attends over its own
        (:func:`_session_attention`), so no history is copied."""
        donor = self._donor(items)
        f_max = max(lens)
        for (kv, _), p, m in zip(items, past, lens, strict=True):
            kv.reserve(p + m, donor)
        batch = _Batch([kv for kv, _ in items], past, lens)
        cache = self._cache_obj([_Sessions(batch, li, k, p_max)
                                 for li, (k, _) in enumerate(donor)])
        _current.batch = batch
        try:
            with self._attention(SESSIONS_ATTENTION):
                res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                 use_cache=True, **{self._cache_kw: cache},
                                 **self._keep(f_max - first))
        finally:
            _current.batch = None
        for (kv, _), p, m in zip(items, past, lens, strict=True):
            kv.length = p + m
        self.copy_s += batch.copy_s
        return [res.logits[i, : lens[i] - first] for i in range(len(items))]

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        if self._unused is not None:
            x = x.masked_fill(self._unused, float("-inf"))
        return torch.softmax(x, dim=-1)
