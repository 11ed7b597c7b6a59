"""``bmoe chat`` used as a person uses it: what the conversation keeps when the context is
outgrown."""

from __future__ import annotations

import pytest

from bmoe.cli.chat import _fit
from bmoe.engine.chat import ChatFormat, Message


class _Tokens:
    """A stand-in session for ``_fit``: one token per character."""

    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return [0] * len(text)


@pytest.mark.pure
def test_an_outgrown_context_drops_whole_turns(capsys) -> None:  # noqa: ANN001
    """The oldest user message was dropped without its reply, so the conversation began with an
    orphan assistant message (a template that checks roles refuses that); the message counted
    messages as turns."""
    fmt = ChatFormat(None)  # "role: content" lines
    turn = [Message("user", "u" * 20), Message("assistant", "a" * 20)]
    history = [Message("system", "s"), *turn, *turn, *turn, Message("user", "new")]
    prompt = _fit(_Tokens(n_ctx=100), fmt, history, 10)
    assert [m.role for m in history] == ["system", "user", "assistant", "user"]
    assert len(prompt) + 10 <= 100
    err = capsys.readouterr().err
    assert "the conversation outgrew the context (100 tokens, 10 of them kept for the reply)" in err
    assert "the oldest 2 turns were dropped, the model no longer sees them" in err
    history = [*turn, Message("user", "x" * 60)]
    _fit(_Tokens(n_ctx=100), fmt, history, 10)
    assert [m.role for m in history] == ["user"] and "the oldest turn was dropped" in capsys.readouterr().err
