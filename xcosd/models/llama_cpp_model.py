"""GGUF models on llama.cpp behind :class:`~xcosd.models.base.LanguageModel`.

Edge devices run their small model on llama.cpp (and the apps built on it) from a
quantised GGUF file, not through torch: :class:`LlamaCppModel` is that runtime as an
xcosd model, for the draft and for the target, through llama-cpp-python's bindings
of llama.cpp's C API (no torch, no transformers).

Sessions are sequences. One llama.cpp context holds every session's cache, each
under a sequence id of its own, in one unified KV buffer: :meth:`LlamaCppModel.score`
puts every session's new tokens into **one** ``llama_decode`` (a cloud verifies a
batch of devices in one call), each token tagged with its session's sequence and
position, and asks for rows only where a call returns them. A rollback after a
rejection removes the rejected positions from the session's sequence
(``llama_memory_seq_rm``); the prefix is never evaluated again. When more sessions
are open than the context has sequences (``sequences``), or its cells run out, the
least recently used session not in the call gives its sequence up and is evaluated
again from its ids the next time it is scored: slower, never different.

Trees. With ``tree_branches``, :meth:`LlamaCppModel.score_tree` scores a draft tree's
nodes in one decode by sequence ids (one buffer for all sequences then, which gives
up the bit-exact batch invariance below for the branching rows; see docs/MODELS.md).

Rows. Each row is llama.cpp's logits for the position, before any sampler, as a
float32 softmax over the full vocabulary: the row llama.cpp's own sampler starts
from, handed to xcosd's warpers and draws as every model's rows are.

Start state, as in :class:`~xcosd.models.transformers_model.TransformersModel`: a
model whose vocabulary adds a BOS gets it in front of every context, an empty
context starts from BOS (or EOS); ``session.ids`` counts only real ids.

Vocabulary. Built from llama.cpp's own token table (:mod:`xcosd.vocab.llama`),
identical to the one the transformers path builds from the same file, and encoded
with llama.cpp's tokenizer; the tests compare both on every id and on real prompts.

Threads. ``threads`` sets llama.cpp's threads for one-token steps and for batches
alike. The bindings release the GIL during a decode, so a draft thread computes while
the event loop goes on.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError
from ..protocol.contexts import common_prefix
from ..vocab import Vocabulary
from ..vocab.llama import llama_table
from .base import Session
from .prefix_cache import MIN_COPY, Cached, best_donor, victim
from .tree_scoring import leaf_paths, score_tree_by_paths

log = logging.getLogger(__name__)

#: the llama-cpp-python release the project builds and tests (Makefile, setup-llama)
LLAMA_CPP_VERSION = "0.3.16"
INSTALL_HINT = "install it with: make setup-llama  (it builds llama-cpp-python from source)"

#: the KV cache a model's context may take by default, across all its sequences
#: (allocated and cleared up front): the default ``context`` is the model's trained
#: context, or what fits this bound, whichever is shorter. An explicit ``context``
#: is not held to it
DEFAULT_KV_BYTES = 1 << 30
#: a default context is a multiple of this many positions (llama.cpp pads to it)
CONTEXT_ALIGN = 256
#: default number of sessions that keep a cache at once; more are served, the least
#: recently used evaluated again when next scored
DEFAULT_SEQUENCES = 8
#: llama.cpp's limit on the sequences of one context (``LLAMA_MAX_SEQ``)
MAX_SEQUENCES = 64
#: bytes of one cached key or value element (llama.cpp's default cache type, f16)
KV_ELEMENT_BYTES = 2


#: the CPU features the project's build (Makefile, LLAMA_CMAKE_ARGS) compiles in
BUILD_CPU_FLAGS = ("avx2", "fma", "f16c")


def _bindings() -> Any:
    """llama-cpp-python's module, or a one-line :class:`ModelError` naming the install."""
    missing = _missing_cpu_flags()
    if missing:
        raise ModelError(f"this CPU lacks {', '.join(missing)}, which the llama.cpp build "
                         "needs: rebuild llama-cpp-python without them (Makefile, LLAMA_CMAKE_ARGS)")
    try:
        import llama_cpp
    except ImportError as e:
        raise ModelError(f"the llama.cpp backend needs llama-cpp-python ({e}); {INSTALL_HINT}") from e
    _init_backend(llama_cpp)
    return llama_cpp


