"""How to run a prompt through a streamed model: the cost model behind the prefill strategies.

A prompt run as one batch reads, per MoE layer, the union of every expert its tokens route to that
the cache does not hold, all of it before the layer computes. Run in chunks of m tokens (m = 1:
token by token) through the cache, each call reads its own chunk's missing experts and pays a
per-call compute overhead (the dense weights stream through the cores once per call, not once per
prompt). Under one routing, chunking never reads less than one batch: an expert the batch reads
once, the chunked run reads at its first use too, and again if the cache evicted it in between
(``ceil(T/m) * U(m) >= U(T)`` below, U being concave). Measured on the tiny models with a warm
64 MiB cache, a 20-token follow-up read 8 experts as one batch, 10 in micro-batches of 8 and 16
token by token. What chunking does buy is a bound on the transient union: a batch pins every
expert its union routes to in a layer, so a union bigger than the cache budget breaks the budget
for that layer's duration; chunks whose union fits keep it.

For chunks of ``m`` tokens (``m >= T``: one batch):

    time(m) = bytes(m) / read_rate + ceil(T / m) * call_s + T * token_s
    bytes(m) = ceil(T / m) * sum over layers of misses(U(m)) * expert_bytes
    U(m) = E * (1 - (1 - k / E) ** m)               distinct experts m tokens route to (uniform)
    misses(u) = max(u - cached, u * (1 - hit))      cached: experts of the layer resident now

Expert-major (``expert``) runs one batch whose experts bmoe reads and computes group by group: it
reads one batch's bytes (measured equal) and keeps the budget, so where one batch would exceed the
budget it beats every chunk size; where one batch fits, one batch is kept (no faster, measured).

``hit`` is the hit rate decode measured on this cache (the chance a routed expert is resident),
``cached/E`` when nothing was measured. ``call_s`` and ``token_s`` come from a per-call / per-token
split of measured compute: a decode step's compute is ``call_s + token_s``, a batched prefill's
per-token compute is ``token_s`` (its one call's overhead spread over many tokens). Routing is
assumed uniform across experts: real routing is skewed, which makes unions smaller and hit rates
higher; both enter through the measured hit rate, never through constants.

``auto`` never chunks: it runs one batch, or expert-major where one batch would break the
budget and the model has the expert chain for it. A chunked prompt is summed by llama.cpp in
another order than a batch, so its greedy output may differ from the resident run's (and a choice
made from measured timings would make it differ from run to run): on gemma4, gpt-oss and llama4,
which have no expert-major path, a chat with a cache smaller than a prompt's union chose micro-
batches from its second turn and its replies left the resident run's (an audit, 2026-12-07). One
batch whose union exceeds the budget holds it for that layer's duration, inside the room the
memory model sets aside for a prompt's union (``bmoe.pipeline.budget``). The forced ``micro`` and
``token`` strategies remain, exact against a resident run of the same batching. Chunk estimates
(``estimate_s`` of any size) stay for the benches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

STRATEGIES = ("auto", "batch", "token", "micro", "expert")
MICRO_TOKENS = 8  # the forced "micro" strategy's chunk size


@dataclass(frozen=True)
class LayerCache:
    """One MoE layer as the cost model sees it."""

    n_expert: int
    k: int  # experts routed per token
    expert_bytes: int  # all projections of one expert
    cached: int  # experts of this layer resident now


@dataclass(frozen=True)
class Rates:
    """Measured rates; None = not measured yet."""

    read_bytes_per_s: float | None = None
    call_s: float | None = None  # per decode call, beyond its tokens
    token_s: float | None = None  # per prompt token in a batch
    hit: float | None = None  # decode's hit rate on this cache, 0..1

    @classmethod
    def from_measurements(
        cls, *, read_bytes_per_s: float | None, decode_compute_s: float | None,
        batch_compute_s_per_token: float | None, hit: float | None,
    ) -> Rates:
        """``decode_compute_s``: one decode step's compute (wall minus waiting for reads);
        ``batch_compute_s_per_token``: a batched prefill's compute over its tokens."""
        call = token = None
        if batch_compute_s_per_token is not None:
            token = max(0.0, batch_compute_s_per_token)
            if decode_compute_s is not None:
                call = max(0.0, decode_compute_s - token)
        return cls(read_bytes_per_s, call, token, hit)


@dataclass(frozen=True)
class Choice:
    chunk: int  # tokens per decode call
    strategy: str  # "batch", "token" or "micro"
    reason: str
    est_s: dict[int, float] | None = None  # chunk -> estimated seconds, when estimated


def distinct(n_expert: int, k: int, m: int) -> float:
    """Expected distinct experts m tokens route to, each choosing k of n_expert uniformly."""
    if n_expert <= 0 or k <= 0 or m <= 0:
        return 0.0
    return n_expert * (1.0 - (1.0 - k / n_expert) ** m)


