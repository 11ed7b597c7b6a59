"""Expert-major prefill: a prompt's experts read and computed group by group give the resident
tokens, keep the cache budget at every group (one batch does not), fall back to routing the union
where the chain is not one it computes, and never let a token through when a layer goes unserved."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import bmoe.llama.expert_major as expert_major
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError, DecodeAbortedError
from bmoe.io.layout import read_layout
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT

LONG = PROMPT * 3  # ~60 tokens: a union of most of a layer's experts
BIG = TinySpec(n_embd=256, n_ff=256, n_layer=3)  # ~0.8 MB experts (f32): 1 MiB evicts within a layer


def expert(cache_bytes: int, **kw: object) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, cache_bytes=cache_bytes, force_cache=True, prefill="expert", **kw)


def run(path, config: RunConfig, hooks: Hooks | None = None, n: int = N_TOKENS):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        with Session.open(path, config, hooks=hooks) as s:
            g = await s.generate(LONG, n, stop_at_end=False)
            em = s._callback.expert_major  # noqa: SLF001
            return g.tokens, (em.layers_computed, em.groups, len(em.layers)) if em is not None else None

    return asyncio.run(go())


def resident(tiny, path) -> list[int]:  # noqa: ANN001
    return run(path, RunConfig(mode="resident", n_ctx=256))[0]


@pytest.mark.parametrize(("arch", "wtype"), [("qwen3moe", "f32"), ("qwen3moe", "q8_0"), ("qwen2moe", "f16"),
                                             ("deepseek2", "f32"), ("olmoe", "q8_0")])
def test_expert_major_streams_the_resident_tokens(tiny, arch: str, wtype: str) -> None:
    path = tiny.path(TinySpec(arch=arch, wtype=wtype, n_layer=3, n_embd=256, n_ff=256))
    want = resident(tiny, path)
    for budget in (64 * MiB, 1 * MiB):
        tokens, (layers, groups, eligible) = run(path, expert(budget))
        assert tokens == want, f"{budget // MiB} MiB"
        moe = len(read_layout(str(path)).moe_layers)
        assert eligible == moe and layers >= moe - 1, "the prompt's layers ran expert-major"  # the last: 1 row
    assert groups > layers, "a 1 MiB cache reads the union in several groups"


def test_the_union_is_never_resident_at_once(tiny) -> None:
    path = tiny.path(BIG)
    budget = 2 * MiB
    peak = {"expert": 0, "batch": 0}
    which = {"now": "expert"}

    def on_plan(event, plan) -> None:  # noqa: ANN001
        s = held["session"]
        peak[which["now"]] = max(peak[which["now"]], s.resident_cache_bytes)

    held: dict = {}

    async def go(config: RunConfig) -> list[int]:
        with Session.open(path, config, hooks=Hooks(on_plan=on_plan)) as s:
            held["session"] = s
            return (await s.generate(LONG, 4, stop_at_end=False)).tokens

    got = asyncio.run(go(expert(budget)))
    which["now"] = "batch"  # negative control: one batch holds a layer's union, over the budget
    batch = asyncio.run(go(RunConfig(mode="stream", n_ctx=256, cache_bytes=budget, force_cache=True, prefill="batch")))
    assert got == batch
    assert 0 < peak["expert"] <= budget
    assert peak["batch"] > budget


def test_negative_control_a_wrong_expert_changes_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.path(TinySpec(n_layer=3))
    want = resident(tiny, path)
    real = expert_major.swiglu_experts

    def one_expert_lost(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        outs = real(*args, **kw)
        outs[0] = np.zeros_like(outs[0])
        return outs

    monkeypatch.setattr(expert_major, "swiglu_experts", one_expert_lost)
    assert run(path, expert(64 * MiB))[0] != want


def test_a_chain_it_cannot_compute_falls_back_to_routing_the_union(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.path(TinySpec(n_layer=3))
    want = resident(tiny, path)
    found = expert_major.LayerNodes.find
    calls = {"n": 0}

    def refuse_after_warm_up(node: int, muted=None):  # noqa: ANN001, ANN202
        calls["n"] += 1
        return found(node, muted) if calls["n"] <= 3 else None  # the open's warm-up sees the 3 layers

    monkeypatch.setattr(expert_major.LayerNodes, "find", staticmethod(refuse_after_warm_up))
    tokens, (layers, _, eligible) = run(path, expert(1 * MiB))
    assert eligible == 3 and layers == 0
    assert tokens == want


def test_an_output_node_that_never_comes_aborts_the_decode(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.path(TinySpec(n_layer=3))
    want = resident(tiny, path)

    async def go() -> list[int]:
        with Session.open(path, expert(64 * MiB)) as s:
            monkeypatch.setattr(expert_major.ExpertMajor, "on_output", lambda self, node, ask: False)
            with pytest.raises(DecodeAbortedError, match="never came"):
                await s.generate(LONG, 4, stop_at_end=False)
            monkeypatch.undo()  # the session goes on: ops put back, the next prompt starts clean
            return (await s.generate(LONG, N_TOKENS, stop_at_end=False)).tokens

    assert asyncio.run(go()) == want


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma4"])
def test_chains_it_does_not_compute_are_refused_when_forced_and_skipped_by_auto(tiny, arch: str) -> None:
    path = tiny.path(TinySpec(arch=arch))
    with pytest.raises(ConfigError, match="expert chain"):
        run(path, expert(64 * MiB))
    auto = RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MiB, force_cache=True)
    tokens, em = run(path, auto)
    assert em is None and tokens == resident(tiny, path)


def test_auto_runs_expert_major_when_one_batch_would_break_the_budget(tiny) -> None:

    path = tiny.path(BIG)

    async def go():  # noqa: ANN202
        auto = RunConfig(mode="stream", n_ctx=256, cache_bytes=1 * MiB, force_cache=True)
        with Session.open(path, auto) as s:
            g = await s.generate(LONG, N_TOKENS, stop_at_end=False)
            return g.tokens, s.prefill_choice, s._callback.expert_major.layers_computed  # noqa: SLF001

    tokens, choice, layers = asyncio.run(go())
    assert choice.strategy == "expert" and layers > 0, choice.reason
    assert tokens == resident(tiny, path)


@pytest.mark.pure
@pytest.mark.parametrize("kw", [{"cache_bytes": 0}, {"cache_bytes": 8 * MiB, "overlap": True},
                                {"cache_bytes": 8 * MiB, "mode": "resident"}])
def test_expert_prefill_config_is_validated(kw: dict) -> None:
    base = {"mode": "stream", "n_ctx": 256, "prefill": "expert"}
    with pytest.raises(ConfigError, match="prefill 'expert'"):
        RunConfig(**{**base, **kw}).validate()
