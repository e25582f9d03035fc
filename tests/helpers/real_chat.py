"""What the real pair's chat tests share: the conversations, the model pair, and
the reference they are held to -- the target's own transformers ``generate``
(greedy, with its KV cache) on ``apply_chat_template``'s ids."""

from __future__ import annotations

from typing import Any

import pytest

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a prime number between 10 and 20."},
     {"role": "assistant", "content": "11"},
     {"role": "user", "content": "Another one?"}],
]


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    """(SmolLM2-135M, Gemma-3-270m), from the model cache after the first run."""
    from xcosd.models import load_model

    return load_model("smollm2-135m"), load_model("gemma3-270m")


def templated(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat as transformers renders it, the generation prompt added."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(out, list):  # a BatchEncoding in newer transformers
        out = out["input_ids"]
    return [int(i) for i in out]


def own_greedy(target: Any, ids: list[int], n: int, stops: list[int]) -> list[int]:
    """The target's own greedy ``generate`` after ``ids``: at most ``n`` new ids."""
    import torch

    with torch.no_grad():
        out = target.model.generate(torch.tensor([ids], device=target.device), do_sample=False,
                                    max_new_tokens=n, eos_token_id=stops, pad_token_id=stops[0])
    return [int(t) for t in out[0, len(ids):].tolist()]
