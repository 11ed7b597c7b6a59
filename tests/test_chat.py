"""Chat: template rendering and a multi-turn CLI session whose cache stays warm between turns."""

from __future__ import annotations

import re

import pytest

from bmoe.engine.chat import ChatFormat, Message
from bmoe.synth.tiny import TinySpec
from tests.helpers import bmoe

CHATML = (
    b"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    b" + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.pure
def test_model_template_is_rendered_by_llama_cpp() -> None:
    fmt = ChatFormat(CHATML)
    text = fmt.render([Message("system", "be brief"), Message("user", "hi")])
    assert fmt.description == "the model's own chat template"
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.pure
def test_without_a_template_a_plain_transcript_is_used() -> None:
    fmt = ChatFormat(None)
    assert fmt.render([Message("user", "hi")]) == "user: hi\nassistant:"
    assert "no chat template" in fmt.description


def test_chat_cli_two_turns_with_a_warm_cache(tiny) -> None:
    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    proc = bmoe(
        "chat", "-m", str(path), "-n", "8", "--cache-mb", "64", "-c", "512",
        stdin="hello there, how are you today?\nand again, the same words please\n",
    )
    assert proc.returncode == 0, proc.stderr
    hits = [float(h) for h in re.findall(r"hit ([0-9.]+)%", proc.stderr)]
    assert len(hits) == 2, proc.stderr
    assert hits[1] > hits[0], "the second turn finds experts the first one cached"


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(tiny) -> None:
    path = tiny.path(TinySpec())
    proc = bmoe(
        "chat", "-m", str(path), "-n", "4", "-c", "256",
        stdin="first words\n" + "x" * 2000 + "\n/think\nafter that\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "does not fit the context" in proc.stderr and "not sent" in proc.stderr
    assert "dropped the oldest turn" not in proc.stderr  # the history was left as it was
    assert "/think takes on or off" in proc.stderr
    assert len(re.findall(r"\] \d+ tokens, ", proc.stderr)) == 2, proc.stderr  # both other messages answered


BOS_FIRST = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
             "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_a_template_that_writes_bos_gives_one_bos_not_two(tmp_path) -> None:  # noqa: ANN001
    """Llama 4's and DeepSeek-V3's templates start with ``{{ bos_token }}``; the prompt is then
    tokenized with BOS added, so the model saw BOS twice (llama.cpp drops the template's own)."""
    from gguf import GGUFValueType
    from gguf.gguf_writer import GGUFValue

    from bmoe.engine.completions import prepare_chat_completion
    from bmoe.engine.config import RunConfig
    from bmoe.engine.sync import SyncSession
    from bmoe.synth.tiny import write_tiny

    def edit(w) -> None:  # noqa: ANN001
        w.kv_data[0]["tokenizer.chat_template"] = GGUFValue(BOS_FIRST, GGUFValueType.STRING)

    (path,) = write_tiny(tmp_path / "bos.gguf", TinySpec(), edit_metadata=edit)
    with SyncSession.open(path, RunConfig(n_ctx=128)) as s:
        bos = s.session.tokenize("", special=False)
        assert len(bos) == 1, "this vocabulary adds BOS"
        tokens = prepare_chat_completion(s.session, [{"role": "user", "content": "hi"}]).tokens
        assert tokens[0] == bos[0] and tokens[1] != bos[0], tokens[:4]
        assert s.session.chat_format().render([Message("user", "hi")]) == "[user] hi\n[assistant] "
    # Without BOS added by the tokenizer, the template's own stays.
    assert ChatFormat(BOS_FIRST.encode(), bos="<s>").render([Message("user", "hi")]).startswith("<s>[user]")


ALTERNATING = (
    b"{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    b"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    b"{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
    b"{% endif %}{% endfor %}"
)


@pytest.mark.pure
def test_a_conversation_the_template_refuses_is_refused_with_its_words() -> None:
    """Mistral's and Llama 2's templates raise_exception on roles that do not alternate: the
    conversation was rendered another way, silently (llama.cpp's server and llama-cpp-python
    refuse it)."""

    from bmoe.engine.sampling import ParamError

    fmt = ChatFormat(ALTERNATING, bos="<s>", eos="</s>")
    assert fmt.description == "the model's own chat template"
    ok = [Message("user", "a"), Message("assistant", "b"), Message("user", "c")]
    assert fmt.render(ok) == "<s>[INST] a [/INST]b</s>[INST] c [/INST]"
    with pytest.raises(ParamError, match="refuses this conversation: Conversation roles must alternate") as info:
        fmt.render([Message("user", "a"), Message("user", "c")])
    assert info.value.param == "messages"


def test_a_lossy_chat_says_so_in_its_banner_replies_and_stats(tiny) -> None:  # noqa: ANN001
    """``bmoe run`` labels every figure of a lossy run; ``bmoe chat`` labelled none."""
    path = tiny.path(TinySpec())
    proc = bmoe(
        "chat", "-m", str(path), "-n", "4", "-c", "256", "--cache-mb", "1",
         "--n-expert-used", "1",
        stdin="hello there\n/stats\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOSSY --n-expert-used 1, context" in proc.stderr  # the banner
    assert len(re.findall(r"\[stream LOSSY --n-expert-used 1\] \d+ tokens", proc.stderr)) == 2, proc.stderr
