"""Pipeline trace replay: recorded routing driven through the live stages, with compute modelled.

Which cache size does a model need here, and what would a better policy buy? A replay answers
without running the model: every layer event of a route trace goes through the same routing gate,
prefetch (the cache and its policy), read lanes and ready stage a live run uses; only the compute
is modelled, as a sleep on the compute thread (the trace's own per-layer timings when it has
them, else a fixed time per layer), and with ``io="sim"`` the reads are modelled too, from a
probe of this machine's disk at the trace's expert size. Counts (hits, bytes) are deterministic;
the predicted tok/s is the wall time the replay took, so it is as noisy as the machine.

``timing="model"`` (``model_replay``) answers the same what-if without sleeping or threads: the
cache and its policy run exactly as in the staged replay (one plan per layer event, a trim per
llama_decode call), so hits, misses and bytes read are identical (``tests/test_replay.py``), and
time is computed rather than waited for: each missed slice goes, in the order the prefetch stage
issues them (projection by projection, then expert), to the lane that frees first, at the probed
per-lane bandwidth; compute follows the same overlap rules as the staged replay's modelled
decode. What it leaves out is what a staged replay measures beyond the model: the loop's hops
and thread wake-ups (tens to hundreds of microseconds per missed layer), so it predicts a
little higher tok/s than the staged replay of the same trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bmoe.engine.per_expert import PerExpertGate, PerExpertPrefetch
from bmoe.engine.streaming import Streamer, StreamParts, open_reader, recycling_fits
from bmoe.errors import BmoeError, DecodeAbortedError
from bmoe.io.direct import ShardReader
from bmoe.io.layout import ModelLayout
from bmoe.io.probe import ProbeResult, SimReader, cached_probe
from bmoe.io.recipes import recipe_for
from bmoe.pipeline.boundary import ComputeModes, OverlapPlan
from bmoe.pipeline.budget import Budget
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.events import PHASE_DECODE
from bmoe.pipeline.gate import RoutingGate
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.policies import make_policy
from bmoe.pipeline.trace import LayerEvent, RouteTrace
from bmoe.stages.bind import Residency, SimResidency
from bmoe.stages.compute import ComputeStage

MiB = 1 << 20


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    cache_mb: float
    decode_hit_pct: float | None
    hit_pct: float | None
    bytes_read: int
    tok_per_s: float | None  # predicted decode tok/s: decode tokens over the replay's decode wall time
    hits: int
    misses: int
    decode_tokens: int
    io: str
    overlap: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def tally(cls, cache: ExpertCache, budget_bytes: int, hits: list[int], misses: list[int], bytes_read: int,
              decode_tokens: int, decode_s: float, io: str, overlap: str) -> ReplayResult:
        """The result from per-phase hits and misses ([prefill, decode]) and the decode time."""

        def pct(h: int, m: int) -> float | None:
            return 100.0 * h / (h + m) if h + m else None

        return cls(
            policy=cache.policy_name, cache_mb=budget_bytes / MiB,
            decode_hit_pct=pct(hits[1], misses[1]), hit_pct=pct(sum(hits), sum(misses)),
            bytes_read=bytes_read, tok_per_s=decode_tokens / decode_s if decode_s > 0 else None,
            hits=sum(hits), misses=sum(misses), decode_tokens=decode_tokens, io=io, overlap=overlap,
        )


@dataclass(frozen=True)
class ComputeModel:
    """Seconds of compute after each layer event: the trace's timing, else a fixed time."""

    timing: dict[tuple[int, int, int, int], dict[str, float]]
    per_layer_s: float

    def __call__(self, ev: LayerEvent) -> float:
        t = self.timing.get((ev.turn, ev.phase, ev.step, ev.layer))
        return t["compute_us"] / 1e6 if t is not None else self.per_layer_s

    def describe(self) -> str:
        if self.timing:
            return "the trace's recorded per-layer compute times"
        return f"{self.per_layer_s * 1e3:g} ms per layer (--compute-ms-per-layer)"


def check_layout(trace: RouteTrace, layout: ModelLayout) -> dict[int, int]:
    """The model's per-layer expert bytes, refusing a model that is not the trace's."""
    entry = layout.entry_bytes()
    if (layout.n_layer, layout.n_expert) != (trace.n_layer, trace.n_expert) or entry != trace.expert_bytes:
        raise BmoeError(
            f"{layout.shards[0].name} does not match the trace's layout: model has {layout.n_layer} "
            f"layers x {layout.n_expert} experts of {sorted(set(entry.values()))} bytes, trace "
            f"{trace.n_layer} x {trace.n_expert} of {sorted(set(trace.expert_bytes.values()))} bytes"
        )
    return entry


