"""The async and sync fronts, cancellation, and failures inside the decode."""

from __future__ import annotations

import asyncio

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.engine.sync import SyncSession
from bmoe.errors import BmoeError, ReadError
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from bmoe.synth.vocab import EOS_ID
from tests.helpers import N_TOKENS, PROMPT

GUARD_S = 120  # a hang guard, not a timing: the calls below take a second

CONFIG = RunConfig(mode="stream", n_ctx=256)


def test_async_and_sync_fronts_agree(tiny) -> None:
    path = tiny.path(TinySpec())

    async def via_async() -> list[int]:
        async with Session.open(path, CONFIG) as session:
            pieces = [p async for p in session.stream(PROMPT, N_TOKENS, stop_at_end=False)]
        return [p.token for p in pieces if p.token is not None]

    async_tokens = asyncio.run(via_async())
    with SyncSession.open(path, CONFIG) as sync:
        sync_tokens = [p.token for p in sync.stream(PROMPT, N_TOKENS, stop_at_end=False) if p.token is not None]
        assert sync.generate(PROMPT, N_TOKENS, stop_at_end=False).tokens == sync_tokens
    assert async_tokens == sync_tokens == tiny.resident_tokens(path)


@pytest.mark.asyncio
async def test_cancel_mid_generation_then_generate_again(tiny) -> None:
    path = tiny.path(TinySpec(arch="qwen2moe"))
    started = asyncio.Event()

    async with Session.open(path, CONFIG) as session:
        async def consume() -> None:
            async for piece in session.stream(PROMPT, 200, stop_at_end=False):
                if piece.token is not None:
                    started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    assert again.tokens == await asyncio.to_thread(tiny.resident_tokens, path)


@pytest.mark.asyncio
async def test_cancel_while_callback_waits_on_a_read(tiny) -> None:
    path = tiny.path(TinySpec(arch="gemma4"))
    gate = asyncio.Event()
    reads = 0

    def before_read(_request) -> bool:  # noqa: ANN001
        nonlocal reads
        reads += 1
        if reads == 40:
            loop.call_soon_threadsafe(gate.set)
        return True

    loop = asyncio.get_running_loop()
    async with Session.open(path, CONFIG, hooks=Hooks(before_read=before_read)) as session:
        task = asyncio.create_task(session.generate(PROMPT, 200, stop_at_end=False))
        await gate.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    assert again.tokens == await asyncio.to_thread(tiny.resident_tokens, path)


@pytest.mark.asyncio
async def test_raising_read_aborts_decode_and_session_recovers(tiny) -> None:
    path = tiny.path(TinySpec())
    fail = {"on": True, "count": 0}

    class Boom(OSError):
        pass

    def before_read(request) -> bool:  # noqa: ANN001
        fail["count"] += 1
        if fail["on"] and fail["count"] == 30:
            raise Boom("disk on fire")
        return True

    emitted: list[int] = []
    async with Session.open(path, CONFIG, hooks=Hooks(before_read=before_read)) as session:
        with pytest.raises(ReadError):
            async for piece in session.stream(PROMPT, N_TOKENS, stop_at_end=False):
                emitted.append(piece.token)
        fail["on"] = False
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    resident = await asyncio.to_thread(tiny.resident_tokens, path)
    assert emitted == resident[: len(emitted)], "every token emitted before the failure is correct"
    assert len(emitted) < N_TOKENS
    assert again.tokens == resident


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_ctrl_c_in_a_sync_call_cancels_the_generation(tiny, call: str) -> None:
    """A KeyboardInterrupt in the thread waiting on a SyncSession call left the generation running
    on the loop with the session's lock held: the next call waited for all of its tokens
    (``generate``), or for ever (``stream``, whose generator was left inside the lock)."""
    import signal
    import threading

    path = tiny.path(TinySpec())
    main, armed = threading.get_ident(), threading.Event()
    plans = fire_at = 0

    def on_plan(_event, _plan) -> None:  # noqa: ANN001 - on the portal's loop thread
        nonlocal plans
        plans += 1
        if armed.is_set() and plans >= fire_at:
            armed.clear()
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, to the thread that waits

    with SyncSession.open(path, CONFIG, hooks=Hooks(on_plan=on_plan)) as sync:
        n_layer = sync.session.layout.n_layer
        fire_at = plans + 20 * n_layer  # some tokens into a 200-token generation
        armed.set()
        with pytest.raises(KeyboardInterrupt):
            if call == "generate":
                sync.generate(PROMPT, 200, stop_at_end=False)
            else:
                for _ in sync.stream(PROMPT, 200, stop_at_end=False):
                    pass
        at_interrupt = plans
        done: list = []
        after = threading.Thread(target=lambda: done.append(sync.generate(PROMPT, N_TOKENS, stop_at_end=False)))
        after.start()
        after.join(GUARD_S)
        assert done, "the next call still waits for the interrupted generation"
        assert plans - at_interrupt < (200 - 40) * n_layer, "the interrupted generation ran on"
    assert done[0].tokens == tiny.resident_tokens(path)


