"""``bmoe chat`` used as a person uses it: what the terminal shows (a reply's reasoning and answer
on lines of their own, no raw control characters, why a reply ended early, how to leave), what a
piped session prints, and what the conversation keeps when a reply is stopped or the context is
outgrown. Nothing is timed: every wait is on expected output, with a generous guard."""

from __future__ import annotations

import re
import subprocess

import pytest
from gguf import GGUFValueType
from gguf.gguf_writer import GGUFValue

from bmoe.cli.chat import _fit, _settle
from bmoe.engine.chat import ChatFormat, Message
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.helpers import bmoe
from tests.test_chat_tty import ENTERED, PROMPT, spawn
from tests.test_harmony import write_harmony_model
from tests.test_thinking import QWEN3_LIKE

DIM, UNDIM = "\x1b[2m", "\x1b[0m"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):  # noqa: ANN001, ANN201
    """A tiny qwen3moe whose template is Qwen3-shaped (``<think>``, ``enable_thinking``)."""
    def edit(w) -> None:  # noqa: ANN001
        w.kv_data[0]["tokenizer.chat_template"] = GGUFValue(QWEN3_LIKE.decode(), GGUFValueType.STRING)

    (path,) = write_tiny(tmp_path_factory.mktemp("qwen3") / "q.gguf", TinySpec(), edit_metadata=edit)
    return path


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):  # noqa: ANN001, ANN201
    """A tiny gpt-oss with the harmony markers in its vocabulary and a gpt-oss-shaped template."""
    return write_harmony_model(tmp_path_factory.mktemp("gptoss"))


def grammar(tmp_path, rule: str):  # noqa: ANN001, ANN201
    path = tmp_path / "g.gbnf"
    path.write_text(f"root ::= {rule}\n")
    return str(path)


