"""The streaming side of a session: expert regions, the reader, the cache and the stages over them.

Built once at open when the session streams; each decode call asks ``serve`` for the stage
coroutines that answer its routing events, and ``end_step`` brings the cache back under its budget
between decode calls. The budget is sized at open from a model of what else the process needs
(``measure_needs``), and the pressure guard moves it while running: ``tick`` runs between layers
(at each routing event, on the cache writer's side, and between decode calls), never in the eval
callback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from bmoe.engine.config import RunConfig
from bmoe.errors import BudgetError, ConfigError
from bmoe.io.direct import ShardReader
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout
from bmoe.io.regions import WarmPool, map_count_limit
from bmoe.metrics.stats import Counters
from bmoe.pipeline.boundary import SERIAL, ComputeModes, FastPath
from bmoe.pipeline.budget import (
    Budget,
    Needs,
    guard_ceiling,
    needs_from,
    parse_smaps,
    read_memory,
    resolve_budget,
    transient_bytes,
)
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import GateItem, ReadItem
from bmoe.pipeline.gate import RoutingGate
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.policies import make_policy
from bmoe.pipeline.pressure import BudgetChange, GuardSettings, PressureGuard
from bmoe.pipeline.profile import load_profile, prewarm_order, save_profile
from bmoe.pipeline.readiness import ReadinessBoard
from bmoe.stages.bind import Residency, SimResidency
from bmoe.stages.prefetch import PrefetchStage
from bmoe.stages.read import Reader, ReadStage, limit_reads
from bmoe.stages.ready import LayerReads, ReadyStage


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


def read_smaps() -> str:
    try:
        with open("/proc/self/smaps") as f:
            return f.read()
    except OSError:
        return ""  # no smaps (not Linux, or hidden): buffers and code count as 0, the margin remains


def measure_needs(
    layout: ModelLayout, *, dense_in_file: bool, union_tokens: int, mem_total: int,
    expert_data: Sequence[tuple[int, int]] = (),
) -> Needs:
    """What the process needs besides the cache, measured now (after the model and its context
    are made, before the expert regions are reserved: their address space is not a need).
    ``union_tokens``: the most tokens whose experts one layer may hold at once (a batch; one where
    every layer can run expert-major). ``expert_data``: [start, end) of where the open put each
    expert tensor's bytes (never touched once rebound)."""
    smaps = parse_smaps(read_smaps(), [str(p) for p in layout.shards], expert_data)
    transient = transient_bytes(layout.n_expert, layout.n_expert_used, union_tokens, max(layout.entry_bytes().values()))
    return needs_from(smaps=smaps, dense_bytes=layout.dense_bytes, dense_in_file=dense_in_file,
                      transient=transient, mem_total=mem_total)


FRESH_LANES = 2  # read lanes per configured one while reads land in fresh pages (Streamer.lanes_now)


