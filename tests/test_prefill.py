"""Prefill strategies: each (one batch, micro-batches, token by token) streams the tokens of a resident
run of the same batching, on every recipe, with the cache evicting during the prompt; a negative
control shows the gate catches a skipped expert; ``auto`` chooses from measurements through the
cost model, whose choices are checked on their own.

Why "of the same batching": llama.cpp sums a batch's matmuls in a different order than single
tokens', so a token-wise resident run is not guaranteed to match a batched one bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError
from bmoe.pipeline.events import PHASE_PREFILL
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.prefill import (
    LayerCache,
    Rates,
    choose,
    distinct,
    estimate_s,
    fits,
    read_bytes,
)
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT, generate_tokens

MIB = 1 << 20
# F32: the tiny banks are 1.5 MiB, so the smallest budget (1 MiB) evicts during the prompt.
RECIPES = [("qwen3moe", "f32"), ("qwen2moe", "f32"), ("gemma4", "f32")]
STRATEGIES = ["token", "micro", "batch"]
N = 8


def resident(path, strategy: str) -> list[int]:  # noqa: ANN001
    return generate_tokens(path, RunConfig(mode="resident", n_ctx=256, prefill=strategy), n=N)


def evicting(strategy: str) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, cache_bytes=MIB, prefill=strategy)


def prefill_evictions() -> tuple[Hooks, list[int]]:
    seen = [0]

    def on_plan(event, plan) -> None:  # noqa: ANN001
        if event.phase == PHASE_PREFILL:
            seen[0] += len(plan.evictions)

    return Hooks(on_plan=on_plan), seen


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch,wtype", RECIPES)
def test_strategy_streams_its_resident_tokens(tiny, arch: str, wtype: str, strategy: str) -> None:
    path = tiny.path(TinySpec(arch=arch, wtype=wtype))
    want = resident(path, strategy)
    assert len(set(want)) > 2, "degenerate fixture"
    hooks, evicted = prefill_evictions()
    assert generate_tokens(path, evicting(strategy), hooks, n=N) == want
    if strategy != "batch":  # one call plans each layer once: nothing to evict within it
        assert evicted[0] > 0, "the cache never evicted during the prompt: the gate would be weak"


def test_negative_control_token_wise(tiny) -> None:
    path = tiny.path(TinySpec(arch="qwen3moe", wtype="f32"))
    skip = {"expert": -1}

    def on_plan(event, plan) -> None:  # noqa: ANN001
        if event.layer == 0 and event.phase == PHASE_PREFILL and skip["expert"] == -1 and plan.misses:
            skip["expert"] = plan.misses[0]

    def before_read(request) -> bool:  # noqa: ANN001
        return not (request.key.layer == 0 and request.key.expert == skip["expert"])

    got = generate_tokens(path, evicting("token"), Hooks(before_read=before_read, on_plan=on_plan), n=N)
    assert skip["expert"] != -1
    assert got != resident(path, "token")


def test_auto_learns_and_keeps_resident_tokens(tiny) -> None:
    """Turn one (nothing measured) runs one batch; turn two has every term of the cost model
    measured and runs whatever it chose, with the resident tokens of that batching."""
    path = tiny.path(TinySpec(arch="qwen2moe", wtype="q8_0"))
    short = PROMPT[:12]

    async def go() -> tuple[list, list]:
        choices, outs = [], []
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MIB)) as s:
            for prompt in (PROMPT, short):
                outs.append((await s.generate(prompt, N, stop_at_end=False)).tokens)
                choices.append(s.prefill_choice)
        return choices, outs

    (first, second), (_, out) = asyncio.run(go())
    assert first.strategy == "batch" and first.est_s is None
    assert second.est_s is not None, second.reason  # measured: a real choice
    want = generate_tokens(path, RunConfig(mode="resident", n_ctx=256, prefill=second.strategy), prompt=short, n=N)
    assert out == want


@pytest.mark.pure
def test_prefill_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="prefill"):
        RunConfig(prefill="sideways")
    assert RunConfig(prefill="token").prefill == "token"


# --- the cost model alone ----------------------------------------------------------------------

LAYERS = [LayerCache(n_expert=128, k=8, expert_bytes=1 << 20, cached=0) for _ in range(4)]
MEASURED = Rates(read_bytes_per_s=1e9, call_s=0.05, token_s=0.002, hit=None)


def warm(cached: int) -> list[LayerCache]:
    return [LayerCache(l.n_expert, l.k, l.expert_bytes, cached) for l in LAYERS]


@pytest.mark.pure
def test_distinct_experts() -> None:
    assert distinct(128, 8, 1) == pytest.approx(8)
    assert distinct(128, 8, 1000) == pytest.approx(128)
    assert distinct(128, 8, 2) < 16


@pytest.mark.pure
def test_forced_and_unmeasured_choices() -> None:
    assert choose("token", 50, 512, LAYERS, MEASURED).chunk == 1
    assert choose("micro", 50, 512, LAYERS, MEASURED).chunk == 8
    assert choose("batch", 50, 512, LAYERS, MEASURED).chunk == 512
    assert choose("auto", 50, 512, None, MEASURED).strategy == "batch"  # resident
    unmeasured = choose("auto", 5, 512, warm(120), Rates(read_bytes_per_s=1e9))
    assert unmeasured.strategy == "batch" and unmeasured.est_s is None
    with pytest.raises(ValueError):
        choose("sideways", 5, 512, LAYERS, MEASURED)


@pytest.mark.pure
@pytest.mark.parametrize("cached,hit", [(0, None), (64, None), (96, 0.9), (120, 0.5)])
def test_chunking_never_reads_less_than_one_batch(cached: int, hit: float | None) -> None:
    """Under one routing an expert the batch reads once, a chunked run reads at first use too."""
    for n in (5, 50, 200):
        batch = read_bytes(warm(cached), n, n, hit)
        assert all(read_bytes(warm(cached), n, m, hit) >= batch for m in (1, 2, 4, 8, 16))


@pytest.mark.pure
def test_measured_auto_runs_one_batch_when_it_fits() -> None:
    rates = Rates(1e9, 0.05, 0.002, hit=0.9)
    for n in (5, 50, 1000):
        c = choose("auto", n, 512, warm(96), rates, budget_bytes=1 << 30)
        assert c.strategy == "batch" and c.est_s is not None, c.reason
    assert choose("auto", 50, 512, LAYERS, Rates(1e9, 0.05, 0.002, hit=0.0)).strategy == "batch"


@pytest.mark.pure
def test_auto_keeps_one_batch_where_the_estimate_favours_chunks() -> None:
    """Measured on a 48-layer model: a warm cache holding ~60 of 128 experts a layer, a decode hit
    rate of 87 % (skewed routing) against the uniform-routing union of one batch makes chunks look
    cheaper; a chunked prompt sums in another order than resident, so auto must not take them
    while one batch keeps the budget (its choice flipped with timing, and so did the 7th token)."""
    layers = [LayerCache(n_expert=128, k=8, expert_bytes=3 << 20, cached=60) for _ in range(48)]
    rates = Rates(1.5e9, 0.01, 0.07, hit=0.87)
    c = choose("auto", 49, 512, layers, rates, budget_bytes=6 << 30)
    assert min(estimate_s(layers, 49, m, rates) for m in (1, 2, 4, 8)) < estimate_s(layers, 49, 49, rates), \
        "the estimate favours chunks"
    assert c.strategy == "batch" and c.chunk == 512 and c.est_s is not None, c.reason


@pytest.mark.pure
def test_auto_never_chunks_even_where_one_batch_would_break_the_budget() -> None:
    """A cold 50-token union is about 122 of 128 experts a layer (122 MiB here): a 32 MiB budget
    holds the union of a few tokens only. auto chose micro-batches there, which sum in another
    order than the resident run's one batch: on gemma4, gpt-oss and llama4 (no expert-major path)
    a chat's replies left the resident run's from its second turn. One batch now, said why."""
    rates = Rates(1e9, 0.05, 0.002, hit=0.0)
    c = choose("auto", 50, 512, LAYERS, rates, budget_bytes=32 << 20)
    assert not fits(LAYERS, 50, 32 << 20), "one batch would break the budget"
    assert c.strategy == "batch" and c.chunk == 512 and "exceeds the 32 MiB budget" in c.reason, c.reason
    # The cache off (budget 0) has no budget to keep: one batch.
    assert choose("auto", 50, 512, LAYERS, rates, budget_bytes=0).strategy == "batch"


@pytest.mark.pure
def test_auto_runs_expert_major_where_one_batch_would_break_the_budget() -> None:
    rates = Rates(1e9, 0.05, 0.002, hit=0.0)
    tight = choose("auto", 50, 512, LAYERS, rates, budget_bytes=32 << 20, expert=True)
    assert tight.strategy == "expert" and tight.chunk == 512 and "exceed" in tight.reason
    unmeasured = choose("auto", 50, 512, LAYERS, Rates(), budget_bytes=32 << 20, expert=True)
    assert unmeasured.strategy == "expert", "it needs no measurement: it reads what one batch reads"
    roomy = choose("auto", 50, 512, LAYERS, rates, budget_bytes=1 << 40, expert=True)
    assert roomy.strategy == "batch", "where one batch fits, one batch"
    assert choose("auto", 1, 512, LAYERS, rates, budget_bytes=32 << 20, expert=True).strategy != "expert"
    assert choose("expert", 50, 512, LAYERS, rates).strategy == "expert"


@pytest.mark.pure
def test_a_warm_cache_counts_the_experts_it_already_holds_in_the_union() -> None:
    """A batch pins its whole union while a layer computes, cached experts too. Counting only the
    reads, a warm cache holding most of a layer chose one batch whose union was 6.2 MiB against a
    4.5 MiB budget (peak 37 % over), and said it kept the budget."""
    rates = Rates(1e9, 0.05, 0.002, hit=0.9)
    hot = [LayerCache(n_expert=64, k=4, expert_bytes=100 << 10, cached=40) for _ in range(4)]
    budget = int(4.5 * (1 << 20))
    assert distinct(64, 4, 120) * (100 << 10) > budget, "the union is over the budget"
    assert not fits(hot, 120, budget)
    assert choose("auto", 120, 512, hot, rates, budget_bytes=budget, expert=True).strategy == "expert"


def test_a_session_whose_prompts_outgrow_the_cache_keeps_the_resident_tokens(tiny) -> None:
    """llama4 has no expert-major path: from the third generation (its terms measured) auto chose
    micro-batches for prompts whose union exceeded a 1 MiB cache, and the replies left the
    resident run's at token 3 and 14 (an audit of every arch through chat and the server)."""
    path = tiny.path(TinySpec(arch="llama4", n_expert=32, n_ff=128, wtype="q8_0"))
    long = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4
    prompts = ["Hello there", long, "Once upon a time " + long, long + " and then"]

    async def run(config: RunConfig) -> tuple[list[list[int]], list[str]]:
        outs, plans = [], []
        with Session.open(path, config) as s:
            for p in prompts:
                outs.append((await s.generate(p, 24, stop_at_end=False)).tokens)
                choice = s.prefill_choice
                plans.append(choice.reason if choice is not None else "")
        return outs, plans

    resident, _ = asyncio.run(run(RunConfig(mode="resident", reuse_prompt=False)))
    streamed, plans = asyncio.run(run(RunConfig(cache_bytes=MIB, reuse_prompt=False)))
    assert streamed == resident
    assert any("exceeds the 1 MiB budget" in p for p in plans), plans  # the case the audit hit


def test_the_strategy_a_prompt_ran_with_is_in_the_stats(tiny) -> None:
    """Which strategy auto took, and why, was kept only inside the planner: --json could not say
    whether a prompt ran in one batch or expert-major."""
    path = tiny.path(TinySpec())
    for prefill in ("expert", "token", "batch"):
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=MiB, prefill=prefill)) as s:
            stats = asyncio.run(s.generate(PROMPT, 2)).stats
        assert stats.prefill_strategy == prefill and stats.prefill_reason, (prefill, stats.prefill_reason)
        assert stats.as_dict()["prefill_strategy"] == prefill
