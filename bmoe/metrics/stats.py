"""What one generation measured, and how.

Wall times come from ``time.perf_counter`` around whole phases; read figures are counted by the
read stage (bytes transferred from the file, which under O_DIRECT include the page-aligned
superset); figures a mode cannot measure are None ("unmeasured"), never 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Counters:
    """Monotonic pipeline counters, snapshotted around a token or a generation."""

    slices: int = 0
    bytes_read: int = 0
    busy_s: float = 0.0
    read_wall_s: float = 0.0
    blocked_s: float = 0.0
    cache_s: float = 0.0
    misses: int = 0
    hits: int = 0
    evictions: int = 0
    speculative_bytes: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    recycled_bytes: int = 0
    budget_changes: int = 0  # how many times the pressure guard moved the budget

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


@dataclass
class GenerationStats:
    mode: str
    io_mode: str | None  # "odirect" / "buffered" when streaming, None when resident
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # summed wall time of the decode calls after prefill (not the caller's)
    # Those decode calls. One per token after the first, and one more when the generation ends
    # with the model's end token: that call's time is in decode_s, so it counts as a step.
    decode_steps: int = 0
    # The cache's figures count every (layer, expert) once per use, all projections together. A
    # read ahead of need (prompt read-ahead, predicted or profile prewarm, a prompt read in
    # chunks) is a read, not a hit, even when its layer then finds it resident: the hit rate
    # says what the cache saved, and bytes read always match experts read.
    experts_read: int | None = None  # entries read, on demand or ahead of need
    experts_routed: int | None = None  # routed entries the cache served (hits, misses, read ahead)
    slices_read: int | None = None  # (layer, projection, expert) reads
    bytes_read: int | None = None  # bytes transferred from the model file(s)
    read_busy_s: float | None = None  # summed time the I/O lanes spent inside reads
    read_wall_s: float | None = None  # summed per layer: reads issued -> last read landed
    blocked_s: float | None = None  # compute thread waiting on the pipeline (reads + hops)
    cache_hits: int | None = None  # routed entries found resident and not read ahead for the use
    cache_evictions: int | None = None
    cache_s: float | None = None  # cache writer time: planning, evicting, trimming
    budget_bytes: int | None = None  # at the start of the generation
    budget_bytes_end: int | None = None  # at its end (the pressure guard may move it)
    # Each move of the budget by the pressure guard: t (monotonic s), old, new, why, step.
    budget_changes: list[dict[str, object]] | None = None
    resident_cache_bytes: int | None = None  # at the end of the generation
    speculative_bytes: int | None = None  # of bytes_read, read ahead of need (prefetch)
    prefetch_issued: int | None = None  # experts read ahead into the cache
    prefetch_useful: int | None = None  # of those, later routed while still cached
    recycled_bytes: int | None = None  # read into pages moved over from evicted experts, not faulted in
    # Predictive read-ahead: per MoE layer, share of its routed experts the predictor named one
    # layer early (decode steps of this session so far).
    predict_accuracy_pct: dict[int, float] | None = None
    # How the prompt ran (``--prefill``; auto's choice): batch, expert, micro or token, and why.
    prefill_strategy: str | None = None
    prefill_reason: str | None = None
    open_mode: str | None = None
    # Who filters graph nodes for the eval callback: "c", "python: <why not c>", None (no callback).
    node_filter: str | None = None
    open_bytes_read: int | None = None  # /proc/self/io read_bytes across Session.open
    # Drafts (``draft="ngram"``): tokens drafted and verified, and how many the draws kept (None:
    # no drafts ran). In a step shared with other sequences (``parallel``), the pipeline counters
    # above cover every step this generation took part in, the others' tokens included.
    draft_tokens: int | None = None
    draft_accepted: int | None = None
    # Sequences decoded together (``parallel``): seconds this generation waited for a free slot.
    queue_s: float | None = None

    def add_counters(self, c: Counters) -> None:
        self.slices_read, self.bytes_read, self.read_busy_s = c.slices, c.bytes_read, c.busy_s
        self.read_wall_s, self.blocked_s, self.cache_s = c.read_wall_s, c.blocked_s, c.cache_s
        self.experts_read = c.misses + c.prefetch_issued
        self.cache_hits, self.experts_routed = c.hits - c.prefetch_useful, c.hits + c.misses
        self.cache_evictions = c.evictions
        self.speculative_bytes = c.speculative_bytes
        self.prefetch_issued, self.prefetch_useful = c.prefetch_issued, c.prefetch_useful
        self.recycled_bytes = c.recycled_bytes

    @property
    def cache_hit_pct(self) -> float | None:
        if self.cache_hits is None or not self.experts_routed:
            return None
        return 100.0 * self.cache_hits / self.experts_routed

    @property
    def tok_per_s(self) -> float | None:
        """Decode tokens per second: the decode steps after the prompt's over their time. A step
        that produced the end token counts (its time is in decode_s); counting only the tokens
        shown understated a 3-token reply that ended by itself by a third."""
        if self.decode_steps < 1 or self.decode_s <= 0:
            return None
        return self.decode_steps / self.decode_s

    @property
    def read_mib_per_s(self) -> float | None:
        """Engine read bandwidth: file bytes over the layers' read windows, all lanes together."""
        if not self.bytes_read or not self.read_wall_s:
            return None
        return self.bytes_read / (1 << 20) / self.read_wall_s

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["tok_per_s"] = self.tok_per_s
        out["read_mib_per_s"] = self.read_mib_per_s
        out["cache_hit_pct"] = self.cache_hit_pct
        out["stall_ms"] = None if self.blocked_s is None else self.blocked_s * 1e3
        return out
