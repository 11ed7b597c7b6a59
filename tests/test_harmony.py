"""gpt-oss's channels ("harmony"): the analysis channel is ``reasoning_content``, the final channel
is ``content``, and no marker is ever shown, even split across tokens; and the facts about the
pinned llama.cpp the splitter relies on (which markers render without special tokens, which end
the generation)."""

from __future__ import annotations

import pytest
from gguf import GGUFValueType, TokenType
from gguf.gguf_writer import GGUFValue

from bmoe.engine.thinking import ChannelSplitter

REPLY = ("<|channel|>analysis<|message|>weigh <it>, a|b<|end|>"
         "<|start|>assistant<|channel|>final<|message|>The answer.")
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# The shape of gpt-oss's template: past answers in the final channel, the turn opened for the reply.
GPT_OSS_LIKE = (
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def run(splitter: ChannelSplitter, pieces: list[str]) -> tuple[str, str]:
    r, a = zip(*(splitter.feed(p) for p in pieces)) if pieces else ((), ())
    fr, fa = splitter.flush()
    return "".join(r) + fr, "".join(a) + fa


@pytest.mark.pure
@pytest.mark.parametrize("pieces,expected", [
    ([REPLY], ("weigh <it>, a|b", "The answer.")),
    (list(REPLY), ("weigh <it>, a|b", "The answer.")),
    (["<|channel|>analysis<|message|>only thinking<|end|>"], ("only thinking", "")),
    (["<|channel|>analysis<|message|>cut short by max_tok"], ("cut short by max_tok", "")),
    (["<|channel|>final<|message|>just ", "the answer"], ("", "just the answer")),
    (["<|channel|>final <|constrain|>json<|message|>{\"a\": 1}"], ("", "{\"a\": 1}")),
    (["<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b<|end|>"
      "<|start|>assistant<|channel|>final<|message|>c"], ("a", "bc")),
    # a tool call is not text for the reader (llama-server parses it into tool_calls)
    (["<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary to=functions.f "
      "<|constrain|>json<|message|>{\"x\": 1}"], ("a", "")),
    (["<|channel|>mystery<|message|>dropped<|end|><|start|>assistant<|channel|>final<|message|>kept"], ("", "kept")),
    (["<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b"], ("a", "b")),  # no <|end|>
    (["<|channel|>analysis<|message|>a<|end|> stray <|start|>assistant<|channel|>final<|message|>b"], ("a", "b")),
    (["<|channel|>analy"], ("", "")),  # an unfinished header is never shown
    (["  ", "<|chan", "nel|>final<|mess", "age|>x"], ("", "x")),
    (["Plain text, <b>no</b> channels."], ("", "Plain text, <b>no</b> channels.")),
    (["<|cha"], ("", "<|cha")),  # as ThinkSplitter: what never became a marker is the reply's text
    ([], ("", "")),
])
def test_channel_splitter(pieces: list[str], expected: tuple[str, str]) -> None:
    assert run(ChannelSplitter(), pieces) == expected


@pytest.mark.pure
def test_markers_split_at_every_position() -> None:
    expected = ("weigh <it>, a|b", "The answer.")
    for i in range(len(REPLY) + 1):
        assert run(ChannelSplitter(), [REPLY[:i], REPLY[i:]]) == expected, i
        for j in range(i, len(REPLY) + 1, 7):
            assert run(ChannelSplitter(), [REPLY[:i], REPLY[i:j], REPLY[j:]]) == expected, (i, j)


@pytest.mark.pure
def test_shown_text_never_holds_a_marker_piece_by_piece() -> None:
    split = ChannelSplitter()
    shown = [split.feed(c) for c in REPLY] + [split.flush()]
    assert not any("<|" in r + a or "|>" in r + a for r, a in shown)


@pytest.mark.pure
def test_a_prompt_that_opened_the_message_or_the_header() -> None:
    assert run(ChannelSplitter("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>"),
               ["direct"]) == ("", "direct")
    assert run(ChannelSplitter("<|start|>assistant<|channel|>analysis<|message|>"),
               ["hm<|end|><|start|>assistant<|channel|>final<|message|>so"]) == ("hm", "so")
    assert run(ChannelSplitter("<|start|>assistant<|channel|>"), ["analysis<|message|>hm<|end|>"]) == ("hm", "")
    assert run(ChannelSplitter("<|start|>user<|message|>hi<|end|><|start|>assistant"), [REPLY]) == (
        "weigh <it>, a|b", "The answer.")


def test_the_model_or_its_template_chooses_the_splitter(tiny) -> None:  # noqa: ANN001
    from bmoe.engine.chat import ChatFormat
    from bmoe.engine.config import RunConfig
    from bmoe.engine.sync import SyncSession
    from bmoe.engine.thinking import ThinkSplitter
    from bmoe.synth.tiny import TinySpec

    assert isinstance(ChatFormat(GPT_OSS_LIKE.encode()).splitter(""), ChannelSplitter)
    assert isinstance(ChatFormat(b"{{ messages[0].content }}").splitter(""), ThinkSplitter)
    for arch, channels in (("gpt-oss", True), ("qwen3moe", False)):  # files without a template
        with SyncSession.open(tiny.path(TinySpec(arch=arch, n_layer=2)), RunConfig(mode="stream", n_ctx=64)) as s:
            assert s.session.chat_format().channels is channels, arch


def write_harmony_model(folder):  # noqa: ANN001, ANN201
    """A tiny gpt-oss whose vocabulary holds the harmony markers as control tokens (the last
    normal pieces give up their slots) and whose template is gpt-oss-shaped."""
    from bmoe.synth.tiny import TinySpec, write_tiny
    from bmoe.synth.vocab import byte_vocab

    def edit(w) -> None:  # noqa: ANN001
        vocab = byte_vocab()
        tokens, types = list(vocab.tokens), list(vocab.types)
        for i, marker in enumerate(HARMONY, start=len(tokens) - len(HARMONY)):
            tokens[i], types[i] = marker, int(TokenType.CONTROL)
        kv = w.kv_data[0]
        kv["tokenizer.ggml.tokens"] = GGUFValue(tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
        kv["tokenizer.ggml.token_type"] = GGUFValue(types, GGUFValueType.ARRAY, GGUFValueType.INT32)
        kv["tokenizer.chat_template"] = GGUFValue(GPT_OSS_LIKE, GGUFValueType.STRING)

    (path,) = write_tiny(folder / "g.gguf", TinySpec(arch="gpt-oss", n_layer=2), edit_metadata=edit)
    return path


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):  # noqa: ANN001, ANN201
    return write_harmony_model(tmp_path_factory.mktemp("harmony"))


def test_the_pinned_llama_cpp_renders_the_markers_and_ends_only_at_return_and_call(harmony_model) -> None:  # noqa: ANN001
    """llama-vocab.cpp re-types the header markers and ``<|end|>`` as user-defined (rendered
    without special tokens) and takes ``<|end|>`` off the end-of-generation list when
    ``<|return|>`` and ``<|call|>`` are on it: a reply goes on past its analysis message."""
    from bmoe.engine.config import RunConfig
    from bmoe.engine.sync import SyncSession

    with SyncSession.open(harmony_model, RunConfig(mode="stream", n_ctx=64)) as s:
        model = s.session._model
        for marker in HARMONY:
            (token,) = s.tokenize(marker, special=True)[1:]  # after BOS
            ends = marker in ("<|return|>", "<|call|>")
            assert model.is_end(token) is ends, marker
            assert model.piece(token) == (b"" if ends else marker.encode()), marker


def test_reasoning_content_from_the_analysis_channel(harmony_model) -> None:  # noqa: ANN001
    """Through ``create_chat_completion`` (whole and streamed) on real generation: the grammar
    forces the channel text; what the random weights pick inside it is free."""
    from bmoe.engine.config import RunConfig
    from bmoe.engine.sync import SyncSession

    grammar = ('root ::= "<|channel|>analysis<|message|>" [a-z]{2,6} "<|end|><|start|>assistant'
               '<|channel|>final<|message|>" [a-z]{1,4}')
    msgs = [{"role": "user", "content": "think"}]
    with SyncSession.open(harmony_model, RunConfig(mode="stream", n_ctx=256)) as s:
        kw = dict(max_tokens=80, temperature=0.9, seed=4, grammar=grammar)
        body = s.create_chat_completion(msgs, **kw)
        chunks = list(s.create_chat_completion(msgs, stream=True, **kw))
    choice = body["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "stop", "ended at the grammar's end, not at <|end|>"
    assert message["reasoning_content"].isalpha() and message["content"].isalpha(), message
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