def test_a_threads_stream_is_not_closed_by_another_threads_call(tiny) -> None:
    """``_begin`` closed the session's last open iterator whichever thread read it: thread A's
    stream ended early, without a last piece, when thread B called ``stream``."""
    import threading

    path = tiny.path(TinySpec())
    with SyncSession.open(path, CONFIG) as sync:
        first_piece, b_done = threading.Event(), threading.Event()
        got: dict[str, list] = {"a": [], "b": []}

        def reader(name: str) -> None:
            for piece in sync.stream(PROMPT, N_TOKENS, stop_at_end=False):
                got[name].append(piece)
                first_piece.set()
                if name == "a" and len(got["a"]) == 1:
                    b.start()  # B calls while A is between pieces
                    b_done.wait(0.2)

        a = threading.Thread(target=reader, args=("a",))
        b = threading.Thread(target=lambda: (reader("b"), b_done.set()))
        a.start()
        a.join(GUARD_S)
        b.join(GUARD_S)
    resident = tiny.resident_tokens(path)
    for name in "ab":
        assert got[name] and got[name][-1].finish_reason == "length", name
        assert [p.token for p in got[name] if p.token is not None] == resident, name


def test_sync_front_refuses_the_loop_thread(tiny) -> None:
    path = tiny.path(TinySpec())

    async def inside_loop() -> None:
        with SyncSession.open(path, CONFIG) as sync:
            sync.generate(PROMPT, 2)

    with pytest.raises(BmoeError, match="from async code"):
        asyncio.run(inside_loop())


@pytest.mark.asyncio
async def test_a_second_model_opens_while_the_first_generates_on_the_loop(tiny) -> None:
    """``Session.open`` on the loop's thread, while a streamed session's decode is in flight on that
    loop, hung the process: its warm-up waited for the compute thread, whose decode waited for the
    loop. It is refused by name now; ``open_async`` opens it while the first goes on."""
    import threading

    from bmoe.errors import ComputeBusyError

    # deepseek2 is opened with a capture decode (its expert tensors found by running one), on the
    # compute thread: what the loop's thread would wait for.
    first, second = tiny.path(TinySpec()), tiny.path(TinySpec(arch="deepseek2"))
    held, release, armed = asyncio.Event(), threading.Event(), threading.Event()

    def before_read(_request) -> bool:  # noqa: ANN001 - on a read lane: holds a decode in flight
        if armed.is_set() and not release.is_set():
            loop.call_soon_threadsafe(held.set)
            release.wait(60)
        return True

    async def generate() -> list[int]:
        tokens = []
        async for piece in a.stream(PROMPT, N_TOKENS, stop_at_end=False):
            tokens.append(piece.token)
            armed.set()  # the next token's reads happen inside its decode (the cache is off)
        return [t for t in tokens if t is not None]

    loop = asyncio.get_running_loop()
    async with Session.open(first, CONFIG, hooks=Hooks(before_read=before_read)) as a:
        task = asyncio.create_task(generate())
        await held.wait()
        with pytest.raises(ComputeBusyError, match="open_async"):
            Session.open(second, CONFIG)
        opening = asyncio.create_task(Session.open_async(second, CONFIG))
        await asyncio.sleep(0.05)
        release.set()
        async with await opening as b:
            got = await b.generate(PROMPT, N_TOKENS, stop_at_end=False)
        done = await task
    assert got.tokens == await asyncio.to_thread(tiny.resident_tokens, second)
    assert done == await asyncio.to_thread(tiny.resident_tokens, first)


