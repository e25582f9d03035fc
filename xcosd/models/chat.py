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


#: Gemma 3's chat template as Google publishes it with the instruction-tuned models
#: (text content only): a system message is folded into the first user turn, turns
#: alternate user / model between ``<start_of_turn>`` and ``<end_of_turn>``, and the
#: answer follows ``<start_of_turn>model``. The Gemma-3-270m GGUF this project loads
#: carries no template, so its tokenizer is given this one (xcosd/models/registry.py).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
