"""The Python API: llama-cpp-python-shaped completions, the top-level import, closed sessions, close
during a generation, concurrent generations, and the sync front's open iterators."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.engine.sync import SyncSession
from bmoe.errors import SessionClosedError
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT

CONFIG = RunConfig(mode="stream", n_ctx=256)
HANG_GUARD_S = 120  # only to turn a deadlock into a failure; nothing is timed


@pytest.mark.pure
def test_top_level_import_is_lazy_and_complete() -> None:
    code = ("import sys, bmoe; heavy = [m for m in ('numpy', 'llama_cpp', 'bmoe.engine.session') if m in sys.modules];"
            "from bmoe import Session, SyncSession, RunConfig, SamplingParams, SessionClosedError;"
            "print(heavy, Session.__module__, SyncSession.__module__, RunConfig.__module__, SamplingParams.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "[]", "import bmoe must not load numpy or llama.cpp"
    assert out[1:] == ["bmoe.engine.session", "bmoe.engine.sync", "bmoe.engine.config", "bmoe.engine.sampling"]


def test_completion_dicts_in_llama_cpp_python_shape(tiny) -> None:
    path = tiny.path(TinySpec())
    with SyncSession.open(path, CONFIG) as s:
        body = s.create_completion(PROMPT, max_tokens=8, logprobs=2)
        chunks = list(s.create_completion(PROMPT, max_tokens=8, stream=True))
        chat = s.create_chat_completion([{"role": "user", "content": "hello"}], max_tokens=6, seed=3,
                                        temperature=0.8, logprobs=True, top_logprobs=2)
        chat_chunks = list(s.create_chat_completion([{"role": "user", "content": "hello"}], max_tokens=6,
                                                    seed=3, temperature=0.8, stream=True))
        greedy = s.generate(PROMPT, 8, stop_at_end=False)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and choice["index"] == 0
    assert len(choice["logprobs"]["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == body["usage"]["total_tokens"]
    if choice["finish_reason"] == "length":
        assert choice["text"] == greedy.text
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"] and "usage" in chunks[-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the same prompt reuses the context"
    assert chat["object"] == "chat.completion"
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert len(chat["choices"][0]["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
    assert chat_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chat_chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chat_chunks)
    assert streamed == message["content"], "same seed, same answer, streamed or not"
    json.dumps([body, chunks, chat, chat_chunks])  # plain data all the way down


@pytest.mark.asyncio
async def test_async_completions_and_json_mode(tiny) -> None:
    path = tiny.path(TinySpec())
    async with Session.open(path, CONFIG) as s:
        body = await s.create_chat_completion(
            [{"role": "system", "content": "json"}, {"role": "user", "content": [{"type": "text", "text": "go"}]}],
            max_tokens=60, temperature=1.0, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})
        chunks = [c async for c in await s.create_completion(PROMPT, max_tokens=4, stream=True)]
    assert isinstance(json.loads(body["choices"][0]["message"]["content"])["ok"], bool)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_every_call_on_a_closed_session_raises(tiny) -> None:
    path = tiny.path(TinySpec())
    session = Session.open(path, CONFIG)
    session.close()
    session.close()  # twice is harmless
    calls = [
        lambda: session.tokenize("x"), session.chat_template, lambda: session.detokenize([5]),
        lambda: session.set_cache_budget(0), lambda: asyncio.run(session.generate(PROMPT, 2)),
        lambda: asyncio.run(anext(session.stream(PROMPT, 2))),
        lambda: asyncio.run(session.create_completion(PROMPT)),
    ]
    for call in calls:
        with pytest.raises(SessionClosedError):
            call()
    sync = SyncSession.open(path, CONFIG)
    sync.close()
    for call in (lambda: sync.generate(PROMPT, 2), lambda: sync.tokenize("x"), lambda: sync.stream(PROMPT),
                 sync.chat_template, lambda: sync.create_completion(PROMPT)):
        with pytest.raises(SessionClosedError):
            call()


@pytest.mark.parametrize("mode", ["stream", "resident"])
def test_close_during_a_generation_cancels_it(tiny, mode: str) -> None:
    path = tiny.path(TinySpec())

    async def go() -> list:
        session = Session.open(path, RunConfig(mode=mode, n_ctx=256))
        pieces = []
        async for piece in session.stream(PROMPT, 200, stop_at_end=False):
            pieces.append(piece)
            if len(pieces) == 3:
                asyncio.get_running_loop().call_soon(session.close)  # lands while the next decode runs
        return pieces

    pieces = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert pieces[-1].finish_reason == "cancelled" and pieces[-1].token is None
    assert 3 <= len(pieces) < 10


CLOSE_FROM_A_THREAD = """
import asyncio, random, sys, threading
from bmoe import RunConfig, Session, SessionClosedError
random.seed(0)
out = []
for mode in ("resident", "stream"):
    for i in range(12):
        s = Session.open(sys.argv[1], RunConfig(mode=mode, n_ctx=512))
        async def go():
            threading.Timer(random.uniform(0, 0.05), s.close).start()  # the closing thread
            last = None
            try:
                async for piece in s.stream("Once upon a time", 300, stop_at_end=False):
                    last = piece
            except SessionClosedError:
                return "closed before it started"
            return last.finish_reason
        out.append(asyncio.run(go()))