OVERLAP_MODES = ("none", "tensor", "expert")
TIMING_MODES = ("model", "measure")


def _modelled_decode(
    gate: RoutingGate, compute: ComputeModel, overlap: str, n_proj: int
) -> Callable[[Sequence[LayerEvent]], None]:
    """The compute thread of a replay. A layer's compute is modelled as n_proj + 1 equal parts,
    one per expert projection's matmul and one for the rest of the layer; ``none`` waits for all
    of the layer's bytes first, ``tensor`` (what stock llama.cpp allows) waits for each projection
    before its matmul, ``expert`` (what a per-expert readiness hook in the kernel would allow)
    waits for each expert's slice before that expert's share of the matmul."""

    def decode(call: Sequence[LayerEvent]) -> None:
        clock = _ComputeClock()
        for ev in call:
            if gate.aborting:
                raise gate.error or DecodeAbortedError("replay aborted")
            ranks = None if ev.ranks is None else np.asarray(ev.ranks)[np.argsort(ev.experts, kind="stable")]
            gate.route(ev.layer, np.asarray(ev.experts, dtype=np.int32)[None, :], ranks)
            part = compute(ev) / (n_proj + 1)
            if overlap == "tensor":
                for p in range(n_proj):
                    if p:
                        gate.wait_proj(ev.layer, p)
                    clock.work(part)
            elif overlap == "expert":
                assert isinstance(gate, PerExpertGate)
                experts = sorted(set(ev.experts))
                for p in range(n_proj):
                    for e in experts:
                        gate.wait_expert(ev.layer, p, e)
                        clock.work(part / len(experts))
                gate.close_layer(ev.layer)
            else:
                clock.work(part * n_proj)
            clock.work(part)
        if gate.error is not None:
            raise gate.error

    return decode


class _ComputeClock:
    """Modelled compute against deadlines, not sleeps: a sleep's overshoot is absorbed by the next
    piece of work instead of adding up, so many sub-millisecond pieces cost what they model."""

    def __init__(self) -> None:
        self._until = time.perf_counter()

    def work(self, seconds: float) -> None:
        self._until = max(self._until, time.perf_counter()) + seconds
        delay = self._until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def _projections(arch: str) -> int:
    """Expert projections per layer of an architecture (3 when bmoe has no recipe for it); the
    trace does not say whether gate/up were fused, so the recipe's first (usual) layout."""
    try:
        return len(recipe_for(arch).layouts[0])
    except BmoeError:
        return 3


def _calls(events: Sequence[LayerEvent]) -> list[list[LayerEvent]]:
    calls: list[list[LayerEvent]] = [[]]
    for ev in events:
        calls[-1].append(ev)
        if ev.ends_call:
            calls.append([])
    return [c for c in calls if c]


def _modelled_layer(
    t0: float, compute_s: float, slices: Sequence[tuple[int, int, int]], lanes: int,
    lane_bytes_s: float, overlap: str, n_proj: int, experts: Sequence[int],
) -> float:
    """When one layer's compute ends, given its routing at ``t0`` and its missed ``slices``
    ((projection, expert, bytes), in issue order): each slice on the lane that frees first."""
    free = [t0] * lanes  # lanes are idle at a layer's routing: the previous layer waited for all
    ready: dict[tuple[int, int], float] = {}
    proj_ready = [t0] * n_proj
    for p, e, nbytes in slices:
        lane = min(range(lanes), key=free.__getitem__)
        free[lane] += nbytes / lane_bytes_s
        ready[p, e] = free[lane]
        proj_ready[p] = max(proj_ready[p], free[lane])
    part = compute_s / (n_proj + 1)
    t = t0
    if overlap == "tensor":
        for p in range(n_proj):
            t = max(t, proj_ready[p]) + part
    elif overlap == "expert":
        uniq = sorted(set(experts))
        for p in range(n_proj):
            for e in uniq:
                t = max(t, ready.get((p, e), t0)) + part / len(uniq)
    else:
        t = max([t, *proj_ready]) + part * n_proj
    return t + part


