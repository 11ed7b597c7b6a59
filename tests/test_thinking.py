"""Thinking models: ``enable_thinking`` reaches the template, and ``<think>`` reasoning is separated
from the answer (``reasoning_content``), even when a tag is split across tokens."""

from __future__ import annotations

import re

import pytest
from gguf import GGUFValueType
from gguf.gguf_writer import GGUFValue

from bmoe.engine.chat import BUILTIN, OWN, ChatFormat, Message
from bmoe.engine.config import RunConfig
from bmoe.engine.sync import SyncSession
from bmoe.engine.thinking import ThinkSplitter
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.helpers import bmoe

# The shape of Qwen3's template: thinking off appends an empty think block to the generation prompt.
QWEN3_LIKE = (
    b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    b"{% if add_generation_prompt %}<|im_start|>assistant\n"
    b"{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def run(splitter: ThinkSplitter, pieces: list[str]) -> tuple[str, str]:
    r, a = zip(*(splitter.feed(p) for p in pieces)) if pieces else ((), ())
    fr, fa = splitter.flush()
    return "".join(r) + fr, "".join(a) + fa


@pytest.mark.pure
@pytest.mark.parametrize("pieces,expected", [
    (["<think>", "plan", "</think>", "\n\nAnswer"], ("plan", "Answer")),
    (["<th", "ink>pl", "an</th", "ink>", "Ans", "wer"], ("plan", "Answer")),
    (["  <think>a<b", "</think>x"], ("a<b", "x")),
    (["Just ", "an answer"], ("", "Just an answer")),
    (["<b>bold</b>"], ("", "<b>bold</b>")),
    (["<thi"], ("", "<thi")),
    (["<think>never closed"], ("never closed", "")),
])
def test_splitter(pieces: list[str], expected: tuple[str, str]) -> None:
    assert run(ThinkSplitter(), pieces) == expected


@pytest.mark.pure
@pytest.mark.parametrize("pieces,expected", [
    (["<thi"], ("", "")),  # cut while writing <think>: it had leaked as the answer, and the turn was kept
    (["<think>plan</thi"], ("plan", "")),
    (["  <"], ("", "")),
    (["An answer <"], ("", "An answer <")),  # once the answer began, no marker is looked for: all text
])
def test_a_reply_cut_inside_a_marker_drops_the_markers_start(pieces: list[str], expected: tuple[str, str]) -> None:
    from bmoe.engine.thinking import ChannelSplitter

    splitter = ThinkSplitter()
    r, a = zip(*(splitter.feed(p) for p in pieces))
    fr, fa = splitter.flush(cut=True)
    assert ("".join(r) + fr, "".join(a) + fa) == expected
    channels = ChannelSplitter()
    assert channels.feed("<|channel|>final<|message|>Yes<|en") == ("", "Yes")
    assert channels.flush(cut=True) == ("", "")


@pytest.mark.pure
def test_a_prompt_that_opened_the_block_starts_in_reasoning() -> None:
    assert run(ThinkSplitter("<|im_start|>assistant\n<think>\n"), ["weigh it", "</think>", "done"]) == ("weigh it", "done")


@pytest.mark.pure
def test_enable_thinking_reaches_the_template() -> None:
    fmt = ChatFormat(QWEN3_LIKE)
    msgs = [Message("user", "hi")]
    assert fmt.description == OWN and fmt.thinks
    assert fmt.render(msgs).endswith("<|im_start|>assistant\n")
    assert fmt.render(msgs, {"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    assert fmt.render(msgs, {"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_jinja_cannot_render_falls_back_to_llama_cpp() -> None:
    fmt = ChatFormat(b"<|im_start|>{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}")
    assert fmt.description == BUILTIN
    assert fmt.render([Message("user", "hi")]).startswith("<|im_start|>user\nhi<|im_end|>")


def test_reasoning_content_in_chat_completions(tiny) -> None:
    path = tiny.path(TinySpec())
    grammar = 'root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{1,4}'
    with SyncSession.open(path, RunConfig(mode="stream", n_ctx=256)) as s:
        kw = dict(max_tokens=30, temperature=0.9, seed=4, grammar=grammar,
                  chat_template_kwargs={"enable_thinking": True})
        body = s.create_chat_completion([{"role": "user", "content": "think"}], **kw)
        chunks = list(s.create_chat_completion([{"role": "user", "content": "think"}], stream=True, **kw))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].isalpha() and message["content"].isalpha()
    assert "<" not in message["content"] + message["reasoning_content"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_chat_no_think_flag_think_command_and_hidden_reasoning(tmp_path) -> None:  # noqa: ANN001
    """``bmoe chat --no-think`` and ``/think off`` reach the template (the generation prompt grows by
    the empty think block); with stdout not a terminal the reasoning is left out of the transcript."""
    def with_template(w) -> None:  # noqa: ANN001
        w.kv_data[0]["tokenizer.chat_template"] = GGUFValue(QWEN3_LIKE.decode(), GGUFValueType.STRING)

    (path,) = write_tiny(tmp_path / "t.gguf", TinySpec(), edit_metadata=with_template)
    (tmp_path / "g.gbnf").write_text('root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{1,4}')

    def chat(lines: str, *extra: str) -> tuple[int, str]:
        proc = bmoe("chat", "-m", path, "-n", "30", "-c", "256", "-q", "--temp", "0.9", "--seed", "4",
                    "--grammar-file", tmp_path / "g.gbnf", *extra, stdin=lines)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        prompt = int(re.findall(r"last prompt: (\d+) tokens", proc.stderr)[-1])
        assert re.fullmatch(r"[a-z]{1,4}\n", proc.stdout), "only the answer: the reasoning is not shown"
        return prompt, proc.stdout

    thinking, _ = chat("hi\n/stats\n")
    flag, _ = chat("hi\n/stats\n", "--no-think")
    command, _ = chat("/think off\nhi\n/stats\n")
    assert flag == command > thinking
