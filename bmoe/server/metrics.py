"""Server metrics in Prometheus text format (prometheus_client, one private registry per app).

Counters add up every generation; the gauges say what the last generation measured; histograms
give the spread of a request's latency, its first token's and its prompt's evaluation. A figure the
engine could not measure (a resident model reads no experts) is left out of the sums and its gauge
reads NaN, never 0. No ``_created`` series: each counter's second line said only when the server
started (``disable_created_metrics``, process-wide, as the server owns its process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

disable_created_metrics()
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sequences per decode step
MiB = 1 << 20
# Seconds: from a local answer in a blink to a model bigger than RAM evaluating a long prompt.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float], budget_bytes: Callable[[], float] = lambda: math.nan,
                 bodies_held: Callable[[], float] = lambda: 0, steps: Callable[[], Any] = lambda: None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(_StepCollector(steps))
        self.requests = Counter("bmoe_requests", "Completion requests by outcome", ["outcome"], registry=r)
        self.generated = Counter("bmoe_completion_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("bmoe_prompt_tokens", "Prompt tokens received", registry=r)
        self.reused = Counter("bmoe_prompt_tokens_reused", "Prompt tokens found in the context (not evaluated)", registry=r)
        self.decode_seconds = Counter("bmoe_decode_seconds", "Wall time of decode steps after prefill", registry=r)
        self.bytes_read = Counter("bmoe_expert_bytes_read", "Expert bytes read from the model file", registry=r)
        self.stall_ms = Counter("bmoe_stall_milliseconds", "Compute thread time spent waiting on expert reads", registry=r)
        self.cache_hits = Counter("bmoe_cache_hits", "Routed experts found in the cache", registry=r)
        # Not "misses": reads include read-ahead, so hits / (hits + reads) is not the hit rate. The
        # hit rate is hits / routed (what bmoe_cache_hit_percent shows).
        self.experts_routed = Counter("bmoe_experts_routed", "Routed experts the cache served (hits, misses, read ahead)",
                                     registry=r)
        self.experts_read = Counter("bmoe_experts_read", "Experts read from the model file, on demand or ahead of need",
                                    registry=r)
        self.tok_per_s = Gauge("bmoe_tokens_per_second", "Decode tokens per second of the last generation", registry=r)
        self.hit_pct = Gauge("bmoe_cache_hit_percent", "Cache hit % over the server's life", registry=r)
        self.queue = Gauge("bmoe_queue_depth", "Requests waiting for their turn", registry=r)
        self.budget = Gauge("bmoe_cache_budget_bytes", "The expert cache budget now (the pressure guard moves it)",
                            registry=r)
        self.bodies = Gauge("bmoe_request_bodies_held", "Requests being read, parsed or checked (bounded; more get 503)",
                            registry=r)
        self.latency = Histogram("bmoe_request_seconds", "Completion requests: arrival to the last byte sent",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("bmoe_first_token_seconds",
                                     "Completion requests: arrival to the first generated token (waiting included)",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("bmoe_queue_seconds",
                                    "Sequences decoded together (--parallel): each generation's wait for a free slot",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_eval = Histogram("bmoe_prompt_eval_seconds", "Prompt evaluation (prefill) of each generation",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue.set_function(queue_depth)
        self.bodies.set_function(bodies_held)
        self.budget.set_function(budget_bytes)  # read at each scrape, as the queue depth is
        self.tok_per_s.set(math.nan)
        self.hit_pct.set(math.nan)
        self._hits = self._used = 0
        self.tokens_total = 0  # generated over the server's life (what /stats shows)
        self.last_stats: Any = None  # the last generation that ended (the session's may be running)

    def record(self, stats: Any, usage: Any) -> None:
        """One finished (or cancelled) generation: its GenerationStats and Usage."""
        if usage is not None:
            self.tokens_total += usage.completion_tokens
            self.generated.inc(usage.completion_tokens)
            self.prompt.inc(usage.prompt_tokens)
            self.reused.inc(usage.prompt_reused)
        if stats is None:
            return
        self.last_stats = stats
        self.prompt_eval.observe(stats.prefill_s)
        self.tok_per_s.set(math.nan if stats.tok_per_s is None else stats.tok_per_s)
        if stats.queue_s is not None:
            # One of several sequences: its pipeline counters cover every step it shared with the
            # others, so they would be counted once per sequence; the step loop's own totals
            # (bmoe_step_*) count them once.
            self.queue_time.observe(stats.queue_s)
            return
        self.decode_seconds.inc(stats.decode_s)
        if stats.bytes_read is not None:
            self.bytes_read.inc(stats.bytes_read)
        if stats.blocked_s is not None:
            self.stall_ms.inc(stats.blocked_s * 1e3)
        if stats.cache_hits is not None and stats.experts_read is not None and stats.experts_routed is not None:
            self.cache_hits.inc(stats.cache_hits)
            self.experts_routed.inc(stats.experts_routed)
            self.experts_read.inc(stats.experts_read)
            self._hits += stats.cache_hits
            self._used += stats.experts_routed
            self.hit_pct.set(100.0 * self._hits / self._used if self._used else math.nan)

    @property
    def life_hit_pct(self) -> float | None:
        return 100.0 * self._hits / self._used if self._used else None

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StepCollector:
    """The step loop's totals (``bmoe.engine.scheduler.StepFigures``), read at each scrape: decode
    steps by how many sequences they held, tokens they gave, expert bytes they read and MiB read
    per generated token. Nothing while no step loop runs (``--parallel 1`` without drafts)."""

    def __init__(self, figures: Callable[[], Any]) -> None:
        self._figures = figures

    def describe(self) -> list:
        return []  # the families exist only with a step loop: nothing to announce up front

    def collect(self):  # noqa: ANN201 - prometheus metric families
        f = self._figures()
        if f is None:
            return
        counts = f.batch_counts
        buckets, running = [], 0
        for edge in BATCH_BUCKETS:
            running = sum(n for size, n in counts.items() if size <= edge)
            buckets.append((str(edge), running))
        total = sum(counts.values())
        buckets.append(("+Inf", total))
        h = HistogramMetricFamily("bmoe_step_batch_size", "Sequences per decode step (--parallel)")
        h.add_metric([], buckets, sum_value=sum(size * n for size, n in counts.items()))
        yield h
        yield CounterMetricFamily("bmoe_step_decode_tokens", "Tokens given by decode steps (drafts kept included)",
                                  value=f.emitted_tokens)
        yield CounterMetricFamily("bmoe_step_prompt_steps", "Prompt chunks evaluated by the step loop",
                                  value=f.prompt_steps)
        read = f.decode_bytes_read
        yield CounterMetricFamily("bmoe_step_expert_bytes_read", "Expert bytes read by decode steps (streamed)",
                                  value=math.nan if read is None else read)
        per = read / MiB / f.emitted_tokens if read is not None and f.emitted_tokens else math.nan
        yield GaugeMetricFamily("bmoe_mib_read_per_token", "Expert MiB read per generated token, decode steps, ever",
                                value=per)