@dataclass(eq=False)
class StreamParts:
    """The memory and I/O side of streaming, made before any stage: the expert regions (bound:
    llama.cpp's expert tensors point at them from now on), the reader, the cache and its budget.

    Made apart from the stages so that a session can settle the run's modes in between: overlap's
    wait points come from a warm-up decode, which needs the regions bound, and a route trace's run
    line names the budget and the reader. A trace replay makes its own, simulated or not."""

    residency: Residency | SimResidency
    reader: Reader
    cache: ExpertCache
    budget: Budget
    guard: PressureGuard | None = None
    prewarm: tuple[tuple[int, int], ...] = ()  # a profile's experts to read into free room, best first

    @classmethod
    def live(
        cls, layout: ModelLayout, tensors: dict[tuple[int, str], int], config: RunConfig, *,
        dense_in_file: bool = True, union_tokens: int = 512,
    ) -> StreamParts:
        """``dense_in_file``: the dense weights live in llama.cpp's file mapping (or are still to be
        copied), not in anonymous memory the open already filled."""
        memory = read_memory()  # the host's, or the container's where its cgroup limits it
        mem_total = memory.total
        nbytes = {(il, et.suffix): et.span.nbytes for il in layout.moe_layers for et in layout.layer_experts(il)}
        expert_data = [(data, data + nbytes[key]) for key, addr in tensors.items()
                       if (data := GgmlTensor.from_address(addr).data) and key in nbytes]
        needs = measure_needs(layout, dense_in_file=dense_in_file, union_tokens=union_tokens, mem_total=mem_total,
                              expert_data=expert_data)
        budget = resolve_budget(
            config.cache_bytes,
            ceiling=config.cache_ceiling_bytes,
            mem_available=memory.available,
            source=memory.how,
            needs=needs,
            expert_bank_bytes=layout.expert_bytes,
            working_set_bytes=layout.expert_bytes_per_token(),
            force=config.force_cache,
        )
        guard = None
        if config.pressure_guard and budget.bytes > 0:
            top = guard_ceiling(budget.bytes, requested=config.cache_bytes, needs=needs,
                                expert_bank_bytes=layout.expert_bytes, ceiling=config.cache_ceiling_bytes)
            guard = PressureGuard(top, GuardSettings.around(needs.margin + needs.kept_pages))
        policy = make_policy(config.cache_policy)
        if config.prewarm and not hasattr(policy, "seed"):
            raise ConfigError(f"prewarm needs a cache policy that learns usage; {config.cache_policy!r} does not")
        prewarm: tuple[tuple[int, int], ...] = ()
        if config.cache_profile and os.path.exists(config.cache_profile) and hasattr(policy, "seed"):
            profile = load_profile(config.cache_profile, n_layer=layout.n_layer, n_expert=layout.n_expert)
            policy.seed(profile.usage, visits=profile.visits)
            if config.prewarm:
                prewarm = tuple(prewarm_order(profile.usage, layout.entry_bytes(), budget.bytes))
        cache = ExpertCache(budget.bytes, layout.entry_bytes(), policy)
        recycle = recycling_fits(layout, budget.bytes)
        pool = None
        if config.warm_pool and recycle and budget.bytes > 0:
            pool = WarmPool(budget.bytes, lambda: cache.budget_bytes, lambda: cache.resident_bytes)
        try:
            residency = Residency(layout, tensors, recycle=recycle, shared=budget.bytes == 0, pool=pool)
        except BaseException:
            if pool is not None:
                pool.close()
            raise
        try:
            reader = limit_reads(open_reader(layout, config.odirect), config.disk_limit_mib_s, layout.shards)
        except BaseException:
            residency.close()
            raise
        residency.bind()
        return cls(residency, reader, cache, budget, guard, prewarm)

    def close(self) -> None:
        """Restore llama.cpp's expert pointers, free the regions, close the reader."""
        self.residency.close()
        self.reader.close()


