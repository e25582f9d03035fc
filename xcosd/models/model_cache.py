"""A disk cache of GGUF files converted to Hugging Face form.

Loading a ``.gguf`` through transformers is slow for reasons that have nothing to
do with the weights: gguf-py parses every metadata field element by element
(262k vocabulary strings for Gemma, twice: once for the config, once for the
tokenizer), the GGUF -> Hugging Face tokenizer conversion rebuilds the whole
tokenizer, and the tensor-name map is rebuilt for every tensor. On a small CPU
that is tens of seconds per model, every time. The result, though, is an ordinary
model: so after the first load it is written once with ``save_pretrained``
(safetensors, in the dtype it was loaded in) next to its tokenizer and its
:class:`~xcosd.vocab.Vocabulary`, and later loads of the same file read that
directory instead. float weights survive the round trip bit for bit, so a cached
model scores exactly like a fresh GGUF load.

An entry lives under ``cache_dir()/hf/<stem>-<key>``. The key hashes what decides
the converted result: the GGUF file's resolved path, size, modification time and
a hash of its first and last MiB (cheap, and it catches a file rewritten in
place), the dtype, and the transformers version (its conversion code may change).
Entries are written to a temporary directory and renamed into place, so parallel
processes never see half an entry; the loser of a race drops its copy. An
unreadable entry is ignored (and removed) and the GGUF file is loaded instead.

Opt out per call with ``cache=False`` or process-wide with
``XCOSD_NO_MODEL_CACHE=1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..vocab import Vocabulary
from ..vocab.hf import hf_encoder
from .corpus import cache_dir

log = logging.getLogger(__name__)

#: bump when the layout of an entry changes
FORMAT = 1
#: bytes hashed at each end of the GGUF file
_EDGE = 1 << 20
_META = "xcosd-entry.json"
_VOCAB = "xcosd-vocab.json"
_DISABLE_ENV = "XCOSD_NO_MODEL_CACHE"


def enabled(cache: bool | None = None) -> bool:
    """Whether to use the cache: ``cache`` when given, else on unless
    ``$XCOSD_NO_MODEL_CACHE`` is set to something other than ``0``/empty."""
    if cache is not None:
        return bool(cache)
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in ("", "0", "false", "no")


def _edges_hash(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()


def identity(gguf: Path, dtype: Any) -> dict[str, Any]:
    """What a converted model depends on (see the module docstring)."""
    import transformers

    p = gguf.resolve()
    st = p.stat()
    return {"format": FORMAT, "path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "edges": _edges_hash(p, st.st_size), "dtype": str(dtype),
            "transformers": transformers.__version__}


def entry_dir(gguf: Path, dtype: Any) -> tuple[Path, dict[str, Any]]:
    """The cache directory for ``gguf`` loaded as ``dtype``, and its identity."""
    ident = identity(gguf, dtype)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "hf" / f"{gguf.stem}-{key}", ident


def _vocab_to_json(v: Vocabulary) -> dict[str, Any]:
    return {"tokens": [None if b is None else b.hex() for b in v.tokens],
            "special": sorted(v.special_ids), "roles": v.roles}


def _vocab_from_json(d: dict[str, Any], name: str, tokenizer: Any) -> Vocabulary:
    tokens = [None if t is None else bytes.fromhex(t) for t in d["tokens"]]
    return Vocabulary(name, tokens, special=d["special"], roles=d["roles"],
                      encoder=hf_encoder(tokenizer))


def load(entry: Path, ident: dict[str, Any], *, name: str, dtype: Any,
         **kw: Any) -> tuple[Any, Any, Vocabulary] | None:
    """``(model, tokenizer, vocabulary)`` from a complete entry, or ``None`` when
    there is none or it cannot be read (a broken entry is removed)."""
    meta = entry / _META
    if not meta.is_file():
        return None
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if json.loads(meta.read_text()) != ident:
            raise ValueError("entry identity does not match its GGUF file")
        tok = AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=dtype,
                                                     local_files_only=True, **kw)
        vocab = _vocab_from_json(json.loads((entry / _VOCAB).read_text()), name, tok)
    except Exception as e:  # any failure means: load the GGUF file instead
        log.warning("model cache entry %s is unreadable (%s); loading the GGUF file", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    log.info("loaded %s from the model cache", entry.name)
    return model, tok, vocab


def _as_plain(model: Any) -> bool:
    """Drop the GGUF quantizer's bookkeeping from a model whose weights it fully
    dequantised, so ``save_pretrained`` writes ordinary tensors under their
    Hugging Face names. ``False`` when weights stay packed in GGUF blocks (a
    ``kernels`` install): such a model is not what a plain reload would give."""
    q = getattr(model, "hf_quantizer", None)
    if q is None:
        return True
    config = getattr(q, "quantization_config", None)
    if getattr(config, "quant_method", None) != "gguf" or getattr(q, "packed_modules", None):
        return False
    if any(type(m).__module__.startswith("transformers.integrations.gguf")
           for m in model.modules()):
        return False
    if not all(p.is_floating_point() for p in model.parameters()):
        return False
    q.remove_quantization_config(model)
    return True


def store(entry: Path, ident: dict[str, Any], model: Any, tokenizer: Any,
          vocab: Vocabulary) -> bool:
    """Write an entry atomically; ``False`` (logged, not raised) when it cannot be
    written or another process wrote it first. Older entries of the same GGUF
    path are removed."""
    if not _as_plain(model):
        log.info("not caching %s: its weights stay packed in GGUF blocks", entry.name)
        return False
    parent = entry.parent
    tmp: Path | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the entry is an ordinary cache dir
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _VOCAB).write_text(json.dumps(_vocab_to_json(vocab)))
        (tmp / _META).write_text(json.dumps(ident, sort_keys=True))  # last: marks it complete
        os.rename(tmp, entry)
        tmp = None
    except OSError as e:
        if entry.is_dir():  # another process won the race: its entry is as good as ours
            return False
        log.warning("cannot write model cache entry %s: %s", entry, e)
        return False
    except Exception as e:  # save_pretrained refusing a model must not fail the load
        log.warning("cannot write model cache entry %s: %s", entry, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(entry, ident)
    return True


def _prune(entry: Path, ident: dict[str, Any]) -> None:
    """Remove other entries of the same GGUF path and dtype (an older file there,
    or an older transformers)."""
    for other in entry.parent.glob(f"{Path(ident['path']).stem}-*"):
        if other == entry or not other.is_dir():
            continue
        try:
            old = json.loads((other / _META).read_text())
            if (old.get("path"), old.get("dtype")) == (ident["path"], ident["dtype"]):
                shutil.rmtree(other, ignore_errors=True)
        except (OSError, ValueError):
            continue
