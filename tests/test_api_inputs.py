"""The Python API refuses bad input with a ConfigError before llama.cpp sees it (a token id outside
the vocabulary aborts the process there), checks RunConfig's field types, warns about and frees a
session dropped unclosed, and never lets an unclosed SyncSession hang the interpreter's exit."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.engine.sync import SyncSession
from bmoe.errors import BmoeError, ConfigError
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT

CONFIG = RunConfig(mode="stream", n_ctx=256)
HANG_GUARD_S = 120  # only to turn a hang into a failure; nothing is timed


@pytest.fixture(scope="module")
def session(tiny):
    with SyncSession.open(tiny.path(TinySpec()), RunConfig(mode="stream", n_ctx=256, cache_bytes=4 << 20)) as s:
        yield s


def test_token_ids_outside_the_vocabulary_are_refused(session) -> None:
    s = session.session
    n = s.n_vocab
    for call in (lambda: s.detokenize([n]), lambda: s.detokenize([0, -5]), lambda: s.token_bytes(10**6),
                 lambda: s.token_bytes(-5)):
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            call()
    for bad in ("a", 1.5, True, None):
        with pytest.raises(ConfigError, match="integer"):
            s.token_bytes(bad)
    with pytest.raises(ConfigError, match="list of token ids"):
        s.detokenize("abc")
    assert s.detokenize(np.array(s.tokenize("hello"), dtype=np.int64).tolist()) == s.detokenize(s.tokenize("hello"))
    assert s.detokenize(np.array(s.tokenize("hello"), dtype=np.int32)) == s.detokenize(s.tokenize("hello"))
    for bad in (np.array([1.0, 2.0]), np.zeros((2, 2), dtype=np.int32), np.array([n], dtype=np.int64)):
        with pytest.raises(ConfigError, match="integer|list of token ids|outside the vocabulary"):
            s.detokenize(bad)
    assert s.token_bytes(np.int32(s.tokenize("hello")[0])) == s.token_bytes(s.tokenize("hello")[0])


def test_forced_tokens_are_checked(session) -> None:
    n = session.session.n_vocab
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        _stream(session, PROMPT, 2, forced=[n, 1])
    with pytest.raises(ConfigError, match="integer"):
        _stream(session, PROMPT, 1, forced=["a"])
    with pytest.raises(ConfigError, match="list of token ids"):
        _stream(session, PROMPT, 1, forced=5)
    good = session.generate(PROMPT, 3, stop_at_end=False).tokens
    assert [p.token for p in _stream(session, PROMPT, 3, forced=good, stop_at_end=False) if p.token is not None] == good


def _stream(sync: SyncSession, prompt, max_tokens: int, **kwargs) -> list:
    async def run() -> list:
        return [p async for p in sync.session.stream(prompt, max_tokens, **kwargs)]
    return sync._portal.call(run)


def test_completion_requests_name_the_parameter_that_holds_a_lone_surrogate(session) -> None:
    from bmoe.engine.completions import prepare_chat_completion, prepare_completion
    from bmoe.engine.sampling import ParamError

    s = session.session
    with pytest.raises(ParamError, match="not valid Unicode") as info:
        prepare_chat_completion(s, [{"role": "user", "content": "a\ud800"}])
    assert info.value.param == "messages"
    with pytest.raises(ParamError, match="not valid Unicode") as info:
        prepare_completion(s, "a\ud800")
    assert info.value.param == "prompt"
    with pytest.raises(ParamError, match="outside the vocabulary") as info:
        prepare_completion(s, [s.n_vocab])
    assert info.value.param == "prompt"


def test_the_python_api_refuses_what_the_server_refuses_in_a_chat(session) -> None:
    """A message without content was rendered as empty, and an out-of-range top_logprobs was
    refused under the name logprobs: the server had a check of its own, the Python API none."""
    from bmoe.engine.completions import prepare_chat_completion
    from bmoe.engine.sampling import ParamError

    s = session.session
    for messages in ([{"role": "user"}], [{"role": "system", "content": None}, {"role": "user", "content": "x"}],
                     [{"role": "user", "content": "x"}, {"role": "assistant"}]):
        with pytest.raises(ParamError, match=r"messages\[\d\] has no content") as info:
            prepare_chat_completion(s, messages)
        assert info.value.param == "messages"
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]}
    prepare_chat_completion(s, [{"role": "user", "content": "x"}, call, {"role": "user", "content": "y"}])
    for value in (50, -1):
        with pytest.raises(ParamError, match=rf"^top_logprobs must be an integer in \[0, 20\], got {value}$") as info:
            prepare_chat_completion(s, [{"role": "user", "content": "x"}], logprobs=True, top_logprobs=value)
        assert info.value.param == "top_logprobs"


def test_unknown_arguments_a_non_bool_json_object_and_a_non_path_are_refused_by_name(session) -> None:
    """Unknown keyword arguments raised a TypeError naming an internal function; llama-cpp-python's
    samplers bmoe has not got are refused by name, but taken at the values that leave them off;
    ``json_object="yes"`` was accepted; ``Session.open(None)`` was a raw TypeError."""
    from bmoe.engine.sampling import ParamError, SamplingParams
    from bmoe.engine.session import Session

    for call in (session.create_completion, lambda p, **kw: session.create_chat_completion(
            [{"role": "user", "content": p}], **kw)):
        with pytest.raises(ParamError, match="^unknown parameter 'bogus'$") as info:
            call(PROMPT, max_tokens=2, bogus=1)
        assert info.value.param == "bogus"
        with pytest.raises(ParamError, match="^typical_p is not supported") as info:
            call(PROMPT, max_tokens=2, typical_p=0.5)
        assert info.value.param == "typical_p"
        assert call(PROMPT, max_tokens=2, typical_p=1.0, mirostat_mode=0, tfs_z=None)["usage"]["completion_tokens"]
    with pytest.raises(ParamError, match="json_object must be True or False"):
        SamplingParams(json_object="yes")
    for path in (None, 5):
        with pytest.raises(ConfigError, match="path must be a file path"):
            Session.open(path)


def test_text_that_utf8_cannot_encode_and_wrong_types(session) -> None:
    with pytest.raises(ConfigError, match="lone surrogate"):
        session.generate("hi \udcff", 2)
    with pytest.raises(ConfigError, match="lone surrogate"):
        session.tokenize("\udcff")
    with pytest.raises(ConfigError, match="must be a str"):
        session.tokenize(None)
    with pytest.raises(ConfigError, match="not bytes"):
        session.generate(b"hello", 2)
    with pytest.raises(ConfigError, match="special must be True or False"):
        session.generate(PROMPT, 2, special="yes")
    with pytest.raises(ConfigError, match="stop must be a string or a list"):
        session.generate(PROMPT, 2, stop=5)
    with pytest.raises(ConfigError, match="a prompt is text or a list"):
        session.generate(12, 2)
    assert session.generate(PROMPT, 2, stop_at_end=False).tokens, "the session still works"


def test_cache_budget_must_be_whole_bytes(session) -> None:
    for bad in (float("nan"), float("inf"), True, 1.5e6, -1, "1000"):
        with pytest.raises(ConfigError, match="whole number of bytes"):
            session.set_cache_budget(bad)
    with pytest.raises(ConfigError, match="at least 1 MiB, got 10 bytes"):
        session.set_cache_budget(10)  # as RunConfig refuses it: bytes given for MiB
    before, bank = session.session.budget_bytes, session.session.layout.expert_bytes
    assert bank > MiB + 1
    session.set_cache_budget(np.int64(MiB + 1))
    assert session.session.budget_bytes == MiB + 1 != before
    session.set_cache_budget(bank * 100)
    assert session.session.budget_bytes == bank, "past the bank is the bank"


@pytest.mark.pure
def test_run_config_checks_its_field_types(tmp_path: Path) -> None:
    for kwargs, field in [({"odirect": "no"}, "odirect"), ({"io_threads": 2.0}, "io_threads"),
                          ({"n_ctx": "256"}, "n_ctx"), ({"cache_bytes": 1.5e6}, "cache_bytes"),
                          ({"reuse_prompt": 1}, "reuse_prompt"), ({"drop_cold_experts": "0.1"}, "drop_cold_experts"),
                          ({"route_trace": 5}, "route_trace"), ({"n_threads": True}, "n_threads")]:
        with pytest.raises(ConfigError, match=f"^{field} must be"):
            RunConfig(**kwargs)
    config = RunConfig(route_trace=tmp_path / "t.jsonl", io_threads=np.int64(3), n_ctx=256)
    assert config.route_trace == str(tmp_path / "t.jsonl") and type(config.io_threads) is int
    with pytest.raises(ConfigError, match="must be a RunConfig"):
        Session.open(tmp_path / "x.gguf", {"n_ctx": 256})


def test_a_session_dropped_unclosed_warns_and_is_freed(tiny) -> None:
    s = Session.open(tiny.path(TinySpec()), CONFIG)
    model = s._model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del s
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "unclosed bmoe Session" in str(w.message) for w in caught)
    assert model.ctx is None, "the native context was freed"


def test_an_unclosed_sync_session_does_not_hang_exit(tiny) -> None:
    code = textwrap.dedent(f"""
        import os
        os.environ["BMOE_ISOLATE"] = "0"
        from bmoe.engine.config import RunConfig
        from bmoe.engine.sync import SyncSession
        s = SyncSession.open({str(tiny.path(TinySpec()))!r}, RunConfig(mode="stream", n_ctx=256))
        print(len(s.generate("hello", 2, stop_at_end=False).tokens))
        keep = s  # never closed, still referenced at exit
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