print(sorted(set(out)))
"""


def test_close_from_another_thread_mid_generation_is_a_cancel_not_a_crash(tiny) -> None:
    """``close()`` on a thread other than the loop's freed the context in place: between two
    decodes of the generation still running on the loop, the next call used freed memory (a
    segfault in 2 of 14 runs, or a ReadError naming the model file). The freeing is the loop's now."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CLOSE_FROM_A_THREAD, str(tiny.path(TinySpec()))],
                          capture_output=True, text=True, timeout=HANG_GUARD_S * 4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(eval(proc.stdout.strip().splitlines()[-1])) <= {"cancelled", "closed before it started"}, proc.stdout


def test_sync_close_from_another_thread_during_a_stream(tiny) -> None:
    path = tiny.path(TinySpec())
    sync = SyncSession.open(path, CONFIG)
    seen = []
    started = threading.Event()

    def consume() -> None:
        for piece in sync.stream(PROMPT, 200, stop_at_end=False):
            seen.append(piece)
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(HANG_GUARD_S)
    closer = threading.Thread(target=sync.close)
    closer.start()
    closer.join(HANG_GUARD_S)
    t.join(HANG_GUARD_S)
    assert not closer.is_alive() and not t.is_alive(), "close and the stream both return"
    assert len(seen) < 200
    with pytest.raises(SessionClosedError):
        sync.generate(PROMPT, 2)


def test_an_open_stream_iterator_does_not_deadlock_generate(tiny) -> None:
    path = tiny.path(TinySpec())
    result = {}

    def go() -> None:
        with SyncSession.open(path, CONFIG) as sync:
            it = sync.stream(PROMPT, 50, stop_at_end=False)
            next(it)
            result["gen"] = sync.generate(PROMPT, N_TOKENS, stop_at_end=False).tokens
            result["old"] = list(it)  # the earlier iterator was closed: nothing more

    t = threading.Thread(target=go)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), "generate() waited forever on the open iterator"
    assert result["gen"] == tiny.resident_tokens(path) and result["old"] == []


@pytest.mark.asyncio
async def test_concurrent_generations_wait_their_turn(tiny) -> None:
    path = tiny.path(TinySpec())
    other = "A different prompt about the weather in the hills."
    async with Session.open(path, CONFIG) as s:
        a, b = await asyncio.gather(s.generate(PROMPT, N_TOKENS, stop_at_end=False),
                                    s.generate(other, N_TOKENS, stop_at_end=False))
        alone_b = await s.generate(other, N_TOKENS, stop_at_end=False)
    assert a.tokens == await asyncio.to_thread(tiny.resident_tokens, path)
    assert b.tokens == alone_b.tokens


@pytest.mark.asyncio
async def test_a_generation_that_ends_itself_counts_its_last_step_in_tok_per_s(tiny) -> None:
    """Ended by the end token, a generation has decoded once more than it shows (the call whose
    output was the end token): that time was in decode_s and the step was not counted, so a
    3-token reply read a third slow."""
    from bmoe.synth.vocab import EOS_ID

    path = tiny.path(TinySpec())
    async with Session.open(path, CONFIG) as session:
        pieces = [p async for p in session.stream(PROMPT, 4, forced=[5, 6, 7, EOS_ID])]
        by_itself = session.last_stats
        cut = await session.generate(PROMPT, 3, stop_at_end=False)
    assert pieces[-1].finish_reason == "stop" and by_itself.generated_tokens == 3
    assert by_itself.decode_steps == 3 and by_itself.tok_per_s == pytest.approx(3 / by_itself.decode_s)
    assert cut.finish_reason == "length" and cut.stats.decode_steps == 2
    assert cut.stats.tok_per_s == pytest.approx(2 / cut.stats.decode_s)
