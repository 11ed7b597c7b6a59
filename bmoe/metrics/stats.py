"""What one generation measured, and how.

Wall times come from ``time.perf_counter`` around whole phases; read figures are counted by the
read stage (bytes transferred from the file, which under O_DIRECT include the page-aligned
superset); figures a mode cannot measure are None ("unmeasured"), never 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GenerationStats:
    mode: str
    io_mode: str | None  # "odirect" / "buffered" when streaming, None when resident
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # summed wall time of the decode calls after prefill (not the caller's)
    experts_read: int | None = None  # (layer, expert) entries read, all projections
    slices_read: int | None = None  # (layer, projection, expert) reads
    bytes_read: int | None = None  # bytes transferred from the model file(s)
    read_busy_s: float | None = None  # summed time the I/O lanes spent inside reads
    read_wall_s: float | None = None  # summed per layer: reads issued -> last read landed
    blocked_s: float | None = None  # compute thread waiting on the pipeline (reads + hops)
    cache_hits: int | None = None
    cache_evictions: int | None = None

    @property
    def tok_per_s(self) -> float | None:
        """Decode tokens per second: tokens after the first over the decode steps that made them."""
        if self.generated_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.generated_tokens - 1) / self.decode_s

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
        return out