@pytest.mark.asyncio
async def test_break_out_of_stream_then_generate(tiny) -> None:
    path = tiny.path(TinySpec(wtype="f16"))
    async with Session.open(path, CONFIG) as session:
        async for piece in session.stream(PROMPT, 50, stop_at_end=False):
            if piece.token is not None:
                break
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    assert again.tokens == await asyncio.to_thread(tiny.resident_tokens, path)


@pytest.mark.asyncio
async def test_failure_inside_a_stage_aborts_and_session_recovers(tiny) -> None:
    path = tiny.path(TinySpec())
    armed = {"on": True}

    def on_plan(event, _plan) -> None:  # noqa: ANN001
        if armed["on"] and event.step == 3:
            raise ValueError("planner bug")

    async with Session.open(path, CONFIG, hooks=Hooks(on_plan=on_plan)) as session:
        with pytest.raises(ValueError, match="planner bug"):
            await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
        armed["on"] = False
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    assert again.tokens == await asyncio.to_thread(tiny.resident_tokens, path)


def test_special_parses_control_text_on_every_front(tiny) -> None:
    """``special=True`` reads control-token text in a prompt as that token (the chat's templates
    depend on it); without it the same text is plain characters. Async, sync, stream and generate."""
    path = tiny.path(TinySpec())
    text = PROMPT + "</s>"  # the tiny vocabulary's end-of-sequence control token, spelled out
    with SyncSession.open(path, CONFIG) as sync:
        ids_special, ids_plain = sync.tokenize(text, special=True), sync.tokenize(text)
        assert ids_special[-1] == EOS_ID and EOS_ID not in ids_plain, "the control text is parsed only when asked"
        by_ids = sync.generate(ids_special, 6, stop_at_end=False)
        sync_special = sync.generate(text, 6, special=True, stop_at_end=False)
        sync_plain = sync.generate(text, 6, stop_at_end=False)
        streamed = [p.token for p in sync.stream(text, 6, special=True, stop_at_end=False) if p.token is not None]

    async def via_async() -> list[int]:
        async with Session.open(path, CONFIG) as session:
            return (await session.generate(text, 6, special=True, stop_at_end=False)).tokens

    assert sync_special.usage.prompt_tokens == len(ids_special) != sync_plain.usage.prompt_tokens == len(ids_plain)
    assert sync_special.tokens == by_ids.tokens == streamed == asyncio.run(via_async())


