"""Prefill strategies: how a session runs a prompt (one batch, expert-major, micro-batches, or token
by token).

``PrefillPlanner.plan(tokens, last_stats)`` returns the prompt's decode calls as an iterator the
session (or its step loop) consumes one call at a time. The strategy is forced by ``RunConfig.prefill``, or for ``auto``
chosen by ``choose`` in ``bmoe.pipeline.prefill``: one batch (calls of the context's ``n_batch``
tokens), or expert-major where the session can run it and one batch's expert union in some layer,
expected from the experts the layer holds now and decode's measured hit rate, would exceed the
cache budget. No cost model picks a chunk size. What this session has measured (the engine's read
rate, decode's hit rate and per-step compute from the previous generation's stats, and a batched
prefill's compute per token, timed here around the calls of the prompt) gives the hit rate that
test uses and the time estimate reported with the choice (``last_choice``; none until each term is
measured). The iterator does that timing itself: a call has finished when the session asks for the
next one, so no clock or hook is added to the session.

Chunking never reads fewer bytes than one batch under one routing (see ``bmoe.pipeline.prefill``):
what it buys is a transient union that keeps the cache budget, at the price of a per-call compute
overhead, and a greedy output that may leave the resident run's one batch. ``auto`` therefore
never chunks: one batch, or expert-major where one batch's union would exceed the budget and the
model has the expert chain for it; ``micro`` and ``token`` are there when forced.

Every strategy runs the same tokens through the same cache; greedy output is byte-identical to a
resident run of the same batching (llama.cpp sums in a different order for a batch than for single
tokens, so token-wise and batched resident runs may differ from each other: the gates compare each
strategy with the resident run of that same strategy).

Each session owns one planner, made with what it reads (the layout, the config, the context's
batch, the streamer and expert-major compute): it never reaches into the session.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bmoe.engine.config import RunConfig
from bmoe.io.layout import ModelLayout
from bmoe.pipeline.prefill import Choice, LayerCache, Rates, choose


@dataclass
class _PrefillRecord:
    """Counters of one prompt's calls, to take them out of the generation's totals."""

    n_tokens: int
    chunk: int
    wall_s: float
    blocked_s: float
    hits: int  # found resident, not read ahead (GenerationStats.cache_hits)
    routed: int  # GenerationStats.experts_routed
    bytes_read: int | None  # None when resident


class PrefillPlanner:
    """Measurements of one session and the choice they lead to. ``streaming``: the session's
    ``Streamer`` (None when resident); ``expert_major``: its ``ExpertMajor`` compute (None where a
    prompt cannot run expert-major), switched on for the calls of a prompt that does."""

    def __init__(self, layout: ModelLayout, config: RunConfig, n_batch: int, streaming: Any = None,
                 expert_major: Any = None) -> None:
        self._layout, self._config, self._n_batch = layout, config, n_batch
        self._streaming, self._em = streaming, expert_major
        self.batch_token_s: float | None = None  # batched prefill compute per token
        self.decode_compute_s: float | None = None  # one decode step's compute
        self.hit: float | None = None  # decode's hit rate
        self.last_choice: Choice | None = None
        self.last_prefill: _PrefillRecord | None = None
        self._learned_from: Any = None  # the stats object already folded in

    def learn(self, stats: Any) -> None:
        """Fold in the previous generation (``GenerationStats``) and the prefill timed for it."""
        rec = self.last_prefill
        if stats is None or stats is self._learned_from or rec is None:
            return
        self._learned_from = stats
        steps = stats.decode_steps  # decode calls after the prompt's
        if steps > 0 and stats.decode_s > 0:
            blocked = max(0.0, (stats.blocked_s or 0.0) - rec.blocked_s)
            self.decode_compute_s = max(0.0, stats.decode_s - blocked) / steps
            if stats.cache_hits is not None and stats.experts_routed is not None:
                used = stats.experts_routed - rec.routed
                if used > 0:
                    self.hit = (stats.cache_hits - rec.hits) / used

    def _layers(self) -> list[LayerCache] | None:
        streaming = self._streaming
        if streaming is None:
            return None
        layout = self._layout
        maps = streaming.residency.maps
        entry = layout.entry_bytes()
        return [
            LayerCache(layout.n_expert, layout.n_expert_used, entry[il], int(maps[il].sum()))
            for il in layout.moe_layers
        ]

    def rates(self) -> Rates:
        streaming = self._streaming
        read_rate = None
        if streaming is not None:
            c = streaming.counters()
            if c.read_wall_s > 0 and c.bytes_read > 0:
                read_rate = c.bytes_read / c.read_wall_s
        return Rates.from_measurements(
            read_bytes_per_s=read_rate, decode_compute_s=self.decode_compute_s,
            batch_compute_s_per_token=self.batch_token_s, hit=self.hit,
        )

    def plan(self, tokens: list[int], last_stats: Any = None) -> Iterator[list[int]]:
        """The calls of a prompt of ``tokens`` (``last_stats``: the previous generation's, which the
        planner learns from first)."""
        self.learn(last_stats)
        budget = self._streaming.cache.budget_bytes if self._streaming is not None else 0
        choice = choose(
            self._config.prefill, len(tokens), self._n_batch, self._layers(), self.rates(), budget,
            expert=self._em is not None,
        )
        self.last_choice = choice
        return self._calls(tokens, choice.chunk)

    def _calls(self, tokens: list[int], chunk: int) -> Iterator[list[int]]:
        streaming = self._streaming
        before = streaming.counters() if streaming is not None else None
        em = self._em
        expert = self.last_choice is not None and self.last_choice.strategy == "expert"
        t0 = time.perf_counter()
        try:
            if em is not None:
                em.enabled = expert
            for i in range(0, len(tokens), chunk):
                yield tokens[i : i + chunk]
        finally:
            if em is not None:
                em.enabled = False
        wall = time.perf_counter() - t0
        after = streaming.counters() if streaming is not None else None
        d = after - before if after is not None and before is not None else None
        rec = _PrefillRecord(
            len(tokens), chunk, wall, d.blocked_s if d else 0.0, d.hits - d.prefetch_useful if d else 0,
            d.hits + d.misses if d else 0, d.bytes_read if d else None,
        )
        self.last_prefill = rec
        compute = max(0.0, wall - rec.blocked_s)
        if chunk >= len(tokens) and len(tokens) >= 8:
            # One call over many tokens: its per-call overhead is spread thin.
            self.batch_token_s = compute / len(tokens)
        elif chunk == 1:
            self.decode_compute_s = compute / len(tokens)


__all__ = ["PrefillPlanner"]
