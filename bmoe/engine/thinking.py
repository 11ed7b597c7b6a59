"""Reasoning separated from the answer (llama-server's ``reasoning_content``), for the two ways
thinking models write it: ``<think>...</think>`` (Qwen3, DeepSeek-R1 style: ``ThinkSplitter``) and
gpt-oss's channels (``ChannelSplitter``). Both hold back text that may still become a marker until
the next piece decides it, so a marker split across tokens is never shown.

``<think>``: a reply is reasoning while it is inside the think block: when it begins with
``<think>`` (after whitespace), or when the prompt already opened the block (a template whose
generation prompt ends with ``<think>``). Everything after ``</think>`` is the answer. A reply that
does not think is all answer.

Channels (gpt-oss, "harmony"): a reply is a sequence of messages,
``<|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER``,
ended by ``<|return|>`` (or ``<|call|>`` after a tool call). The analysis channel is reasoning; the
final and commentary channels are the answer; a message addressed to a tool (``to=functions.x`` in
its header) or with an unknown header is left out of the text, as llama-server's gpt-oss parser
does (when tools were offered, one to ``functions.NAME`` is a tool call: ``take_calls``); so is
text between messages. The pinned llama.cpp renders these markers as text even without special
tokens (it re-types ``<|channel|>``, ``<|message|>``, ``<|start|>``, ``<|constrain|>`` and
``<|end|>`` as user-defined at load) and ends the generation at ``<|return|>`` and ``<|call|>``
only: ``<|end|>`` is taken off the end-of-generation list when both of those exist, so a reply is
not cut between its analysis and its final message. A reply that does not begin with a channel
header is all answer.
"""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
CUT = ("length", "cancelled")  # finish reasons of a reply stopped before its end: ``flush(cut=True)``


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

    def flush(self, cut: bool = False) -> tuple[str, str]:
        """What is still held at the end of the reply. ``cut``: the reply was stopped before its
        end (``-n``/``max_tokens``, a cancel): what is held is the start of a marker the model did
        not finish writing, markup rather than text, and is dropped. A reply that ended on its own
        with a lone ``<`` or ``</thi`` did write it, and keeps it."""
        held, self._held = self._held, ""
        if cut:
            return "", ""
        return (held, "") if self._state == "thinking" else ("", held if self._state != "after" else "")


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
# Where a message body ends: its own end, the generation's ends (never rendered by the pinned
# llama.cpp, but never shown if they are), or the next message's header.
_BODY_ENDS = (END, "<|return|>", "<|call|>")
_HEADS = (START, CHANNEL)
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_CALL = re.compile(r"to=functions\.([A-Za-z0-9_-]+)")  # a message addressed to a function: a tool call


class ChannelSplitter:
    """gpt-oss's channels split into (reasoning, answer); the same interface as ``ThinkSplitter``.

    ``prompt``: the rendered prompt, whose end may already have opened a header or a message
    (a generation prompt that ends with ``<|start|>assistant<|channel|>final<|message|>``)."""

    def __init__(self, prompt: str = "", *, calls: bool = False) -> None:
        """``calls``: a message to ``functions.NAME`` is a tool call, reported by ``take_calls``
        (else it is hidden like any other message the reader should not see)."""
        self._state, self._held, self._header = "start", "", ""
        self._calls_on, self._calls = calls, []
        at = prompt.rfind(START)
        tail = prompt[at:] if at >= 0 else ""
        if tail.endswith(MESSAGE) and tail.count(MESSAGE) == 1:
            self._state = self._open(tail[: -len(MESSAGE)])
        elif CHANNEL in tail and MESSAGE not in tail:
            self._state, self._header = "header", tail

    def take_calls(self) -> list[tuple[str, str]]:
        """The tool-call events since the last take: ("name", NAME) as a call's message opens,
        then ("args", TEXT) pieces of its body (the arguments' JSON)."""
        out, self._calls = self._calls, []
        return out

    def _open(self, header: str) -> str:
        """The state a message with this header is read in (a call's name is reported here)."""
        if self._calls_on and (call := _CALL.search(header)):
            self._calls.append(("name", call.group(1)))
            return "call"
        return _channel_of(header)

    def _emit(self, out: dict[str, str], text: str) -> None:
        if self._state == "call":
            if text:
                self._calls.append(("args", text))
        elif self._state != "between":
            out[self._state] += text

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that may be shown now."""
        pending = self._held + text
        self._held = ""
        out = {"reasoning": "", "answer": "", "hidden": ""}
        while pending:
            if self._state == "start":
                stripped = pending.lstrip()
                if stripped.startswith(_HEADS):
                    self._state, pending = "header", stripped
                elif any(h.startswith(stripped) for h in _HEADS):
                    self._held = pending  # could still open a header
                    break
                else:
                    self._state = "plain"
            elif self._state == "plain":
                out["answer"] += pending
                break
            elif self._state == "header":  # up to <|message|>; never shown
                pending, self._header = self._header + pending, ""
                at, marker = _first(pending, (MESSAGE, END))
                if at < 0:
                    self._header = pending
                    break
                header, pending = pending[:at], pending[at + len(marker):]
                self._state = self._open(header) if marker == MESSAGE else "between"
            else:  # a message body (reasoning, answer, hidden, call), or "between" messages (dropped)
                at, marker = _first(pending, _BODY_ENDS + _HEADS)
                if at < 0:
                    keep = max(_partial(pending, m) for m in _BODY_ENDS + _HEADS)
                    self._emit(out, pending[: len(pending) - keep])
                    self._held = pending[len(pending) - keep:]
                    break
                self._emit(out, pending[:at])
                if marker in _HEADS:
                    self._state, pending = "header", pending[at:]
                else:
                    self._state, pending = "between", pending[at + len(marker):]
        return out["reasoning"], out["answer"]

    def flush(self, cut: bool = False) -> tuple[str, str]:
        """What is still held at the end of the reply (an unfinished header is dropped; so is a
        marker's start held when the reply was ``cut``, as for ``ThinkSplitter.flush``)."""
        held, self._held, self._header = self._held, "", ""
        if cut:
            return "", ""
        if self._state == "call":  # a call ends the reply at <|call|>, which renders as no text
            out = {"reasoning": "", "answer": ""}
            self._emit(out, held)
            return "", ""
        if self._state == "reasoning":
            return held, ""
        return ("", held) if self._state in ("start", "plain", "answer") else ("", "")


def _channel_of(header: str) -> str:
    """Where a message with this header goes: "reasoning", "answer" or "hidden"."""
    if "to=" in header:  # a tool call: not text for the reader
        return "hidden"
    name = _CHANNEL_NAME.findall(header)
    if name and name[-1] == "analysis":
        return "reasoning"
    if name and name[-1] in ("final", "commentary"):
        return "answer"
    return "hidden"


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest marker in ``text`` and where it is, or (-1, "")."""
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else (-1, "")
