"""Hugging Face causal language models behind :class:`~xcosd.models.base.LanguageModel`.

:class:`TransformersModel` wraps ``AutoModelForCausalLM`` loaded from a local
directory or a GGUF file (``gguf_file=``, dequantised by transformers), on CPU by
default. It keeps a KV cache per session and verifies many sessions in **one**
forward pass.

Cache layout. Each session keeps, per layer, its own key and value tensors
``(1, heads, n, head_dim)`` for every context token fed so far, so each position
is computed once: a call feeds only the tokens appended since (a draft step, one
token; a round, the resolved or bonus token plus the drafts). Only when nothing
was appended (a rollback into the cached part, then a score) is the last cached
token fed again, because the first row a call returns is the distribution after
the context as it is. Rolling back after a rejection is a slice of each tensor.
Keeping the full history (never a sliding-window ring) makes the slice exact for
every architecture; sliding-window layers still see only their window through
the attention mask.

Batching. Sessions' caches are left-padded to a common length and stacked; their
new tokens are right-padded; a 2-D attention mask hides both paddings and
explicit position ids keep every session's positions its own. Each session's
rows and cache are cut back out of the batch afterwards. Batched and one-by-one
scoring agree to float32 rounding (the tests check 1e-4).

Start state. A model whose tokenizer adds a BOS gets it in front of every
context; a session with an empty prompt starts from BOS (or EOS when there is
none, the document separator of GPT-2-style models). The BOS is internal:
``session.ids`` and the lengths given to :meth:`rollback` count only real ids.

torch and transformers are imported only here, so ``import xcosd.models`` stays
light.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from ..vocab import Vocabulary, vocabulary_from_hf
from . import model_cache
from .base import Session

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(eq=False)
class _KV:
    """A session's cache: per-layer (key, value) for ``prefix + ids[:n]``, where
    ``n = session.cached``."""

    prefix: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[-2]) if self.layers else 0

    def crop(self, n: int) -> None:
        if n < self.length:
            self.layers = [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]


class TransformersModel:
    """A Hugging Face causal LM with per-session KV caches and batched scoring.

    Build with :meth:`from_pretrained` (a local model directory) or
    :meth:`from_gguf` (a ``.gguf`` file), or wrap an already-loaded model and
    tokenizer. ``device`` and ``dtype`` follow torch (``"cpu"``, ``"cuda"``;
    ``"float32"``, ``"bfloat16"`` ...); rows are always float32 probabilities.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str | None = None,
                 vocab: Vocabulary | None = None, device: str | torch.device | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if device is not None:
            self.model.to(self.device)
        out = model.get_output_embeddings()
        width = int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)
        v = vocab or vocabulary_from_hf(tokenizer, name=name)
        if v.size < width:  # padded embedding rows: ids with no token
            v = Vocabulary(v.name, [*v.tokens, *([None] * (width - v.size))], special=v.special_ids,
                           roles=v.roles, encoder=v._encoder)
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

    def __repr__(self) -> str:
        return f"TransformersModel({self.name!r}, vocab={self.vocab.size}, device={self.device})"

    # -- loading ---------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None,
                        device: str = "cpu", dtype: str | torch.dtype | None = None,
                        name: str | None = None, attn_implementation: str | None = None,
                        threads: int | None = None, cache: bool | None = None,
                        **kw: Any) -> TransformersModel:
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
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:
            raise ModelError("the transformers backend needs: pip install 'xcosd[models]'") from e
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
                    return cls(hit[0], hit[1], name=name or default, vocab=hit[2], device=device)
        if gguf_file is not None:
            extra["gguf_file"] = gguf_file
        try:
            tok = AutoTokenizer.from_pretrained(str(path), **extra)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=td, **extra, **kw)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ModelError(f"cannot load a causal LM from {path}"
                             f"{' / ' + gguf_file if gguf_file else ''}: {e}") from e
        out = cls(model, tok, name=name or default, device=device)
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

    def start(self, prompt_ids: Sequence[int]) -> Session:
        ids = [int(i) for i in prompt_ids]
        self._check(ids)
        prefix = [self._start] if self._start is not None and (self._add_bos or not ids) else []
        return Session(ids=ids, cached=0, cache=_KV(prefix=prefix))

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
        session.ids = []
        session.cached = 0
        session.cache = None

    @torch.inference_mode()
    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
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
            if kv.length >= len(full):
                # all cached: the row after the context needs its last token fed again
                kv.crop(len(full) - 1)
            feed = full[kv.length:] + new
            n_out = len(new) + 1
            plan.append((session, kv, new, feed, n_out))
        if len(plan) == 1:
            logits, caches = self._forward_one(plan[0][1], plan[0][3])
        else:
            logits, caches = self._forward_batch([(p[1], p[3]) for p in plan])
        out: list[np.ndarray] = []
        for (session, kv, new, _feed, n_out), lg, layers in zip(plan, logits, caches, strict=True):
            kv.layers = layers
            session.ids.extend(new)
            session.cached = kv.length - len(kv.prefix)
            out.append(self._probs(lg[-n_out:]))
        return out

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

    def _cache_obj(self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
        from transformers import DynamicCache

        # no config: every layer is a plain full-history DynamicLayer we can slice
        return DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()

    def _forward_one(self, kv: _KV, feed: list[int]) -> tuple[list[torch.Tensor], list[Any]]:
        past = kv.length
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(past, past + len(feed), device=self.device).unsqueeze(0)
        cache = self._cache_obj(kv.layers)
        res = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self._cache_kw: cache})
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return [res.logits[0]], [layers]

    def _forward_batch(self, items: list[tuple[_KV, list[int]]]
                       ) -> tuple[list[torch.Tensor], list[Any]]:
        b = len(items)
        past = [kv.length for kv, _ in items]
        lens = [len(f) for _, f in items]
        p_max, f_max = max(past), max(lens)
        ids = torch.full((b, f_max), self._pad, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, p_max + f_max), dtype=torch.long, device=self.device)
        pos = torch.zeros((b, f_max), dtype=torch.long, device=self.device)
        for i, (_kv, feed) in enumerate(items):
            ids[i, : lens[i]] = torch.tensor(feed, dtype=torch.long)
            mask[i, p_max - past[i]: p_max + lens[i]] = 1
            pos[i] = torch.arange(past[i], past[i] + f_max)
        layers_in = None
        if p_max > 0:
            n_layers = max(len(kv.layers) for kv, _ in items)
            layers_in = []
            for li in range(n_layers):
                ks, vs = [], []
                for kv, _ in items:
                    k, v = kv.layers[li] if kv.layers else self._empty_like(items, li)
                    pad = p_max - k.shape[-2]
                    if pad:
                        k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                        v = torch.nn.functional.pad(v, (0, 0, pad, 0))
                    ks.append(k)
                    vs.append(v)
                layers_in.append((torch.cat(ks, 0), torch.cat(vs, 0)))
        cache = self._cache_obj(layers_in)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self._cache_kw: cache})
        out_layers = [(layer.keys, layer.values) for layer in cache.layers]
        logits, caches = [], []
        for i in range(b):
            lo, hi = p_max - past[i], p_max + lens[i]
            caches.append([(k[i: i + 1, :, lo:hi].clone(), v[i: i + 1, :, lo:hi].clone())
                           for k, v in out_layers])
            logits.append(res.logits[i, : lens[i]])
        return logits, caches

    @staticmethod
    def _empty_like(items: list[tuple[_KV, list[int]]], li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A zero-length cache entry shaped like another session's layer ``li``."""
        for kv, _ in items:
            if kv.layers:
                k, v = kv.layers[li]
                return k[:1, :, :0], v[:1, :, :0]
        raise ModelError("no session has a cache to take shapes from")

    def _probs(self, logits: torch.Tensor) -> np.ndarray:
        x = logits.float()
        if self._unused is not None:
            x = x.masked_fill(self._unused, float("-inf"))
        return torch.softmax(x, dim=-1).cpu().numpy().astype(np.float32, copy=False)