def own_llama(path: str | Path, n_ctx: int = 512, threads: int = 1, logits_all: bool = False
              ) -> Any:
    """llama-cpp-python's own ``Llama`` for ``path``, with the weights in their file
    layout as :class:`LlamaCppModel` loads them: the reference its rows are tested
    against and the loop its speed is compared with."""
    import llama_cpp
    import llama_cpp.llama_cpp as bindings

    _bindings()
    default = bindings.llama_model_default_params

    def plain_layout() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    bindings.llama_model_default_params = plain_layout  # what Llama() builds its params from
    try:
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                               n_threads_batch=threads, logits_all=logits_all, verbose=False)
    finally:
        bindings.llama_model_default_params = default


def default_context(trained: int, bytes_per_cell: int, sequences: int,
                    kv_bytes: int = DEFAULT_KV_BYTES) -> int:
    """The positions per session a model gets when none is asked for: its trained
    context (``trained``, 0: unknown), shortened to what ``sequences`` sessions fit in
    ``kv_bytes`` of cache, a multiple of :data:`CONTEXT_ALIGN` and never under it.
    Allocating the trained context whatever it costs would take 4.5 GiB for
    Gemma-3-270m's 32,768 positions x 8 sequences; a fixed short one (this backend
    opened 2,048) refuses prompts the model was trained for."""
    fits = kv_bytes // max(1, bytes_per_cell * sequences)
    fits = max(CONTEXT_ALIGN, fits - fits % CONTEXT_ALIGN)
    return min(trained, fits) if trained > 0 else fits


def _kv_bytes_per_cell(L: Any, model: Any) -> int:
    """Bytes of KV cache one position takes: every layer's keys and values at the
    default cache type (the sliding-window layers too: the context keeps their full
    history, ``swa_full``). Key and value widths per head come from the GGUF's
    ``<arch>.attention.key_length`` / ``value_length`` where given (Gemma-3's heads are
    256 wide, not ``n_embd / n_head``). Checked against llama.cpp's own log of its
    cache size for both real models."""
    layers = int(L.llama_model_n_layer(model))
    heads = max(1, int(L.llama_model_n_head(model)))
    kv_heads = int(L.llama_model_n_head_kv(model)) or heads
    arch = _meta(L, model, "general.architecture")
    width = int(L.llama_model_n_embd(model)) // heads
    k = _meta_int(L, model, f"{arch}.attention.key_length", width)
    v = _meta_int(L, model, f"{arch}.attention.value_length", k)
    return layers * kv_heads * (k + v) * KV_ELEMENT_BYTES


def _meta(L: Any, model: Any, key: str) -> str | None:
    """A GGUF metadata value as text (``None``: not in the file)."""
    buf = ctypes.create_string_buffer(256)
    n = int(L.llama_model_meta_val_str(model, key.encode(), buf, len(buf)))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


def _meta_int(L: Any, model: Any, key: str, default: int) -> int:
    raw = _meta(L, model, key)
    return int(raw) if raw is not None and raw.strip().isdigit() else default


def _missing_cpu_flags() -> list[str]:
    """The build's CPU features this x86 Linux machine lacks (a model loaded without
    them dies of an illegal instruction, with no message); elsewhere nothing."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in BUILD_CPU_FLAGS if x not in have]
    except OSError:
        pass
    return []


_backend_lock = threading.Lock()
_backend_ready = False
_log_callback: Any = None


def _init_backend(L: Any) -> None:
    """Once per process: llama.cpp's backend, and its log (which writes to stderr by
    default) routed to Python's ``logging``: errors as errors, warnings (a context
    shorter than the model was trained for, ...) as info."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return

        def _log(level: int, text: bytes | None, _data: Any) -> None:
            if text and level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
                log.log(logging.INFO if level == 3 else logging.ERROR, "llama.cpp: %s",
                        text.decode("utf-8", "replace").rstrip())

        _log_callback = L.llama_log_callback(_log)  # kept: llama.cpp holds the pointer
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        L.llama_backend_init()
        _backend_ready = True


@dataclass(eq=False)
class _Seq(Cached):
    """A session's place in the context: its sequence id (``None``: not resident,
    evaluated again on its next score) and how many positions of
    ``prefix + ids`` the context holds for it.

    An ended session's sequence stays, *retired* (``tokens`` set, ``ids``
    ``None``), until its room is needed: a later session that starts with the same
    tokens takes it over (:mod:`xcosd.models.prefix_cache`)."""

    seq: int | None = None
    #: the model whose context holds the sequence (a session is one model's)
    owner: Any = field(default=None, repr=False)