def test_a_sync_close_that_raises_still_lets_the_interpreter_exit(tiny, tmp_path) -> None:  # noqa: ANN001
    """A cache profile that cannot be saved makes close() raise: the loop thread still stops (it
    kept the interpreter from exiting: the session was no longer on the list the exit hook closes)."""
    code = textwrap.dedent(f"""
        import os, shutil
        os.environ["BMOE_ISOLATE"] = "0"
        from bmoe.engine.config import RunConfig
        from bmoe.engine.sync import SyncSession
        from bmoe.errors import ConfigError
        folder = {str(tmp_path / "gone")!r}
        os.mkdir(folder)
        s = SyncSession.open({str(tiny.path(TinySpec()))!r},
                             RunConfig(mode="stream", n_ctx=256, cache_profile=folder + "/p.json"))
        s.generate("hello", 2, stop_at_end=False)
        shutil.rmtree(folder)
        try:
            s.close()
        except ConfigError as e:
            print("raised:", "cache profile" in str(e))
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised: True"


def test_a_second_loop_while_the_first_is_open_is_refused(tiny) -> None:
    s = Session.open(tiny.path(TinySpec()), CONFIG)
    first_loop = asyncio.new_event_loop()
    try:
        first = first_loop.run_until_complete(s.generate(PROMPT, 2, stop_at_end=False))
        with pytest.raises(BmoeError, match="event loop it last ran on"):
            asyncio.run(s.generate(PROMPT, 2, stop_at_end=False))
        assert first_loop.run_until_complete(s.generate(PROMPT, 2, stop_at_end=False)).tokens == first.tokens
    finally:
        s.close()
        first_loop.close()


def test_sequential_asyncio_runs_share_one_session(tiny) -> None:
    s = Session.open(tiny.path(TinySpec()), CONFIG)
    try:
        runs = [asyncio.run(s.generate(PROMPT, 3, stop_at_end=False)).tokens for _ in range(2)]
    finally:
        s.close()
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_close_frees_everything_even_when_saving_the_profile_fails(tiny, tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    s = Session.open(tiny.path(TinySpec()), RunConfig(mode="stream", n_ctx=256, cache_bytes=4 << 20,
                                                      cache_profile=str(folder / "p.json")))
    asyncio.run(s.generate(PROMPT, 2, stop_at_end=False))
    folder.rmdir()  # the profile cannot be written any more
    model = s._model
    with pytest.raises(ConfigError, match="cannot write the cache profile"):
        s.close()
    assert model.ctx is None and s._streaming is None, "the model and the regions were freed all the same"
