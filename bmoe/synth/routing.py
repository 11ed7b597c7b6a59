"""Synthetic routing traces: what a cache policy must be judged on besides the one real trace.

A policy tuned on one model's routing can fail on another's (issue 14: the default closed 65 % of
the LRU -> Belady gap on Qwen3 at 500 MiB and 9 % on gpt-oss at 1000 MiB). ``routing_trace``
draws a ``RouteTrace`` from a handful of numbers that describe how a model routes, so a sweep can
cover the space real models occupy instead of the one point we hold.

The model of routing, per MoE layer, is the smallest one that reproduces what the shared trace
shows (``shared/traces/qwen3-30b-a3b.route.csv``, decode, 48 layers x 128 experts, top-6):

- **Popularity**: a Zipf law over a random permutation of the experts, ``p(rank r) ~ r^-s``. Its
  exponent varies by layer (``s * m_l``, ``m_l`` log-normal with sigma 0.4 and a mean of 1): Qwen's
  layers run from near-uniform (layer 0: its 8 hottest carry 21.5 % of the routing) to heavily
  concentrated (77 %), mean 44.5 %.
  ``law="lognormal"`` draws Gaussian logits of std ``skew`` instead: a light tail (some experts
  almost never routed), which is what the real trace has: its layers touch 64 of 128 experts in
  128 tokens, where a Zipf law of the same concentration touches 105. LRU's hit rate over budget
  fractions 0.05 / 0.1 / 0.2 / 0.3 / 0.5 of the bank: real 37.7 / 49.7 / 74.0 / 87.9 / 96.3; Zipf
  1.05 gives 37.4 / 46.2 / 62.2 / 71.7 / 84.1 (harsher than the real trace at large budgets);
  lognormal 2.0 gives 39.0 / 54.6 / 73.6 / 84.0 / 94.2 (within 5 points everywhere). The grid
  sweeps Zipf laws (the heavy-tailed, harder case) and the fitted lognormal.
- **Carry-over**: each expert of the previous token's set is kept with probability ``c`` (its
  slot is reused); the rest of the set is drawn from the popularity without replacement (Gumbel
  top-k). On Qwen the overlap with the previous token is 38 % of the slots, 29 % at lag 2 and
  27 % at lag 8: popularity alone explains most of the reuse (per-layer reuse and concentration
  correlate at 0.95), and a short-lived carry explains the rest. So the requested per-slot reuse
  ``r`` is what is controlled: ``c`` is solved per layer from the layer's popularity floor (the
  overlap of two independent draws), and a cell whose ``r`` is below its floor gets the floor
  (``RoutingSpec.measure`` reports what a trace actually has).
- **Rank and weight**: the routed set is ordered by a fresh Gumbel-perturbed popularity logit, so
  popular experts take the high ranks and are reused more, as on Qwen (rank 0 reused 46 % of the
  time, rank 5 30 %); weights are the softmax of those logits over the set.
- **Prefill**: ``prompt`` tokens drawn the same way, recorded layer-major as a llama.cpp ubatch
  runs them.

The corners of the space (``bench/policy_grid.py`` sweeps them) come from published facts, not
guesses:

- expert count 32 - 512 and top-k 1 - 10, layers 16 - 94: gpt-oss-20b (32 experts, top-4, 24
  layers), OLMoE-1B-7B (64, top-8, 16 layers), Qwen3-30B-A3B (128, top-8, 48), gpt-oss-120b (128,
  top-4, 36; recorded at top-2), Gemma-4-26B-A4B (128, top-6 as recorded, 30), Llama-4-Maverick
  (128, top-1), Qwen3-235B-A22B (128, top-8, 94 layers), Qwen3-Next-80B-A3B (512, top-10, 48):
  the models' published configs, as listed in ``shared/ARCHITECTURES.md`` and BigMoeOnEdge's
  ``docs/bench-data/2026-07-15-route-trace/findings.md``.
- per-slot reuse 5 - 50 %: the previous token's ``k`` predict 17.9 % of gpt-oss's routing, 35.7 %
  of Gemma's and 38.0 % of Qwen's (BigMoeOnEdge, same findings); Qwen's layers range from 6.7 %
  (layer 0) to 67 %, its rank 0 48 %.
- popularity near-uniform to heavy-tailed: Qwen's layer 0 (8 hottest carry 21.5 %) to its most
  concentrated layer (77 %); on gpt-oss the run's 2 hottest experts per layer predict 26.7 % of
  its top-2 against 1.6 % by chance (BigMoeOnEdge, same findings), heavier than any Qwen mean.

Everything is seeded numpy; a trace of 48 layers x 128 tokens takes milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bmoe.errors import ConfigError
from bmoe.pipeline.trace import RouteTrace

SKEW_SIGMA = 0.4  # per-layer spread of the Zipf exponent (log-normal): Qwen's 0.34 - 1.64 slopes


@dataclass(frozen=True)
class RoutingSpec:
    """How a model routes: shape, popularity skew (Zipf exponent) and per-slot reuse."""

    n_expert: int = 128
    top_k: int = 6
    n_layer: int = 48
    skew: float = 0.6  # Zipf exponent of the popularity (0 = uniform); lognormal: std of the logits
    law: str = "zipf"  # or "lognormal"
    reuse: float = 0.38  # wanted share of a token's slots routed to an expert of the previous token
    tokens: int = 128  # decoded tokens
    prompt: int = 28  # prefill tokens
    expert_bytes: int = 3 << 20  # bytes of one expert (all projections), every layer
    seed: int = 0
    # Which run of the model: its popularity and carry-over come from ``seed`` alone, the tokens it
    # routes from the session too (0: the one stream ``seed`` gives). Another session of the same
    # model is what a cache profile saved by an earlier run meets.
    session: int = 0

    def __post_init__(self) -> None:
        checks = (
            (1 <= self.top_k <= self.n_expert <= 4096, f"need 1 <= top_k <= n_expert <= 4096, got "
             f"top_k={self.top_k} n_expert={self.n_expert}"),
            (1 <= self.n_layer <= 512, f"n_layer must be 1..512, got {self.n_layer}"),
            (math.isfinite(self.skew) and 0 <= self.skew <= 4, f"skew must be 0..4, got {self.skew}"),
            (self.law in ("zipf", "lognormal"), f"law must be 'zipf' or 'lognormal', got {self.law!r}"),
            (math.isfinite(self.reuse) and 0 <= self.reuse < 1, f"reuse must be in [0, 1), got {self.reuse}"),
            (0 <= self.tokens <= 100_000 and 0 <= self.prompt <= 100_000, "tokens and prompt must be 0..100000"),
            (self.tokens + self.prompt > 0, "a trace needs at least one token"),
            (self.seed >= 0 and self.session >= 0, f"seed and session must be >= 0, got {self.seed}, {self.session}"),
            (0 < self.expert_bytes <= 1 << 34, f"expert_bytes must be 1 .. 16 GiB, got {self.expert_bytes}"),
        )
        for ok, what in checks:
            if not ok:
                raise ConfigError(f"routing spec: {what}")


def popularity(spec: RoutingSpec, rng: np.random.Generator) -> np.ndarray:
    """Per layer, log-probabilities of the experts (layers x experts)."""
    mult = np.exp(SKEW_SIGMA * rng.standard_normal(spec.n_layer) - SKEW_SIGMA**2 / 2)
    if spec.law == "lognormal":
        logp = (spec.skew * mult)[:, None] * rng.standard_normal((spec.n_layer, spec.n_expert))
        return logp - np.logaddexp.reduce(logp, axis=1, keepdims=True)
    ranks = np.arange(1, spec.n_expert + 1, dtype=np.float64)
    logp = -(spec.skew * mult)[:, None] * np.log(ranks)[None, :]
    for row in logp:
        rng.shuffle(row)  # which expert is popular differs per layer
    return logp - np.logaddexp.reduce(logp, axis=1, keepdims=True)


def draw(logp: np.ndarray, k: int, rng: np.random.Generator, exclude: np.ndarray | None = None) -> np.ndarray:
    """k experts per row without replacement (Gumbel top-k), never one marked in ``exclude``."""
    score = logp + rng.gumbel(size=logp.shape)
    if exclude is not None:
        score = np.where(exclude, -np.inf, score)
    return np.argpartition(-score, k - 1, axis=1)[:, :k] if k < logp.shape[1] else np.argsort(-score, axis=1)


def _floor(logp: np.ndarray, k: int, rng: np.random.Generator, samples: int = 64) -> np.ndarray:
    """Per layer, the share of slots two independent draws have in common (the reuse popularity
    alone gives), estimated from ``samples`` draws: sum of inclusion probabilities squared / k."""
    n_layer, n = logp.shape
    incl = np.zeros((n_layer, n))
    rows = np.arange(n_layer)[:, None]
    for _ in range(samples):
        incl[rows, draw(logp, k, rng)] += 1.0
    incl /= samples
    return (incl**2).sum(axis=1) / k


def routing_trace(spec: RoutingSpec) -> RouteTrace:
    """A route trace drawn from ``spec`` (prefill then decode, one turn), as ``read_trace`` gives."""
    rng = np.random.default_rng(spec.seed)
    L, n, k = spec.n_layer, spec.n_expert, spec.top_k
    logp = popularity(spec, rng)
    floor = _floor(logp, k, rng)
    carry = np.clip((spec.reuse - floor) / np.maximum(1.0 - floor, 1e-9), 0.0, 0.999)
    if spec.session:
        rng = np.random.default_rng([spec.seed, spec.session])
    rows = np.arange(L)[:, None]
    n_tok = spec.prompt + spec.tokens
    sets = np.empty((n_tok, L, k), dtype=np.int32)
    weights = np.empty((n_tok, L, k), dtype=np.float32)
    prev: np.ndarray | None = None
    for t in range(n_tok):
        if prev is None:
            chosen = draw(logp, k, rng)
        else:
            keep = rng.random((L, k)) < carry[:, None]
            mask = np.zeros((L, n), dtype=bool)
            mask[rows, prev] = keep
            fresh = draw(logp, k, rng, exclude=mask)
            # Kept experts first, then fresh ones until the set has k.
            n_keep = keep.sum(axis=1)
            chosen = np.empty((L, k), dtype=np.int64)
            for il in range(L):
                kept = prev[il][keep[il]]
                chosen[il] = np.concatenate([kept, fresh[il, : k - n_keep[il]]])
        score = logp[rows, chosen] + rng.gumbel(size=chosen.shape)
        order = np.argsort(-score, axis=1)
        chosen = np.take_along_axis(chosen, order, axis=1)
        score = np.take_along_axis(score, order, axis=1)
        w = np.exp(score - score.max(axis=1, keepdims=True))
        sets[t] = chosen
        weights[t] = w / w.sum(axis=1, keepdims=True)
        prev = chosen
    return _as_trace(spec, sets, weights)


def _as_trace(spec: RoutingSpec, sets: np.ndarray, weights: np.ndarray) -> RouteTrace:
    """Rows in execution order: the prompt layer-major (one ubatch), then decode token-major."""
    P, L, k = spec.prompt, spec.n_layer, spec.top_k
    pre = sets[:P].transpose(1, 0, 2)  # layer, token, slot
    pre_w = weights[:P].transpose(1, 0, 2)
    pre_step = np.broadcast_to(np.arange(P)[None, :, None], pre.shape)
    pre_layer = np.broadcast_to(np.arange(L)[:, None, None], pre.shape)
    dec = sets[P:]
    dec_step = np.broadcast_to(np.arange(spec.tokens)[:, None, None], dec.shape)
    dec_layer = np.broadcast_to(np.arange(L)[None, :, None], dec.shape)
    slot_pre = np.broadcast_to(np.arange(k), pre.shape)
    slot_dec = np.broadcast_to(np.arange(k), dec.shape)
    n_pre, n_dec = pre.size, dec.size
    expert = np.concatenate([pre.ravel(), dec.ravel()]).astype(np.int32)
    return RouteTrace(
        path=f"<synthetic {spec}>", version=1, model="synthetic", arch="synthetic",
        n_layer=L, n_expert=spec.n_expert, n_expert_used=k,
        expert_bytes={il: spec.expert_bytes for il in range(L)}, dense_bytes={il: 0 for il in range(L)},
        turn=np.zeros(n_pre + n_dec, dtype=np.int32),
        phase=np.concatenate([np.zeros(n_pre, np.int8), np.ones(n_dec, np.int8)]),
        step=np.concatenate([pre_step.ravel(), dec_step.ravel()]).astype(np.int32),
        layer=np.concatenate([pre_layer.ravel(), dec_layer.ravel()]).astype(np.int16),
        slot=np.concatenate([slot_pre.ravel(), slot_dec.ravel()]).astype(np.int16),
        expert=expert,
        weight=np.concatenate([pre_w.ravel(), weights[P:].ravel()]).astype(np.float32),
        residency=np.zeros(n_pre + n_dec, dtype=np.int8),
        bytes_read=np.zeros(n_pre + n_dec, dtype=np.int64),
    )


@dataclass(frozen=True)
class RoutingStats:
    """What a trace's decode routing looks like, as the grid's corners are stated."""

    reuse: float  # share of slots routed to an expert of the previous token (mean over layers)
    lag8_reuse: float  # the same against the token 8 back: the popularity floor
    top8_share: float  # share of the routing carried by each layer's 8 hottest experts (mean)
    rank_reuse: tuple[float, ...]  # per rank, how often that slot's expert was in the previous set


def measure(trace: RouteTrace) -> RoutingStats:
    """Decode statistics of any route trace (real or synthetic), for side-by-side reports."""
    dec = trace.phase == 1
    steps = np.unique(trace.step[dec])
    L, k = trace.n_layer, trace.n_expert_used
    T = steps.shape[0]
    grid = np.full((T, L, k), -1, dtype=np.int64)
    idx = np.searchsorted(steps, trace.step[dec])
    grid[idx, trace.layer[dec].astype(np.int64), trace.slot[dec].astype(np.int64)] = trace.expert[dec]

    def overlap(lag: int) -> float:
        if T <= lag:
            return float("nan")
        a, b = grid[lag:], grid[:-lag]
        hit = (a[..., :, None] == b[..., None, :]).any(axis=-1) & (a >= 0)
        return float(hit.sum() / max((a >= 0).sum(), 1))

    shares = []
    for il in range(L):
        ids = grid[:, il][grid[:, il] >= 0]
        if ids.size:
            counts = np.sort(np.bincount(ids))[::-1]
            shares.append(counts[:8].sum() / ids.size)
    ranks = []
    if T > 1:
        a, b = grid[1:], grid[:-1]
        hit = (a[..., :, None] == b[..., None, :]).any(axis=-1)
        ranks = [float(hit[..., r].mean()) for r in range(k)]
    return RoutingStats(overlap(1), overlap(8), float(np.mean(shares)) if shares else float("nan"), tuple(ranks))


# The grid's corners (see the module docstring for the sources).
GRID_SHAPES: dict[str, tuple[int, int, int]] = {  # name -> (experts, top-k, MoE layers)
    "gpt-oss-20b": (32, 4, 24),
    "olmoe-1b-7b": (64, 8, 16),
    "llama4-maverick": (128, 1, 24),
    "gpt-oss-120b@k2": (128, 2, 36),
    "gemma4-26b@k6": (128, 6, 30),
    "qwen3-30b": (128, 8, 48),
    "qwen3-235b": (128, 8, 94),
    "qwen3-next-80b": (512, 10, 48),
}
# Zipf exponents: uniform; Qwen's mean concentration (8 hottest carry 44.5 %, the generator gives
# 44.7 % at 1.05) which is also gpt-oss's (its 2 hottest predict 26.7 % of top-2: 26.1 % here);
# Qwen's most concentrated layer (77 %: 75.6 % at 2.2).
GRID_SKEWS = (0.0, 1.05, 2.2)
GRID_LOGNORMAL = 2.0  # the law fitted to the real trace's LRU curve (one more skew level)
# Per-slot reuse: below Qwen's layer 0 (6.7 %), gpt-oss (17.9 %), Qwen (38 %), Qwen's rank 0 and
# upper layers (48 - 67 %).
GRID_REUSES = (0.05, 0.18, 0.38, 0.5)
# Budgets in units of one token's working set (layers x top-k experts): below it (where LRU hits
# nothing), at it, and above, then fractions of the bank; each capped below the whole bank.
GRID_BUDGETS_WS = (0.5, 1.0, 2.0, 4.0)
GRID_BUDGETS_BANK = (0.25, 0.5)
