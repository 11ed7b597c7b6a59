"""A blocking front over the async Session, for scripts and the sync half of the API.

It runs the session's coroutines on an event loop in a portal thread (anyio's blocking portal), so
sync and async callers share one code path. Like the portal, it refuses to be used from an event
loop thread: blocking there would deadlock the very loop the eval callback waits on.

One generation at a time, as on Session. A ``stream()`` iterator left open holds the session: a
new ``stream()`` or ``generate()`` from the same thread closes it first (it ends there, as if its
loop had broken), so forgetting to exhaust an iterator never deadlocks the next call. Calls from
several threads wait their turn; one thread never closes another's stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from anyio.from_thread import start_blocking_portal

from bmoe.engine import completions
from bmoe.engine.aio import loop_backend_options
from bmoe.engine.config import RunConfig
from bmoe.engine.sampling import SamplingParams
from bmoe.engine.session import Generation, Piece, Session
from bmoe.errors import BmoeError, ConfigError, SessionClosedError
from bmoe.pipeline.hooks import Hooks


def _refuse_on_loop_thread() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise BmoeError("SyncSession blocks: from async code, use Session and await it instead")


async def _next(agen: AsyncIterator[Any]) -> Any:
    return await agen.__anext__()


_unclosed: weakref.WeakSet[SyncSession] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False


def _close_at_exit() -> None:
    """The portal's loop runs in a non-daemon pool thread that the interpreter joins at exit: a
    SyncSession never closed would hang the exit there. Close what is left first."""
    for s in list(_unclosed):
        try:
            s.close()
        except Exception:  # noqa: BLE001 - exiting: nothing to report to
            pass


def _hook_exit() -> None:
    """Run ``_close_at_exit`` before threads are joined: the hook concurrent.futures itself uses
    (private, so guarded); registered after it, so it runs first (they run in reverse order)."""
    global _exit_hooked
    with _exit_hook:
        if not _exit_hooked:
            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                register(_close_at_exit)
            _exit_hooked = True


class SyncSession:
    def __init__(self, session: Session) -> None:
        self.session = session
        _hook_exit()
        self._portal_cm = start_blocking_portal("asyncio", loop_backend_options())
        self._portal = self._portal_cm.__enter__()
        # Per thread, the iterator it opened last (weakly: one dropped is closed by its finalizer).
        self._open_iters: weakref.WeakValueDictionary[int, Iterator[Any]] = weakref.WeakValueDictionary()
        self._guard = threading.Lock()
        self._reset_pending = False
        _unclosed.add(self)

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None = None, *, hooks: Hooks | None = None) -> SyncSession:
        return cls(Session.open(path, config, hooks=hooks))

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` awaited on the portal. An interrupt here (Ctrl-C's KeyboardInterrupt in the
        waiting thread) cancels it on the loop too: a plain ``portal.call`` left the generation
        running with the session's lock held, and the next call waited for all its tokens (or,
        for a stream, for ever)."""
        future = self._portal.start_task_soon(fn, *args)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a no-op once it is done; else the task is cancelled on the loop
            raise

    def _begin(self) -> None:
        """Refuse the loop thread and a closed session; close an iterator this thread left open.
        Only this thread's: another thread's stream is being read there, and this call waits its
        turn (closing it ended that stream early, without a last piece)."""
        _refuse_on_loop_thread()
        if self._portal_cm is None:
            raise SessionClosedError("the session is closed")
        with self._guard:
            old = self._open_iters.pop(threading.get_ident(), None)
        if old is not None:
            try:
                old.close()  # type: ignore[attr-defined]
            except ValueError:  # being iterated by another thread right now: wait for the lock
                pass

    def _iterate(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        """Step ``agen`` on the portal; it ends quietly once the session is closed under it."""
        try:
            while self._portal_cm is not None:
                try:
                    item = self._call(_next, agen)
                except StopAsyncIteration:
                    return
                except RuntimeError:
                    if self._portal_cm is None:  # the portal stopped: closed from another thread
                        return
                    raise
                yield item
        finally:
            try:
                if self._portal_cm is not None:
                    self._portal.call(agen.aclose)  # type: ignore[attr-defined]
            except RuntimeError:
                pass

    def _track(self, it: Iterator[Any]) -> Iterator[Any]:
        with self._guard:
            self._open_iters[threading.get_ident()] = it
        return it

    def stream(
        self, prompt: str | Sequence[int], max_tokens: int = 64, *, sampling: SamplingParams | None = None,
        stop: Sequence[str] | str | None = None, stop_at_end: bool = True, special: bool = False,
    ) -> Iterator[Piece]:
        self._begin()
        agen = self.session.stream(prompt, max_tokens, sampling=sampling, stop=stop,
                                   stop_at_end=stop_at_end, special=special, reuse_prompt=self._take_reset())
        return self._track(self._iterate(agen))

    def generate(
        self, prompt: str | Sequence[int], max_tokens: int = 64, *, sampling: SamplingParams | None = None,
        stop: Sequence[str] | str | None = None, stop_at_end: bool = True, special: bool = False,
    ) -> Generation:
        self._begin()
        kw = dict(sampling=sampling, stop=stop, stop_at_end=stop_at_end, special=special)
        reuse = None if self._take_reset() is None else False  # after a reset: from the first token
        return self._call(lambda: self.session.generate(prompt, max_tokens, reuse_prompt=reuse, **kw))

    def create_completion(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """llama-cpp-python's ``create_completion``: a dict, or an iterator of chunk dicts."""
        self._begin()
        if self._reset_pending:
            return self._answer(self._portal_call(completions.prepare_completion, self.session, prompt, **kwargs))
        out = self._call(lambda: self.session.create_completion(prompt, **kwargs))
        return self._track(self._iterate(out)) if kwargs.get("stream") else out

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        """llama-cpp-python's ``create_chat_completion``: a dict, or an iterator of chunk dicts."""
        self._begin()
        if self._reset_pending:
            return self._answer(self._portal_call(completions.prepare_chat_completion, self.session, messages,
                                                  **kwargs))
        out = self._call(lambda: self.session.create_chat_completion(messages, **kwargs))
        return self._track(self._iterate(out)) if kwargs.get("stream") else out

    def _answer(self, prepared: completions.Prepared) -> Any:
        """A request prepared after a ``reset()``, run from its first prompt token (what
        ``Session.create_*`` do otherwise: ``completions.run`` of the prepared request)."""
        if self._take_reset() is False:
            prepared = dataclasses.replace(prepared, reuse_prompt=False)
        out = self._call(lambda: completions.run(self.session, prepared))
        return self._track(self._iterate(out)) if prepared.stream else out

    def reset(self) -> None:
        """As ``llama_cpp.Llama.reset()``: forget what the context holds. The next generation (any
        of ``stream``, ``generate``, ``create_*``, a call) evaluates its whole prompt from the first
        token instead of reusing the prefix the context kept, so it answers exactly as a fresh
        session would (``RunConfig.reuse_prompt`` says why reuse may change the last bits)."""
        with self._guard:
            self._reset_pending = True

    def _take_reset(self) -> bool | None:
        """False (reuse nothing) once after ``reset()``; None (the session's config) otherwise."""
        with self._guard:
            pending, self._reset_pending = self._reset_pending, False
        return False if pending else None

    def __call__(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """``create_completion``, as ``Llama(...)("Q: ...", max_tokens=32)`` calls it."""
        return self.create_completion(prompt, **kwargs)

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """The text's tokens. As llama-cpp-python's ``Llama.tokenize``: ``text`` may be UTF-8
        bytes, and ``add_bos=False`` leaves out the BOS the model's tokenizer puts first."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"text: the bytes are not UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not isinstance(add_bos, bool):
            raise ConfigError(f"add_bos must be true or false, got {add_bos!r}")
        tokens = self._portal_call(self.session.tokenize, text, special=special)
        bos = self._bos()
        if not add_bos and bos is not None and tokens[:1] == [bos]:
            tokens = tokens[1:]
        return tokens

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The tokens' bytes, as llama-cpp-python's ``Llama.detokenize`` gives them: the space a
        SentencePiece vocabulary puts before the first word is dropped after a BOS, so
        ``detokenize(tokenize(b"Hi"))`` is ``b"Hi"``; bytes, since a token may hold part of a
        UTF-8 character. ``prev_tokens`` changes nothing (nor does it in llama-cpp-python); control
        tokens are no text (``special=True``, which would spell them, is refused)."""
        if special is not False:
            raise ConfigError("detokenize: special=True (control tokens as text) is not supported")
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise ConfigError(f"tokens must be a list of token ids, got {type(tokens).__name__}")
        ids = list(tokens)
        out = b"".join(self._portal_call(lambda: [self.session.token_bytes(t) for t in ids]))
        if ids and ids[0] == self._bos() and out.startswith(b" "):
            out = out[1:]
        return out

    def _bos(self) -> int | None:
        """The token the tokenizer puts first (None when it puts none): what an empty text
        tokenizes to."""
        if not hasattr(self, "_bos_id"):
            empty = self._portal_call(self.session.tokenize, "")
            self._bos_id = empty[0] if len(empty) == 1 else None
        return self._bos_id

    def n_ctx(self) -> int:
        """The context length in tokens (``Llama.n_ctx()``)."""
        return self._portal_call(lambda: self.session.n_ctx)

    def n_vocab(self) -> int:
        """How many tokens the vocabulary holds; ids run from 0 to n_vocab() - 1 (``Llama.n_vocab()``)."""
        return self._portal_call(lambda: self.session.n_vocab)

    def chat_template(self) -> bytes | None:
        return self._portal_call(self.session.chat_template)

    def cancel(self) -> None:
        """Stop the running generation at its next MoE layer (from any thread)."""
        self.session.cancel()

    def set_cache_budget(self, budget_bytes: int) -> None:
        self._portal_call(self.session.set_cache_budget, budget_bytes)

    def _portal_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A session call made on the loop thread, so it never runs beside a generation's step."""
        _refuse_on_loop_thread()
        if self._portal_cm is None:
            raise SessionClosedError("the session is closed")
        return self._portal.call(lambda: _call_async(fn, *args, **kwargs))

    def close(self) -> None:
        """Close the session (a generation running on another thread ends as cancelled), then the
        portal. Safe to call twice."""
        if self._portal_cm is None:
            return
        _unclosed.discard(self)
        try:
            self._portal.call(lambda: _call_async(self.session.close))
        finally:  # a close that raised (a profile that cannot be saved) still stops the loop thread
            cm, self._portal_cm = self._portal_cm, None
            cm.__exit__(None, None, None)

    def __del__(self) -> None:
        if getattr(self, "_portal_cm", None) is None or sys.is_finalizing():
            return
        warnings.warn("unclosed bmoe SyncSession: close() it or use 'with'", ResourceWarning, source=self, stacklevel=2)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _call_async(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)
