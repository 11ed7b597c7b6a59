"""Chat: a conversation rendered to a prompt with the model's own template.

The template comes from the file (``tokenizer.chat_template``) and is rendered by llama.cpp's
built-in renderer, which recognises the common template families; a file without a template, or
with one llama.cpp does not recognise, gets a plain "role: content" transcript and says so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from bmoe.engine.seam import llama_lib

PLAIN = "plain transcript (the model file has no chat template llama.cpp recognises)"


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


class ChatFormat:
    def __init__(self, template: bytes | None) -> None:
        self._template = template
        self.description = PLAIN
        if template is not None and self._apply(template, [Message("user", "hi")]) is not None:
            self.description = "the model's own chat template"
        else:
            self._template = None

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt for the assistant's next turn."""
        if self._template is not None:
            text = self._apply(self._template, messages)
            if text is not None:
                return text
        lines = [f"{m.role}: {m.content}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    @staticmethod
    def _apply(template: bytes, messages: Sequence[Message]) -> str | None:
        lib = llama_lib()
        encoded = [(m.role.encode(), m.content.encode()) for m in messages]
        chat = (lib.llama_chat_message * len(encoded))(*(lib.llama_chat_message(r, c) for r, c in encoded))
        size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lib.llama_chat_apply_template(template, chat, len(encoded), True, buf, size)
            if n < 0:
                return None
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        return None
