"""RunConfig: every knob of a run as one value object that validates itself.

An invalid RunConfig cannot exist: ``__post_init__`` checks every field and each combination, so a
bad value fails where it is written (``ConfigError``), not at ``Session.open`` or deep in a stage.
The choice fields are ``Literal`` types whose allowed values are read back from the types, so the
check and the annotation cannot drift apart.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args

from bmoe.errors import ConfigError
from bmoe.pipeline.policies import POLICIES

Mode = Literal["stream", "resident"]
OpenMode = Literal["auto", "user", "reserved", "mmap", "mmap-drop"]
DensePolicy = Literal["mmap", "anon"]
Prefill = Literal["auto", "batch", "token", "micro", "expert"]
Draft = Literal["none", "ngram"]
MODES: tuple[str, ...] = get_args(Mode)
OPEN_MODES: tuple[str, ...] = get_args(OpenMode)
DENSE_POLICIES: tuple[str, ...] = get_args(DensePolicy)
PREFILLS: tuple[str, ...] = get_args(Prefill)
DRAFTS: tuple[str, ...] = get_args(Draft)
MAX_PARALLEL = 64  # sequences one context holds at most (llama.cpp's LLAMA_MAX_SEQ is 256)
MAX_DRAFT = 16  # draft tokens verified in one step at most
MiB = 1 << 20
MAX_CTX = 1 << 20  # the largest context a run may ask for


def check_cache_bytes(nbytes: int) -> None:
    """A cache budget is 0 (off) or at least 1 MiB: less is a units mistake (bytes, not MiB). The
    one rule RunConfig and ``Session.set_cache_budget`` hold a budget to."""
    if not (nbytes == 0 or nbytes >= MiB):
        raise ConfigError(f"cache budget must be 0 (off) or at least 1 MiB, got {nbytes} bytes")
# Field annotation (a string: annotations are postponed) -> the type its value must have.
_KINDS: dict[str, type] = {
    "bool": bool, "bool | None": bool, "int": int, "int | None": int, "float | None": float,
    "str": str, "str | None": str,
}
_KIND_NAMES = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
_PATH_FIELDS = ("route_trace", "cache_profile")


@dataclass(frozen=True)
class RunConfig:
    mode: Mode = "stream"
    io_threads: int = 2
    odirect: bool = True
    n_threads: int | None = None  # None: every core this process may run on
    n_ctx: int = 2048
    # Expert cache budget: 0 = off (every routed expert read every time it is used), None = auto
    # (sized once at open from available memory, see bmoe.pipeline.budget).
    cache_bytes: int | None = 0
    cache_ceiling_bytes: int | None = None
    # A fixed cache_bytes that the memory model says cannot fit is refused at open; forced, it is
    # only warned about.
    force_cache: bool = False
    # Shrink the cache when memory pressure appears while running, grow it back when it clears
    # (bmoe.pipeline.pressure). Only with a cache.
    pressure_guard: bool = True
    # Fault the cache's pages in from the open on, in a background thread, so that a fresh
    # cache's first misses land in pages already present (bmoe.io.regions.WarmPool).
    warm_pool: bool = True
    cache_policy: str = "default"  # a name in bmoe.pipeline.policies.POLICIES; "lru" is the baseline
    # Seed the cache policy from this profile at open (if the file exists) and save what the run
    # learned to it at close (bmoe.pipeline.profile); streamed runs with a cache only.
    cache_profile: str | None = None
    # With a profile: read its most used experts into the cache's free room in the background,
    # from the first generation on (real reads always first); lossless (bmoe.stages.prefetch).
    prewarm: bool = False
    # How the model is opened when streaming (bmoe.llama.loader): auto picks the cheapest that works.
    open_mode: OpenMode = "auto"
    # Dense weights: stay in llama.cpp's file mapping, or copied into anonymous memory ("anon").
    dense_weights: DensePolicy = "mmap"
    # Overlap reads with compute: wait at each expert matmul only for the projection it consumes.
    overlap: bool = False
    # Temporal read-ahead: while layer l computes, read the experts the previous token used at
    # layers l+1..l+K into the cache (needs a cache budget). A count of layers; 0 = off.
    prefetch_layers: int = 0
    # Predictive read-ahead: the next layer's router applied to this layer's router input.
    predict_prefetch: bool = False
    # The same for a batched prompt: while layer l computes, read the next layer's experts that
    # its router picks for any of the prompt's rows (needs a cache budget). None (auto): on when
    # streaming with a cache, unless expert-major, route-ahead or cold-expert dropping runs
    # (``predicts_prompts``).
    predict_prompt: bool | None = None
    # Write every routing decision to this file (route_trace v2; streamed runs only).
    route_trace: str | None = None
    # How a prompt is run (bmoe.engine.prefill): one batch, micro-batches of 8, token by token,
    # expert-major (one batch whose experts are read and computed group by group; needs a cache),
    # or auto (one batch, or expert-major when one batch's expert union would exceed the budget:
    # never chunks, since chunks sum in another order than the resident run's one batch).
    prefill: Prefill = "auto"
    # Resident mode only: install the eval callback that filters nodes but streams nothing, to
    # measure what the callback itself costs.
    eval_filter: bool = False
    # Keep what the context holds between generations: a prompt that begins with the same tokens
    # evaluates only the rest (False: every prompt is evaluated from its first token).
    reuse_prompt: bool = True
    # Lossy levers (bmoe.engine.lossy): off by default; any of them on makes the run's output a
    # different model's, and every figure it reports says so (``lossy: true`` and the flags).
    # Top-K experts per token instead of the file's own k (1..k, checked against the file at open).
    n_expert_used: int | None = None
    # Drop a routed expert that is a cache miss and weighs less than F x (1/k) of the layer's routed
    # mass (never the top one; bmoe.llama.drop_cold). None = off; 0.0 runs the machinery, drops nothing.
    drop_cold_experts: float | None = None
    drop_renorm: bool = True  # survivors scaled back to the original routed mass
    drop_prefill: bool = False  # also drop during prefill (decode only by default)
    # Route MoE layer L from the hidden state N MoE layers earlier, its experts read N layers ahead
    # (bmoe.llama.route_ahead). None = off; 0 installs the machinery as a passthrough.
    route_ahead: int | None = None
    # Sequences decoded together (bmoe.engine.scheduler): up to this many generations share each
    # llama_decode, one token of each, so one read of an expert serves every sequence routed to it.
    # The context's cells are split evenly between them (llama.cpp's n_seq_max). 1: one generation
    # at a time, as before.
    parallel: int = 1
    # Speculative decoding: "ngram" drafts from the context's own repeated n-grams (prompt lookup),
    # verified in one step; greedy and seeded draws are kept exactly (bmoe.engine.drafts).
    draft: Draft = "none"
    draft_max: int = 8  # the longest draft one step verifies (the length adapts below it)
    # A test aid: the read lanes land at most this many MiB/s (a token bucket in front of the reads;
    # bmoe bench --disk-limit emulates a slower disk with it). None: no limit.
    disk_limit_mib_s: float | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'stream' or 'resident', got {self.mode!r}")
        if self.cache_policy not in POLICIES or getattr(POLICIES[self.cache_policy], "offline", False):
            live = ", ".join(n for n, f in POLICIES.items() if not getattr(f, "offline", False))
            raise ConfigError(f"cache_policy must be one of {live}, got {self.cache_policy!r}")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io_threads must be 1..64, got {self.io_threads}")
        if self.n_threads is not None and not 1 <= self.n_threads <= 512:
            raise ConfigError(f"n_threads must be 1..512, got {self.n_threads}")
        if not 16 <= self.n_ctx <= MAX_CTX:
            raise ConfigError(f"n_ctx must be 16..{MAX_CTX}, got {self.n_ctx}")
        if self.cache_bytes is not None:
            check_cache_bytes(self.cache_bytes)
        if self.cache_ceiling_bytes is not None and self.cache_ceiling_bytes < 0:
            raise ConfigError(f"cache ceiling must be >= 0, got {self.cache_ceiling_bytes}")
        if self.open_mode not in OPEN_MODES:
            raise ConfigError(f"open_mode must be one of {', '.join(OPEN_MODES)}, got {self.open_mode!r}")
        if self.dense_weights not in DENSE_POLICIES:
            raise ConfigError(
                f"dense_weights must be one of {', '.join(DENSE_POLICIES)}, got {self.dense_weights!r}"
            )
        if self.prefill not in PREFILLS:
            raise ConfigError(f"prefill must be one of {', '.join(PREFILLS)}, got {self.prefill!r}")
        if self.prefill == "expert":
            if self.mode != "stream" or self.cache_bytes == 0:
                raise ConfigError("prefill 'expert' reads a prompt's experts group by group through the expert cache: "
                                  "stream with a cache budget")
            if self.overlap or self.predict_prefetch or self.predict_prompt is True or self.route_trace is not None \
                    or self.drop_cold_experts is not None or self.route_ahead is not None:
                raise ConfigError("prefill 'expert' computes the expert nodes itself: not with overlap, "
                                  "predict_prefetch / predict_prompt, a route trace, drop_cold_experts or route_ahead")
        if self.route_trace is not None and self.mode != "stream":
            raise ConfigError("route traces are recorded by the streaming callback: use mode='stream'")
        if not 0 <= self.prefetch_layers <= 64:
            raise ConfigError(f"prefetch_layers must be 0..64 layers ahead, got {self.prefetch_layers}")
        if self.prefetch_layers and (self.mode != "stream" or self.cache_bytes == 0):
            raise ConfigError("prefetch_layers reads ahead into the expert cache: stream with a cache budget")
        if self.prewarm and (self.mode != "stream" or self.cache_bytes == 0 or not self.cache_profile):
            raise ConfigError("prewarm reads a cache profile's experts into the cache: it needs streaming, a cache "
                              "budget and a cache profile (--cache-profile)")
        if self.predict_prefetch and (self.mode != "stream" or self.cache_bytes == 0):
            raise ConfigError("predict_prefetch reads ahead into the expert cache: stream with a cache budget")
        if self.predict_prompt not in (None, True, False):
            raise ConfigError(f"predict_prompt must be True, False or None (auto), got {self.predict_prompt!r}")
        if self.predict_prompt is True and (self.mode != "stream" or self.cache_bytes == 0):
            raise ConfigError("predict_prompt reads ahead into the expert cache: stream with a cache budget")
        if self.overlap and self.mode != "stream":
            raise ConfigError("overlap applies to streamed runs: use mode='stream'")
        if self.eval_filter and self.mode != "resident":
            raise ConfigError("eval_filter measures the callback alone and needs mode='resident'")
        if self.disk_limit_mib_s is not None and not (math.isfinite(self.disk_limit_mib_s) and self.disk_limit_mib_s > 0):
            raise ConfigError(f"disk_limit_mib_s must be a positive number of MiB/s, got {self.disk_limit_mib_s}")
        self._check_lossy()
        self._check_steps()

    def _check_types(self) -> None:
        """Each field holds its annotated type: ``odirect="no"`` would otherwise be true, and a
        float where a count belongs would fail much later, inside a stage. Choice fields are
        checked by value below; paths may be ``os.PathLike`` (kept as ``str``)."""
        for f in fields(self):
            kind = _KINDS.get(f.type)
            if kind is None:
                continue
            value = getattr(self, f.name)
            if value is None and f.type.endswith("| None"):
                continue
            if kind is str and isinstance(value, os.PathLike) and f.name in _PATH_FIELDS:
                object.__setattr__(self, f.name, os.fspath(value))
                continue
            if kind is bool:
                ok = isinstance(value, bool)
            elif kind is int:
                ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
                if ok:
                    object.__setattr__(self, f.name, int(value))
            elif kind is float:
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            else:
                ok = isinstance(value, kind)
            if not ok:
                raise ConfigError(f"{f.name} must be {_KIND_NAMES[kind]}, got {value!r}")

    def _check_lossy(self) -> None:
        if self.n_expert_used is not None and self.n_expert_used < 1:
            raise ConfigError(f"n_expert_used must be at least 1, got {self.n_expert_used}")
        f = self.drop_cold_experts
        if f is None:
            if not self.drop_renorm or self.drop_prefill:
                raise ConfigError("drop_renorm / drop_prefill tune drop_cold_experts: set it too")
        elif not (math.isfinite(f) and f >= 0):
            raise ConfigError(f"drop_cold_experts must be a finite fraction >= 0, got {f}")
        elif self.mode != "stream" or self.cache_bytes == 0:
            raise ConfigError("drop_cold_experts drops cache misses: stream with a cache budget (cache_bytes)")
        n = self.route_ahead
        if n is not None:
            if not 0 <= n <= 64:
                raise ConfigError(f"route_ahead must be 0..64 MoE layers, got {n}")
            if self.mode != "stream" or self.cache_bytes == 0:
                raise ConfigError("route_ahead reads experts ahead into the cache: stream with a cache budget (cache_bytes)")
            if self.prefetch_layers or self.predict_prefetch or self.predict_prompt is True:
                raise ConfigError("route_ahead already reads ahead: drop prefetch_layers / predict_prefetch / "
                                  "predict_prompt")
            if f is not None:
                raise ConfigError("route_ahead and drop_cold_experts both rewrite the routing: pick one")

    def _check_steps(self) -> None:
        """Many tokens per decode step (sequences decoded together, drafts verified): the modes that
        assume one sequence's token per step are refused here, never silently off."""
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise ConfigError(f"parallel must be 1..{MAX_PARALLEL} sequences, got {self.parallel}")
        if self.draft not in DRAFTS:
            raise ConfigError(f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        if not 1 <= self.draft_max <= MAX_DRAFT:
            raise ConfigError(f"draft_max must be 1..{MAX_DRAFT} tokens, got {self.draft_max}")
        if self.parallel > 1 and self.n_ctx // self.parallel < 16:
            raise ConfigError(f"n_ctx {self.n_ctx} split between {self.parallel} sequences leaves fewer than 16 "
                              "tokens each: raise n_ctx or lower parallel")
        if self.stepped:
            what = "parallel > 1" if self.parallel > 1 else f"draft {self.draft!r}"
            for name, on in (("route_trace", self.route_trace is not None), ("predict_prefetch", self.predict_prefetch),
                             ("drop_cold_experts", self.drop_cold_experts is not None),
                             ("route_ahead", self.route_ahead is not None)):
                if on:
                    raise ConfigError(f"{name} assumes one sequence's token per decode step: not with {what}")

    @property
    def stepped(self) -> bool:
        """Whether generations run through the step scheduler (many sequences or drafts) rather than
        one at a time, token by token."""
        return self.parallel > 1 or self.draft != "none"

    @property
    def predicts_prompts(self) -> bool:
        """Whether batched prompts read the next layer's predicted experts ahead (``predict_prompt``
        resolved: auto is on when streaming with a cache and nothing else decides a prompt's reads)."""
        if self.predict_prompt is not None:
            return self.predict_prompt
        return (self.mode == "stream" and self.cache_bytes != 0 and self.prefill != "expert"
                and self.route_ahead is None and self.drop_cold_experts is None)

    def validate(self) -> RunConfig:
        """The config itself: it was validated when it was made (kept for callers that chain it)."""
        return self

    @property
    def threads(self) -> int:
        return self.n_threads or max(1, len(os.sched_getaffinity(0)))

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
