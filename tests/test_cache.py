"""The cache policy alone: no model, no llama.cpp."""

from __future__ import annotations

import pytest

from bmoe.errors import BudgetError, ConfigError
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.policies import LruPolicy, make_policy

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds

ENTRY = {0: 100, 1: 100, 2: 100}


def cache(budget: int) -> ExpertCache:
    return ExpertCache(budget, ENTRY, LruPolicy())


def test_miss_then_hit() -> None:
    c = cache(1000)
    assert c.plan(0, (1, 2)).misses == (1, 2)
    plan = c.plan(0, (2, 3))
    assert plan.hits == (2,) and plan.misses == (3,) and plan.evictions == ()
    assert c.resident_bytes == 300


def test_lru_evicts_least_recently_used_and_never_the_current_layer() -> None:
    c = cache(300)
    c.plan(0, (1, 2))
    c.plan(1, (1,))
    c.plan(0, (1,))  # (0,1) is now most recent; (0,2) is the oldest
    plan = c.plan(2, (5,))
    assert plan.evictions == ((0, 2),)
    assert c.resident_bytes == 300


def test_routed_set_larger_than_budget_is_served_then_trimmed() -> None:
    c = cache(100)
    plan = c.plan(0, (1, 2, 3))
    assert plan.misses == (1, 2, 3) and plan.evictions == ()
    assert c.resident_bytes == 300  # over budget only while the layer is pinned
    assert len(c.trim()) == 2
    assert c.resident_bytes == 100


def test_cache_off_reads_every_time() -> None:
    c = cache(0)
    for _ in range(3):
        for layer in (0, 1, 2):
            plan = c.plan(layer, (4, 7))
            assert plan.hits == () and plan.misses == (4, 7)
        c.trim()
        assert c.resident_bytes == 0


def test_shrinking_budget_evicts_and_discard_forgets() -> None:
    c = cache(1000)
    c.plan(0, (1, 2, 3))
    assert len(c.set_budget(100)) == 2
    c.discard((0, 3))
    c.discard((0, 1))
    assert c.resident_bytes == 0
    with pytest.raises(BudgetError):
        c.set_budget(-1)


def test_speculation_holds_the_budget_and_outlives_the_policy_until_its_layer_runs() -> None:
    c = cache(300)
    c.plan(0, (1, 2))
    ok, evicted = c.speculate((1, 5), protect={(0, 1), (0, 2)})
    assert ok and evicted == () and c.resident_bytes == 300
    ok, _ = c.speculate((1, 6), protect={(0, 1), (0, 2), (1, 5)})
    assert not ok and c.resident_bytes == 300, "no room without touching what is protected"
    plan = c.plan(0, (3,))
    assert plan.evictions == ((0, 1),), "read-ahead for a layer still to run outlives the policy's victims"
    plan = c.plan(1, (9,))
    assert plan.evictions == ((1, 5),), "guessed wrong: once its layer ran, read-ahead goes first"
    c.speculate((2, 7), protect=set())
    assert c.plan(2, (7,)).hits == (7,) and c.speculation_useful == 1


def test_read_ahead_left_by_an_aborted_step_is_stale_after_trim() -> None:
    c = cache(200)
    c.plan(0, (1,))
    c.speculate((1, 5), protect=set())
    c.trim()
    assert c.plan(0, (2, 3)).evictions == ((1, 5), (0, 1))


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown cache policy"):
        make_policy("nope")