class LlamaCppModel:
    """A GGUF model on llama.cpp with one sequence per session and batched scoring.

    Build with :meth:`from_gguf`. ``threads`` (default: every core) is llama.cpp's
    thread count; ``context`` the positions one session may hold (default: the
    model's trained context, shortened to what ``kv_bytes`` of cache holds for every
    sequence: :func:`default_context`; at most the trained context); ``sequences``
    how many sessions keep a cache at once (1..64 with ``tree_branches``);
    ``batch`` the most tokens one decode takes; ``tree_branches`` (0: none) how many
    leaves a draft tree scored in one decode may have (:meth:`score_tree`).
    """

    def __init__(self, path: str | Path, *, name: str | None = None, threads: int | None = None,
                 context: int | None = None, sequences: int = DEFAULT_SEQUENCES,
                 batch: int = 512, chat_template: str | None = None,
                 tree_branches: int = 0, prefix_reuse: bool = True,
                 kv_bytes: int = DEFAULT_KV_BYTES) -> None:
        L = _bindings()
        self._L = L
        p = Path(path)
        if not p.is_file():
            raise ModelError(f"no GGUF file at {p}")
        if threads is not None and int(threads) < 1:
            raise ModelError(f"threads must be >= 1, got {threads}")
        if int(sequences) < 1 or int(tree_branches) < 0 or (
                int(sequences) + int(tree_branches) > MAX_SEQUENCES):
            raise ModelError(f"sequences + tree_branches must be 1..{MAX_SEQUENCES} (llama.cpp's "
                             f"limit), got {sequences} + {tree_branches}")
        if context is not None and int(context) < 1:
            raise ModelError(f"context must be >= 1 position, got {context}")
        if int(batch) < 1:
            raise ModelError(f"batch must be >= 1 token, got {batch}")
        self.path = p
        self.threads = int(threads) if threads is not None else (os.cpu_count() or 1)
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        # no repacked weight layouts: their kernels sum a row differently by where it
        # falls in the batch, so a position's row would depend on the batch
        mp.use_extra_bufts = False
        self._model = L.llama_model_load_from_file(str(p).encode(), mp)
        if not self._model:
            raise ModelError(f"llama.cpp cannot load {p} (not a GGUF model it supports)")
        #: the positions the model was trained for (the GGUF's ``context_length``; 0:
        #: the file does not say)
        self.trained_context = int(L.llama_model_n_ctx_train(self._model))
        #: bytes of KV cache one position of one session takes
        self.kv_bytes_per_cell = _kv_bytes_per_cell(L, self._model)
        if context is None:
            context = default_context(self.trained_context, self.kv_bytes_per_cell,
                                      int(sequences), int(kv_bytes))
        elif 0 < self.trained_context < int(context):
            L.llama_model_free(self._model)
            self._model = None
            raise ModelError(f"context={context} is longer than the {self.trained_context} "
                             f"positions {p.name} was trained for")
        cp = L.llama_context_default_params()
        cp.n_ctx = int(context) * int(sequences)
        cp.n_batch = cp.n_ubatch = int(batch)
        cp.n_seq_max = int(sequences) + int(tree_branches)
        cp.n_threads = cp.n_threads_batch = self.threads
        # a buffer of its own per session: its cells stay in position order, so a
        # row does not depend on what other sessions did (see the module docstring);
        # one buffer for all when trees are decoded at once (a node's cells shared by
        # the branches under it); the full history of sliding-window layers, so a
        # rollback into the window's past is exact (as in the transformers backend)
        cp.kv_unified = int(tree_branches) > 0
        cp.swa_full = True
        cp.no_perf = True
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            L.llama_model_free(self._model)
            self._model = None
            need = int(context) * int(sequences) * self.kv_bytes_per_cell
            raise ModelError(f"llama.cpp cannot make a context for {p} (context={context} x "
                             f"sequences={sequences}: {need / (1 << 20):.0f} MiB of KV cache); "
                             "a shorter context or fewer sequences may fit")
        self._mem = L.llama_get_memory(self._ctx)
        # llama.cpp pads the cells it allocates: the positions asked for bound a session
        self.context = min(int(context), int(L.llama_n_ctx(self._ctx)) // int(sequences))
        self.sequences = int(sequences)
        self.tree_branches = int(tree_branches)
        self.batch = int(batch)
        self._vocab_p = L.llama_model_get_vocab(self._model)
        self._n_vocab = int(L.llama_vocab_n_tokens(self._vocab_p))
        self.name = name or p.stem
        self.vocab = self._read_vocab(self.name)
        bos = self.vocab.roles.get("bos")
        #: whether every context starts with the BOS (the file's own setting)
        self.add_bos = bos is not None and bool(L.llama_vocab_get_add_bos(self._vocab_p))
        self._start = bos if bos is not None else self.vocab.roles.get("eos")
        template = chat_template
        if template is None:
            raw = L.llama_model_chat_template(self._model, None)
            template = raw.decode("utf-8") if raw else None
        self.chat_template = template
        self._free = list(range(self.sequences - 1, -1, -1))
        #: resident sessions, least recently used first
        self._lru: OrderedDict[int, _Seq] = OrderedDict()
        # one decode at a time on the context: a model used by two threads (an edge
        # drafting while it renders) must not interleave their batches
        self._lock = threading.RLock()
        #: (session, its sequence then, positions kept or None to end it): asked for
        #: while a decode held the lock, applied before the next one
        self._deferred: deque[tuple[_Seq, int | None, int | None]] = deque()
        #: whether an ended session's cache stays for a later one that starts with
        #: the same tokens (:mod:`xcosd.models.prefix_cache`)
        self.prefix_reuse = bool(prefix_reuse)
        #: decodes run, tokens fed to them, sessions evicted to make room, and
        #: positions a session started with from another's cache instead of
        #: computing them (for the benches and tests)
        self.decodes = 0
        self.tokens_fed = 0
        self.evictions = 0
        self.reused_tokens = 0

    def __repr__(self) -> str:
        return (f"LlamaCppModel({self.name!r}, vocab={self.vocab.size}, threads={self.threads}, "
                f"context={self.context}, sequences={self.sequences})")

    @property
    def context_tokens(self) -> int:
        """The most ids one session may hold, its prompt and all it generates: its
        cells less the BOS put in front of them (the cloud's ``ServerLimits.context``;
        a longer session is refused before any compute)."""
        return self.context - (1 if self.add_bos else 0)

    @property
    def kv_bytes(self) -> int:
        """The KV cache this model's context holds, every sequence's cells."""
        return self.context * self.sequences * self.kv_bytes_per_cell

    @classmethod
    def from_gguf(cls, file: str | Path, **kw: Any) -> LlamaCppModel:
        """Load a ``.gguf`` file (its quantised weights stay quantised)."""
        return cls(file, **kw)

    def close(self) -> None:
        """Free the context and the weights (also done when collected)."""
        L = getattr(self, "_L", None)
        if L is None:
            return
        with self._lock:
            if getattr(self, "_ctx", None):
                L.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None):
                L.llama_model_free(self._model)
                self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at shutdown the bindings may be gone
            self.close()

    # -- the vocabulary ----------------------------------------------------------

    def _read_vocab(self, name: str) -> Vocabulary:
        L, v = self._L, self._vocab_p
        texts = [bytes(L.llama_vocab_get_text(v, i)) for i in range(self._n_vocab)]
        attrs = [int(L.llama_vocab_get_attr(v, i)) for i in range(self._n_vocab)]
        roles = {"bos": int(L.llama_vocab_bos(v)), "eos": int(L.llama_vocab_eos(v)),
                 "pad": int(L.llama_vocab_pad(v))}
        t = llama_table(name, int(L.llama_vocab_type(v)), texts, attrs, roles, self._encode)
        return Vocabulary(t.name, t.tokens, special=t.special, roles=t.roles, encoder=t.encoder)

    def _encode(self, text: str) -> list[int]:
        """llama.cpp's tokenizer, no BOS added, special-token texts parsed as their
        ids (as a Hugging Face tokenizer's ``encode`` does)."""
        data = text.encode("utf-8", "surrogatepass")
        cap = len(data) + 8
        while True:
            buf = (self._L.llama_token * cap)()
            n = int(self._L.llama_tokenize(self._vocab_p, data, len(data), buf, cap, False, True))
            if n >= 0:
                return [int(buf[i]) for i in range(n)]
            cap = -n

    # -- the LanguageModel interface ---------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """A chat rendered by the model's chat template (the GGUF file's, or the one
        given), the generation prompt added, as the ids :meth:`start` is given: the
        same ids as the transformers backend gives for the same file and template."""
        if not self.chat_template:
            raise ModelError(f"{self.name}: the model has no chat template", code="unsupported")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def _raise(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        roles = self.vocab.roles
        special = {r: self.vocab.tokens[i].decode("utf-8", "replace")  # type: ignore[union-attr]
                   for r, i in roles.items() if self.vocab.tokens[i] is not None}
        try:
            text = env.from_string(self.chat_template).render(
                messages=[dict(m) for m in messages], add_generation_prompt=True,
                bos_token=special.get("bos", ""), eos_token=special.get("eos", ""))
        except TemplateError as e:
            raise ModelError(f"{self.name}: chat template: {e}") from e
        ids = self._encode(text)
        if self.add_bos and ids and ids[0] == self._start:
            ids = ids[1:]
        return ids

    def start(self, prompt_ids: Sequence[int]) -> Session:
        ids = [int(i) for i in prompt_ids]
        self._check(ids)
        prefix = [self._start] if self._start is not None and (self.add_bos or not ids) else []
        return Session(ids=ids, cached=0, cache=_Seq(prefix=prefix, owner=self, ids=ids))

    def append(self, session: Session, ids: Sequence[int]) -> None:
        new = [int(i) for i in ids]
        self._check(new)
        self._seq(session)
        session.ids.extend(new)

    def rollback(self, session: Session, length: int) -> None:
        if length < 0:
            raise ValueError(f"rollback length must be >= 0, got {length}")
        s = self._seq(session)
        del session.ids[length:]
        keep = len(s.prefix) + len(session.ids)
        if s.length > keep:
            self._run_or_defer(s, keep)
        session.cached = max(0, s.length - len(s.prefix))

    def end(self, session: Session) -> None:
        s = session.cache
        if isinstance(s, _Seq) and s.owner is self:
            self._run_or_defer(s, None)
        session.ids = []
        session.cached = 0
        session.cache = None

    def cached_prefix(self, prompt_ids: Sequence[int], tenant: str = "") -> int:
        """How many of ``prompt_ids`` a session started with them would take from a
        cached prefix instead of computing (0 while a decode holds the context: the
        answer is a hint, and this never waits)."""
        if not self.prefix_reuse or not self._lock.acquire(blocking=False):
            return 0
        try:
            prefix = [self._start] if self._start is not None and (
                self.add_bos or not prompt_ids) else []
            found = best_donor([*prefix, *prompt_ids], list(self._lru.values()), _Seq.cells,
                               lambda r: r.tokens is not None, lambda r: r.tenant, tenant)
        finally:
            self._lock.release()
        if found is None:
            return 0
        return max(0, found[1] - len(prefix))

    def score(self, batch: Sequence[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        """For each ``(session, new_ids)``, ``len(new_ids) + 1`` rows, all sessions in
        one ``llama_decode`` (more only past ``sequences`` sessions or ``batch``
        tokens)."""
        if not batch:
            return []
        plan: list[tuple[Session, _Seq, list[int], list[int], int]] = []
        seen: set[int] = set()
        for session, new_ids in batch:
            new = [int(i) for i in new_ids]
            self._check(new)
            s = self._seq(session)
            if id(s) in seen:
                raise ModelError(f"{self.name}: a session appears twice in one score call")
            seen.add(id(s))
            if not s.prefix and not session.ids and not new:
                if self._start is None:
                    raise ModelError(f"{self.name}: empty context and no BOS/EOS to start from")
                s.prefix = [self._start]
            if not s.prefix and not session.ids:
                raise ModelError(f"{self.name}: cannot score an empty context without BOS/EOS")
            plan.append((session, s, new, [], len(new) + 1))
        with self._lock:
            if self._ctx is None:
                raise ModelError(f"{self.name}: the model is closed")
            self._apply_deferred()
            rows: list[np.ndarray] = []
            # at most `sequences` sessions a decode: a bigger batch (the cloud's) is
            # decoded in groups, a later group evicting an earlier one if it must
            for lo in range(0, len(plan), self.sequences):
                members = [s for _, s, _, _, _ in plan[lo: lo + self.sequences]]
                fulls: list[list[int]] = []
                for i in range(lo, lo + len(members)):
                    session, s, new, _, n_out = plan[i]
                    s.tenant = session.tenant
                    fulls.append(s.prefix + session.ids)
                    self._make_resident(s, members, fulls[-1])
                if self.prefix_reuse and len(members) > 1:
                    self._share_in_call(members, fulls)
                for i, full in zip(range(lo, lo + len(members)), fulls, strict=True):
                    session, s, new, _, n_out = plan[i]
                    if s.length >= len(full):
                        # all cached: the row after the context needs its last token again
                        self._cut(s, len(full) - 1)
                    plan[i] = (session, s, new, full[s.length:] + new, n_out)
                rows += self._decode([(s, feed, n_out) for _, s, _, feed, n_out
                                      in plan[lo: lo + len(members)]], members)
        out = []
        for (session, s, new, _feed, _n), r in zip(plan, rows, strict=True):
            session.ids.extend(new)
            session.cached = s.length - len(s.prefix)
            out.append(r)
        return out

    def _share_in_call(self, members: Sequence[_Seq], fulls: Sequence[list[int]]) -> None:
        """Sessions of one call that share a prefix none of them holds yet (devices
        arriving together with one system prompt): the first computes it alone, in a
        decode of its own before the call's, and the others copy its cells, so the
        prefix is computed once."""
        follow: dict[int, tuple[int, int]] = {}  # member -> (its leader, shared)
        for i in range(1, len(members)):
            best = (-1, 0)
            for j in range(i):
                if j in follow:
                    continue  # a follower's cells come from its own leader
                n = min(common_prefix(np.asarray(fulls[i]), np.asarray(fulls[j])),
                        len(fulls[i]) - 1, len(fulls[j]) - 1)
                if n > best[1]:
                    best = (j, n)
            j, n = best
            if j >= 0 and n - max(members[i].length, members[j].length) >= MIN_COPY:
                follow[i] = (j, n)
        if not follow:
            return
        need: dict[int, int] = {}
        for j, n in follow.values():
            need[j] = max(need.get(j, 0), n)
        self._decode([(members[j], fulls[j][members[j].length: n], 0)
                      for j, n in need.items() if members[j].length < n], members)
        for i, (j, n) in follow.items():
            lead, s = members[j], members[i]
            assert lead.seq is not None and s.seq is not None
            self._L.llama_memory_seq_cp(self._mem, lead.seq, s.seq, -1, -1)
            s.length = lead.length
            self._cut(s, n)
            self.reused_tokens += s.length

    def score_tree(self, session: Session, parents: Sequence[int], ids: Sequence[int]
                   ) -> np.ndarray:
        """The rows of a draft tree after the session's context: row 0 after the
        context, row ``i + 1`` after the path to node ``i`` (``parents[i]``: the node
        before it, -1 for the context; ``ids``: this model's ids). The context is left
        as it was: the caller appends the path it accepts.

        With ``tree_branches`` at least the tree's leaves, one ``llama_decode``, as
        llama.cpp's own speculative example does: each leaf gets a scratch sequence
        that shares the session's cells (``llama_memory_seq_cp``: no copy in a unified
        buffer), each node is tagged with the sequences of the leaves under it, at
        the position of its depth, so it attends to the context and its own path
        only; the scratch sequences are dropped after. Otherwise one decode per leaf
        path, each rolled back after."""
        n = len(parents)
        if len(ids) != n:
            raise ModelError(f"{self.name}: a tree of {n} nodes given {len(ids)} ids")
        for i, p in enumerate(parents):
            if not -1 <= int(p) < i:
                raise ModelError(f"{self.name}: tree node {i}'s parent {p} is not an "
                                 "earlier node or -1")
        new = [int(i) for i in ids]
        self._check(new)
        s = self._seq(session)
        paths = leaf_paths(parents)
        if not paths:
            return self.score([(session, [])])[0]
        if len(paths) > self.tree_branches:
            return score_tree_by_paths(self, session, parents, new)
        if not s.prefix and not session.ids:
            raise ModelError(f"{self.name}: cannot score a tree after an empty context "
                             "without BOS/EOS")
        depth = [0] * n
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
        scratch = [self.sequences + k for k in range(len(paths))]
        under: list[list[int]] = [[] for _ in range(n)]
        for k, path in enumerate(paths):
            for node in path:
                under[node].append(scratch[k])
        with self._lock:
            if self._ctx is None:
                raise ModelError(f"{self.name}: the model is closed")
            self._apply_deferred()
            s.tenant = session.tenant
            full = s.prefix + session.ids
            self._make_resident(s, [s], full)
            assert s.seq is not None
            if s.length >= len(full):
                self._cut(s, len(full) - 1)
            tail = full[s.length:]
            for q in scratch:
                self._L.llama_memory_seq_rm(self._mem, q, -1, -1)
                self._L.llama_memory_seq_cp(self._mem, s.seq, q, -1, -1)
            every = (s.seq, *scratch)
            tokens = [(tok, s.length + j, every, j == len(tail) - 1) for j, tok in enumerate(tail)]
            top = s.length + len(tail)
            tokens += [(new[i], top + depth[i], tuple(under[i]), True) for i in range(n)]
            try:
                rows = self._run(tokens, [s], items=[s])
                if s.seq is not None:
                    s.length = top
            finally:
                for q in scratch:  # the nodes' cells go with them; the tail stays
                    self._L.llama_memory_seq_rm(self._mem, q, -1, -1)
        session.cached = s.length - len(s.prefix)
        return rows

    # -- internals ---------------------------------------------------------------

    def _check(self, ids: Sequence[int]) -> None:
        n = self.vocab.size
        for i in ids:
            if not 0 <= i < n:
                raise ModelError(f"{self.name}: token id {i} outside 0..{n - 1}")

    def _seq(self, session: Session) -> _Seq:
        s = session.cache
        if not isinstance(s, _Seq) or s.owner is not self:
            raise ModelError("session does not belong to this llama.cpp model (or has ended)")
        return s

    def _run_or_defer(self, s: _Seq, keep: int | None) -> None:
        """Cut the session to ``keep`` positions (``None``: end it) now, or, while a
        decode holds the context (the cloud's worker thread scoring a batch), at the
        start of the next call that takes it: a rollback or an end on the event loop
        never waits for a decode. The positions count as gone at once; their cells go
        before anything else is decoded."""
        if self._lock.acquire(blocking=False):
            try:
                self._apply_deferred()
                if keep is None:
                    self._retire(s)
                else:
                    self._cut(s, keep)
            finally:
                self._lock.release()
            return
        self._deferred.append((s, s.seq, keep))
        if keep is not None:
            s.length = min(s.length, keep)

    def _apply_deferred(self) -> None:
        """The cuts and ends asked for while a decode ran (the lock held)."""
        while self._deferred:
            s, seq, keep = self._deferred.popleft()
            if seq is None or s.seq != seq:
                continue  # released or evicted since: its cells are gone already
            if keep is None:
                self._retire(s)
            elif not self._L.llama_memory_seq_rm(self._mem, seq, keep, -1):
                self._release(s)

    def _cut(self, s: _Seq, keep: int) -> None:
        """Drop the session's positions from ``keep`` on (the context's cells too)."""
        if (s.seq is not None and s.length > keep
                and not self._L.llama_memory_seq_rm(self._mem, s.seq, keep, -1)):
            self._release(s)  # cannot cut part of it: evaluate it all again
            return
        s.length = min(s.length, keep)

    def _retire(self, s: _Seq) -> None:
        """An ended session: its sequence stays, retired, for a later session that
        starts with the same tokens (released instead when reuse is off, or when its
        ids no longer account for its cells)."""
        if s.seq is None:
            return
        held = s.prefix + (s.ids or [])
        if not self.prefix_reuse or s.length == 0 or len(held) < s.length:
            self._release(s)
            return
        s.tokens = np.asarray(held[: s.length], dtype=np.int64)
        s.ids = None

    def _release(self, s: _Seq) -> None:
        """Give up the session's sequence: its cells are freed, its cache forgotten."""
        if s.seq is not None:
            self._L.llama_memory_seq_rm(self._mem, s.seq, -1, -1)
            self._lru.pop(s.seq, None)
            self._free.append(s.seq)
            s.seq = None
        s.length = 0

    def _evict(self, keep: Sequence[_Seq]) -> bool:
        """Release a resident sequence not in ``keep``: a retired one first, the
        fair share's pick (:func:`~xcosd.models.prefix_cache.victim`), else the least
        recently used session's."""
        protected = {id(s) for s in keep}
        held: dict[str, int] = {}
        for r in self._lru.values():
            held[r.tenant] = held.get(r.tenant, 0) + 1
        out = victim([r for r in self._lru.values() if id(r) not in protected],
                     lambda r: r.tenant, lambda r: r.tokens is not None, held)
        if out is None:
            return False
        if out.tokens is None:
            self.evictions += 1
        self._release(out)
        return True

    def _make_resident(self, s: _Seq, members: Sequence[_Seq], full: Sequence[int]) -> None:
        """Give ``s`` a sequence, starting from the longest cached prefix of its
        context ``full`` where that pays: a retired sequence is taken over, a live
        one's cells are copied (``llama_memory_seq_cp``, applied before the next
        decode computes anything) and cut to what is shared
        (:func:`~xcosd.models.prefix_cache.best_donor` says which and how)."""
        if s.seq is not None:
            self._lru.move_to_end(s.seq)
            return
        s.length = 0
        found = None
        if self.prefix_reuse:
            found = best_donor(full, [r for r in self._lru.values() if r is not s],
                               _Seq.cells, lambda r: r.tokens is not None, lambda r: r.tenant,
                               s.tenant)
        if found is not None and found[2]:  # its own retired sequence: take it over
            donor, n, _ = found
            assert donor.seq is not None
            s.seq, s.length = donor.seq, donor.length
            donor.seq, donor.length, donor.tokens = None, 0, None
            self._lru.pop(s.seq)
            self._lru[s.seq] = s
            self._cut(s, n)
            self.reused_tokens += s.length
            return
        keep = [*members, found[0]] if found is not None else list(members)
        if not self._free and not self._evict(keep):
            found = None  # the donor is the only sequence that can give way
            if not self._evict(members):  # cannot be: a group fits
                raise ModelError(f"{self.name}: no sequence free for a session")
        s.seq = self._free.pop()
        self._lru[s.seq] = s
        if found is not None:
            donor, n, _ = found
            self._L.llama_memory_seq_cp(self._mem, donor.seq, s.seq, -1, -1)
            s.length = donor.length
            self._cut(s, n)
            self.reused_tokens += s.length

    def _decode(self, items: list[tuple[_Seq, list[int], int]],
                members: Sequence[_Seq]) -> list[np.ndarray]:
        """Feed each session's tokens after its cached positions; per session, the
        probability rows of its last ``n_out`` fed positions."""
        total = sum(len(feed) for _, feed, _ in items)
        if max(s.length + len(feed) for s, feed, _ in items) > self.context:
            raise ModelError(f"{self.name}: a context longer than the model's "
                             f"{self.context} cells")
        if total <= self.batch:
            return self._decode_once(items, members)
        # more tokens than one decode takes: each session's feed in turn, in chunks,
        # the last chunk exactly the positions whose rows are returned
        out = []
        for s, feed, n_out in items:
            if n_out > self.batch:
                raise ModelError(f"{self.name}: {n_out} rows in one call, over the model's "
                                 f"batch of {self.batch} tokens")
            head = feed[: len(feed) - n_out]
            for lo in range(0, len(head), self.batch):
                self._decode_once([(s, head[lo: lo + self.batch], 0)], members)
            if n_out:
                out.extend(self._decode_once([(s, feed[len(feed) - n_out:], n_out)], members))
            else:  # a prefix computed for others to copy: no rows
                out.append(np.empty((0, self._n_vocab), dtype=np.float32))
        return out

    def _decode_once(self, items: list[tuple[_Seq, list[int], int]],
                     members: Sequence[_Seq]) -> list[np.ndarray]:
        tokens: list[tuple[int, int, Sequence[int], bool]] = []
        for s, feed, n_out in items:
            assert s.seq is not None
            first_out = len(feed) - n_out
            tokens += [(tok, s.length + j, (s.seq,), j >= first_out)
                       for j, tok in enumerate(feed)]
        rows = self._run(tokens, members, items=[s for s, _, _ in items])
        out: list[np.ndarray] = []
        k = 0
        for s, feed, n_out in items:
            out.append(rows[k: k + n_out])
            k += n_out
            s.length += len(feed)
        return out

    def _run(self, tokens: Sequence[tuple[int, int, Sequence[int], bool]],
             members: Sequence[_Seq], items: Sequence[_Seq]) -> np.ndarray:
        """One ``llama_decode`` of ``(token, position, sequence ids, row wanted)``; the
        probability rows wanted, in order. No room in the cells: the least recently
        used session outside ``members`` is evicted and the decode tried again; any
        other failure releases ``items`` (a failed decode may leave part of itself)."""
        L = self._L
        width = max(len(seqs) for _, _, seqs, _ in tokens)
        b = L.llama_batch_init(len(tokens), 0, width)
        try:
            for k, (tok, pos, seqs, want) in enumerate(tokens):
                b.token[k] = tok
                b.pos[k] = pos
                b.n_seq_id[k] = len(seqs)
                for j, q in enumerate(seqs):
                    b.seq_id[k][j] = q
                b.logits[k] = 1 if want else 0
            b.n_tokens = len(tokens)
            while True:
                rc = int(L.llama_decode(self._ctx, b))
                if rc == 0:
                    break
                # 1: no room in the cells (the context restored as it was): make room
                if rc == 1 and self._evict(members):
                    continue
                for s in items:
                    self._release(s)
                raise ModelError(f"{self.name}: llama_decode failed ({rc}) on {len(tokens)} "
                                 "tokens" + (": the context is full" if rc == 1 else ""))
            self.decodes += 1
            self.tokens_fed += len(tokens)
            wanted = [k for k, t in enumerate(tokens) if t[3]]
            rows = np.empty((len(wanted), self._n_vocab), dtype=np.float32)
            for r, k in enumerate(wanted):
                ptr = L.llama_get_logits_ith(self._ctx, k)
                rows[r] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            _softmax_rows(rows)
            return rows
        finally:
            L.llama_batch_free(b)


def _softmax_rows(x: np.ndarray) -> None:
    """Logits -> probabilities in place, row by row, in float32."""
    x -= x.max(axis=1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=1, keepdims=True)
