"""The streaming side of a session: expert regions, the reader, the cache and the stages over them.

Built once at open when the session streams; each decode call asks ``serve`` for the stage
coroutines that answer its routing events, and ``end_step`` brings the cache back under its budget
between decode calls.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from bmoe.engine.config import RunConfig
from bmoe.io.direct import ShardReader
from bmoe.io.layout import ModelLayout
from bmoe.io.regions import map_count_limit
from bmoe.metrics.stats import Counters
from bmoe.pipeline.budget import Budget, read_meminfo, resolve_budget
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import RoutingEvent
from bmoe.pipeline.gate import RoutingGate
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.policies import make_policy
from bmoe.pipeline.profile import load_profile, save_profile
from bmoe.pipeline.readiness import ReadinessBoard
from bmoe.stages.bind import BindStage, Residency, SimResidency
from bmoe.stages.prefetch import PrefetchStage
from bmoe.stages.read import Reader, ReadStage


def open_reader(layout: ModelLayout, direct: bool) -> ShardReader:
    """A reader of the model's shards, its O_DIRECT checked on one expert slice (or turned off)."""
    reader = ShardReader(layout.shards, direct=direct)
    first = layout.layer_experts(layout.moe_layers[0])[0]
    try:
        reader.verify(first.span.shard, first.span.offset, first.stride)
    except BaseException:
        reader.close()
        raise
    return reader


def recycling_fits(layout: ModelLayout, budget_bytes: int) -> bool:
    """Whether moving pages between expert slots may split the regions' mappings: each resident
    expert can cost a few mappings per projection, and the process's map count limit must keep
    most of its room for llama.cpp and the allocator (a refused mapping there is a crash)."""
    entries = max(budget_bytes // min(layout.entry_bytes().values()), layout.n_expert)
    n_proj = len(layout.layer_experts(layout.moe_layers[0]))
    return entries * n_proj * 2 <= map_count_limit() // 2


class Streamer:
    """Owns what streaming needs; ``close`` restores llama.cpp's expert pointers first.

    Built from parts so that a trace replay runs the very same stages over a simulated residency
    and reader; ``Streamer.live`` builds the parts of a live session.
    """

    def __init__(
        self, residency: Residency | SimResidency, reader: Reader, cache: ExpertCache, gate: RoutingGate,
        hooks: Hooks, io_threads: int, budget: Budget,
    ) -> None:
        self.residency = residency
        self.reader = reader
        self.cache = cache
        self.budget = budget
        self.lanes = ThreadPoolExecutor(io_threads, thread_name_prefix="bmoe-io")
        self.board = ReadinessBoard()
        self.prefetch = PrefetchStage(cache, residency, self.board, gate.fast_hits, hooks)
        self.read = ReadStage(reader, self.lanes, io_threads, self.board, hooks)
        self.bind = BindStage(residency)
        self._gate = gate
        self.trim_s = 0.0
        gate.set_resident_maps(residency.maps)
        residency.bind()

    @classmethod
    def live(
        cls, layout: ModelLayout, tensors: dict[tuple[int, str], int], config: RunConfig,
        gate: RoutingGate, hooks: Hooks,
    ) -> Streamer:
        meminfo = read_meminfo()
        budget = resolve_budget(
            config.cache_bytes,
            ceiling=config.cache_ceiling_bytes,
            mem_available=meminfo.get("MemAvailable", 0),
            mem_total=meminfo.get("MemTotal", 0),
            dense_bytes=layout.dense_bytes,
            expert_bank_bytes=layout.expert_bytes,
            working_set_bytes=layout.expert_bytes_per_token(),
        )
        policy = make_policy(config.cache_policy)
        if config.cache_profile and os.path.exists(config.cache_profile) and hasattr(policy, "seed"):
            policy.seed(load_profile(config.cache_profile, n_layer=layout.n_layer, n_expert=layout.n_expert))
        cache = ExpertCache(budget.bytes, layout.entry_bytes(), policy)
        residency = Residency(layout, tensors, recycle=recycling_fits(layout, budget.bytes))
        try:
            reader = open_reader(layout, config.odirect)
        except BaseException:
            residency.close()
            raise
        streamer = cls(residency, reader, cache, gate, hooks, config.io_threads, budget)
        streamer.prefetch.lookahead = config.prefetch_layers
        return streamer

    def counters(self) -> Counters:
        c = self.cache
        return Counters(
            self.read.counters.slices, self.read.counters.bytes_read, self.read.counters.busy_s,
            self.bind.read_wall_s, self._gate.blocked_s, self.prefetch.cache_s + self.trim_s,
            c.misses, c.hits, c.evictions,
            self.read.counters.speculative_bytes, c.speculated, c.speculation_useful,
            self.residency.recycled_bytes,
        )

    def serve(self, events: Channel[RoutingEvent]) -> list:
        reads: Channel = Channel()
        binds: Channel = Channel()
        return [self.prefetch.run(events, reads, binds), self.read.run(reads), self.bind.run(binds)]

    def end_step(self) -> None:
        """Between decode steps: account fast-path hits and evict down to the budget."""
        t0 = time.perf_counter()
        self.prefetch.account_fast_hits()
        self.prefetch.evict(self.cache.trim())
        self.trim_s += time.perf_counter() - t0

    def save_profile(self, path: str, layout: ModelLayout) -> None:
        """What the policy learned about the model's routing, for the next run (if it keeps any)."""
        policy = self.cache.policy
        if hasattr(policy, "usage"):
            save_profile(path, policy.usage(), model=layout.shards[0].name, n_layer=layout.n_layer,
                         n_expert=layout.n_expert, tokens=int(getattr(policy, "steps", 0)))

    def close(self) -> None:
        self.lanes.shutdown(wait=True)
        self.residency.close()
        self.reader.close()