def test_every_llama_decode_runs_on_the_process_compute_thread(tiny, monkeypatch) -> None:
    """The open's warm-up decodes (expert capture, expert-major shapes, overlap's wait points, the
    dense capture) and every generation's decodes, of every session, run on one thread: a second
    thread that ever ran llama.cpp keeps an OpenMP team of its own, and libgomp then stops spinning
    at its barriers (an all-cached decode measured 0.80x resident that way)."""
    import threading

    import bmoe.engine.assembly as session_mod
    from bmoe.llama.seam import LlamaModel

    threads: list[tuple[str, int]] = []
    decode = LlamaModel.decode
    capture = session_mod.capture_weights

    def spy_decode(self, tokens):
        threads.append(("decode", threading.get_ident()))
        return decode(self, tokens)

    def spy_capture(*args, **kwargs):
        threads.append(("capture", threading.get_ident()))
        return capture(*args, **kwargs)

    monkeypatch.setattr(LlamaModel, "decode", spy_decode)
    monkeypatch.setattr(session_mod, "capture_weights", spy_capture)
    path = tiny.path(TinySpec())
    configs = [RunConfig(mode="stream", n_ctx=256, open_mode="mmap-drop", dense_weights="anon", overlap=True),
               RunConfig(mode="stream", n_ctx=256, cache_bytes=1 << 20), RunConfig(mode="resident", n_ctx=256)]
    for config in configs:
        with SyncSession.open(path, config) as s:
            assert s.generate(PROMPT, 4, stop_at_end=False).tokens == tiny.resident_tokens(path)[:4]
    kinds = {kind for kind, _ in threads}
    assert kinds == {"decode", "capture"}
    assert len(threads) > 3 * 5  # the warm-ups and the prompt and token decodes, all seen
    assert {ident for _, ident in threads} != {threading.get_ident()}
    assert len({ident for _, ident in threads}) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel", "task"])
async def test_a_turn_cancelled_inside_a_decode_call_leaves_the_context_before_it(tiny, how: str) -> None:
    """Ctrl-C in chat (``cancel()``) or a client gone (the task cancelled) lands inside a decode
    call: the context before that call still stands, so the next turn reuses it (it re-read the
    whole conversation) and gives the tokens of a session that never saw the cancelled turn."""
    path = tiny.path(TinySpec())
    config = RunConfig(mode="stream", n_ctx=256, cache_bytes=0)  # every expert is read: the hook fires
    armed, reads, hit = False, 0, asyncio.Event()
    loop = asyncio.get_running_loop()

    def before_read(_request) -> bool:  # noqa: ANN001
        nonlocal reads
        if armed:
            reads += 1
            if reads == 5:  # inside the second turn's first decode call
                if how == "cancel":
                    session.cancel()
                loop.call_soon_threadsafe(hit.set)
        return True

    async with Session.open(path, config, hooks=Hooks(before_read=before_read)) as session:
        first = await session.generate(PROMPT, 4, stop_at_end=False)
        turn = session.tokenize(PROMPT) + first.tokens
        follow = turn + session.tokenize(" and then some more words of the next turn")
        armed = True
        if how == "cancel":
            cut = await session.generate(follow, 8, stop_at_end=False)
            assert cut.finish_reason == "cancelled" and cut.tokens == []
        else:
            task = asyncio.create_task(session.generate(follow, 8, stop_at_end=False))
            await hit.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert reads >= 5
        armed = False
        again = await session.generate(follow, N_TOKENS, stop_at_end=False)
    assert again.usage.prompt_reused >= len(turn) - 1, again.usage
    async with Session.open(path, config) as fresh:
        assert again.tokens == (await fresh.generate(follow, N_TOKENS, stop_at_end=False)).tokens


# A small llama-cpp-python script, as a user has it; the port changes the import and the constructor
# and nothing else.
LLAMA_SCRIPT = '''\
import sys
from llama_cpp import Llama

llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
tokens = llm.tokenize(b"Routed experts stream from the disk")
print("tokens", tokens, llm.n_ctx(), llm.n_vocab())
print("text", repr(llm.detokenize(tokens).decode("utf-8")))
print("nobos", llm.tokenize("the disk".encode(), add_bos=False))
out = llm("Q: Name a colour. A:", max_tokens=8, temperature=0.0)
print("call", repr(out["choices"][0]["text"]), out["choices"][0]["finish_reason"], out["usage"]["total_tokens"])
llm.reset()
pieces = [c["choices"][0]["text"] for c in llm.create_completion("Once", max_tokens=6, temperature=0.0, stream=True)]
print("stream", repr("".join(pieces)))
chat = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
print("chat", chat["object"], chat["choices"][0]["message"]["role"])
llm.close()
'''
PORT = (("from llama_cpp import Llama", "from bmoe import RunConfig, SyncSession"),
        ("llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)",
         "llm = SyncSession.open(sys.argv[1], RunConfig(n_ctx=256))"))