class Streamer:
    """Owns what streaming needs; ``close`` restores llama.cpp's expert pointers first.

    Built from parts so that a trace replay runs the very same stages over a simulated residency
    and reader. ``modes`` are the run's, fixed for its life: the routing gate (``gate``, which the
    compute side routes through) and the prefetch stage are made from them. ``gate_type`` and
    ``prefetch_type``: a replay's modelled per-expert overlap brings its own
    (``bmoe.engine.per_expert``).
    """

    def __init__(
        self, parts: StreamParts, hooks: Hooks, io_threads: int, modes: ComputeModes = SERIAL, *,
        gate_type: type[RoutingGate] = RoutingGate, prefetch_type: type[PrefetchStage] = PrefetchStage,
    ) -> None:
        self.residency = residency = parts.residency
        self.reader = parts.reader
        self.cache = cache = parts.cache
        self.budget = parts.budget
        self.guard = parts.guard
        self.modes = modes
        fast_path = FastPath.over(residency.maps)
        self.gate = gate_type(modes, fast_path, self.reads_in)
        self.io_threads = io_threads
        self._entry_bytes = residency.entry_bytes()
        self._largest_entry = max(self._entry_bytes.values(), default=0)
        self.lanes = ThreadPoolExecutor(FRESH_LANES * io_threads, thread_name_prefix="bmoe-io")
        self.board = ReadinessBoard()
        self.prefetch = prefetch_type(cache, residency, self.board, fast_path.hits, hooks, modes,
                                      between_layers=self.tick)
        if parts.prewarm:
            self.prefetch.prewarm(parts.prewarm)
        self.read = ReadStage(self.reader, self.lanes, self.lanes_now, self.board, hooks)
        self.ready = ReadyStage(residency)
        self.trim_s = 0.0
        self.budget_changes: list[BudgetChange] = []

    def reads_in(self, layer: int, seconds: float) -> int | None:
        """At most how many of ``layer``'s experts land in ``seconds``: a lane's measured rate so
        far (bytes over the lanes' summed time inside reads; bytes over the layers' wait time
        would count read-ahead that landed outside any wait) times the lanes this call reads on.
        An upper bound, lanes contend for the device (measured on a cold 50-token prompt at full
        depth: 937 MB/s a lane, four lanes, about 1.6 GB/s in all), and the safe side for a cut:
        one too short loses overlap, one too long only reads a few more guesses. None before any
        read. Called on the compute thread: it only reads counters."""
        counters, entry = self.read.counters, self._entry_bytes.get(layer)
        if counters.busy_s <= 0 or counters.bytes_read <= 0 or not entry:
            return None
        rate = counters.bytes_read / counters.busy_s * self.lanes_now()
        return max(0, int(seconds * rate / entry))

    def counters(self) -> Counters:
        c = self.cache
        return Counters(
            self.read.counters.slices, self.read.counters.bytes_read, self.read.counters.busy_s,
            self.ready.read_wall_s, self.gate.blocked_s, self.prefetch.cache_s + self.trim_s,
            c.misses, c.hits, c.evictions,
            self.read.counters.speculative_bytes, c.speculated, c.speculation_useful,
            self.residency.recycled_bytes, len(self.budget_changes),
        )

    def serve(self, events: Channel[GateItem]) -> list:
        reads: Channel[ReadItem] = Channel()
        layers: Channel[LayerReads] = Channel()
        return [self.prefetch.run(events, reads, layers), self.read.run(reads), self.ready.run(layers)]

    def lanes_now(self) -> int:
        """Read lanes for the decode call about to run: twice the configured number while its
        misses land in pages faulted in on the read (a fresh cache with room for another expert
        beyond what the warm pool has ready: no evicted pages to recycle; or no recycling at all). A lane then spends
        about as long faulting the slice's pages in as the transfer takes (0.73 s/GiB first touch
        against 0.62 s/GiB at 1.6 GB/s on the bench machine), so twice the lanes keep as many
        transfers in flight. Measured there, 2 -> 4 lanes: reads into fresh pages 1130 -> 1515-1730
        MiB/s; a cold 5-token prompt 3.0-3.6 -> 2.8-3.2 s (``docs/facts.md``)."""
        residency = self.residency
        if not isinstance(residency, Residency) or residency.shared:
            return self.io_threads  # modelled reads, or one shared set of slots (populated after one call)
        pool = residency.pool
        spare = pool.spare_bytes if pool is not None else 0
        room = self.cache.budget_bytes - self.cache.resident_bytes - spare  # what misses fill unrecycled
        fresh = not residency.recycle or room >= self._largest_entry
        return FRESH_LANES * self.io_threads if fresh else self.io_threads

    def end_step(self) -> None:
        """Between decode steps: account fast-path hits, let the guard move the budget, and evict
        down to it."""
        t0 = time.perf_counter()
        self.gate.drain_native()
        self.prefetch.account_fast_hits()
        self.tick()
        self.prefetch.evict(self.cache.trim())
        self.trim_s += time.perf_counter() - t0

    def save_profile(self, path: str, layout: ModelLayout) -> None:
        """What the policy learned about the model's routing, for the next run (if it keeps any)."""
        policy = self.cache.policy
        if hasattr(policy, "usage"):
            save_profile(path, policy.usage(), model=layout.shards[0].name, n_layer=layout.n_layer,
                         n_expert=layout.n_expert, tokens=int(getattr(policy, "steps", 0)),
                         visits=policy.evidence())

    def tick(self) -> BudgetChange | None:
        """Between layers (no layer pinned, fast-path hits accounted): ask the guard, and on a
        change evict down to the new budget at once, so the promise holds from this layer on.
        The change, if any."""
        guard = self.guard
        if guard is None:
            return None
        # The warm pool's spare pages are the cache's to be, already out of MemAvailable: counted
        # as unfilled budget too, they would read as another program's memory (a false shrink).
        pool = self.residency.pool
        spare = pool.spare_bytes if pool is not None else 0
        change = guard.poll(self.cache.budget_bytes, self.cache.resident_bytes + spare)
        if change is None:
            return None
        change = replace(change, step=self.gate.step)
        self.budget_changes.append(change)
        self.prefetch.evict(self.cache.set_budget(change.new))
        return change

    def pause_pool(self) -> None:
        """A generation runs: the warm pool (if any) faults nothing in meanwhile."""
        if self.residency.pool is not None:
            self.residency.pool.pause()

    def resume_pool(self) -> None:
        if self.residency.pool is not None:
            self.residency.pool.resume()

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget from the caller (between generations): also the guard's new ceiling."""
        if budget_bytes > 0 and getattr(self.residency, "shared", False):
            raise BudgetError("this session was opened with the cache off: every layer shares one set of expert "
                              "slots, so it cannot cache; open it with a cache budget instead")
        self.prefetch.evict(self.cache.set_budget(budget_bytes))
        if self.guard is not None:
            self.guard.ceiling = budget_bytes

    def budget_changes_since(self, count: int) -> list[BudgetChange]:
        return self.budget_changes[count:]

    def close(self) -> None:
        self.lanes.shutdown(wait=True)
        self.residency.close()
        self.reader.close()
