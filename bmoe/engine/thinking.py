"""Reasoning separated from the answer, for models that think in ``<think>...</think>`` (Qwen3,
DeepSeek-R1 style), as llama-server's ``reasoning_content`` does.

A reply is reasoning while it is inside the think block: when it begins with ``<think>`` (after
whitespace), or when the prompt already opened the block (a template whose generation prompt ends
with ``<think>``). Everything after ``</think>`` is the answer. Text that may still become a tag is
held back until the next piece decides it, so a tag split across tokens is never shown. A reply
that does not think is all answer. (gpt-oss's channel format is not handled yet.)
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    def __init__(self, prompt: str = "") -> None:
        self._state = "thinking" if prompt.rstrip().endswith(OPEN) else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that may be shown now."""
        pending = self._held + text
        self._held = ""
        reasoning = answer = ""
        while pending:
            if self._state == "start":
                stripped = pending.lstrip()
                if stripped.startswith(OPEN):
                    self._state, pending = "thinking", stripped[len(OPEN):]
                elif OPEN.startswith(stripped):
                    self._held = pending  # could still open the block
                    return reasoning, answer
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                at = pending.find(CLOSE)
                if at >= 0:
                    reasoning += pending[:at]
                    self._state, pending = "after", pending[at + len(CLOSE):]
                    continue
                keep = _partial(pending, CLOSE)
                reasoning += pending[: len(pending) - keep]
                self._held = pending[len(pending) - keep:]
                return reasoning, answer
            elif self._state == "after":  # the blank lines between the block and the answer
                pending = pending.lstrip()
                if pending:
                    self._state = "answer"
            else:
                answer += pending
                pending = ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """What is still held at the end of the reply."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "thinking" else ("", held if self._state != "after" else "")


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
