"""Replay a recorded route trace through an ``ExpertCache`` the way the engine drives it, and
score a policy by hits and bytes read: the offline what-if behind ``bench/policies.py`` and the
policy tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

from bmoe.pipeline.cache import EvictionPolicy, ExpertCache
from bmoe.pipeline.policies import make_policy
from bmoe.pipeline.trace import LayerEvent, RouteTrace


@dataclass(frozen=True)
class SimResult:
    policy: str
    budget_bytes: int
    decode_hit_pct: float
    hit_pct: float
    bytes_read: int
    hits: int
    misses: int
    decode_hits: int
    decode_misses: int
    max_resident_bytes: int  # highest resident bytes seen after a trim (must be <= the budget)


PolicySpec = Union[str, Callable[[Sequence[LayerEvent]], EvictionPolicy]]


def simulate(
    trace: RouteTrace,
    policy: PolicySpec,
    budget_bytes: int,
    *,
    events: Sequence[LayerEvent] | None = None,
) -> SimResult:
    """Replay ``trace`` through an ``ExpertCache`` the way the engine drives it.

    One ``plan`` per layer event (a prefill ubatch is one event per layer with the union of its
    experts), a ``trim`` after every llama_decode call. ``policy`` is a registry name or a factory
    taking the event list. Pass ``events`` (``trace.layer_events(...)``) to reuse or vary them.
    """
    evs = trace.layer_events() if events is None else events
    if isinstance(policy, str):
        name = policy
        pol = make_policy(name, future=[(e.layer, e.experts) for e in evs])
    else:
        pol = policy(evs)
    cache = ExpertCache(budget_bytes, trace.expert_bytes, pol)
    eb = trace.expert_bytes
    hits = [0, 0]
    misses = [0, 0]
    read = 0
    worst = 0
    plan = cache.plan
    for ev in evs:
        p = plan(ev.layer, ev.experts, ev.ranks)
        d = 1 if ev.phase == 1 else 0
        hits[d] += len(p.hits)
        n_miss = len(p.misses)
        misses[d] += n_miss
        read += n_miss * eb[ev.layer]
        if ev.ends_call:
            cache.trim()
            if cache.resident_bytes > worst:
                worst = cache.resident_bytes
    h, m = sum(hits), sum(misses)
    return SimResult(
        policy=pol.name,
        budget_bytes=budget_bytes,
        decode_hit_pct=100.0 * hits[1] / (hits[1] + misses[1]) if hits[1] + misses[1] else 0.0,
        hit_pct=100.0 * h / (h + m) if h + m else 0.0,
        bytes_read=read,
        hits=h,
        misses=m,
        decode_hits=hits[1],
        decode_misses=misses[1],
        max_resident_bytes=worst,
    )