def model_replay(
    trace: RouteTrace,
    *,
    budget_bytes: int,
    policy: str,
    compute: ComputeModel,
    probe: ProbeResult,
    io_threads: int = 2,
    overlap: str = "none",
    consumption: Sequence[int] | None = None,
) -> ReplayResult:
    """One replay at one budget with one policy, its time computed instead of waited for.

    Hits and bytes are those of the staged replay (the same cache, policy and events); reads take
    ``nbytes / (probe bandwidth / probe lanes)`` on each of ``io_threads`` lanes; a layer's compute
    is split as in the staged replay's modelled decode. ``consumption`` is the order in which the
    graph consumes the projections (default: as stored)."""
    if overlap not in OVERLAP_MODES:
        raise BmoeError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {overlap!r}")
    if not 1 <= io_threads <= 64:
        raise BmoeError(f"io_threads must be 1..64, got {io_threads}")
    events = trace.layer_events()
    entry = dict(trace.expert_bytes)
    n_proj = _projections(trace.arch)
    residency = SimResidency(trace.n_layer, trace.n_expert, entry, n_proj)
    order = tuple(consumption) if consumption else tuple(range(n_proj))
    sizes = {il: [r.nbytes for r in residency.requests(il, 0)] for il in entry}
    lane_bytes_s = probe.mib_s * MiB / probe.lanes
    cache = ExpertCache(budget_bytes, entry, make_policy(policy, future=[(e.layer, e.experts) for e in events]))
    hits = [0, 0]
    misses = [0, 0]
    read = 0
    decode_s = 0.0
    decode_tokens = 0
    for call in _calls(events):
        phase = 1 if call[0].phase == PHASE_DECODE else 0
        t = 0.0
        for ev in call:
            plan = cache.plan(ev.layer, ev.experts, ev.ranks)
            hits[phase] += len(plan.hits)
            misses[phase] += len(plan.misses)
            size = sizes[ev.layer]
            slices = [(p, e, size[p]) for p in order for e in plan.misses]
            read += len(plan.misses) * entry[ev.layer]
            t = _modelled_layer(t, compute(ev), slices, io_threads, lane_bytes_s, overlap, n_proj, ev.experts)
        cache.trim()
        if phase:
            decode_s += t
            decode_tokens += 1

    io = f"modelled ({probe.mode} probe, {probe.mib_s:.0f} MiB/s over {probe.lanes} lanes; no sleeps)"
    return ReplayResult.tally(cache, budget_bytes, hits, misses, read, decode_tokens, decode_s, io, overlap)


async def replay(
    trace: RouteTrace,
    *,
    budget_bytes: int,
    policy: str,
    compute: ComputeModel,
    io_threads: int = 2,
    model: ModelLayout | None = None,
    sim_dir: Path | None = None,
    odirect: bool = True,
    overlap: str = "none",
) -> ReplayResult:
    """One replay at one budget with one policy; reads from ``model`` (real) or modelled (sim)."""
    events = trace.layer_events()
    if overlap not in OVERLAP_MODES:
        raise BmoeError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {overlap!r}")
    if model is not None:
        entry = check_layout(trace, model)
        residency: Residency | SimResidency = Residency(model, None, recycle=recycling_fits(model, budget_bytes))
        reader: ShardReader | SimReader = open_reader(model, odirect)
        io = reader.mode
    else:
        entry = dict(trace.expert_bytes)
        residency = SimResidency(trace.n_layer, trace.n_expert, entry, _projections(trace.arch))
        probe = cached_probe(sim_dir or Path.cwd(), max(entry.values()), io_threads)
        reader = SimReader(probe)
        io = reader.mode
    cache = ExpertCache(budget_bytes, entry, make_policy(policy, future=[(e.layer, e.experts) for e in events]))
    n_proj = residency.n_proj(trace.moe_layers[0])
    modes = ComputeModes(overlap=OverlapPlan.in_order(trace.moe_layers, n_proj) if overlap == "tensor" else None)
    parts = StreamParts(residency, reader, cache, Budget(budget_bytes, "replay"))
    if overlap == "expert":
        streamer = Streamer(parts, Hooks(), io_threads, modes, gate_type=PerExpertGate, prefetch_type=PerExpertPrefetch)
    else:
        streamer = Streamer(parts, Hooks(), io_threads, modes)
    gate = streamer.gate
    stage = ComputeStage(_modelled_decode(gate, compute, overlap, n_proj), gate.arm, gate.disarm, gate.abort)
    hits = [0, 0]
    misses = [0, 0]
    decode_s = 0.0
    decode_tokens = 0
    try:
        for step, call in enumerate(_calls(events)):
            phase = 1 if call[0].phase == PHASE_DECODE else 0
            h0, m0 = cache.hits, cache.misses
            t0 = time.perf_counter()
            await stage.decode(call, step, call[0].phase, streamer.serve)
            streamer.end_step()
            if phase:
                decode_s += time.perf_counter() - t0
                decode_tokens += 1
            hits[phase] += cache.hits - h0
            misses[phase] += cache.misses - m0
    finally:
        stage.close()
        streamer.close()
    read = streamer.read.counters.slice_bytes

    return ReplayResult.tally(cache, budget_bytes, hits, misses, read, decode_tokens, decode_s, io, overlap)
