"""Gates of ``--drop-cold-experts F``: F = 0 is byte-identical to the exact run (the rewriting
machinery installed, nothing dropped); F > 0 drops only cache misses, never the top expert, reads
less, and is deterministic; the decision rule on known inputs; nonsense combinations refused."""

from __future__ import annotations

import numpy as np
import pytest

import bmoe.llama.drop_cold as drop_cold
from bmoe.engine.config import MiB, RunConfig
from bmoe.llama.drop_cold import choose_drops
from bmoe.errors import ConfigError
from bmoe.synth.tiny import TinySpec
from tests.helpers import generate_tokens
from tests.test_lossy_topk import SPEC


def _drop(f: float | None, **kw: object) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, cache_bytes=MiB, drop_cold_experts=f, **kw)


@pytest.mark.pure
def test_rule_on_known_inputs() -> None:
    ids = np.array([[3, 1, 2, 0]], np.int32)
    probs = np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)  # shares of the routed mass
    none = np.zeros(8, bool)
    # threshold 0.2: the 0.15 and 0.05 shares go, the 0.3 stays
    assert choose_drops(ids, probs, none, 0.2).tolist() == [[False, False, True, True]]
    resident = none.copy()
    resident[2] = True  # a cache hit is never dropped
    assert choose_drops(ids, probs, resident, 0.2).tolist() == [[False, False, False, True]]
    # whatever the threshold, the top-ranked expert stays
    assert choose_drops(ids, probs, none, 100.0).tolist() == [[False, True, True, True]]
    assert not choose_drops(ids, probs, none, 0.0).any()


@pytest.mark.pure
def test_rule_keeps_an_expert_another_row_needs() -> None:
    ids = np.array([[3, 1], [1, 3]], np.int32)
    probs = np.array([[0.9, 0.1], [0.9, 0.1]], np.float32)
    # each row would drop the other's top expert, which is read anyway: nothing is dropped
    assert not choose_drops(ids, probs, np.zeros(4, bool), 0.5).any()
    # an expert every row drops goes from all of them
    ids = np.array([[3, 1], [0, 1]], np.int32)
    assert choose_drops(ids, probs, np.zeros(4, bool), 0.5).tolist() == [[False, True], [False, True]]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])  # weights normalised / not
def test_zero_fraction_is_byte_identical(tiny, arch: str) -> None:
    path = tiny.path(TinySpec(arch=arch, n_expert=8, n_expert_used=4))
    exact = tiny.resident_tokens(path)
    assert len(set(exact)) >= 6, "fixture is degenerate; the gate would prove little"
    assert generate_tokens(path, _drop(0.0)) == exact
    assert generate_tokens(path, _drop(0.0, drop_renorm=False, drop_prefill=True)) == exact


def test_drops_only_misses_never_the_top_and_is_deterministic(tiny, monkeypatch) -> None:
    path = tiny.path(SPEC)
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    rule = drop_cold.choose_drops

    def spy(ids, probs, resident, threshold):  # noqa: ANN001, ANN202
        mask = rule(ids, probs, resident, threshold)
        seen.append((ids.copy(), resident.copy(), mask))
        return mask

    monkeypatch.setattr(drop_cold, "choose_drops", spy)
    got = generate_tokens(path, _drop(1.0))
    assert seen and sum(int(m.sum()) for _, _, m in seen) > 0, "nothing was dropped: the gate proves nothing"
    for ids, resident, mask in seen:
        assert not mask[:, 0].any()
        assert not resident[ids[mask]].any()
    assert got != tiny.resident_tokens(path), "drops changed nothing: the weights were not rewritten"
    monkeypatch.setattr(drop_cold, "choose_drops", rule)
    assert generate_tokens(path, _drop(1.0)) == got
    no_renorm = generate_tokens(path, _drop(1.0, drop_renorm=False))
    assert no_renorm != got  # the renormalisation is real


def test_counters_report_drops_and_bytes_saved(tiny) -> None:
    import asyncio

    from bmoe.engine.session import Session

    async def go(config: RunConfig):  # noqa: ANN202
        with Session.open(tiny.path(SPEC), config) as s:
            g = await s.generate("Hello there, experts", 8, stop_at_end=False)
            return g.stats, s.lossy_counters()

    exact, none = asyncio.run(go(RunConfig(mode="stream", n_ctx=256, cache_bytes=MiB)))
    dropped, c = asyncio.run(go(_drop(4.0)))
    assert none == {}
    assert c["drop_tokens"] == 7 and c["drop_dropped_experts"] > 0 and c["drop_bytes_saved"] > 0
    assert c["drop_experts_per_token"] == c["drop_dropped_experts"] / 7
    assert dropped.bytes_read < exact.bytes_read


@pytest.mark.pure
@pytest.mark.parametrize("kw,msg", [
    ({"drop_cold_experts": 0.5}, "stream with a cache budget"),
    ({"drop_cold_experts": 0.5, "mode": "resident"}, "stream with a cache budget"),
    ({"drop_cold_experts": -1.0, "cache_bytes": MiB}, "finite fraction"),
    ({"drop_cold_experts": float("nan"), "cache_bytes": MiB}, "finite fraction"),
    ({"drop_renorm": False}, "set it too"),
    ({"drop_prefill": True}, "set it too"),
])
def test_nonsense_is_refused(kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        RunConfig(**kw)


@pytest.mark.pure
def test_levers_off_keep_the_plain_callback(tiny) -> None:
    """Decided at construction: with no node-level lever the session gets the plain callback, so
    the per-node path is exactly the lossless one."""
    from bmoe.llama.callback import EvalCallback
    from bmoe.llama.drop_cold import DropColdCallback
    from bmoe.engine.lossy import lossy_callback
    from bmoe.llama.route_ahead import RouteAheadCallback
    from bmoe.io.validate import open_layout
    from bmoe.pipeline.gate import RoutingGate

    layout = open_layout(tiny.path(SPEC))
    assert lossy_callback(RoutingGate(), layout, RunConfig(mode="stream", cache_bytes=MiB, n_expert_used=2)) is None
    drop = lossy_callback(RoutingGate(), layout, _drop(0.5))
    ahead = lossy_callback(RoutingGate(), layout, RunConfig(mode="stream", cache_bytes=MiB, route_ahead=1))
    assert isinstance(drop, DropColdCallback) and isinstance(ahead, RouteAheadCallback)
    assert isinstance(drop, EvalCallback) and isinstance(ahead, EvalCallback)


@pytest.mark.parametrize("arch", ["llama4", "gpt-oss", "deepseek2"])
def test_routers_whose_scores_are_not_shares_are_refused_at_open(tiny, arch: str) -> None:
    """llama4 sorts raw logits, deepseek2 sorts probabilities plus a selection bias, gpt-oss
    re-softmaxes what it chose: a "share" came out negative, so F = 0 dropped experts (and changed
    llama4's output), and gpt-oss was refused only at its first decode."""
    from bmoe.engine.session import Session
    from bmoe.errors import ConfigError

    path = tiny.path(TinySpec(arch=arch))
    with pytest.raises(ConfigError, match="drop_cold_experts: not on this model"):
        Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=1 << 20, drop_cold_experts=0.0))


@pytest.mark.pure
def test_zero_fraction_drops_nothing_whatever_the_scores() -> None:
    from bmoe.llama.drop_cold import choose_drops

    ids = np.array([[0, 1, 2, 3]])
    scores = np.array([[1.81, 0.32, -1.52, -1.99]], dtype=np.float32)  # llama4's logits, as read
    assert not choose_drops(ids, scores, np.zeros(4, dtype=bool), 0.0).any()
