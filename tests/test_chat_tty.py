"""``bmoe chat`` as a person uses it, through a pseudo-terminal (pexpect): Ctrl-C mid-reply stops
the reply and keeps the conversation, /stats and /reset answer, Ctrl-C at the prompt clears the
line, an empty line does nothing, Ctrl-D leaves with status 0; no traceback, no llama.cpp log."""

from __future__ import annotations

import os
import re
import sys

import pexpect

from bmoe.synth.tiny import TinySpec
from tests.helpers import bmoe

GUARD_S = 120  # turns a hang into a failure; nothing is timed
# prompt_toolkit draws the prompt with cursor moves, not as plain "> ": it turns bracketed paste on
# when a prompt starts and off when the line is entered, which marks both points in the stream.
PROMPT = "\x1b[?2004h"
ENTERED = "\x1b[?2004l"


def spawn(path, *extra: str) -> pexpect.spawn:  # noqa: ANN001
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PROMPT_TOOLKIT_NO_CPR="1")  # nobody answers cursor-position requests in a pty
    return pexpect.spawn(sys.executable, ["-m", "bmoe.cli", "chat", "-m", str(path), *extra],
                         env=env, encoding="utf-8", timeout=GUARD_S, dimensions=(40, 200))


def test_chat_in_a_terminal(tiny) -> None:
    path = tiny.path(TinySpec())
    # A reply of up to 3000 tokens (this fixture's greedy reply does not end early) takes seconds:
    # Ctrl-C is sent as soon as its first text shows.
    chat = spawn(path, "-n", "3000", "-c", "4096")
    chat.expect_exact("/help lists commands")
    chat.expect_exact(PROMPT)
    chat.sendline("")  # nothing happens: the prompt comes back
    chat.expect_exact(PROMPT)
    chat.sendline("/help")
    chat.expect_exact("/reset")
    chat.expect_exact(PROMPT)
    chat.sendline("tell me a long story")
    chat.expect_exact(ENTERED)
    chat.expect(r"[^\x1b\r\n]")  # the reply has begun
    chat.sendintr()
    chat.expect_exact("[stopped]")
    chat.expect_exact(PROMPT)
    chat.sendline("/stats")
    chat.expect(r"session: 1 reply, (\d+) tokens? generated")
    assert 0 < int(chat.match.group(1)) < 3000, "the reply was stopped"
    chat.expect_exact(PROMPT)
    chat.send("half a line")
    chat.sendintr()  # at the prompt: the line is dropped, the chat goes on
    chat.expect_exact(PROMPT)
    chat.sendline("/reset")
    chat.expect_exact("conversation cleared")
    chat.expect_exact(PROMPT)
    chat.sendline("/nonsense")
    chat.expect_exact("unknown command /nonsense")
    chat.expect_exact(PROMPT)
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0, chat.before
    transcript = chat.before or ""
    assert "Traceback" not in transcript and "graph_compute" not in transcript


def test_prompts_go_to_stderr_when_stdout_is_redirected(tiny) -> None:
    path = tiny.path(TinySpec())
    proc = bmoe("chat", "-m", path, "-n", "4", "-q", stdin="\nhello\n/stats\n")
    assert proc.returncode == 0, proc.stderr
    assert "> " not in proc.stdout and proc.stderr.count("> ") == 4
    assert re.search(r"session: 1 reply,", proc.stderr) and "Traceback" not in proc.stderr
