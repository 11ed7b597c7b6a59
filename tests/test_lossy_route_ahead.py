"""Gates of ``--route-ahead N``: N = 0 is a byte-identical passthrough; N >= 1 issues no read at a
routed layer's own turn (every read of MoE layers N.. was issued N layers ahead), is deterministic,
and changes the output (the routing really was replaced). The N = 0 run is the negative control:
it does read at the layers' turns, so the check can fail."""

from __future__ import annotations

import numpy as np
import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.llama.route_ahead import top_k_rows
from bmoe.errors import ConfigError
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import generate_tokens

SPEC4 = TinySpec(arch="qwen3moe", n_layer=4, n_expert=8, n_expert_used=2)


def _ahead(n: int) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MiB, route_ahead=n)


def _run(tiny, n: int) -> tuple[list[int], list[tuple[int, tuple[int, ...]]]]:  # noqa: ANN001
    reads: list[tuple[int, tuple[int, ...]]] = []  # (layer, experts read at its own routing)
    hooks = Hooks(on_plan=lambda event, plan: reads.append((event.layer, plan.misses)))
    return generate_tokens(tiny.path(SPEC4), _ahead(n), hooks), reads


@pytest.mark.pure
def test_top_k_rows_best_first_ties_to_the_lower_id() -> None:
    router = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]], np.float32)
    x = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    # scores row 0: [1, 0, 1, 0] -> 0, 2 (tie broken by id); row 1: [0, 2, 2, 2] -> 1, 2
    assert top_k_rows(router, x, 2).tolist() == [[0, 2], [1, 2]]


def test_zero_is_a_passthrough_and_reads_at_the_layers_turn(tiny) -> None:
    exact = tiny.resident_tokens(tiny.path(SPEC4))
    assert len(set(exact)) >= 6, "fixture is degenerate; the gate would prove little"
    got, reads = _run(tiny, 0)
    assert got == exact
    assert any(misses for layer, misses in reads if layer >= 1), "negative control: the check below could not fail"


@pytest.mark.parametrize("n", [1, 2])
def test_reads_are_all_issued_ahead_and_deterministic(tiny, n: int) -> None:
    got, reads = _run(tiny, n)
    late = [(layer, misses) for layer, misses in reads if layer >= n and misses]
    assert not late, f"layers routed {n} ahead still read at their own turn: {late[:3]}"
    assert _run(tiny, n)[0] == got
    if n == 1:
        assert got != tiny.resident_tokens(tiny.path(SPEC4)), "the routing was never replaced"


@pytest.mark.pure
@pytest.mark.parametrize("kw,msg", [
    ({"route_ahead": 1}, "stream with a cache budget"),
    ({"route_ahead": -1, "cache_bytes": MiB}, "0..64"),
    ({"route_ahead": 1, "cache_bytes": MiB, "prefetch_layers": 2}, "already reads ahead"),
    ({"route_ahead": 1, "cache_bytes": MiB, "predict_prefetch": True}, "already reads ahead"),
    ({"route_ahead": 1, "cache_bytes": MiB, "drop_cold_experts": 0.5}, "pick one"),
])
def test_nonsense_is_refused(kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        RunConfig(**kw)


def test_a_distance_past_the_last_moe_layer_is_refused_at_open(tiny) -> None:
    """On 4 MoE layers, --route-ahead 4 routed nothing ahead yet labelled the run lossy."""
    with pytest.raises(ConfigError, match=r"route_ahead 4 reaches past the model's 4 MoE layers.*at most 3"):
        _run(tiny, 4)
    got, _ = _run(tiny, 3)  # the farthest that still routes a layer ahead
    assert got == _run(tiny, 3)[0]
