"""The default cache policy on synthetic routing unlike the trace it was designed on: never more
than a point below LRU, never above Belady, the budget held, at budgets from half a token's working
set to half the bank (a small subset of bench/policy_grid.py's grid, seconds)."""

from __future__ import annotations

import pytest

from bench.policy_grid import learned_usage, seeded
from bmoe.errors import ConfigError
from bmoe.pipeline.simulate import simulate
from bmoe.synth.routing import RoutingSpec, measure, routing_trace

MiB = 1 << 20
CELLS = [  # (experts, top-k, layers) x (law, skew, reuse): the grid's corners, shallow and short
    (shape, law, skew, reuse)
    for shape in ((32, 4, 8), (128, 2, 12), (64, 8, 6))
    for law, skew, reuse in (("zipf", 0.0, 0.05), ("zipf", 1.05, 0.18), ("zipf", 1.05, 0.5), ("zipf", 2.2, 0.5),
                             ("lognormal", 2.0, 0.38))
]


@pytest.mark.pure
@pytest.mark.parametrize(("shape", "law", "skew", "reuse"), CELLS)
def test_default_holds_up_on_the_grid(shape: tuple[int, int, int], law: str, skew: float, reuse: float) -> None:
    n_expert, k, n_layer = shape
    spec = RoutingSpec(n_expert=n_expert, top_k=k, n_layer=n_layer, skew=skew, reuse=reuse,
                       tokens=48, prompt=8, expert_bytes=MiB, seed=1, law=law)
    trace = routing_trace(spec)
    events = trace.layer_events()
    ws = n_layer * k * MiB
    bank = n_layer * n_expert * MiB
    usage, visits = learned_usage(spec)  # a profile from an earlier session of the same model
    policies = {"lru": "lru", "default": "default", "opt": "opt", "warm": lambda _e: seeded(usage, visits)}
    for budget in (ws // 2, ws, 2 * ws, 4 * ws, bank // 4, bank // 2, bank):
        r = {name: simulate(trace, p, budget, events=events) for name, p in policies.items()}
        for name in ("default", "warm"):
            assert r[name].decode_hit_pct >= r["lru"].decode_hit_pct - 1.0, (name, budget)
        assert r["opt"].decode_hit_pct >= max(x.decode_hit_pct for x in r.values()), budget
        assert all(x.max_resident_bytes <= budget for x in r.values())


@pytest.mark.pure
def test_a_profile_from_an_earlier_session_closes_more_of_the_gap() -> None:
    """Skewed popularity with weak reuse (gpt-oss's kind): a cold run spends its first hundred
    tokens learning which experts are popular, a run seeded from the last run's profile knows."""
    spec = RoutingSpec(n_expert=128, top_k=2, n_layer=12, skew=1.05, reuse=0.18, tokens=96, prompt=8,
                       expert_bytes=MiB, seed=3)
    trace = routing_trace(spec)
    events = trace.layer_events()
    usage, visits = learned_usage(spec)
    assert visits == pytest.approx(spec.tokens + 1, abs=1.0)  # a visit per token, the prompt's one
    budget = spec.n_layer * spec.n_expert * MiB // 4
    hits = {name: simulate(trace, p, budget, events=events).decode_hit_pct
            for name, p in {"lru": "lru", "default": "default", "opt": "opt",
                            "warm": lambda _e: seeded(usage, visits)}.items()}
    gap = hits["opt"] - hits["lru"]
    assert hits["warm"] - hits["lru"] >= hits["default"] - hits["lru"] + 0.1 * gap, hits


@pytest.mark.pure
def test_generator_hits_its_targets() -> None:
    """Reuse is what it is asked for where popularity allows it; skew concentrates routing."""
    flat = measure(routing_trace(RoutingSpec(skew=0.0, reuse=0.38, tokens=64)))
    assert flat.reuse == pytest.approx(0.38, abs=0.05) and flat.lag8_reuse < 0.1
    skewed = measure(routing_trace(RoutingSpec(skew=1.05, reuse=0.0, tokens=128)))
    assert skewed.top8_share == pytest.approx(0.445, abs=0.04)  # Qwen3's mean concentration
    assert skewed.rank_reuse[0] > skewed.rank_reuse[-1]  # popular experts take the high ranks
    a = routing_trace(RoutingSpec(seed=3, tokens=8))
    b = routing_trace(RoutingSpec(seed=3, tokens=8))
    assert (a.expert == b.expert).all()
    ev = a.layer_events()
    assert sum(e.phase == 1 for e in ev) == 8 * 48 and ev[-1].ends_call
    with pytest.raises(ConfigError):
        RoutingSpec(top_k=0)
    with pytest.raises(ConfigError):
        RoutingSpec(reuse=float("nan"))


@pytest.mark.pure
def test_lognormal_law_touches_fewer_experts_than_zipf() -> None:
    """The light-tailed law the real trace has: far fewer distinct experts per layer."""
    import numpy as np

    def distinct(spec: RoutingSpec) -> float:
        t = routing_trace(spec)
        d = t.phase == 1
        return float(np.mean([np.unique(t.expert[d & (t.layer == il)]).size for il in range(t.n_layer)]))

    zipf = distinct(RoutingSpec(n_layer=8, skew=1.05, tokens=96))
    logn = distinct(RoutingSpec(n_layer=8, skew=2.0, law="lognormal", tokens=96))
    assert logn < zipf - 15
    with pytest.raises(ConfigError):
        RoutingSpec(law="pareto")


@pytest.mark.pure
def test_markov_reference_uses_the_carry_over_and_stays_under_belady() -> None:
    """The bench's ``markov`` reference knows the generator's carry-over: with strong reuse at one
    token's working set it beats LRU and the popularity-only oracle; Belady stays the ceiling."""
    from bench.policy_grid import MarkovOracle, PopularityOracle, inclusion

    spec = RoutingSpec(n_expert=64, top_k=4, n_layer=8, skew=1.05, reuse=0.5, tokens=96, prompt=8,
                       expert_bytes=MiB, seed=2)
    trace = routing_trace(spec)
    events = trace.layer_events()
    incl, carry = inclusion(spec)
    assert carry.mean() > 0.2, "this cell carries experts over"
    budget = spec.n_layer * spec.top_k * MiB * 2
    hits = {name: simulate(trace, factory, budget, events=events).decode_hit_pct for name, factory in {
        "lru": "lru", "opt": "opt",
        "oracle": lambda _e: PopularityOracle(incl),
        "markov": lambda _e: MarkovOracle(incl, carry),
    }.items()}
    assert hits["markov"] > hits["lru"] and hits["markov"] > hits["oracle"]
    assert hits["opt"] >= hits["markov"]
