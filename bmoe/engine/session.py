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
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bmoe.engine.callback import Capture, Consumption, EvalCallback
from bmoe.engine.config import RunConfig
from bmoe.engine.loader import OpenedModel, capture_weights, open_model
from bmoe.engine.prefill import prefill_batches
from bmoe.engine.seam import LlamaModel
from bmoe.engine.streaming import Streamer
from bmoe.errors import BmoeError, ConfigError, SeamMismatchError, first_error
from bmoe.io.ggml import check_live_tensor, check_overhead
from bmoe.io.layout import ModelLayout
from bmoe.io.pagecache import mapping_spans, read_io_bytes, release_file_pages
from bmoe.io.paths import check_output
from bmoe.io.validate import open_layout
from bmoe.metrics.route_trace import RouteRecorder
from bmoe.metrics.stats import Counters, GenerationStats
from bmoe.metrics.tokens import ProcessSample, TokenMetrics, rss_bytes
from bmoe.pipeline.events import PHASE_DECODE, PHASE_PREFILL
from bmoe.pipeline.gate import RoutingGate
from bmoe.pipeline.hooks import Hooks
from bmoe.stages.compute import ComputeStage
from bmoe.stages.dense import AnonDense
from bmoe.stages.predict import Predictor, load_routers

_EXPERT_TENSOR = re.compile(rb"^blk\.(\d+)\.([a-z_]+_exps)\.weight$")


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes. ``token`` is None only for the final flush of
    a byte sequence that ended mid-character (its replacement text)."""

    token: int | None
    text: str
    metrics: TokenMetrics | None = None


@dataclass(frozen=True)
class _Measure:
    wall_s: float
    delta: Counters | None
    counters: Counters | None  # pipeline counters at the end of the call(s)
    before: ProcessSample
    after: ProcessSample
    next_step: int


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stats: GenerationStats | None = None


class Session:
    """Use ``Session.open``; ``close`` (or ``async with``) restores llama.cpp's pointers and frees."""

    def __init__(
        self, layout: ModelLayout, config: RunConfig, model: LlamaModel, callback: EvalCallback,
        opened: OpenedModel, streaming: Streamer | None, dense: AnonDense | None,
    ) -> None:
        self.layout = layout
        self.config = config
        self._model = model
        self._callback = callback
        self._streaming = streaming
        self._dense = dense
        gate = callback.gate
        self._compute = ComputeStage(model.decode, gate.arm, gate.disarm, gate.abort)
        self._lock: asyncio.Lock | None = None
        self.open_mode = opened.open_mode
        self.open_reason = opened.open_reason
        self.open_bytes_read = opened.open_bytes_read
        self.last_stats: GenerationStats | None = None
        self._generations = 0
        self._recorder: RouteRecorder | None = None

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None = None, *, hooks: Hooks | None = None) -> Session:
        """Validate the file, open it the cheapest way that works, and get streaming ready."""
        config = (config or RunConfig()).validate()
        io_before = read_io_bytes()
        layout = open_layout(path)
        if config.route_trace is not None:
            check_output(config.route_trace, "route_trace", layout.shards)
        streaming = config.mode == "stream"
        if streaming:
            check_overhead()
        opened = open_model(layout, streaming=streaming, mode=config.open_mode if streaming else "mmap")
        callback = EvalCallback(RoutingGate())
        model = LlamaModel(
            opened, n_ctx=config.n_ctx, n_threads=config.threads, callback=callback,
            install=streaming or config.eval_filter,
        )
        streamer = dense = recorder = None
        try:
            if streaming:
                tensors = opened.expert_tensors(layout) or _capture_experts(model, callback)
                check_live_tensor(next(iter(tensors.values())))
                if opened.open_mode == "mmap-drop":
                    release_file_pages(layout, mapping_spans(layout, tensors))
                streamer = Streamer.live(layout, tensors, config, callback.gate, hooks or Hooks())
                if config.overlap:
                    _plan_overlap(model, callback, layout, tensors, streamer)
                if config.predict_prefetch:
                    predictor = Predictor(load_routers(layout), layout.n_expert_used)
                    callback.predictor = streamer.prefetch.predictor = predictor
                callback.streaming = True
                if config.route_trace is not None:
                    recorder = RouteRecorder(config.route_trace, layout, _run_line(config, streamer))
                    callback.gate.tap = recorder.tap
                    callback.weights_tap = recorder.tap_weights
            if config.dense_weights == "anon":
                dense = _anon_dense(layout, opened, model, config)
        except BaseException:
            if recorder is not None:
                recorder.close()
            if streamer is not None:
                streamer.close()
            model.close()
            raise
        session = cls(layout, config, model, callback, opened, streamer, dense)
        session._recorder = recorder
        io_after = read_io_bytes()
        if io_before is not None and io_after is not None:
            session.open_bytes_read = io_after - io_before  # the index, the model, any capture
        return session

    @property
    def io_mode(self) -> str | None:
        return self._streaming.reader.mode if self._streaming else None

    @property
    def io_fallback_reason(self) -> str | None:
        return self._streaming.reader.fallback_reason if self._streaming else None

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self._model.tokenize(text, parse_special=special)

    @property
    def n_ctx(self) -> int:
        return self._model.n_ctx

    def chat_template(self) -> bytes | None:
        return self._model.chat_template()

    async def stream(
        self, prompt: str, max_tokens: int = 64, *, stop_at_end: bool = True, special: bool = False
    ) -> AsyncIterator[Piece]:
        """Greedy generation, one Piece per token; cancel it, or break and close it, at any point.

        ``special`` parses control-token text in the prompt (a chat template's markers) as tokens.

        One generation runs at a time: a second waits until the first has finished or been closed
        (a generator abandoned by ``break`` is closed by the event loop shortly after).
        """
        if self._model.ctx is None:
            raise BmoeError("session is closed")
        tokens = self._model.tokenize(prompt, parse_special=special)
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
            batches = prefill_batches(self, tokens)  # learns from last_stats: before it moves on
            stats = self._new_stats(len(tokens))
            self.last_stats = stats
            start = self._counters()
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            try:
                self._model.clear_memory()
                if self._recorder is not None:
                    self._recorder.turn = self._generations
                self._generations += 1
                m = await self._measured_decode(batches, 0, PHASE_PREFILL, 0)
                stats.prefill_s = m.wall_s
                for i in range(max_tokens):
                    token = int(np.argmax(self._model.logits()))
                    if stop_at_end and self._model.is_end(token):
                        break
                    stats.generated_tokens += 1
                    metrics = self._token_metrics(i, token, m, start)
                    yield Piece(token, decoder.decode(self._model.piece(token)), metrics)
                    if i + 1 == max_tokens:
                        break
                    m = await self._measured_decode([[token]], m.next_step, PHASE_DECODE, i)
                    stats.decode_s += m.wall_s
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield Piece(None, tail)
            finally:
                self._finish_stats(stats, start)

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
            raise first_error(group) from group
        finally:
            if streaming:
                streaming.end_step()

    def _counters(self) -> Counters | None:
        return self._streaming.counters() if self._streaming else None

    def _new_stats(self, prompt_tokens: int) -> GenerationStats:
        return GenerationStats(
            self.config.mode, self.io_mode, prompt_tokens=prompt_tokens,
            budget_bytes=self.budget_bytes, open_mode=self.open_mode,
            open_bytes_read=self.open_bytes_read,
        )

    def _finish_stats(self, stats: GenerationStats, start: Counters | None) -> None:
        end = self._counters()
        if end is not None and start is not None:
            stats.add_counters(end - start)
            stats.resident_cache_bytes = self.resident_cache_bytes
            predictor = self._streaming.prefetch.predictor if self._streaming else None
            if predictor is not None:
                stats.predict_accuracy_pct = predictor.accuracy_pct()

    async def _measured_decode(self, batches: list[list[int]], step: int, phase: int, position: int) -> _Measure:
        """Decode calls with their measurement; ``position`` is the route trace's step of the first
        token (prompt index in prefill, decode iteration in decode)."""
        before, sample, t0 = self._counters(), ProcessSample.now(), time.perf_counter()
        for tokens in batches:
            if self._recorder is not None:
                self._recorder.begin_call(position)
            await self._decode(tokens, step, phase)
            if self._recorder is not None:
                self._recorder.end_call()
            step += 1
            position += len(tokens)
        wall = time.perf_counter() - t0
        after = self._counters()
        delta = after - before if after is not None and before is not None else None
        return _Measure(wall, delta, after, sample, ProcessSample.now(), step)

    def _token_metrics(self, index: int, token: int, m: _Measure, start: Counters | None) -> TokenMetrics:
        d = m.delta
        cum = None
        if m.counters is not None and start is not None:
            total = m.counters - start
            used = total.hits + total.misses
            cum = 100.0 * total.hits / used if used else None
        wait = d.blocked_s if d else None
        return TokenMetrics(
            index=index, token=token, phase="prefill" if index == 0 else "decode",
            wall_ms=m.wall_s * 1e3,
            read_wait_ms=wait * 1e3 if wait is not None else None,
            cache_ms=d.cache_s * 1e3 if d else None,
            compute_ms=(m.wall_s - (wait or 0.0)) * 1e3,
            bytes_read=d.bytes_read if d else None,
            experts_read=d.misses if d else None,
            hits=d.hits if d else None,
            cum_hit_pct=cum,
            major_faults=m.after.major_faults - m.before.major_faults,
            cpu_ms=(m.after.cpu_s - m.before.cpu_s) * 1e3,
            rss_bytes=rss_bytes(),
            resident_cache_bytes=self.resident_cache_bytes,
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
        return out

    @property
    def budget_how(self) -> str | None:
        return self._streaming.budget.how if self._streaming else None

    def set_cache_budget(self, budget_bytes: int) -> None:
        """Change the expert cache budget between generations; evicts down to it at once."""
        if self._lock is not None and self._lock.locked():
            raise BmoeError("cannot change the cache budget while generating")
        if self._streaming is None:
            raise ConfigError("a resident session has no expert cache")
        self._streaming.prefetch.evict(self._streaming.cache.set_budget(budget_bytes))

    def close(self) -> None:
        """Restore every rebound pointer before the memory behind it goes, then free the model."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._streaming is not None:
            self._streaming.close()
            self._streaming = None
        if self._dense is not None:
            self._dense.close()
            self._dense = None
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


def _plan_overlap(
    model: LlamaModel, callback: EvalCallback, layout: ModelLayout,
    tensors: dict[tuple[int, str], int], streamer: Streamer,
) -> None:
    """Find, from a one-token warm-up graph, where each layer consumes each expert projection, and
    set the wait points: at routing, the first consumed; after each consuming node, the next."""
    proj_of = {}
    for (layer, suffix), addr in tensors.items():
        suffixes = [et.suffix for et in layout.layer_experts(layer)]
        proj_of[addr] = (layer, suffixes.index(suffix))
    found = Consumption(proj_of)
    _warm_up(model, callback, found)
    wait_after: dict[bytes, tuple[int, int]] = {}
    gate = callback.gate
    gate.first_proj, gate.last_proj = {}, {}
    for layer in layout.moe_layers:
        order = found.order.get(layer, [])
        if len(order) != len(layout.layer_experts(layer)):
            raise SeamMismatchError(f"overlap: could not find where layer {layer} consumes its experts")
        gate.first_proj[layer], gate.last_proj[layer] = order[0][1], order[-1][1]
        for (name, _), (_, nxt) in zip(order, order[1:]):
            wait_after[name] = (layer, nxt)
        streamer.prefetch.consumption[layer] = tuple(p for _, p in order)
    callback.wait_after = wait_after


def _run_line(config: RunConfig, streamer: Streamer) -> dict[str, object]:
    """How the traced run was made, for the trace's ``# run`` line."""
    return {
        "engine": "bmoe", "cache_bytes": streamer.cache.budget_bytes, "policy": streamer.cache.policy_name,
        "io_threads": config.io_threads, "io": streamer.reader.mode, "threads": config.threads,
    }


def _anon_dense(layout: ModelLayout, opened: OpenedModel, model: LlamaModel, config: RunConfig) -> AnonDense:
    """Copy the dense weights into anonymous memory so page-cache churn cannot evict them."""
    expert_names = {et.span.name for et in layout.experts.values()}
    names = [n for n in layout.tensors if n not in expert_names]
    tensors = opened.tensors or capture_weights(model.model, names, n_threads=config.threads)
    dense = AnonDense(layout, tensors, open_mode=opened.open_mode)
    dense.apply()
    return dense


def _warm_up(model: LlamaModel, callback: EvalCallback, visitor: Capture | Consumption) -> None:
    """One-token decode with ``visitor`` shown every MoE node of the graph, then the KV cleared."""
    callback.capture = visitor
    try:
        model.decode(model.tokenize("a", add_special=False)[:1] or [0])
    finally:
        callback.capture = None
        model.clear_memory()


def _capture_experts(model: LlamaModel, callback: EvalCallback) -> dict[tuple[int, str], int]:
    """One-token warm-up decode that records each expert tensor the graph uses, then clears the KV.
    Needed after an mmap open, where no tensor callback told us the addresses."""
    capture = Capture(lambda name: _EXPERT_TENSOR.match(name) is not None)
    _warm_up(model, callback, capture)
    if not capture.tensors:
        raise SeamMismatchError("the warm-up decode saw no expert matmul: node names changed?")
    out = {}
    for name, addr in capture.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        assert m is not None
        out[int(m[1]), m[2].decode()] = addr
    return out
