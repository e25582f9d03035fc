"""Tiny transformer models built locally, never downloaded: what the tests and the
backend-overhead benchmark run the transformers code path on (the real pair is
hundreds of MB; these take seconds to build and need nothing from a model hub).

* :func:`byte_level_tokenizer` -- a GPT-2-style byte-level BPE trained with
  ``tokenizers`` on a slice of the default corpus;
* :func:`sentencepiece_tokenizer` -- a SentencePiece-style BPE (Metaspace ``▁``,
  ``<0xNN>`` byte-fallback tokens, the Llama-2/Gemma decoder);
* :func:`tiny_llama` -- a few-layer ``LlamaConfig`` model with random weights over one
  of them, saved to a directory so ``from_pretrained`` runs the real loading path.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from .corpus import default_corpus


def _training_text(n_docs: int = 600) -> list[str]:
    return default_corpus()[:n_docs]


def byte_level_tokenizer(vocab_size: int = 600) -> Any:
    """A byte-level BPE with ``<|endoftext|>`` (eos) and ``<|startoftext|>`` (bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|startoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|startoftext|>")


def sentencepiece_tokenizer(vocab_size: int = 700) -> Any:
    """A SentencePiece-style BPE: ``▁`` for spaces, 256 ``<0xNN>`` byte-fallback
    tokens (ids 3..258) for anything the merges do not cover, and the Llama-2
    decoder (Replace ``▁`` -> space, ByteFallback, Fuse)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Replace(" ", "\u2581")
    base.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False)
    base.train_from_iterator(_training_text(), trainer)
    model_json = json.loads(base.to_str())["model"]
    trained: dict[str, int] = model_json["vocab"]
    merges: list[tuple[str, str]] = [
        (str(a), str(b)) for a, b in (m.split(" ") if isinstance(m, str) else m
                                      for m in model_json["merges"])]
    vocab: dict[str, int] = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def save_tiny_llama(path: Path, tokenizer: Any, *, layers: int = 4, hidden: int = 64,
                    seed: int = 0) -> Path:
    """A random-weight Llama over ``tokenizer``, saved with it to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper than the default init, so rows are not near-uniform
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama(path: Path | None = None, *, sentencepiece: bool = False, **kw: Any) -> Any:
    """A :class:`~xcosd.models.TransformersModel` over a freshly built tiny Llama."""
    from xcosd.models import TransformersModel

    if path is None:
        path = Path(tempfile.mkdtemp(prefix="xcosd-tiny-"))
    tok = sentencepiece_tokenizer() if sentencepiece else byte_level_tokenizer()
    save_tiny_llama(path, tok, **kw)
    return TransformersModel.from_pretrained(path)
