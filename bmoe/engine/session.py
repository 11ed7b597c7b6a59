"""Session: open a model once, generate many times. The composition root of bmoe.

Open validates the file in Python, opens it the cheapest way that works here, finds the expert
tensors (from the cheap open's tensor callback, or a one-token warm-up), and when streaming
rebinds them to reserved regions that the pipeline fills on demand. ``stream`` is the async core
every front uses: it owns one generation, yields text pieces with their token ids, and leaves the
session usable when the consumer cancels.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bmoe.engine.assembly import Run, assemble
from bmoe.engine.config import RunConfig, check_cache_bytes
from bmoe.engine.lossy import load_overrides
from bmoe.engine.pieces import Generation, Piece, Usage
from bmoe.engine.prefill import PrefillPlanner
from bmoe.engine.sampling import (
    GREEDY,
    Sampler,
    SamplingParams,
    check_grammar,
    logprobs_of,
)
from bmoe.engine.scheduler import Scheduler
from bmoe.engine.stops import StopStrings
from bmoe.errors import (
    BmoeError,
    ConfigError,
    DecodeAbortedError,
    GenerationCancelled,
    SessionClosedError,
    first_error,
)
from bmoe.io.ggml import check_overhead
from bmoe.io.pagecache import read_io_bytes
from bmoe.io.paths import check_output
from bmoe.io.validate import open_layout
from bmoe.io.watch import FileWatch
from bmoe.llama.blas import release_blas_threads
from bmoe.llama.isolate import check_first_open
from bmoe.llama.seam import LlamaModel, Step, check_token_ids
from bmoe.metrics.stats import Counters, GenerationStats
from bmoe.metrics.tokens import ProcessSample, TokenMetrics, rss_bytes
from bmoe.pipeline.events import PHASE_DECODE, PHASE_PREFILL
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.pressure import PressureGuard
from bmoe.stages.compute import ComputeStage, compute_thread


@dataclass(frozen=True)
class _Measure:
    wall_s: float
    delta: Counters | None
    counters: Counters | None  # pipeline counters at the end of the call(s)
    before: ProcessSample
    after: ProcessSample
    next_step: int


class Session:
    """Use ``Session.open``; ``close`` (or ``async with``) restores llama.cpp's pointers and frees."""

    def __init__(self, run: Run) -> None:
        """From an assembled ``Run`` (``bmoe.engine.assembly``): the session owns it from here on."""
        self.layout = run.layout
        self.config = config = run.config
        self._model = model = run.model
        self._callback = run.callback
        self._streaming = run.streamer
        self._dense = run.dense
        self._recorder = run.recorder
        self._watch: FileWatch | None = run.watch  # the model files as loaded
        self._blas_held = run.blas_held
        gate = run.callback.gate
        self._compute = ComputeStage(model.decode, gate.arm, gate.disarm, gate.abort, compute_thread())
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.open_mode = run.opened.open_mode
        self.open_reason = run.opened.open_reason
        self.open_bytes_read = run.opened.open_bytes_read
        self.last_stats: GenerationStats | None = None
        self._generations = 0
        self._closed = False
        self._decoding = False
        self._torn_down = False
        self._cancel_requested = False
        self._kv: list[int] | None = []  # tokens the context holds; None: unknown (cleared next)
        self.last_usage: Usage | None = None
        # Native calls outside a decode (tokenize, detokenize, a grammar's check) in flight, from
        # any thread: the teardown waits for them before it frees the model under them.
        self._native_calls = 0
        self._native_done = threading.Condition()
        # How a prompt runs (bmoe.engine.prefill): what it reads is handed over, never the session.
        self._planner = PrefillPlanner(run.layout, config, model.n_batch, run.streamer, run.callback.expert_major)
        # Many sequences or drafts: the step loop owns the context (bmoe.engine.scheduler).
        self._scheduler = Scheduler(self) if config.stepped else None

    @classmethod
    async def open_async(cls, path: str | Path, config: RunConfig | None = None, *,
                         hooks: Hooks | None = None) -> Session:
        """``open`` on a worker thread, awaited: the event loop goes on serving while the file is
        checked, loaded and warmed up. Needed to open a model while another session generates on
        the same loop if the open warms up on the compute thread (a mapped open, a cache that may
        run expert-major prefill, overlap): its decode waits on the loop, and that warm-up waits on
        the decode, so a blocking ``open`` there raises ``ComputeBusyError``. Kinder to a server's
        loop anyway."""
        return await asyncio.to_thread(cls.open, path, config, hooks=hooks)

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None = None, *, hooks: Hooks | None = None) -> Session:
        """Validate the file, open it the cheapest way that works, and get streaming ready."""
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
        if config is not None and not isinstance(config, RunConfig):
            raise ConfigError(f"config must be a RunConfig (RunConfig(**options) for a dict), got {type(config).__name__}")
        config = (config or RunConfig()).validate()
        io_before = read_io_bytes()
        layout = open_layout(path)
        check_io = read_io_bytes()
        check_first_open(layout)  # a child loads a file not seen before: a llama.cpp abort kills it, not us
        # A reaped child's reads are added to this process's counters: the check's load of the
        # dense part (once per file) doubled the first open's figure. They are not this open's.
        after_check = read_io_bytes()
        if io_before is not None and check_io is not None and after_check is not None:
            io_before += after_check - check_io
        overrides = load_overrides(layout, config)  # lossy levers applied at load; a no-op when off
        layout = overrides.layout
        if config.route_trace is not None:
            check_output(config.route_trace, "route_trace", layout.shards)
        if config.cache_profile:
            check_output(config.cache_profile, "cache_profile", layout.shards)
        streaming = config.mode == "stream"
        if streaming:
            check_overhead()
        watch = FileWatch(layout.shards)  # the files as they are loaded: checked once a token
        try:
            session = cls(assemble(layout, config, overrides, streaming, hooks, watch))
        except BaseException:
            watch.close()
            raise
        io_after = read_io_bytes()
        if io_before is not None and io_after is not None:
            session.open_bytes_read = io_after - io_before  # the index, the model, any capture
        return session

    def lossy_counters(self) -> dict[str, object]:
        """What the lossy levers did so far this session (empty when none that counts is on)."""
        lever = getattr(self._callback, "lever", None)
        return lever.counters() if lever is not None else {}

    def logits(self) -> np.ndarray:
        """Scores of the last decoded position over the vocabulary: while a Piece is being
        consumed, the scores it was drawn from (a view, valid until the next decode: copy it)."""
        return self._live().logits()

    @property
    def io_mode(self) -> str | None:
        return self._streaming.reader.mode if self._streaming else None

    @property
    def io_fallback_reason(self) -> str | None:
        return self._streaming.reader.fallback_reason if self._streaming else None

    @property
    def closed(self) -> bool:
        return self._closed

    def file_changed(self) -> str | None:
        """How the model file changed since it was loaded (replaced, rewritten, truncated, gone), as
        one line; None while it is as loaded. Every generation checks it once a token; a server's
        health check asks it too (a server whose file changed can only fail)."""
        return self._watch.changed() if self._watch is not None and not self._closed else None

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        text, special = _check_text(text, "text"), _check_flag(special, "special")
        with self._native() as model:
            return _tokenize(model, text, special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._native() as model:
            ids = check_token_ids(tokens, model.n_vocab, "tokens")
            return b"".join(model.piece(t) for t in ids).decode("utf-8", errors="replace")

    def check_grammar(self, sampling: SamplingParams) -> None:
        """Compile ``sampling``'s grammar and free it: one llama.cpp cannot parse raises a
        ``ParamError`` naming its field now, not when a generation starts (what a server's
        request preparation calls; the vocabulary is read-only, so any thread may)."""
        with self._native() as model:
            check_grammar(model.vocab, sampling)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character, for byte tokens)."""
        with self._native() as model:
            return model.piece(check_token_ids([token], model.n_vocab, "token")[0])

    @contextlib.contextmanager
    def _native(self):  # noqa: ANN202 - a context manager giving the model
        """Around a native call made outside a decode, from any thread: refused once closed, and
        counted, so that a ``close`` on another thread frees the model only after it (a tokenize
        running while close freed the vocabulary died inside llama.cpp: std::out_of_range)."""
        with self._native_done:
            model = self._live()
            self._native_calls += 1
        try:
            yield model
        finally:
            with self._native_done:
                self._native_calls -= 1
                self._native_done.notify_all()

    @property
    def model_name(self) -> str:
        """The model's name as an API reports it: its file name."""
        return self.layout.shards[0].name if self.layout.shards else "bmoe"

    async def create_completion(self, prompt: str | Sequence[int], **kwargs: Any) -> Any:
        """llama-cpp-python's ``create_completion``, async: a ``text_completion`` dict, or with
        ``stream=True`` an async iterator of chunk dicts (``bmoe.engine.completions``)."""
        from bmoe.engine.completions import completion

        return await completion(self, prompt, **kwargs)

    async def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        """llama-cpp-python's ``create_chat_completion``, async, with the model's own template."""
        from bmoe.engine.completions import chat_completion

        return await chat_completion(self, messages, **kwargs)

    @property
    def n_ctx(self) -> int:
        return self._model.n_ctx

    @property
    def n_ctx_seq(self) -> int:
        """Cells one generation may fill: ``n_ctx`` split between the ``parallel`` sequences
        (llama.cpp rounds each share up to a multiple of 256, and ``n_ctx`` up to their sum)."""
        return self._model.n_ctx_seq

    @property
    def n_vocab(self) -> int:
        """Token ids run from 0 to n_vocab - 1 (a prompt of ids is checked against it)."""
        return self._live().n_vocab

    def chat_template(self) -> bytes | None:
        return self._live().chat_template()

    def chat_format(self):  # noqa: ANN201 - a bmoe.engine.chat.ChatFormat
        """The model's chat template, ready to render a conversation."""
        from bmoe.engine.chat import ChatFormat

        model = self._live()
        bos, eos = model.special_text()
        return ChatFormat(model.chat_template(), bos=bos, eos=eos, channels=self.layout.arch == "gpt-oss",
                          adds_bos=model.adds_bos())

    async def stream(
        self, prompt: str | Sequence[int], max_tokens: int = 64, *, sampling: SamplingParams | None = None,
        stop: Sequence[str] | str | None = None, stop_at_end: bool = True, special: bool = False,
        forced: Sequence[int] | None = None, reuse_prompt: bool | None = None,
    ) -> AsyncIterator[Piece]:
        """Generate one Piece per token; the last piece of the stream carries ``finish_reason``
        and ``usage``: the last token's own piece when max_tokens or a stop string ended it, else
        one more piece with no token (an end-of-generation token, a cancel). Cancel the stream, or
        break and close it, at any point.

        ``sampling`` chooses the draw (greedy by default); ``stop`` strings end the generation and
        are never shown, nor anything after them; ``stop_at_end=False`` decodes through the
        model's end-of-generation tokens. ``special`` parses control-token text in the prompt (a
        chat template's markers) as tokens. A prompt may also be a list of token ids.
        ``forced`` replaces the draw by these tokens, in order (teacher forcing: ``bmoe quality``
        feeds a lossy run the exact run's tokens, so both score the same contexts computed the
        same way); ``logits()`` holds the scores of the Piece being consumed.

        The context keeps what it last evaluated: a prompt that begins with the same tokens
        evaluates only the rest (``usage.prompt_evaluated``) as a batch of its own, so the output
        equals a fresh session's up to the order llama.cpp sums in (a token may change on some
        models; ``RunConfig(reuse_prompt=False)`` is exact); streamed still equals resident.
        ``reuse_prompt`` False does so for this generation alone (a server request's
        ``cache_prompt: false``); None follows the config.

        One generation runs at a time: a second waits its turn (first come, first served) until
        the first has finished or been closed. A generator left by ``break`` and no longer
        referenced is closed by the event loop shortly after; one still held (``chunks = await
        s.create_completion(..., stream=True)``, then ``break``) holds the session until it is
        closed, as any async generator would: ``async with contextlib.aclosing(chunks)``, or
        ``await chunks.aclose()``. ``cancel()`` or ``close()`` end a running generation at its next
        graph node with ``finish_reason == "cancelled"``.
        """
        self._live()
        self._check_loop()
        sampling = GREEDY if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        stops = StopStrings(stop)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        _check_flag(stop_at_end, "stop_at_end")
        tokens = self._prompt_tokens(prompt, _check_flag(special, "special"))
        if forced is not None:
            forced = check_token_ids(forced, self._model.n_vocab, "forced")
            if len(forced) < max_tokens:
                raise ConfigError(f"forced holds {len(forced)} tokens, fewer than max_tokens ({max_tokens})")
        if len(tokens) + max_tokens > self._model.n_ctx_seq:
            per = f" of each of {self.config.parallel} sequences" if self.config.parallel > 1 else ""
            raise ConfigError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed the context{per} "
                f"({self._model.n_ctx_seq}); raise the context size (n_ctx)"
            )
        if self._scheduler is not None:  # many sequences or drafts: the step loop decodes it
            reuse = self.config.reuse_prompt if reuse_prompt is None else reuse_prompt
            # Closed explicitly with this stream: a consumer that stops reading frees its sequence now,
            # not when the garbage collector gets to the inner generator.
            async with contextlib.aclosing(
                self._scheduler.stream(tokens, max_tokens, sampling, stops, stop_at_end, forced, reuse),
            ) as pieces:
                async for piece in pieces:
                    yield piece
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            model = self._live()
            self._cancel_requested = False
            reused = self._reuse_prefix(tokens, self.config.reuse_prompt if reuse_prompt is None else reuse_prompt)
            # The prompt's decode calls (token-wise, micro-batches or whole batches: a cost model's
            # choice). Asked before last_stats moves on: the planner learns from the previous one.
            batches = self._planner.plan(tokens[reused:], self.last_stats)
            sampler = Sampler(model.vocab, model.n_vocab, sampling, tokens)
            stats = self._new_stats(len(tokens))
            choice = self.prefill_choice  # what plan just chose, and why
            if choice is not None:
                stats.prefill_strategy, stats.prefill_reason = choice.strategy, choice.reason
            self.last_stats = stats
            self.last_usage = None  # this generation's, set as it ends however it ends
            start = self._counters()
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            finish = "length"
            completion = 0
            if self._streaming:  # a generation runs: the warm pool stays out of its way
                self._streaming.pause_pool()
            try:
                if self._recorder is not None:
                    self._recorder.turn = self._generations
                self._generations += 1
                try:
                    m = await self._measured_decode(batches, 0, PHASE_PREFILL, reused)
                except DecodeAbortedError:
                    if not self._stopping:
                        raise
                    finish, m = "cancelled", None
                stats.prefill_s = m.wall_s if m is not None else 0.0
                i = 0
                while m is not None:
                    if self._stopping:
                        finish = "cancelled"
                        break
                    if self._watch is not None:  # the weights just used are the file's, as loaded
                        self._watch.check()
                    logits = model.logits()
                    token = sampler.sample(logits) if forced is None else forced[i]
                    if stop_at_end and model.is_end(token):
                        finish = "stop"
                        break
                    sampler.accept(token)
                    completion += 1
                    stats.generated_tokens += 1
                    lp = logprobs_of(logits, token, sampling.logprobs) if sampling.logprobs is not None else None
                    metrics = self._token_metrics(i, token, m, start)
                    i += 1
                    text = stops.feed(decoder.decode(model.piece(token), final=i == max_tokens))
                    if stops.hit is None and i < max_tokens:
                        yield Piece(token, text, metrics, lp)
                    else:  # the last token: its piece carries the end (nothing is held back any more)
                        finish = "stop" if stops.hit is not None else "length"
                        usage = self._usage(tokens, completion, reused)
                        yield Piece(token, text + stops.flush(), metrics, lp, finish, usage)
                        return
                    try:
                        m = await self._measured_decode([[token]], m.next_step, PHASE_DECODE, i - 1)
                    except DecodeAbortedError:
                        if not self._stopping:
                            raise
                        finish = "cancelled"
                        break
                    stats.decode_s += m.wall_s
                    stats.decode_steps += 1
                # Ended without a last token to carry it (end of generation, cancelled): one more
                # piece, with no token, says why, with any text still held back.
                tail = stops.feed(decoder.decode(b"", final=True)) + stops.flush()
                yield Piece(None, tail, finish_reason=finish, usage=self._usage(tokens, completion, reused))
            finally:
                if self._streaming:
                    self._streaming.resume_pool()
                sampler.close()
                self._finish_stats(stats, start)
                if self.last_usage is None:  # failed or left mid-way: what it did evaluate and make
                    self._usage(tokens, completion, reused)

    async def generate(
        self, prompt: str | Sequence[int], max_tokens: int = 64, *, sampling: SamplingParams | None = None,
        stop: Sequence[str] | str | None = None, stop_at_end: bool = True, special: bool = False,
        reuse_prompt: bool | None = None,
    ) -> Generation:
        """``stream`` gathered: the tokens, the text, why it finished, usage and stats."""
        out = Generation()
        parts = []
        logprobs = []
        async for piece in self.stream(prompt, max_tokens, sampling=sampling, stop=stop,
                                       stop_at_end=stop_at_end, special=special, reuse_prompt=reuse_prompt):
            if piece.token is not None:
                out.tokens.append(piece.token)
            if piece.logprob is not None:
                logprobs.append(piece.logprob)
            parts.append(piece.text)
            if piece.finish_reason is not None:
                out.finish_reason, out.usage = piece.finish_reason, piece.usage
        out.text = "".join(parts)
        out.stats = self.last_stats
        out.logprobs = logprobs if sampling is not None and sampling.logprobs is not None else None
        return out

    def _usage(self, prompt: list[int], completion: int, reused: int) -> Usage:
        usage = Usage(len(prompt), completion, len(prompt) - reused)
        self.last_usage = usage
        return usage

    def cancel(self) -> None:
        """Stop the running generation at its next MoE layer (any thread); it ends with
        ``finish_reason == "cancelled"``. Nothing happens when none is running. With many
        sequences (``parallel``), every running one ends."""
        if self._scheduler is not None:
            self._scheduler.cancel_all()
            return
        self._cancel_requested = True
        if self._lock is not None and self._lock.locked():
            self._callback.gate.abort(GenerationCancelled("generation cancelled"))

    @property
    def _stopping(self) -> bool:
        return self._cancel_requested or self._closed

    def _check_loop(self) -> None:
        """A session's generations run on one event loop (its lock and the pipeline's futures live
        there). Once that loop has closed (``asyncio.run`` called again), a new one takes over."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise BmoeError("this session belongs to the event loop it last ran on, which is still open: "
                            "use it from that loop (or from SyncSession in threads), or close that loop first")
        self._loop, self._lock = loop, None
        if self._scheduler is not None:
            self._scheduler.on_new_loop()

    def _live(self) -> LlamaModel:
        """The model, or SessionClosedError before any native call on a closed session."""
        if self._closed:
            raise SessionClosedError("the session is closed")
        return self._model

    def _prompt_tokens(self, prompt: str | Sequence[int], special: bool) -> list[int]:
        if isinstance(prompt, str):
            tokens = _tokenize(self._model, prompt, special, "the prompt")
        elif isinstance(prompt, (bytes, bytearray, memoryview)):
            raise ConfigError("a prompt is text or a list of token ids, not bytes: decode the bytes to text first")
        elif isinstance(prompt, Sequence):
            tokens = check_token_ids(prompt, self._model.n_vocab, "a prompt of token ids")
        else:
            raise ConfigError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
        if not tokens:
            raise ConfigError("the prompt tokenizes to nothing")
        return tokens

    def _reuse_prefix(self, tokens: list[int], reuse: bool) -> int:
        """Keep the longest prefix the context already holds (at least the last prompt token is
        evaluated again: its logits are needed); clear the rest. Returns the tokens kept."""
        kv = self._kv or []
        n = 0
        if reuse and kv:
            limit = min(len(kv), len(tokens) - 1)
            a, b = np.asarray(kv[:limit]), np.asarray(tokens[:limit])
            diff = np.flatnonzero(a != b)
            n = int(diff[0]) if diff.size else limit
        if n == 0 or not self._model.keep_prefix(n):
            self._model.clear_memory()
            n = 0
        self._kv = kv[:n]
        return n

    async def _decode(self, tokens: list[int], step: int, phase: int) -> None:
        streaming = self._streaming
        self._decoding = True
        try:
            await self._compute.decode(tokens, step, phase, streaming.serve if streaming else None)
        except BaseExceptionGroup as group:
            raise first_error(group) from group
        finally:
            self._decoding = False
            if self._closed:
                self._teardown()  # close() came during this decode and left the freeing to it
            elif streaming:
                streaming.end_step()

    def _counters(self) -> Counters | None:
        return self._streaming.counters() if self._streaming else None

    def _new_stats(self, prompt_tokens: int) -> GenerationStats:
        return GenerationStats(
            self.config.mode, self.io_mode, prompt_tokens=prompt_tokens,
            budget_bytes=self.budget_bytes, open_mode=self.open_mode,
            open_bytes_read=self.open_bytes_read, node_filter=self._model.filter_kind,
        )

    def _finish_stats(self, stats: GenerationStats, start: Counters | None) -> None:
        end = self._counters()
        if end is not None and start is not None:
            stats.add_counters(end - start)
            stats.resident_cache_bytes = self.resident_cache_bytes
            stats.budget_bytes_end = self.budget_bytes
            moves = self._streaming.budget_changes  # type: ignore[union-attr]
            stats.budget_changes = [c.as_dict() for c in moves[len(moves) - (end - start).budget_changes:]]
            predictor = self._streaming.modes.predictor if self._streaming else None
            if predictor is not None:
                stats.predict_accuracy_pct = predictor.accuracy_pct() or None  # nothing scored: unmeasured

    async def _measured_decode(self, batches: list[list[int]], step: int, phase: int, position: int) -> _Measure:
        """Decode calls with their measurement; ``position`` is the route trace's step of the first
        token (prompt index in prefill, decode iteration in decode)."""
        mark = self._mark()
        for tokens in batches:
            if self._stopping:
                raise GenerationCancelled("generation cancelled")
            if self._recorder is not None:
                self._recorder.begin_call(position)
            kv, self._kv = self._kv, None  # unknown while a decode may be half done
            try:
                await self._decode(tokens, step, phase)
            except (DecodeAbortedError, asyncio.CancelledError) as e:
                # Cancelled mid-call (Ctrl-C in chat, a client gone): llama.cpp wrote no cell
                # below this call's first position, so the prefix before it still stands and the
                # next turn reuses it (it clears what this call left past it). An abort for any
                # other reason (a failed read) leaves the context unknown: cleared next.
                cancelled = isinstance(e, asyncio.CancelledError) or self._cancel_requested
                if cancelled and not self._closed and kv is not None:
                    self._kv = kv
                raise
            if kv is not None:
                kv.extend(tokens)
                self._kv = kv
            if self._recorder is not None:
                self._recorder.end_call()
            step += 1
            position += len(tokens)
        return self._measured_since(mark, step)

    async def _measured_step(self, step: Step, n: int, phase: int) -> _Measure:
        """One step of the scheduler with its measurement (``n``: the step's number)."""
        mark = self._mark()
        await self._decode(step, n, phase)  # type: ignore[arg-type]
        return self._measured_since(mark, n + 1)

    def _mark(self) -> tuple[Counters | None, ProcessSample, float]:
        """Where a measurement starts: the pipeline counters, the process sample, the clock."""
        return self._counters(), ProcessSample.now(), time.perf_counter()

    def _measured_since(self, mark: tuple[Counters | None, ProcessSample, float], next_step: int) -> _Measure:
        before, sample, t0 = mark
        wall = time.perf_counter() - t0
        after = self._counters()
        delta = after - before if after is not None and before is not None else None
        return _Measure(wall, delta, after, sample, ProcessSample.now(), next_step)

    def _token_metrics(self, index: int, token: int, m: _Measure, start: Counters | None) -> TokenMetrics:
        d = m.delta
        cum = None
        if m.counters is not None and start is not None:
            total = m.counters - start
            used = total.hits + total.misses
            cum = 100.0 * (total.hits - total.prefetch_useful) / used if used else None
        wait = d.blocked_s if d else None
        return TokenMetrics(
            index=index, token=token, phase="prefill" if index == 0 else "decode",
            wall_ms=m.wall_s * 1e3,
            read_wait_ms=wait * 1e3 if wait is not None else None,
            cache_ms=d.cache_s * 1e3 if d else None,
            compute_ms=(m.wall_s - (wait or 0.0)) * 1e3,
            bytes_read=d.bytes_read if d else None,
            experts_read=d.misses + d.prefetch_issued if d else None,  # a read ahead is a read, not a hit
            hits=d.hits - d.prefetch_useful if d else None,
            cum_hit_pct=cum,
            major_faults=m.after.major_faults - m.before.major_faults,
            cpu_ms=(m.after.cpu_s - m.before.cpu_s) * 1e3,
            rss_bytes=rss_bytes(),
            resident_cache_bytes=self.resident_cache_bytes,
            budget_bytes=self.budget_bytes,
        )

    @property
    def budget_bytes(self) -> int | None:
        return self._streaming.cache.budget_bytes if self._streaming else None

    @property
    def resident_cache_bytes(self) -> int | None:
        """What the cache accounts for (whole experts); ``expert_memory_bytes`` is what RAM holds."""
        return self._streaming.cache.resident_bytes if self._streaming else None

    def expert_memory_bytes(self) -> int | None:
        """Bytes of the expert regions in RAM now, measured page by page (mincore; allocates)."""
        return self._streaming.residency.resident_bytes() if self._streaming else None

    @property
    def warnings(self) -> list[str]:
        """Things a user should know about this configuration (printed by the CLI)."""
        out = []
        if self._streaming and self._streaming.budget.warning:
            out.append(self._streaming.budget.warning)
        if self.io_fallback_reason:
            out.append(f"O_DIRECT is off: {self.io_fallback_reason}")
        kind = self._model.filter_kind
        if kind is not None and kind.startswith("python: ") and kind != "python: BMOE_NODE_FILTER=python":
            # Not asked for: every graph node reaches Python (its build cache unwritable, say).
            out.append(f"the C node filter is not in use ({kind.removeprefix('python: ')}): every graph node "
                       "reaches Python, which slows each token")
        if self.config.parallel > 1 and self.n_ctx != self.config.n_ctx:
            out.append(f"the context holds {self.n_ctx} tokens, not the {self.config.n_ctx} asked for: "
                       f"{self.n_ctx_seq} for each of its {self.config.parallel} sequences (llama.cpp rounds "
                       "a sequence's share up to a multiple of 256)")
        elif self.n_ctx != self.config.n_ctx:  # llama.cpp pads the context to a multiple of 256
            out.append(f"the context holds {self.n_ctx} tokens, not the {self.config.n_ctx} asked for "
                       f"(llama.cpp rounds it up to a multiple of 256)")
        return out

    @property
    def budget_how(self) -> str | None:
        return self._streaming.budget.how if self._streaming else None

    def set_cache_budget(self, budget_bytes: int) -> None:
        """Change the expert cache budget between generations; evicts down to it at once. A budget
        past the expert bank is the bank."""
        self._live()
        if self.generating:
            raise BmoeError("cannot change the cache budget while generating")
        if self._streaming is None:
            raise ConfigError("a resident session has no expert cache")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) or budget_bytes < 0:
            raise ConfigError(f"the cache budget is a whole number of bytes >= 0 (0: off), got {budget_bytes!r}")
        check_cache_bytes(int(budget_bytes))
        # More than the bank can never be filled; the guard's ceiling would count the difference
        # as memory the cache is about to take.
        self._streaming.set_budget(min(int(budget_bytes), self.layout.expert_bytes))

    def check_memory(self) -> bool:
        """Between generations, let the pressure guard look at memory now (at most every quarter
        second; it samples then) and move the cache budget, evicting down to a smaller one at once.
        True when the budget changed. A generation asks between its layers; a session that idles (a
        server between requests) held its cache whatever other programs took until its next
        request, so ``bmoe serve`` calls this every second. Nothing happens while a generation
        runs, with no cache or no guard, or once closed."""
        if self._closed or self._streaming is None or self._streaming.guard is None:
            return False
        if self.generating:
            return False
        return self._streaming.tick() is not None

    @property
    def prefill_choice(self):  # noqa: ANN201 - a bmoe.pipeline.prefill.Choice, or None
        """How the last prompt ran (one batch, expert-major, micro-batches, token by token) and why."""
        return self._planner.last_choice

    @property
    def prefill_record(self):  # noqa: ANN201 - what the last prompt's calls read and took, or None
        return self._planner.last_prefill

    @property
    def generating(self) -> bool:
        """A generation is running or waiting on this session."""
        return bool(self._lock is not None and self._lock.locked()
                    or self._scheduler is not None and self._scheduler.busy)

    @property
    def scheduler(self) -> Scheduler | None:
        """The step loop (many sequences or drafts), or None when generations take turns."""
        return self._scheduler

    @property
    def pressure_guard(self) -> PressureGuard | None:
        """The guard that moves the cache budget under memory pressure (None: no cache, or off)."""
        return self._streaming.guard if self._streaming else None

    def close(self) -> None:
        """Restore every rebound pointer before the memory behind it goes, then free the model.

        A generation running on this session stops at its next MoE layer and ends with
        ``finish_reason == "cancelled"``. If a decode is in flight, close returns at once and the
        decode frees everything as soon as it has stopped (the stage tasks and the compute thread
        still hold the regions until then). Every later call raises SessionClosedError; closing
        twice is harmless. From another thread while the session's event loop runs, the session is
        closed at once (later calls raise SessionClosedError, a running generation is stopped) and
        the freeing is handed to the loop: done in place, it freed the context between two decodes
        of a generation still running there (a segfault).
        """
        if self._closed:
            return
        self._closed = True
        if self._off_loop():
            self._callback.gate.abort(GenerationCancelled("the session was closed"))
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._close_on_loop)
            return
        self._close_on_loop()

    def _off_loop(self) -> bool:
        """Called on a thread other than the one running this session's event loop."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return False
        try:
            return asyncio.get_running_loop() is not loop
        except RuntimeError:  # no loop runs on this thread
            return True

    def _close_on_loop(self) -> None:
        if self._decoding:  # the decode frees everything as soon as it has stopped
            self._callback.gate.abort(GenerationCancelled("the session was closed"))
            return
        self._teardown()

    def _teardown(self) -> None:
        """Every step runs even when one before it raises (a full disk under the route trace or
        the profile must not keep the model and its regions alive); the error is raised after.
        Once only (a close handed to the loop may find the decode has already freed it all)."""
        if self._torn_down:
            return
        self._torn_down = True
        with self._native_done:  # closed is set: no new native call starts; wait for those running
            self._native_done.wait_for(lambda: self._native_calls == 0)
        recorder, self._recorder = self._recorder, None
        streaming, self._streaming = self._streaming, None
        dense, self._dense = self._dense, None
        with contextlib.ExitStack() as steps:  # callbacks run last-pushed first
            if self._blas_held:
                self._blas_held = False
                steps.callback(release_blas_threads)
            if self._watch is not None:
                steps.callback(self._watch.close)
            steps.callback(self._model.close)  # after the regions' pointers are restored
            if dense is not None:
                steps.callback(dense.close)
            if streaming is not None:
                steps.callback(streaming.close)
                if self.config.cache_profile:
                    steps.callback(streaming.save_profile, self.config.cache_profile, self.layout)
            if recorder is not None:
                steps.callback(recorder.close)
            steps.callback(self._compute.close)

    def __del__(self) -> None:
        """A session dropped unclosed: warn as an unclosed file does, and free its threads,
        regions and model (nothing can be generating: a generation holds a reference)."""
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        warnings.warn(f"unclosed bmoe Session of {self.model_name}: close() it or use 'with'", ResourceWarning,
                      source=self, stacklevel=2)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise; the process is no worse off
            pass

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_text(text: object, what: str) -> str:
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a str, got {type(text).__name__}")
    return text


def _check_flag(value: object, what: str) -> bool:
    """A bool, not something truthy: ``special="no"`` would otherwise mean yes."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be True or False, got {value!r}")
    return value


def _tokenize(model: LlamaModel, text: str, special: bool, what: str = "the text") -> list[int]:
    try:
        return model.tokenize(text, parse_special=special)
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), "
                          "which is not text UTF-8 can encode") from None