def read_bytes(layers: Sequence[LayerCache], n_tokens: int, chunk: int, hit: float | None) -> float:
    """Expected bytes read running ``n_tokens`` in chunks of ``chunk`` (see the module doc)."""
    m = min(chunk, n_tokens)
    calls = math.ceil(n_tokens / m)
    total = 0.0
    for layer in layers:
        u = distinct(layer.n_expert, layer.k, m)
        h = layer.cached / layer.n_expert if hit is None else hit
        total += max(u - layer.cached, u * (1.0 - h), 0.0) * layer.expert_bytes
    return calls * total


def estimate_s(layers: Sequence[LayerCache], n_tokens: int, chunk: int, rates: Rates) -> float | None:
    if rates.read_bytes_per_s is None or rates.call_s is None or rates.token_s is None:
        return None
    m = min(chunk, n_tokens)
    calls = math.ceil(n_tokens / m)
    return (read_bytes(layers, n_tokens, m, rates.hit) / rates.read_bytes_per_s
            + calls * rates.call_s + n_tokens * rates.token_s)


def strategy_of(chunk: int, n_tokens: int, n_batch: int) -> str:
    if chunk >= min(n_tokens, n_batch):
        return "batch"
    return "token" if chunk == 1 else "micro"


def fits(layers: Sequence[LayerCache], chunk: int, budget_bytes: int) -> bool:
    """Whether one call of ``chunk`` tokens is expected to hold no more than the budget in any
    layer: its whole expert union is resident while the layer computes, the experts already
    cached as much as those it reads (counting only the reads, a warm cache ran one batch over
    the budget, 6.2 MiB against 4.5, and said it kept it), so no hit rate enters. A cache that is
    off, budget 0, has no budget to keep."""
    if budget_bytes <= 0:
        return True
    m = max(chunk, 1)
    return all(distinct(layer.n_expert, layer.k, m) * layer.expert_bytes <= budget_bytes for layer in layers)


def choose(
    strategy: str, n_tokens: int, n_batch: int, layers: Sequence[LayerCache] | None, rates: Rates,
    budget_bytes: int = 0, expert: bool = False,
) -> Choice:
    """The chunk size for a prompt of ``n_tokens``: forced by ``strategy``, or for ``auto`` one
    batch, said with its estimate and whether it keeps the cache budget (``auto`` never chunks:
    the module doc). ``layers`` None: resident (nothing to read), one batch.

    ``expert``: the session can run a batch expert-major. That reads what one batch reads, at one
    batch's time (measured: the same bytes, 0.75-1.10x its time to first token at full depth), but
    keeps the budget, so ``auto`` takes it exactly when one batch would break the budget: over any
    chunk size, which reads at least as much and pays its calls' overhead too."""
    if strategy not in STRATEGIES:
        raise ValueError(f"prefill strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if strategy == "batch":
        return Choice(n_batch, "batch", "forced")
    if strategy == "token":
        return Choice(1, "token", "forced")
    if strategy == "micro":
        return Choice(min(MICRO_TOKENS, n_batch), "micro", "forced")
    if strategy == "expert":
        return Choice(n_batch, "expert", "forced")
    if layers is None:
        return Choice(n_batch, "batch", "resident: nothing to read")
    full = min(n_tokens, n_batch)
    if expert and full > 1 and not fits(layers, full, budget_bytes):
        est_full = estimate_s(layers, n_tokens, full, rates)
        return Choice(
            n_batch, "expert",
            f"expert-major: one batch would exceed the {budget_bytes / 2**20:g} MiB budget; read once, group by group"
            + ("" if est_full is None else f" (est {est_full:.3f} s, one batch's)"),
            None if est_full is None else {full: est_full},
        )
    # Always one batch (the module doc): chunks sum in another order than the resident run's one
    # batch, so their greedy output may differ; where one batch's union exceeds the budget, it
    # does so for its layer's duration, inside the room the memory model set aside for it.
    est_full = estimate_s(layers, n_tokens, full, rates)
    est = None if est_full is None else {full: float(est_full)}
    if est_full is None:
        return Choice(n_batch, "batch", "not measured yet: one batch")
    if fits(layers, full, budget_bytes):
        return Choice(n_batch, "batch", f"one batch keeps the budget: est {est_full:.3f} s", est)
    return Choice(n_batch, "batch",
                  f"one batch (est {est_full:.3f} s): its union exceeds the {budget_bytes / 2**20:g} MiB budget for a "
                  "layer's duration, inside the room set aside for it; chunks would change the output and this "
                  "model has no expert-major path", est)


__all__ = [
    "MICRO_TOKENS", "STRATEGIES", "Choice", "LayerCache", "Rates", "choose",
    "distinct", "estimate_s", "fits", "read_bytes", "strategy_of",
]
