"""Long-running use: what a server or a chat does for hours (thousands of generations, sessions
opened and closed in one process) must not grow anything without bound. Each test here pins one
leak the soak audit found, deterministically and in a few seconds."""

from __future__ import annotations

import random

import pytest

from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.policies import AdaptiveReusePolicy, ExpectedReusePolicy


def _memory_reference(history: list[dict[tuple[int, int], int]], entry: dict[int, int], budget: int,
                      max_steps: int) -> float:
    """The cache memory T as ``ExpectedReusePolicy._measure_memory`` defines it, from the whole
    history kept (per completed step, the entries routed in it), with no table at all."""
    last: dict[tuple[int, int], int] = {}
    for step, routed in enumerate(history):
        for key in routed:
            last[key] = step
    n = len(history)
    if sum(entry[layer] for layer, _ in last) <= budget:
        return float(max(n, 1))
    at = [0] * n
    for (layer, _), step in last.items():
        at[step] += entry[layer]
    acc, t = 0, float(min(n, max_steps))
    for back in range(min(n, max_steps)):
        b = at[n - 1 - back]
        if b <= 0:
            continue
        if acc + b >= budget:
            return back + (budget - acc) / b
        acc += b
    return t


@pytest.mark.parametrize("policy_type", [ExpectedReusePolicy, AdaptiveReusePolicy])
def test_policy_step_table_stays_bounded(policy_type: type[ExpectedReusePolicy]) -> None:
    """The reuse policies kept one int per decode call for the life of the session (the bytes
    last used at each step), though only the last MAX_MEMORY_STEPS are ever walked: a server's
    policy grew by a list slot and an int object per token, forever. The table now keeps a
    bounded window, and the measured memory T is the same as from the whole history."""

    class Small(policy_type):  # type: ignore[misc, valid-type]
        MAX_MEMORY_STEPS = 8  # the window, small so that a few hundred steps wrap it many times

    entry = {0: 100, 1: 100, 2: 150}
    budget = 3000  # T then ranges from under 1 to the window's cap: every branch of the walk
    policy = Small()
    cache = ExpertCache(budget, entry, policy)
    rng = random.Random(0)
    history: list[dict[tuple[int, int], int]] = []
    seen: set[float] = set()
    for step in range(600):
        routed: dict[tuple[int, int], int] = {}
        for layer in entry:
            hot = 6 if step % 50 < 25 else 32  # phases of concentrated and spread routing
            experts = rng.sample(range(hot), 4)
            cache.plan(layer, experts)
            routed.update({(layer, e): 1 for e in experts})
        cache.trim()
        history.append(routed)
        assert policy.memory_steps == pytest.approx(
            _memory_reference(history, entry, budget, Small.MAX_MEMORY_STEPS)), step
        seen.add(round(policy.memory_steps, 3))
    assert len(seen) > 20 and Small.MAX_MEMORY_STEPS in seen  # T moved, and hit the window's cap
    assert policy.steps == 600
    # The window and the step just opened, at most twice over (trimmed one slice at a time).
    assert len(policy._bytes_at) <= 2 * (Small.MAX_MEMORY_STEPS + 1)  # noqa: SLF001
