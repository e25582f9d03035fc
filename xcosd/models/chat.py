"""Chat prompts: a conversation as the text (and so the ids) a model continues.

A model with a chat template of its own (a Hugging Face tokenizer's) renders a
chat with it (:meth:`~xcosd.models.TransformersModel.chat_prompt`). The models
built here (n-gram, table, synthetic) have none, so they share one plain template,
:func:`plain_chat`: each message as ``"Role: content"`` followed by a blank line,
then ``"Assistant:"`` for the answer to follow::

    System: You answer briefly.

    User: What does sorted() return?

    Assistant:

These models have no end-of-turn token: an answer ends at ``max_new_tokens``, at
the end-of-sequence token, or at a stop string (``"\\n\\nUser:"`` ends it where a
next turn would begin).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: the plain template's name for each role
ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def plain_chat(messages: Sequence[Mapping[str, str]]) -> str:
    """``messages`` (``{"role", "content"}`` maps) in the plain template, the
    generation prompt (``"Assistant:"``) added."""
    parts = []
    for m in messages:
        role = m["role"]
        if role not in ROLE_NAMES:
            raise ValueError(f"unknown chat role {role!r}; known: {', '.join(ROLE_NAMES)}")
        parts.append(f"{ROLE_NAMES[role]}: {m['content']}\n\n")
    return "".join(parts) + "Assistant:"