def chat_piped(path, lines: str, *extra: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    proc = bmoe("chat", "-m", path, *extra, stdin=lines)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def leave(chat) -> str:  # noqa: ANN001
    chat.sendeof()
    chat.expect(pexpect_eof())
    chat.close()
    assert chat.exitstatus == 0, chat.before
    return chat.before or ""


def pexpect_eof():  # noqa: ANN201
    import pexpect

    return pexpect.EOF


@pytest.mark.parametrize("model,rule", [
    ("qwen3", '"<think>" [a-z]{2,6} "</think>" [a-z]{1,4}'),
    ("gpt-oss", '"<|channel|>analysis<|message|>" [a-z]{2,6} "<|end|><|start|>assistant<|channel|>final<|message|>" '
                '[a-z]{1,4}'),
])
def test_the_answer_starts_on_a_line_of_its_own_after_the_reasoning(model, rule, request, tmp_path) -> None:  # noqa: ANN001
    """Dimmed reasoning that does not end its line was run together with the answer."""
    path = request.getfixturevalue("qwen3" if model == "qwen3" else "gpt_oss")
    chat = spawn(path, "-n", "90", "-q", "--temp", "0.9", "--seed", "3", "--grammar-file", grammar(tmp_path, rule))
    chat.expect_exact(PROMPT)
    chat.sendline("hi")
    chat.expect_exact(ENTERED)
    chat.expect_exact(PROMPT)
    reply = chat.before
    assert re.fullmatch(rf"(?:{re.escape(DIM)}[a-z]+{re.escape(UNDIM)})+\r\n[a-z]{{1,4}}\r\n", reply), repr(reply)
    leave(chat)


def test_control_characters_from_the_model_are_shown_as_symbols_on_a_terminal(qwen3, tmp_path) -> None:
    """A model's escape sequence, backspace, carriage return or bell reached the terminal raw (it
    moved the cursor, changed colours); a redirected transcript keeps them as the model wrote them."""
    rule = grammar(tmp_path, r'"x\x1b[7m\x08\ry\x07z"')
    chat = spawn(qwen3, "-n", "30", "-q", "--grammar-file", rule)
    chat.expect_exact(PROMPT)
    chat.sendline("hi")
    chat.expect_exact(ENTERED)
    chat.expect_exact(PROMPT)
    assert chat.before == "x\u241b[7m\u2408y\u2407z\r\n", repr(chat.before)
    leave(chat)
    proc = bmoe("chat", "-m", qwen3, "-n", "30", "-q", "--grammar-file", rule, stdin=b"hi\n", binary=True)
    assert proc.returncode == 0 and proc.stdout == b"x\x1b[7m\x08\ry\x07z\n", proc


def test_a_reply_cut_by_n_says_so(qwen3) -> None:
    """A reply that ran into -n ended with no word of why; on a terminal the mark follows the text,
    redirected it goes to stderr, never into the transcript."""
    chat = spawn(qwen3, "-n", "4", "-q")
    chat.expect_exact(PROMPT)
    chat.sendline("hi")
    chat.expect_exact(ENTERED)
    chat.expect_exact(" [cut at 4 tokens (-n)]\r\n")
    chat.expect_exact(PROMPT)
    leave(chat)
    proc = chat_piped(qwen3, "hi\n", "-n", "4")
    assert "[cut at 4 tokens (-n)]" in proc.stderr and "cut at" not in proc.stdout


def test_a_reply_stopped_before_its_answer_leaves_no_turn(qwen3, tmp_path) -> None:
    """Ctrl-C while the prompt is evaluated or the model is still reasoning: there is no answer, and
    the message is not kept (it stayed in the conversation with an empty reply); the up arrow
    brings it back, and sent again its prompt is the one it had the first time."""
    rule = grammar(tmp_path, '"<think>" [a-z ]{400} "</think>" [a-z]{1,4}')
    chat = spawn(qwen3, "-n", "500", "-q", "--temp", "0.9", "--seed", "5", "--grammar-file", rule)
    chat.expect_exact(PROMPT)
    chat.sendline("tell me")
    chat.expect_exact(ENTERED)
    chat.expect_exact(DIM)  # it is reasoning
    chat.sendintr()
    chat.expect_exact("[stopped before the answer; the message is not kept (up arrow recalls it)]")
    chat.expect_exact(PROMPT)
    chat.sendline("/stats")
    chat.expect(r"last prompt: (\d+) tokens")
    first = int(chat.match.group(1))
    chat.expect_exact(PROMPT)
    chat.send("\x1b[A")  # /stats
    chat.expect_exact("/stats")
    chat.send("\x1b[A")  # the message before it
    chat.expect_exact("tell me")
    chat.send("\r")
    chat.expect_exact(ENTERED)
    chat.expect_exact(PROMPT)
    assert "not kept" not in chat.before and "\r\n" in chat.before  # answered this time
    chat.sendline("/stats")
    chat.expect(r"last prompt: (\d+) tokens")
    assert int(chat.match.group(1)) == first, "the stopped turn is not in the conversation"
    chat.expect_exact(PROMPT)
    leave(chat)


def test_ctrl_c_at_an_empty_prompt_says_how_to_leave_and_twice_leaves(qwen3) -> None:
    """Ctrl-C at an empty prompt did nothing visible; now it says how to leave, and a second one in
    a row leaves (a key typed in between starts over)."""
    chat = spawn(qwen3, "-q")
    chat.expect_exact(PROMPT)
    chat.sendintr()
    chat.expect_exact("(Ctrl-C again, Ctrl-D or /exit leaves)")
    chat.expect_exact(PROMPT)
    chat.send("x")
    chat.expect_exact("x")
    chat.send("\x7f")  # typed and erased: not "in a row"
    chat.expect_exact("\x1b[K")
    chat.sendintr()
    chat.expect_exact("(Ctrl-C again, Ctrl-D or /exit leaves)")
    chat.expect_exact(PROMPT)
    chat.sendintr()
    chat.expect(pexpect_eof())
    chat.close()
    assert chat.exitstatus == 0
    assert "Traceback" not in (chat.before or "")


def test_esc_enter_starts_a_new_line_of_the_same_message(qwen3) -> None:
    """There was no way to type a message of several lines (only to paste one)."""
    chat = spawn(qwen3, "-n", "4", "-q")
    chat.expect_exact(PROMPT)
    chat.send("first line")
    chat.send("\x1b\r")  # Esc, Enter (what Alt-Enter sends)
    chat.send("second line")
    chat.expect_exact("second line")
    chat.send("\r")
    chat.expect_exact("> first line")
    chat.expect_exact(". second line")  # the line entered, redrawn whole: its continuation is marked
    chat.expect_exact(ENTERED)
    chat.expect_exact(PROMPT)
    chat.sendline("/stats")
    chat.expect_exact("session: 1 reply,")
    chat.expect_exact(PROMPT)
    leave(chat)


def test_piped_lines_are_echoed_after_their_prompt(qwen3) -> None:
    """``printf 'hi\\nthere\\n' | bmoe chat``: each line is answered, and the prompt stream shows the
    line after its prompt, so a reply never reads as if it were typed after "> "."""
    proc = chat_piped(qwen3, "hi\nthere\n", "-n", "4", "-q")
    assert proc.stderr == "> hi\n> there\n> \n"
    assert len(proc.stdout.splitlines()) == 2


def test_the_banner_says_what_runs_and_quiet_hides_the_warnings(qwen3) -> None:
    proc = chat_piped(qwen3, "", "-c", "100")
    assert "bmoe: warning: the context holds 256 tokens" in proc.stderr
    # The cache is auto by default (its budget shown), and the default reply length leaves half of a small context.
    assert re.search(r"bmoe chat: q\.gguf \(qwen3moe\), streamed, cache [0-9.,]+ MiB, context 256 tokens, replies up to "
                     r"128 tokens \(-n\)", proc.stderr), proc.stderr
    assert "streamed, cache off, context" in chat_piped(qwen3, "", "-c", "100", "--cache-mb", "0").stderr
    assert "the model's own chat template; thinking on (/think)" in proc.stderr and "/help lists" in proc.stderr
    proc = chat_piped(qwen3, "", "-c", "100", "-q")
    assert proc.stderr == "> \n", "-q: no banner and no warnings"
    proc = chat_piped(qwen3, "", "--resident", "--no-think")
    assert "streamed" not in proc.stderr and ", resident, " in proc.stderr and "thinking off" in proc.stderr


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
    before = list(history)
    prompt, kept = _fit(_Tokens(n_ctx=100), fmt, history, 10)
    assert [m.role for m in kept] == ["system", "user", "assistant", "user"] and history == before
    assert len(prompt) + 10 <= 100 and prompt == fmt.render(kept)
    err = capsys.readouterr().err
    assert "the conversation outgrew the context (100 tokens, 10 of them kept for the reply)" in err
    assert "the oldest 2 turns were dropped, the model no longer sees them" in err
    history = [*turn, Message("user", "x" * 60)]
    _, kept = _fit(_Tokens(n_ctx=100), fmt, history, 10)
    assert [m.role for m in kept] == ["user"] and "the oldest turn was dropped" in capsys.readouterr().err


@pytest.mark.pure
def test_a_reply_stopped_before_its_answer_gives_back_the_turns_dropped_for_it(capsys) -> None:  # noqa: ANN001
    """Turns dropped to fit a message stayed dropped when its reply was then stopped before any
    answer: the message was taken back, the older conversation was lost for a reply that never came."""
    fmt = ChatFormat(None)
    turn = [Message("user", "u" * 20), Message("assistant", "a" * 20)]
    history = [Message("system", "s"), *turn, *turn, *turn]
    _, kept = _fit(_Tokens(n_ctx=100), fmt, [*history, Message("user", "new")], 10)
    assert len(kept) == 4  # two turns dropped to fit
    after, note = _settle(history, kept, "", "cancelled", 10, reasoned=True)
    assert after == history
    assert note == ("stopped before the answer; the message is not kept (up arrow recalls it), "
                    "and the turns dropped for it are back")
    after, note = _settle(history, kept, "  ", "length", 10, reasoned=True)
    assert after == history and note.endswith("are back: raise -n, or /think off")
    after, note = _settle(history, kept, "an answer", "cancelled", 10, reasoned=False)
    assert after == [*kept, Message("assistant", "an answer")] and note == "stopped"
    after, note = _settle(history, kept, "done", "stop", 10, reasoned=False)
    assert after == [*kept, Message("assistant", "done")] and note is None
    nothing_dropped = [*history, Message("user", "new")]
    after, note = _settle(history, nothing_dropped, "", "cancelled", 10, reasoned=False)
    assert after == history and note == "stopped before the answer; the message is not kept (up arrow recalls it)"


def test_a_system_message_that_fills_the_context_is_refused_at_start(qwen3) -> None:
    """Every message, even "hi", was refused as too long, the system message never named."""
    system = "rule " * 300
    proc = bmoe("chat", "-m", qwen3, "-c", "256", "-n", "16", "--system", system, stdin="hi\n")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "bmoe: error: the system message leaves no room in the context (256 tokens, 16 of them kept for the reply) "
        "for a message: shorten it, or raise -c or lower -n"], proc.stderr
    proc = bmoe("chat", "-m", qwen3, "-c", "256", "-n", "16", "-q", "--system", "rule " * 5, stdin="hi\n")
    assert proc.returncode == 0 and "does not fit" not in proc.stderr and proc.stdout.strip(), proc.stderr


def test_a_reply_length_that_fills_the_context_is_refused_at_start(qwen3) -> None:
    """-n at or past -c left no room for any message: every line was refused, then status 0."""
    proc = bmoe("chat", "-m", qwen3, "-c", "256", "-n", "1000", stdin="hello\nworld\n")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "bmoe: error: -n 1000 leaves no room in the context (256 tokens) for a message: lower -n or raise -c"], proc.stderr
