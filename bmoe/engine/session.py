"""Session: open a model once, generate many times. The composition root of bmoe.

Open validates the file in Python, loads it through the seam, captures the expert tensors with a
one-token warm-up, and (when streaming) rebinds them to reserved regions that the pipeline fills on
demand. ``stream`` is the async core every front uses: it owns one generation, yields text pieces
with their token ids, and leaves the session usable when the consumer cancels.
"""

from __future__ import annotations

import asyncio
import codecs
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bmoe.engine.callback import Capture, EvalCallback
from bmoe.engine.config import RunConfig
from bmoe.engine.ggml import check_live_tensor, check_overhead
from bmoe.engine.recipes import recipe_for
from bmoe.engine.seam import LlamaModel
from bmoe.errors import BmoeError, ConfigError, SeamMismatchError
from bmoe.io.direct import ShardReader
from bmoe.io.layout import ModelLayout
from bmoe.io.validate import open_layout
from bmoe.metrics.stats import GenerationStats
from bmoe.pipeline.cache import ExpertCache, make_policy
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import PHASE_DECODE, PHASE_PREFILL, RoutingEvent
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.readiness import ReadinessBoard
from bmoe.stages.bind import BindStage, Residency
from bmoe.stages.compute import ComputeStage
from bmoe.stages.prefetch import PrefetchStage
from bmoe.stages.read import ReadStage

