"""Read-ahead gates: temporal prefetch changes no token, holds the budget, and really reads ahead."""

from __future__ import annotations

import asyncio

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError
from bmoe.synth.tiny import TinySpec
from tests.conftest import N_TOKENS, PROMPT

SPEC = TinySpec(n_embd=256, n_ff=256, n_layer=4)
BUDGET = 4 * MiB  # five experts of 0.75 MiB: tight enough to evict, room to read ahead


def stream_within_budget(path, config: RunConfig):  # noqa: ANN001, ANN201
    """Greedy tokens and stats, checking after every token that the budget held."""

    async def go():  # noqa: ANN202
        with Session.open(path, config) as s:
            tokens = []
            async for piece in s.stream(PROMPT, N_TOKENS, stop_at_end=False):
                tokens.append(piece.token)
                assert s.resident_cache_bytes <= config.cache_bytes
            return tokens, s.last_stats

    return asyncio.run(go())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("lanes", [1, 4])
def test_temporal_prefetch_equals_resident_and_holds_the_budget(tiny, overlap: bool, lanes: int) -> None:
    path = tiny.path(SPEC)
    config = RunConfig(n_ctx=256, cache_bytes=BUDGET, prefetch=2, overlap=overlap, io_threads=lanes)
    tokens, stats = stream_within_budget(path, config)
    assert tokens == tiny.resident_tokens(path)
    assert stats.prefetch_issued > 0 and stats.speculative_bytes > 0, "the read-ahead fired"
    assert stats.cache_evictions > 0
    assert 0 <= stats.prefetch_useful <= stats.prefetch_issued


def test_prefetch_needs_a_cache() -> None:
    with pytest.raises(ConfigError, match="cache budget"):
        RunConfig(prefetch=1, cache_bytes=0).validate()


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma4"])
def test_predictive_prefetch_equals_resident_and_scores_itself(tiny, arch: str) -> None:
    path = tiny.path(TinySpec(arch=arch, n_embd=256, n_ff=256, n_layer=4))
    config = RunConfig(n_ctx=256, cache_bytes=BUDGET, predict_prefetch=True, overlap=arch == "gemma4")
    tokens, stats = stream_within_budget(path, config)
    assert tokens == tiny.resident_tokens(path)
    # Read-ahead survives the eviction of the layer in between: a third of it used, about the
    # predictor's accuracy here (~65 %; 6 % when the next layer's plan evicted it first).
    assert stats.prefetch_issued <= 3 * stats.prefetch_useful, "predicted experts were read ahead and used"
    accuracy = stats.predict_accuracy_pct
    assert accuracy and set(accuracy) == {1, 2, 3}, "every layer after the first is predicted and scored"
    assert all(0 <= v <= 100 for v in accuracy.values())
