"""Router rank (0 = the highest weight) from the top-k rows and the trace to the cache policy."""

from __future__ import annotations

import io

import numpy as np
import pytest

from bmoe.pipeline.boundary import FastPath
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.events import routed_set
from bmoe.pipeline.gate import RoutingGate
from bmoe.pipeline.policies import LruPolicy
from bmoe.pipeline.simulate import simulate
from bmoe.pipeline.trace import TraceWriter, read_trace


@pytest.mark.pure
def test_routed_set_gives_each_expert_its_best_rank() -> None:
    experts, ranks = routed_set(np.array([[7, 3, 5]], dtype=np.int32))
    assert experts.tolist() == [3, 5, 7] and ranks.tolist() == [1, 2, 0]
    # A ubatch: 5 is rank 2 for the first token and rank 0 for the second.
    experts, ranks = routed_set(np.array([[7, 3, 5], [5, 9, 7]], dtype=np.int32))
    assert experts.tolist() == [3, 5, 7, 9] and ranks.tolist() == [1, 0, 0, 1]
    assert experts.tolist() == np.unique([[7, 3, 5], [5, 9, 7]]).tolist()  # the set np.unique gave


@pytest.mark.pure
def test_the_gate_hands_ranks_on_both_paths() -> None:
    gate = RoutingGate(fast_path=FastPath.over([np.ones(16, dtype=bool)]))
    gate.route(0, np.array([[9, 2, 4]], dtype=np.int32))  # all resident: the fast path
    layer, experts, ranks = gate.fast_path.hits.popleft()
    assert (layer, experts.tolist(), ranks.tolist()) == (0, [2, 4, 9], [1, 2, 0])


class Spy(LruPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, tuple[int, ...], tuple[int, ...] | None]] = []

    def routed(self, layer: int, experts: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> None:
        self.seen.append((layer, experts, ranks))


def _trace() -> str:
    buf = io.StringIO()
    with TraceWriter(buf, model="m", arch="qwen3moe", n_layer=1, n_expert=8, n_expert_used=2,
                     expert_bytes={0: 10}) as w:
        w.add(0, 0, 0, 0, [5, 1], [0.6, 0.4], [0, 0])  # prompt token 0
        w.add(0, 0, 1, 0, [1, 3], [0.7, 0.3], [0, 0])  # prompt token 1: 1 is rank 0 here
        w.add(0, 1, 0, 0, [6, 2], [0.9, 0.1], [0, 0])
        w.add(0, 1, 1, 0, [2, 6], [0.5, float("nan")], [0, 0])
    return buf.getvalue()


@pytest.mark.pure
def test_trace_events_carry_ranks_and_weights(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "t.route.csv"
    path.write_text(_trace())
    t = read_trace(path)
    evs = t.layer_events()
    assert [e.experts for e in evs] == [(1, 3, 5), (2, 6), (2, 6)]
    assert [e.ranks for e in evs] == [(0, 1, 0), (1, 0), (0, 1)]
    assert evs[0].weights == pytest.approx((0.7, 0.3, 0.6))
    assert evs[2].weights[0] == pytest.approx(0.5) and np.isnan(evs[2].weights[1])
    recorded = t.layer_events(order="recorded")
    assert [e.experts for e in recorded][1:] == [(6, 2), (2, 6)] and recorded[1].ranks == (0, 1)
    spy = Spy()
    simulate(t, lambda _evs: spy, 100)
    assert [s[2] for s in spy.seen] == [e.ranks for e in evs]


@pytest.mark.pure
def test_cache_without_ranks_tells_the_policy_none() -> None:
    spy = Spy()
    ExpertCache(100, {0: 10}, spy).plan(0, (1, 2))
    assert spy.seen == [(0, (1, 2), None)]