_EXPERT_TENSOR = re.compile(rb"^blk\.(\d+)\.([a-z_]+_exps)\.weight$")


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes. ``token`` is None only for the final flush of
    a byte sequence that ended mid-character (its replacement text)."""

    token: int | None
    text: str


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stats: GenerationStats | None = None


class _Streaming:
    """The streaming parts of a session: regions, reader, cache and the stages over them."""

    def __init__(
        self, layout: ModelLayout, tensors: dict[tuple[int, str], int], config: RunConfig,
        callback: EvalCallback, hooks: Hooks,
    ) -> None:
        self.residency = Residency(layout, tensors)
        self.reader = ShardReader(layout.shards, direct=config.odirect)
        try:
            first = layout.layer_experts(layout.moe_layers[0])[0]
            self.reader.verify(first.span.shard, first.span.offset, first.stride)
            self.cache = ExpertCache(
                config.cache_bytes, self.residency.entry_bytes(), make_policy(config.cache_policy)
            )
            self.lanes = ThreadPoolExecutor(config.io_threads, thread_name_prefix="bmoe-io")
        except BaseException:
            self.reader.close()
            self.residency.close()
            raise
        self.board = ReadinessBoard()
        self.prefetch = PrefetchStage(self.cache, self.residency, self.board, callback.fast_hits, hooks)
        self.read = ReadStage(self.reader, self.lanes, self.board, hooks)
        self.bind = BindStage(self.residency)
        callback.set_resident_maps(self.residency.maps)
        self.residency.bind()

    def serve(self, events: Channel[RoutingEvent]) -> list:
        reads: Channel = Channel()
        binds: Channel = Channel()
        return [self.prefetch.run(events, reads, binds), self.read.run(reads), self.bind.run(binds)]

    def end_step(self) -> None:
        """Between decode steps: account fast-path hits and evict down to the budget."""
        self.prefetch.account_fast_hits()
        self.prefetch.evict(self.cache.trim())

    def close(self) -> None:
        self.lanes.shutdown(wait=True)
        self.residency.close()
        self.reader.close()


class Session:
    """Use ``Session.open``; ``close`` (or ``async with``) restores llama.cpp's pointers and frees."""

    def __init__(
        self, layout: ModelLayout, config: RunConfig, model: LlamaModel, callback: EvalCallback,
        streaming: _Streaming | None,
    ) -> None:
        self.layout = layout
        self.config = config
        self._model = model
        self._callback = callback
        self._streaming = streaming
        self._compute = ComputeStage(model.decode, callback.arm, callback.disarm, callback.abort)
        self._busy = False
        self._lock: asyncio.Lock | None = None
        self._base: tuple[int, int, float, float, float, int, int, int] = (0, 0, 0.0, 0.0, 0.0, 0, 0, 0)
        self.last_stats: GenerationStats | None = None

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None = None, *, hooks: Hooks | None = None) -> Session:
        config = (config or RunConfig()).validate()
        layout = open_layout(path)
        recipe_for(layout.arch)
        check_overhead()
        callback = EvalCallback()
        model = LlamaModel(
            layout.shards[0], n_ctx=config.n_ctx, n_threads=config.threads, callback=callback,
            install=config.mode == "stream" or config.eval_filter,
        )
        streaming = None
        try:
            if config.mode == "stream":
                tensors = _capture_experts(model, callback)
                streaming = _Streaming(layout, tensors, config, callback, hooks or Hooks())
                callback.streaming = True
        except BaseException:
            model.close()
            raise
        return cls(layout, config, model, callback, streaming)

    @property
    def io_mode(self) -> str | None:
        return self._streaming.reader.mode if self._streaming else None

    @property
    def io_fallback_reason(self) -> str | None:
        return self._streaming.reader.fallback_reason if self._streaming else None

    def tokenize(self, text: str) -> list[int]:
        return self._model.tokenize(text)

    async def stream(self, prompt: str, max_tokens: int = 64, *, stop_at_end: bool = True) -> AsyncIterator[Piece]:
        """Greedy generation, one Piece per token; cancel it, or break and close it, at any point.

        One generation runs at a time: a second waits until the first has finished or been closed
        (a generator abandoned by ``break`` is closed by the event loop shortly after).
        """
        if self._model.ctx is None:
            raise BmoeError("session is closed")
        tokens = self._model.tokenize(prompt)
        if not tokens:
            raise ConfigError("the prompt tokenizes to nothing")
        if len(tokens) + max_tokens > self._model.n_ctx:
            raise ConfigError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed the context "
                f"({self._model.n_ctx}); raise n_ctx"
            )
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            self._busy = True
            stats = self._new_stats(len(tokens))
            self.last_stats = stats
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            try:
                self._model.clear_memory()
                t0 = time.perf_counter()
                step = 0
                for i in range(0, len(tokens), self._model.n_batch):
                    await self._decode(tokens[i : i + self._model.n_batch], step, PHASE_PREFILL)
                    step += 1
                stats.prefill_s = time.perf_counter() - t0
                for i in range(max_tokens):
                    token = int(np.argmax(self._model.logits()))
                    if stop_at_end and self._model.is_end(token):
                        break
                    stats.generated_tokens += 1
                    yield Piece(token, decoder.decode(self._model.piece(token)))
                    if i + 1 == max_tokens:
                        break
                    t0 = time.perf_counter()
                    await self._decode([token], step, PHASE_DECODE)
                    stats.decode_s += time.perf_counter() - t0
                    step += 1
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield Piece(None, tail)
            finally:
                self._finish_stats(stats)
                self._busy = False

    async def generate(self, prompt: str, max_tokens: int = 64, *, stop_at_end: bool = True) -> Generation:
        out = Generation()
        parts = []
        async for piece in self.stream(prompt, max_tokens, stop_at_end=stop_at_end):
            if piece.token is not None:
                out.tokens.append(piece.token)
            parts.append(piece.text)
        out.text = "".join(parts)
        out.stats = self.last_stats
        return out

    async def _decode(self, tokens: list[int], step: int, phase: int) -> None:
        streaming = self._streaming
        try:
            await self._compute.decode(tokens, step, phase, streaming.serve if streaming else None)
        except BaseExceptionGroup as group:
            raise _first_error(group) from group
        finally:
            if streaming:
                streaming.end_step()

    def _new_stats(self, prompt_tokens: int) -> GenerationStats:
        stats = GenerationStats(self.config.mode, self.io_mode, prompt_tokens=prompt_tokens)
        if self._streaming:
            s = self._streaming
            self._base = (s.read.counters.slices, s.read.counters.bytes_read, s.read.counters.busy_s,
                          s.bind.read_wall_s, self._callback.blocked_s,
                          s.cache.misses, s.cache.hits, s.cache.evictions)
        return stats

    def _finish_stats(self, stats: GenerationStats) -> None:
        if not self._streaming:
            return
        s = self._streaming
        slices, nbytes, busy, wall, blocked, misses, hits, evictions = self._base
        stats.slices_read = s.read.counters.slices - slices
        stats.bytes_read = s.read.counters.bytes_read - nbytes
        stats.read_busy_s = s.read.counters.busy_s - busy
        stats.read_wall_s = s.bind.read_wall_s - wall
        stats.blocked_s = self._callback.blocked_s - blocked
        stats.experts_read = s.cache.misses - misses
        stats.cache_hits = s.cache.hits - hits
        stats.cache_evictions = s.cache.evictions - evictions

    def set_cache_budget(self, budget_bytes: int) -> None:
        """Change the expert cache budget between generations; evicts down to it at once."""
        if self._busy:
            raise BmoeError("cannot change the cache budget while generating")
        if self._streaming is None:
            raise ConfigError("a resident session has no expert cache")
        self._streaming.prefetch.evict(self._streaming.cache.set_budget(budget_bytes))

    def close(self) -> None:
        if self._streaming is not None:
            self._streaming.close()
            self._streaming = None
        self._compute.close()
        self._model.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _capture_experts(model: LlamaModel, callback: EvalCallback) -> dict[tuple[int, str], int]:
    """One-token warm-up decode that records each expert tensor the graph uses, then clears the KV."""
    capture = Capture(lambda name: _EXPERT_TENSOR.match(name) is not None)
    callback.capture = capture
    try:
        model.decode(model.tokenize("a", add_special=False)[:1] or [0])
    finally:
        callback.capture = None
        model.clear_memory()
    if not capture.tensors:
        raise SeamMismatchError("the warm-up decode saw no expert matmul: node names changed?")
    check_live_tensor(next(iter(capture.tensors.values())))
    out = {}
    for name, addr in capture.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        assert m is not None
        out[int(m[1]), m[2].decode()] = addr
    return out


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception a caller should see from a stage group: a bmoe error before a cancellation."""
    flat: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else flat.append(e)

    walk(group)
    for e in flat:
        if isinstance(e, BmoeError):
            return e
    return flat[0]