def test_a_llama_script_ports_by_changing_the_import_and_the_constructor(tiny, tmp_path) -> None:  # noqa: ANN001
    """The original runs on llama-cpp-python, the port on bmoe (streamed), over the same file: the
    same lines. bmoe writes a byte that is not UTF-8 as U+FFFD where llama-cpp-python drops it
    (bmoe.engine.completions says why), so those are taken out before comparing; the chat prompt
    differs (llama-cpp-python's fallback format for a file without a template is not bmoe's), so
    only its shape is printed."""
    import subprocess
    import sys

    path = tiny.path(TinySpec())
    port = LLAMA_SCRIPT
    for old, new in PORT:
        assert port.count(old) == 1
        port = port.replace(old, new)
    changed = [a for a, b in zip(LLAMA_SCRIPT.splitlines(), port.splitlines(), strict=True) if a != b]
    assert len(changed) == 2
    outputs = []
    for name, script in (("llama.py", LLAMA_SCRIPT), ("port.py", port)):
        (tmp_path / name).write_text(script)
        proc = subprocess.run([sys.executable, str(tmp_path / name), str(path)], capture_output=True, text=True,
                              timeout=GUARD_S)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.replace("\ufffd", "").splitlines())
    original, ported = outputs
    assert len(ported) == 6 and ported == original, (original, ported)


def test_tokenize_takes_bytes_and_detokenize_gives_them_back(tiny) -> None:  # noqa: ANN001
    with SyncSession.open(tiny.path(TinySpec()), CONFIG) as s:
        assert s.tokenize(b"the disk") == s.tokenize("the disk") == [s.tokenize("")[0], *s.tokenize("the disk", False)]
        assert s.detokenize(s.tokenize("Routed experts")) == b"Routed experts"
        assert s.detokenize(s.tokenize("caf\u00e9", add_bos=False)).decode() == " caf\u00e9"
        assert s.n_ctx() == CONFIG.n_ctx and s.n_vocab() == s.session.n_vocab
        assert s("Hi", max_tokens=3)["choices"][0]["text"] == s.create_completion("Hi", max_tokens=3)["choices"][0]["text"]
        with pytest.raises(BmoeError, match="not UTF-8"):
            s.tokenize(b"\xff\xfe")
        with pytest.raises(BmoeError, match="special=True"):
            s.detokenize([5], special=True)
        with pytest.raises(BmoeError):
            s.detokenize([s.n_vocab()])


def test_reset_makes_the_next_generation_evaluate_its_whole_prompt(tiny) -> None:  # noqa: ANN001
    """``Llama.reset()``'s counterpart: once after it, a generation of any kind reuses nothing the
    context held (and answers exactly as a fresh session); without it, the same prompt is reused."""
    path = tiny.path(TinySpec())
    with SyncSession.open(path, CONFIG) as s:
        def cached() -> int:
            return s.create_completion(PROMPT, max_tokens=4)["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached() == 0 and cached() > 0
        s.reset()
        assert cached() == 0 and cached() > 0, "once, then reuse again"
        s.reset()
        chunks = list(s.create_chat_completion([{"role": "user", "content": PROMPT}], max_tokens=3, stream=True))
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        s.reset()
        assert [p.usage for p in s.stream(PROMPT, 3) if p.usage is not None][0].prompt_reused == 0
        assert s.generate(PROMPT, 3).usage.prompt_reused > 0
        s.reset()
        g = s.generate(PROMPT, N_TOKENS, stop_at_end=False)
        assert g.usage.prompt_reused == 0 and g.tokens == tiny.resident_tokens(path)
